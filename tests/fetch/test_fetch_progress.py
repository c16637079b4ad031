"""The fleet-wide view of running fetches (the admin API's model list, `llmgw ctl status`,
/metrics): only allocations whose fetch task runs are read, each reading is kept a few seconds,
and a model waiting on its weights says how far they have come."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, cast

from nomad_driver.fetch.render import FETCH_TASK
from nomad_driver.nomad import Nomad, NomadError
from nomad_driver.watcher.fetch_progress import FRESH_S, FetchProgressCache, fetch_metrics, with_fetch

GIB = 1024**3


@dataclass(frozen=True)
class View:
    allocs: tuple[dict[str, Any], ...]


def alloc(alloc_id: str, node: str, fetch_state: str, client: str = "pending") -> dict[str, Any]:
    return {
        "ID": alloc_id,
        "NodeName": node,
        "ClientStatus": client,
        "TaskStates": {FETCH_TASK: {"State": fetch_state}},
    }


class Logs:
    """Nomad's logs API as the cache sees it, counting what it is asked."""

    def __init__(self, lines: dict[str, str]) -> None:
        self.lines, self.lock = lines, threading.Lock()
        self.reads: list[str] = []

    def log_tail(self, alloc_id: str, task: str, kind: str, nbytes: int = 4096) -> str:
        assert (task, kind) == (FETCH_TASK, "stdout")
        with self.lock:
            self.reads.append(alloc_id)
        if alloc_id not in self.lines:
            raise NomadError(f"alloc {alloc_id} not found")
        return self.lines[alloc_id]


def fleet() -> dict[str, View]:
    """200 models: one fetching on two nodes, one fetching on one, the rest running or idle."""
    views = {f"m{i:03d}": View((alloc(f"a{i}", "gpu-0", "dead", "running"),)) for i in range(200)}
    views["big"] = View((alloc("big-1", "gpu-1", "running"), alloc("big-2", "gpu-2", "running")))
    views["small"] = View(
        (alloc("small-1", "gpu-3", "running"), alloc("small-0", "gpu-3", "dead", "complete"))
    )
    views["idle"] = View(())
    return views


LINES = {
    "big-1": "fetching x into y\nfetch progress: done=1288490188 total=4294967296 rate=36700160 B/s\n",
    "big-2": "fetch progress: done=0 total=4294967296 rate=0 B/s\nwaiting\n",
    "small-1": "fetch progress: done=100 total=unknown rate=10 B/s\n",
}


async def test_only_running_fetches_are_read_and_each_reading_is_kept_a_few_seconds() -> None:
    logs = Logs(LINES)
    now = [1000.0]
    cache = FetchProgressCache(cast(Nomad, logs), clock=lambda: now[0])
    progress = await cache.of_models(fleet())
    assert sorted(logs.reads) == ["big-1", "big-2", "small-1"]
    assert sorted(progress) == ["big", "small"]
    assert [p["node"] for p in progress["big"]] == ["gpu-1", "gpu-2"]
    assert progress["big"][0]["text"] == "1.2 GiB of 4.0 GiB at 35.0 MiB/s on gpu-1"
    assert progress["small"][0]["total"] is None

    # Polled again within the window: answered from what was read, nothing asked of Nomad.
    now[0] += FRESH_S - 1
    assert await cache.of_models(fleet()) == progress
    assert len(logs.reads) == 3

    now[0] += 1
    await cache.of_models(fleet())
    assert len(logs.reads) == 6


async def test_a_log_that_cannot_be_read_is_left_out_and_not_asked_again_at_once() -> None:
    logs = Logs({})
    now = [0.0]
    cache = FetchProgressCache(cast(Nomad, logs), clock=lambda: now[0])
    assert await cache.of_models(fleet()) == {}
    assert await cache.of_models(fleet()) == {}
    assert len(logs.reads) == 3


def test_a_starting_model_says_how_far_its_weights_have_come() -> None:
    fetches = [
        {"text": "1.2 GiB of 4.0 GiB at 35.0 MiB/s on gpu-1"},
        {"text": "0 B of 4.0 GiB at 0 B/s on gpu-2"},
    ]
    starting = with_fetch({"state": "starting", "reason": "1 replica starting"}, fetches)
    assert starting["reason"] == (
        "fetching weights: 1.2 GiB of 4.0 GiB at 35.0 MiB/s on gpu-1; 0 B of 4.0 GiB at 0 B/s on gpu-2"
    )
    assert starting["fetch"] == fetches
    # A parked model keeps the reason that says what to do.
    parked = with_fetch({"state": "parked", "reason": "parked after 5 ..."}, fetches)
    assert parked["reason"] == "parked after 5 ..."
    assert with_fetch({"state": "starting", "reason": "x"}, [])["reason"] == "x"


def test_fetch_gauges_exist_for_running_fetches_only() -> None:
    progress = {
        "big": [{"node": "gpu-1", "done": GIB, "total": 4 * GIB, "rate": 1000}],
        "small": [{"node": "gpu-3", "done": 100, "total": None, "rate": 10}],
    }
    families = {
        f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in fetch_metrics(progress)
    }
    assert families["llmgw_model_fetch_bytes"] == {("big", "gpu-1"): GIB, ("small", "gpu-3"): 100}
    assert families["llmgw_model_fetch_total_bytes"] == {("big", "gpu-1"): 4 * GIB}
    assert families["llmgw_model_fetch_rate_bytes"] == {("big", "gpu-1"): 1000, ("small", "gpu-3"): 10}
    assert [s for f in fetch_metrics({}) for s in f.samples] == []
