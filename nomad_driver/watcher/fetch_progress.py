"""Running fetches across the fleet, for `GET /v1/admin/models` (what `llmgw ctl status` shows)
and /metrics.

A fetch's progress lives only in its task's log on its node, so each reading is a call through
a Nomad server to a client. Only allocations whose fetch task runs now, as the watcher's own
views already say, are read, at most a few at once, and each answer is kept for a few seconds:
a dashboard polling the list or a Prometheus scraping every 15 s costs one log read per running
fetch per few seconds, however many models the fleet defines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

from nomad_driver.fetch.progress import fetching, read_one
from nomad_driver.nomad import Nomad

FRESH_S = 5.0
AT_ONCE = 8  # log reads in flight at a time: each holds a Nomad server and a client busy

# States whose reason is the operator's next step (parked, refused, ...): a fetch under way does
# not replace it. In the others a running fetch is what the model is waiting on.
SHOWN_IN = ("starting", "short", "updating", "satisfied", "idle")


class HasAllocs(Protocol):
    @property
    def allocs(self) -> tuple[Mapping[str, Any], ...]: ...


class FetchProgressCache:
    def __init__(self, nomad: Nomad, clock: Callable[[], float] = time.monotonic) -> None:
        self.nomad, self.clock = nomad, clock
        self._read: dict[str, tuple[float, dict[str, Any] | None]] = {}
        # One refresh at a time, so that callers arriving together share its reads.
        self._lock = asyncio.Lock()

    async def of_models(self, views: Mapping[str, HasAllocs]) -> dict[str, list[dict[str, Any]]]:
        """Model -> its running fetches' progress; models with none are left out."""
        running = {name: fetching(view.allocs) for name, view in views.items()}
        running = {name: allocs for name, allocs in running.items() if allocs}
        async with self._lock:
            now = self.clock()
            stale = [
                alloc
                for allocs in running.values()
                for alloc in allocs
                if now - self._read.get(_id(alloc), (-FRESH_S, None))[0] >= FRESH_S
            ]
            gate = asyncio.Semaphore(AT_ONCE)

            async def read(alloc: Mapping[str, Any]) -> dict[str, Any] | None:
                async with gate:
                    return await read_one(self.nomad, alloc)

            # An unreadable log is kept as "nothing" for as long as a reading would be: a node
            # that does not answer is not asked again on every call.
            for alloc, found in zip(stale, await asyncio.gather(*(read(a) for a in stale)), strict=True):
                self._read[_id(alloc)] = (now, found)
            for alloc_id in [k for k, (at, _) in self._read.items() if now - at >= FRESH_S]:
                del self._read[alloc_id]
            out: dict[str, list[dict[str, Any]]] = {}
            for name, allocs in running.items():
                shown = [p for a in allocs if (p := self._read.get(_id(a), (0.0, None))[1])]
                if shown:
                    out[name] = shown
            return out


def _id(alloc: Mapping[str, Any]) -> str:
    return str(alloc.get("ID") or "")


def with_fetch(status: dict[str, Any], fetches: list[dict[str, Any]]) -> dict[str, Any]:
    """A model's status with its running fetches, and while it waits on them a reason that says
    so (`fetching weights: 1.2 GiB of 4.0 GiB at 35.0 MiB/s on gpu-3`): a long download reads
    as progress, not as a model that does not start."""
    status["fetch"] = fetches
    if fetches and status.get("state") in SHOWN_IN:
        status["reason"] = "fetching weights: " + "; ".join(str(f["text"]) for f in fetches)
    return status


def fetch_metrics(progress: Mapping[str, Iterable[Mapping[str, Any]]]) -> Iterator[Metric]:
    """Gauges of the running fetches only (a fetch is a few minutes of a model's life; a series
    per model at 0 the rest of the time would say nothing)."""
    done = GaugeMetricFamily(
        "llmgw_model_fetch_bytes", "Bytes of the model's weights fetched so far, per running fetch.",
        labels=["model", "node"],
    )  # fmt: skip
    total = GaugeMetricFamily(
        "llmgw_model_fetch_total_bytes",
        "Size of the weights a running fetch downloads (absent while the source has not said).",
        labels=["model", "node"],
    )
    rate = GaugeMetricFamily(
        "llmgw_model_fetch_rate_bytes",
        "Bytes per second a running fetch receives, over its stall window.",
        labels=["model", "node"],
    )
    for model in sorted(progress):
        for p in progress[model]:
            labels = [model, str(p.get("node") or p.get("alloc_id") or "")]
            done.add_metric(labels, float(p.get("done") or 0))
            if p.get("total") is not None:
                total.add_metric(labels, float(p["total"]))
            rate.add_metric(labels, float(p.get("rate") or 0))
    yield from (done, total, rate)
