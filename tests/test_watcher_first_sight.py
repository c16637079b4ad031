"""A watcher that starts (or takes over) holds the count it first finds for the scale-down
delay, so a restart is never a scale-down. "First finds" means first read from Nomad: a pass
that runs before the job feed has answered sees no job, and must not seed that hold with 0 (it
did, and whether the hold held then depended on which answered first, Consul or Nomad)."""

from __future__ import annotations

import time

from nomad_driver.blocking import Reading
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.nomad import Nomad
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.test_reconcile import job
from tests.watcher_support import BARE_CPU_PROFILE

TEXT = (
    BARE_CPU_PROFILE
    + """
models:
  m:
    source: file:///tmp/m.gguf
    profile: cpu
    replicas: {min: 1, max: 3, scale_down_delay: 300s}
"""
)
MODEL = parse_models(TEXT).models["m"]


async def test_a_pass_before_nomad_answered_does_not_seed_the_hold_with_no_replicas() -> None:
    watcher = Watcher(Consul("http://127.0.0.1:1"), Nomad("http://127.0.0.1:1"), WatcherConfig())
    watcher.kv.snapshot = Reading(
        1, {CONFIG_MODELS_KEY: KVEntry(CONFIG_MODELS_KEY, TEXT.encode(), 1)}, time.monotonic()
    )
    watcher.engines.snapshot = Reading(1, (), time.monotonic())
    try:
        # Consul answered, Nomad not yet: a pass runs, as a watcher's first passes do.
        await watcher.run_pass()
        assert watcher.decisions["m"].actions == () or not watcher.ready_to_act()

        # Nomad answers: two replicas, idle. The first sight of them is now.
        watcher.jobs.snapshot = Reading(2, {MODEL.job_id: job(MODEL, 2)}, time.monotonic())
        watcher.allocs.snapshot = Reading(2, (), time.monotonic())
        watcher.evals.snapshot = Reading(2, (), time.monotonic())
        await watcher.run_pass()
        decision = watcher.decisions["m"]
        assert (decision.desired, decision.desired_reason) == (2, "held"), decision.desired_detail
        assert "scale_down_delay 300s" in decision.desired_detail
    finally:
        await watcher.consul.close()
