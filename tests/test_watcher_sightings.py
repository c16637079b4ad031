"""Which start a passing check vouches for (`watcher/sightings.py`): a start that turned healthy
while the watcher's view of Nomad lagged is credited as soon as Nomad shows it, without waiting
for Consul's index to move (which, on a quiet fleet, can take hours), so its eventual exit is
not counted as a failed start; and a restart under a check the last start left passing is not."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import consul as pyconsul

from nomad_driver.blocking import Reading
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.render import SERVICE_NAME
from nomad_driver.spec import parse_models
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from nomad_driver.watcher.sightings import StartSightings
from tests.watcher_support import BARE_CPU_PROFILE, until

MODEL = parse_models(
    BARE_CPU_PROFILE
    + """
models:
  m:
    source: file:///tmp/m.gguf
    profile: cpu
"""
).models["m"]


def _alloc(alloc_id: str, started_ns: int) -> dict[str, Any]:
    return {
        "ID": alloc_id,
        "JobID": MODEL.job_id,
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"Events": [{"Type": "Started", "Time": started_ns}]}},
    }


async def test_a_start_nomad_showed_after_consul_answered_is_credited_once_consul_confirms(
    consul: pyconsul.Consul, consul_url: str
) -> None:
    alloc_id = str(uuid.uuid4())
    # The engine's check passes in Consul, as Nomad registers it (the allocation in the ID).
    consul.catalog.register(
        "gpu-node-1",
        "10.0.0.1",
        service={
            "Service": SERVICE_NAME,
            "ID": f"_nomad-task-{alloc_id}-engine-{SERVICE_NAME}-http",
            "Port": 5678,
            "Meta": {"model": "m"},
        },
        check={"CheckID": f"{alloc_id}-ready", "Name": "engine ready", "Status": "passing"},
    )
    # Long waits: Consul's index does not move again in this test, as on a quiet fleet.
    watcher = Watcher(Consul(consul_url), Nomad("http://127.0.0.1:1"), WatcherConfig(wait_s=300))
    watcher.models = {"m": MODEL}
    engines = asyncio.create_task(watcher.engines.run())
    try:
        await until(lambda: watcher.engines.snapshot is not None, 10, "Consul's first answer")
        answered = watcher.engines.snapshot
        assert answered is not None
        # The watcher had read Nomad before, when the allocation had not started; Nomad's news
        # of the start arrives only now (a Nomad server restarting, say), after Consul's.
        pending = dict(_alloc(alloc_id, 0), ClientStatus="pending", TaskStates={})
        watcher.allocs.snapshot = Reading(6, (pending,), time.monotonic() - 60)
        assert watcher.build_views(now=0.5)["m"].healthy_starts == frozenset()
        start = (1_000, alloc_id)
        watcher.allocs.snapshot = Reading(7, (_alloc(alloc_id, 1_000),), time.monotonic())

        view = watcher.build_views(now=1.0)["m"]
        assert view.ready == 1
        assert start in view.healthy_starts, "the healthy start went uncredited"
        assert watcher.engines.snapshot is not None and watcher.engines.snapshot.index == answered.index
    finally:
        engines.cancel()
        await asyncio.gather(engines, return_exceptions=True)
        await watcher.consul.close()
        consul.catalog.deregister("gpu-node-1")


ALLOC = "6b1f0c2e-0000-4000-8000-000000000001"


def _entry(status: str, index: int) -> dict[str, Any]:
    return {
        "Service": {"ID": f"_nomad-task-{ALLOC}-group-engine-{SERVICE_NAME}-http", "Meta": {"model": "m"}},
        "Checks": [
            {"CheckID": "serfHealth", "ServiceID": "", "Status": "passing", "ModifyIndex": 3},
            {"CheckID": "ready", "ServiceID": "x", "Status": status, "ModifyIndex": index},
        ],
    }


def _restarted(*starts: int) -> dict[str, Any]:
    """The allocation after its engine started at each of `starts`, the last still running."""
    events: list[dict[str, Any]] = []
    for t in starts[:-1]:
        events += [{"Type": "Started", "Time": t}, {"Type": "Terminated", "Time": t + 1}]
    events.append({"Type": "Started", "Time": starts[-1]})
    return {"ID": ALLOC, "ClientStatus": "running", "TaskStates": {"engine": {"Events": events}}}


def test_a_restart_under_the_check_its_predecessor_left_passing_is_not_credited() -> None:
    """Consul runs the check every few seconds; an engine that dies and restarts between two
    runs leaves the last start's passing status standing over the new one."""
    sightings = StartSightings()
    assert sightings.passing([_entry("passing", 20)], {ALLOC: _restarted(100)}).healthy == {(100, ALLOC)}
    # Restarted in place, crash-looping faster than the check runs: still "passing" at 20.
    assert sightings.passing([_entry("passing", 20)], {ALLOC: _restarted(100, 200)}).healthy == frozenset()
    assert (
        sightings.passing([_entry("passing", 20)], {ALLOC: _restarted(100, 200, 300)}).healthy == frozenset()
    )
    # The check runs: critical, then the start that loads passes it; that one is credited.
    assert (
        sightings.passing([_entry("critical", 25)], {ALLOC: _restarted(100, 200, 300)}).healthy == frozenset()
    )
    fresh = sightings.passing([_entry("passing", 30)], {ALLOC: _restarted(100, 200, 300)})
    assert fresh.healthy == {(300, ALLOC)} and fresh.ready == {"m": 1}


def test_a_restart_that_passed_while_nomad_lagged_is_credited_when_nomad_shows_it() -> None:
    sightings = StartSightings()
    assert sightings.passing([_entry("passing", 20)], {ALLOC: _restarted(100)}).healthy == {(100, ALLOC)}
    # Nomad still shows the first start while Consul has seen the engine fail and a restart
    # pass (the watcher need not have read the critical in between).
    sightings.passing([_entry("passing", 30)], {ALLOC: _restarted(100)})
    assert sightings.passing([_entry("passing", 30)], {ALLOC: _restarted(100, 200)}).healthy == {(200, ALLOC)}
