"""A leader cut off from Consul stops calling Nomad within its lease, whatever its reads of
Consul are doing meanwhile: seen from Nomad's side (the stand-in's scaling events), not from the
watcher's own account."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from nomad_driver.nomad import Nomad
from nomad_driver.render import SHARD_GROUP, render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import ModelState, state_key
from nomad_driver.watcher.admin import WatcherCollector
from nomad_driver.watcher.leader import LeaseLost
from nomad_driver.watcher.multinode import scale_replica
from tests.test_multinode_replica_rules import WIDE
from tests.watcher_support import PROFILES, mock_job, until, watcher_on_standin

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TTL_S = 10
MODELS = (
    PROFILES
    + """
models:
  steady:
    source: file:///tmp/steady.gguf
    profile: cpu
    replicas: {min: 1, max: 2}
"""
)
NUDGE = "test: someone else's scale"


def scale_events(url: str, job_id: str) -> list[dict[str, Any]]:
    status = httpx.get(f"{url}/v1/job/{job_id}/scale", timeout=10).json()
    return list(status["TaskGroups"]["engine"]["Events"] or [])


async def test_a_leader_cut_off_from_consul_stops_calling_nomad_within_its_lease(
    make_consul_agent: Callable[[], Any], start_standin: Callable[..., Any]
) -> None:
    agent = make_consul_agent()
    model = parse_models(MODELS).models["steady"]
    standin, consul, _, watcher = await watcher_on_standin(
        agent.url, lambda **kw: start_standin(consul=False, **kw), MODELS, ident="cut-off", clock_speed=1.0
    )
    registry = CollectorRegistry()
    registry.register(WatcherCollector(watcher))
    # Parked: the leader keeps it at 0 with nothing to write to Consul while it does (its state
    # and its Consul UI entry stay the same), so nothing but the lease can stop its Nomad calls.
    parked = ModelState(
        parked=True, consecutive_failures=5, last_error="boom", parked_def_hash=model.def_hash
    )
    await consul.kv_put(state_key("steady"), parked.to_kv())
    job = mock_job(model, 0, run_for="1h")
    httpx.post(f"{standin.url}/v1/job/{job['ID']}", json={"Job": job}, timeout=10).raise_for_status()
    paused = False
    seen: dict[int, dict[str, Any]] = {}

    def nudge_and_record() -> None:
        # Someone keeps starting the parked model; the leader keeps scaling it back to 0, which
        # is a Nomad call each time, for as long as it believes it leads.
        body = {"Count": 1, "Target": {"Job": job["ID"], "Group": "engine"}, "Message": NUDGE}
        httpx.post(f"{standin.url}/v1/job/{job['ID']}/scale", json=body, timeout=10).raise_for_status()
        for event in scale_events(standin.url, job["ID"]):
            seen[event["CreateIndex"]] = event

    await watcher.start()
    try:
        await until(lambda: watcher.leadership.is_leader and watcher.ready_to_act(), 30, "leading")

        def corrections() -> list[float]:
            return sorted(
                e["Time"] / 1e9 for e in seen.values() if str(e.get("Message", "")).startswith("llmgw:")
            )

        for _ in range(4):
            await asyncio.to_thread(nudge_and_record)
            await asyncio.sleep(1.0)
        assert corrections(), "the leader never corrected the count before the cut"

        # Cut it off: Consul stops answering (its process paused, as a partition looks to a
        # client: connections hang rather than fail). The last renewal was at most a third of
        # the TTL ago, so the lease runs out within TTL - margin of this moment.
        cut_at = time.time()
        os.kill(agent.pid, signal.SIGSTOP)
        paused = True
        deadline = cut_at + TTL_S - watcher.leadership.lease_margin_s
        while time.time() < cut_at + 2 * TTL_S:
            await asyncio.to_thread(nudge_and_record)
            await asyncio.sleep(1.0)
        # Until its lease ran out it kept acting (so the test shows something), and not after.
        assert any(cut_at < t <= deadline for t in corrections()), "no call after the cut: nothing tested"
        late = [t for t in corrections() if t > deadline + 0.5]
        assert not late, f"the leader scaled {len(late)} times after its lease ran out: {late} > {deadline}"
        assert not watcher.leadership.is_leader
        assert "llmgw_leader 0.0" in generate_latest(registry).decode()
    finally:
        if paused:
            os.kill(agent.pid, signal.SIGCONT)
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


def test_a_lease_that_runs_out_during_a_replicas_first_scale_call_stops_its_second(
    start_standin: Callable[..., Any],
) -> None:
    """A multi-node replica is scaled with two Nomad calls, its leader then its shards. The
    first one can be slow (Nomad under load) for longer than what is left of the lease: the
    shards' call is then not made, so a deposed leader never scales them against the new one."""
    node = {
        "datacenter": "dc1",
        "cpu_mhz": 8000,
        "memory_mib": 8192,
        "attributes": {"driver.mock_driver": "1"},
        "meta": {"llmgw_engine_llama_cpp": "b6500"},
        "gpus": [{"model": "NVIDIA L4", "memory_mib": 24564, "count": 1}],
    }
    standin = start_standin(nodes=[{**node, "name": f"n{i}"} for i in range(3)], consul=False)
    job = render_job(WIDE)
    for group in job["TaskGroups"]:
        group["Tasks"][0].update(Driver="mock_driver", Config={"run_for": "1h"})
        group["Tasks"][0].pop("Artifacts", None)
        group["Tasks"][0].pop("Templates", None)
    Nomad(standin.url).register_job(job)
    lease_until = time.monotonic() + 1.0

    def check_lease(what: str) -> None:
        # The watcher's own rule (Leadership.check_lease): no Nomad call once the lease ran out.
        if time.monotonic() >= lease_until:
            raise LeaseLost(f"the lease ran out before {what}")

    class SlowNomad(Nomad):
        def scale(self, job_id: str, group: str, count: int, message: str) -> dict[str, Any]:
            answer = super().scale(job_id, group, count, message)
            time.sleep(max(0.0, lease_until - time.monotonic()) + 0.3)  # answered after the lease
            return answer

    with pytest.raises(LeaseLost, match=SHARD_GROUP):
        scale_replica(
            SlowNomad(standin.url), WIDE.job_id, "engine", 0, "llmgw: idle", WIDE, check_lease=check_lease
        )
    groups = httpx.get(f"{standin.url}/v1/job/{WIDE.job_id}", timeout=10).json()["TaskGroups"]
    assert {g["Name"]: g["Count"] for g in groups} == {"engine": 0, SHARD_GROUP: 2}
