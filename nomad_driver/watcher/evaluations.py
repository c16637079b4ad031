"""Evaluations, followed through Nomad's event stream, and read per job for the models that
decide from them.

A pass reads a model's evaluations for one thing: whether its newest decided evaluation failed
to place it (`placement.latest_placement_failure`: unplaceable, and the reason in words). A
blocking `/v1/evaluations` answered every evaluation of the namespace again at each change of
any one, so a fleet of ten thousand paid for every register, scale and reschedule anywhere.

Here the collection is listed once (and again every `RESYNC_S`, and whenever the stream ends:
the safety net for what a gap in the stream, or Nomad's garbage collection, which sends no
event, would hide), then followed by the `Evaluation` topic. An event of one of llmgw's jobs is
taken in as it comes, for free, except for the jobs whose decision reads them now
(`jobs_needing_evaluations`): those are read whole with `GET /v1/job/<id>/evaluations`, so that
what says "fits nowhere" is that job's own current list, a blocked evaluation's parent and all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from itertools import chain
from typing import Any

from nomad_driver.fields import as_int
from nomad_driver.nomad import JOB_PREFIX, Nomad
from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.feeds import READ_EACH_UP_TO, ByJob, _Feed, per_job
from nomad_driver.watcher.job_facts import job_group

# Allocations that hold (or are about to hold) a replica's place.
_LIVE = frozenset({"pending", "running"})


def jobs_needing_evaluations(views: Iterable[ModelView]) -> frozenset[str]:
    """The jobs whose evaluations a pass decides from: one with replicas Nomad has not placed
    (its count above its live allocations: a register or scale not placed yet, or that cannot
    be), one its state calls unplaceable (to see it placed again), or one a router waits on."""
    needed: set[str] = set()
    for view in views:
        if view.job is None:
            continue
        job_id = str(view.job.get("ID") or view.job_id or view.model.job_id)
        _, count = job_group(view.job)
        live = sum(
            1
            for a in view.allocs
            if a.get("ClientStatus") in _LIVE and a.get("DesiredStatus", "run") == "run"
        )
        unplaceable = view.state is not None and view.state.unplaceable
        if count > live or unplaceable or view.asks:
            needed.add(job_id)
    return frozenset(needed)


class EvaluationFeed(_Feed[tuple[dict[str, Any], ...]]):
    """The evaluations of llmgw's jobs. `needed` is set by the watcher after each pass."""

    topic = "Evaluation"

    def __init__(self, nomad: Nomad, wait_s: float, **kw: Any) -> None:
        super().__init__(nomad, wait_s, **kw)
        self.needed: frozenset[str] = frozenset()
        self.by_job: dict[str, dict[str, dict[str, Any]]] = {}
        self.job_reads = 0  # per-job reads made, for tests and the benchmark
        self._data: tuple[dict[str, Any], ...] = ()
        self.indexed = ByJob((), {})

    async def list_all(self) -> int:
        index, items = await asyncio.to_thread(self.nomad.blocking_list, "evaluations")
        by_job: dict[str, dict[str, dict[str, Any]]] = {}
        for e in items:
            job_id = str(e.get("JobID", ""))
            if job_id.startswith(JOB_PREFIX):
                by_job.setdefault(job_id, {})[str(e.get("ID", ""))] = e
        self.by_job = by_job
        self._refresh()
        return index

    async def apply(self, events: list[dict[str, Any]]) -> bool:
        touched: dict[str, list[dict[str, Any]]] = {}
        for event in events:
            payload = event.get("Payload")
            evaluation = payload.get("Evaluation") if isinstance(payload, dict) else None
            if not isinstance(evaluation, dict):
                continue
            job_id = str(evaluation.get("JobID", ""))
            if job_id.startswith(JOB_PREFIX):
                touched.setdefault(job_id, []).append(evaluation)
        if not touched:
            return False
        to_read = [j for j in touched if j in self.needed]
        if len(to_read) > READ_EACH_UP_TO:
            # A wave (a fleet rescheduled after a node died): one list costs less than a read each.
            await self.list_all()
            self._changes = None
            return True
        changed = False
        moved: set[str] = set()
        for job_id, evaluations in touched.items():
            held = self.by_job.get(job_id, {})
            if job_id in to_read:
                fresh = {
                    str(e.get("ID", "")): e
                    for e in await asyncio.to_thread(self.nomad.job_evaluations, job_id)
                }
                self.job_reads += 1
            else:
                fresh = dict(held)
                for e in evaluations:
                    eval_id = str(e.get("ID", ""))
                    if as_int(e.get("ModifyIndex")) >= as_int(fresh.get(eval_id, {}).get("ModifyIndex")):
                        fresh[eval_id] = e
            if fresh != held:
                if fresh:
                    self.by_job[job_id] = fresh
                else:
                    self.by_job.pop(job_id, None)  # a purged job's
                changed = True
                moved.add(job_id)
                self.changed(job_id)
        if changed:
            self._refresh(moved)
        return changed

    def _refresh(self, jobs: Iterable[str] | None = None) -> None:
        """A new reading (`jobs`: those whose evaluations moved; None: every one)."""
        by_job = per_job(self.indexed.by_job, self.by_job, jobs)
        self._data = tuple(chain.from_iterable(by_job.values()))
        self.indexed = ByJob(self._data, by_job)

    def data(self) -> tuple[dict[str, Any], ...]:
        return self._data
