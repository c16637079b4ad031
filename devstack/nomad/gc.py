"""Nomad's garbage collector (`nomad/core_sched.go`): what the servers forget, and when.

Nomad keeps terminal evaluations, allocations, stopped jobs and down nodes only for a while, so
anything that reads them (llmgw's failure count) must survive their disappearance. The rules
here are the core scheduler's:

- An evaluation is collected once it is terminal (complete, failed, canceled) and older than
  `eval_gc_threshold` (1h; `batch_eval_gc_threshold`, 24h, for batch jobs), and only when every
  allocation it created is collectable. Collectable allocations go with it, and are collected
  even when their evaluation stays (`evalGC` reaps them either way).
- An allocation is collectable when it is terminal, older than the threshold and not still
  running on its client; for a live job, a failed allocation only once it was replaced
  (`NextAllocation`), its reschedule policy allows no attempts, or its last reschedule is
  older than the policy's interval (`allocGCEligible`).
- A job is collected (purged, with its evaluations and allocations) once it is dead and
  stopped (or a dead batch job), older than `job_gc_threshold` (4h), and all its evaluations
  are collectable (`jobGC`, `jobIsGCable`).
- A deployment is collected once it is terminal (successful, failed, cancelled), older than
  `deployment_gc_threshold` (1h), and no allocation that is not terminal still names it
  (`deploymentGC`): a running job's last deployment stays as long as its allocations run. A
  collected (or purged) job takes all its deployments with it (`deleteJobImpl`).
- A node is collected once it is down, older than `node_gc_threshold` (24h) and holds only
  terminal allocations (`nodeGC`).
- `PUT /v1/system/gc` forces a collection with every threshold at its maximum: everything
  the rules allow goes now (`forceGC`).

"Older than" compares the object's ModifyIndex with the raft index the store had at
`now - threshold` (Nomad's FSM time table), in the stand-in's clock.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from dataclasses import dataclass
from typing import Any

from devstack.nomad import deployments
from devstack.nomad.clock import Clock
from devstack.nomad.reconcile import TERMINAL_CLIENT, TERMINAL_EVAL
from devstack.nomad.state import StateStore

Json = dict[str, Any]
log = logging.getLogger("devstack.nomad.gc")

HOUR = 3600.0
FORCED = 2**64 - 1  # every index is older than this: what a forced GC compares against


@dataclass(frozen=True)
class GCConfig:
    """The server's GC settings, in seconds of the stand-in's clock (Nomad's defaults)."""

    interval_s: float = 300.0  # eval/job/node_gc_interval
    eval_threshold_s: float = 1 * HOUR
    batch_eval_threshold_s: float = 24 * HOUR
    job_threshold_s: float = 4 * HOUR
    node_threshold_s: float = 24 * HOUR
    deployment_threshold_s: float = 1 * HOUR


class TimeTable:
    """Raft index by time (Nomad's `TimeTable`), to turn "older than 1h" into an index."""

    def __init__(self) -> None:
        self._times: list[float] = []
        self._indexes: list[int] = []

    def witness(self, index: int, when: float) -> None:
        if self._indexes and index <= self._indexes[-1]:
            return
        self._times.append(when)
        self._indexes.append(index)

    def nearest_index(self, cutoff: float) -> int:
        """The newest index witnessed at or before `cutoff` (0 when none is that old)."""
        i = bisect.bisect_right(self._times, cutoff)
        return self._indexes[i - 1] if i else 0


@dataclass
class Collected:
    evals: int = 0
    allocs: int = 0
    jobs: int = 0
    nodes: int = 0
    deployments: int = 0


def _alloc_terminal(alloc: Json) -> bool:
    return alloc.get("DesiredStatus") in ("stop", "evict") or alloc.get("ClientStatus") in TERMINAL_CLIENT


def _group(job: Json, name: str) -> Json | None:
    return next((g for g in job.get("TaskGroups") or [] if g.get("Name") == name), None)


def alloc_gc_eligible(alloc: Json, job: Json | None, now_ns: int, threshold: int) -> bool:
    """`allocGCEligible`."""
    if not _alloc_terminal(alloc) or alloc["ModifyIndex"] > threshold:
        return False
    if alloc.get("ClientStatus") == "running":
        return False
    if job is None:
        return True
    group = _group(job, alloc.get("TaskGroup", ""))
    if group is None:
        return True
    if not job.get("Stop") and group.get("PreventRescheduleOnLost") and alloc.get("ClientStatus") == "lost":
        return False
    if job.get("Stop") or job.get("Status") == "dead":
        return True
    if alloc.get("DesiredStatus") == "stop":
        return True
    if alloc.get("ClientStatus") != "failed":
        return True
    policy = group.get("ReschedulePolicy")
    if not policy or (not policy.get("Unlimited") and not policy.get("Attempts")):
        return True
    if alloc.get("NextAllocation"):
        return True
    if policy.get("Unlimited"):
        return False
    events = (alloc.get("RescheduleTracker") or {}).get("Events") or []
    if not events:
        return False
    return now_ns - int(events[-1]["RescheduleTime"]) > int(policy.get("Interval") or 0)


class GarbageCollector:
    def __init__(self, store: StateStore, clock: Clock, config: GCConfig | None = None) -> None:
        self.store = store
        self.clock = clock
        self.config = config or GCConfig()
        self.times = TimeTable()
        self._task: asyncio.Task[None] | None = None

    def witness(self) -> None:
        self.times.witness(self.store.index, self.clock.now())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            # The time table is sampled often enough for thresholds of minutes, as Nomad's is.
            for _ in range(10):
                self.witness()
                await self.clock.sleep(self.config.interval_s / 10)
            try:
                self.collect(forced=False)
            except Exception:  # one bad object must not end collection for good
                log.exception("garbage collection failed")

    def _threshold(self, forced: bool, seconds: float) -> int:
        if forced:
            return FORCED
        return self.times.nearest_index(self.clock.now() - seconds)

    def collect(self, forced: bool) -> Collected:
        """One pass of the core scheduler's job, eval, deployment and node GC (`forceGC` when
        forced)."""
        self.witness()
        cfg = self.config
        now_ns = self.clock.now_ns()
        # jobGC first, as forceGC runs it: a collected job takes its evaluations with it.
        job_threshold = self._threshold(forced, cfg.job_threshold_s)
        eval_threshold = self._threshold(forced, cfg.eval_threshold_s)
        batch_threshold = self._threshold(forced, cfg.batch_eval_threshold_s)
        gone_jobs: list[tuple[str, str]] = []
        gone_evals: set[str] = set()
        gone_allocs: set[str] = set()
        for key, job in list(self.store.jobs.items()):
            if not self._job_gcable(job) or job["CreateIndex"] > job_threshold:
                continue
            job_evals, job_allocs, all_gc = [], [], True
            for evaluation in self.store.evals_for_job(*key):
                gc, allocs = self._gc_eval(evaluation, job_threshold, now_ns, allow_batch=True)
                if not gc:
                    all_gc = False
                    break
                job_evals.append(evaluation["ID"])
                job_allocs.extend(allocs)
            if all_gc:
                gone_jobs.append(key)
                gone_evals.update(job_evals)
                gone_allocs.update(job_allocs)
        for evaluation in list(self.store.evals.values()):
            if evaluation["ID"] in gone_evals:
                continue
            threshold = batch_threshold if evaluation.get("Type") == "batch" else eval_threshold
            gc, allocs = self._gc_eval(evaluation, threshold, now_ns, allow_batch=False)
            if gc:
                gone_evals.add(evaluation["ID"])
            gone_allocs.update(allocs)
        # deploymentGC; a collected job's deployments go with it whatever their age or status.
        deployment_threshold = self._threshold(forced, cfg.deployment_threshold_s)
        collected_jobs = set(gone_jobs)
        gone_deployments = [
            d["ID"]
            for d in self.store.deployments.values()
            if (d["Namespace"], d["JobID"]) in collected_jobs
            or self._deployment_gcable(d, deployment_threshold)
        ]
        node_threshold = self._threshold(forced, cfg.node_threshold_s)
        gone_nodes = [
            node_id
            for node_id, node in self.store.nodes.items()
            if node.get("Status") == "down"
            and node["ModifyIndex"] <= node_threshold
            and all(_alloc_terminal(a) for a in self.store.allocs_for_node(node_id))
        ]
        with self.store.batch():
            self.store.delete_evals_allocs(gone_evals, gone_allocs)
            self.store.delete_deployments(gone_deployments)
            for ns, job_id in gone_jobs:
                self.store.delete_job(ns, job_id)
            for node_id in gone_nodes:
                self.store.delete_node(node_id)
        done = Collected(
            len(gone_evals), len(gone_allocs), len(gone_jobs), len(gone_nodes), len(gone_deployments)
        )
        if done != Collected():
            log.info(
                "garbage collected %d evaluations, %d allocations, %d jobs, %d nodes, %d deployments"
                " (forced=%s)",
                done.evals,
                done.allocs,
                done.jobs,
                done.nodes,
                done.deployments,
                forced,
            )
        return done

    @staticmethod
    def _job_gcable(job: Json) -> bool:
        """`jobIsGCable`."""
        periodic = bool((job.get("Periodic") or {}).get("Enabled"))
        if periodic or job.get("ParameterizedJob"):
            return bool(job.get("Stop"))
        if job.get("Status") != "dead":
            return False
        return bool(job.get("Stop")) or job.get("Type") in ("batch", "sysbatch")

    def _deployment_gcable(self, deployment: Json, threshold: int) -> bool:
        """`deploymentGC`: terminal, old enough, and no allocation still running under it."""
        if deployments.is_active(deployment) or deployment["ModifyIndex"] > threshold:
            return False
        allocs = self.store.allocs_for_job(deployment["Namespace"], deployment["JobID"])
        return all(_alloc_terminal(a) for a in allocs if a.get("DeploymentID") == deployment["ID"])

    def _gc_eval(
        self, evaluation: Json, threshold: int, now_ns: int, allow_batch: bool
    ) -> tuple[bool, list[str]]:
        """`gcEval`: whether the evaluation goes, and which of its allocations go."""
        if evaluation.get("Status") not in TERMINAL_EVAL or evaluation["ModifyIndex"] > threshold:
            return False, []
        job = self.store.jobs.get((evaluation["Namespace"], evaluation["JobID"]))
        allocs = [a for a in self.store.allocs_for_job(evaluation["Namespace"], evaluation["JobID"])]
        allocs = [a for a in allocs if a.get("EvalID") == evaluation["ID"]]
        if evaluation.get("Type") == "batch":
            collect = job is None or (job.get("Status") == "dead" and (job.get("Stop") or allow_batch))
            if not collect:
                assert job is not None
                old = [
                    a["ID"]
                    for a in allocs
                    if a["CreateIndex"] < job.get("JobModifyIndex", 0)
                    and a["ModifyIndex"] < threshold
                    and _alloc_terminal(a)
                ]
                return len(old) == len(allocs), old
        eligible = [a["ID"] for a in allocs if alloc_gc_eligible(a, job, now_ns, threshold)]
        return len(eligible) == len(allocs), eligible
