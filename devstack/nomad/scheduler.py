"""The scheduler loop (`nomad/eval_broker.go`, `nomad/blocked_evals.go`, the worker): evaluations
queue on an asyncio queue so the HTTP layer answers a register at once; one worker computes each
plan with `reconcile.compute_plan`, applies it in one batch, then tells the client to start or
stop the allocations it touched. Blocked evaluations wait here for capacity, delayed follow-ups
for their time on the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from devstack.nomad import deployments
from devstack.nomad.clock import Clock
from devstack.nomad.encode import parse_rfc3339_ns, rfc3339
from devstack.nomad.reconcile import (
    DESC_BLOCKED,
    TERMINAL_CLIENT,
    Plan,
    compute_plan,
    job_status,
    job_summary,
    last_event_time,
    new_eval,
    reschedule_eligible,
)
from devstack.nomad.state import StateStore

Json = dict[str, Any]
log = logging.getLogger("devstack.nomad.scheduler")


class AllocClient(Protocol):
    def start_alloc(self, alloc_id: str) -> None: ...
    def stop_alloc(self, alloc_id: str) -> None: ...


class Scheduler:
    """The eval broker, the blocked-eval tracker and one worker, on the store's loop."""

    def __init__(self, store: StateStore, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self.client: AllocClient | None = None
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued_ids: set[str] = set()
        # One tracked blocked evaluation per job (`blockedEvals.jobs`).
        self._blocked: dict[tuple[str, str], str] = {}
        self._unblock_scheduled = False
        self._queued_allocs: dict[tuple[str, str], dict[str, int]] = {}
        self._failures_reported: set[str] = set()
        self._timers: set[asyncio.Task[None]] = set()
        self._worker: asyncio.Task[None] | None = None
        self.processed = 0
        self.on_processed: Callable[[Json], None] | None = None
        # The client's health trackers; absent when the stand-in runs no client (unit tests).
        self.health: deployments.HealthWatcher | None = None

    # -- lifecycle

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name="nomad-scheduler")

    async def stop(self) -> None:
        tasks = [*self._timers]
        if self._worker is not None:
            tasks.append(self._worker)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- evaluations in

    def submit(self, evaluation: Json) -> None:
        """Queue an evaluation already written to the store; one with a `WaitUntil` in the
        future waits for it on the clock (the broker's delay heap)."""
        wait_ns = parse_rfc3339_ns(evaluation.get("WaitUntil")) - self.clock.now_ns()
        if wait_ns > 0:
            task = asyncio.create_task(self._delayed(evaluation["ID"], wait_ns / 1e9))
            self._timers.add(task)
            task.add_done_callback(self._timers.discard)
            return
        self._enqueue(evaluation["ID"])

    def _enqueue(self, eval_id: str) -> None:
        if eval_id not in self._queued_ids:
            self._queued_ids.add(eval_id)
            self._queue.put_nowait(eval_id)

    async def _delayed(self, eval_id: str, seconds: float) -> None:
        await self.clock.sleep(seconds)
        self._enqueue(eval_id)

    def capacity_changed(self) -> None:
        """Nodes or allocations changed so that a blocked evaluation might now place; re-run
        them once the current burst of changes is written."""
        if self._blocked and not self._unblock_scheduled:
            self._unblock_scheduled = True
            asyncio.get_running_loop().call_soon(self._unblock)

    def _unblock(self) -> None:
        self._unblock_scheduled = False
        for eval_id in list(self._blocked.values()):
            self._enqueue(eval_id)

    def untrack(self, namespace: str, job_id: str) -> None:
        """Cancel the job's blocked evaluation: the job was stopped or purged."""
        self._cancel_blocked((namespace, job_id), "job deregistered")
        self._queued_allocs.pop((namespace, job_id), None)

    def _cancel_blocked(self, key: tuple[str, str], desc: str) -> None:
        eval_id = self._blocked.pop(key, None)
        if eval_id is None:
            return
        old = self.store.evals.get(eval_id)
        if old is not None and old["Status"] == "blocked":
            self.store.upsert_eval(
                {**old, "Status": "canceled", "StatusDescription": desc, "ModifyTime": self.clock.now_ns()}
            )

    # -- the client's reports

    def on_alloc_update(self, alloc: Json) -> None:
        """Called by the client after each change it writes (`Node.UpdateAlloc`)."""
        try:
            self._on_alloc_update(alloc)
        except Exception:  # a bad report must not take the client's loop down with it
            log.exception("handling the client's update of allocation %s", alloc.get("ID"))

    def _on_alloc_update(self, alloc: Json) -> None:
        current = self.store.allocs.get(alloc["ID"], alloc)
        job = self.store.jobs.get((current["Namespace"], current["JobID"]))
        with self._batch():
            if (
                job is not None
                and current["ClientStatus"] == "failed"
                and current["DesiredStatus"] == "run"
                and not current.get("FollowupEvalID")
                and not current.get("NextAllocation")
                and current["ID"] not in self._failures_reported
            ):
                # A client reports a failed allocation more than once (task events keep coming
                # after the status settles); one evaluation per failure is what Nomad ends up with.
                self._failures_reported.add(current["ID"])
                group = next((g for g in job["TaskGroups"] if g["Name"] == current["TaskGroup"]), None)
                policy = group.get("ReschedulePolicy") if group else None
                if reschedule_eligible(current, policy, last_event_time(current)):
                    evaluation = new_eval(job, "alloc-failure", self.clock.now_ns())
                    self.store.upsert_eval(evaluation)
                    self.submit(evaluation)
            if job is not None:
                self._refresh_job(job)
        if current["ClientStatus"] in TERMINAL_CLIENT or current["DesiredStatus"] != "run":
            self.capacity_changed()

    def _refresh_job(self, job: Json) -> None:
        """Write the job's status and summary if they changed (inside a batch)."""
        key = (job["Namespace"], job["ID"])
        status = job_status(self.store, job)
        if status != job["Status"]:
            self.store.upsert_job({**job, "Status": status}, "JobRegistered")
            job = self.store.jobs[key]
        summary = job_summary(self.store, job, self._queued_allocs.get(key, {}))
        existing = self.store.job_summaries.get(key)
        if existing is None or existing["Summary"] != summary["Summary"]:
            self.store.upsert_job_summary(summary)

    def refresh_job_in_batch(self, namespace: str, job_id: str) -> None:
        """Refresh a job's status and summary as part of the caller's batch."""
        job = self.store.jobs.get((namespace, job_id))
        if job is not None:
            self._refresh_job(job)

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        # A report that arrives inside another writer's batch joins it.
        if self.store._pending is not None:
            yield
            return
        with self.store.batch():
            yield

    # -- the worker

    async def _run(self) -> None:
        while True:
            eval_id = await self._queue.get()
            self._queued_ids.discard(eval_id)
            try:
                self.process(eval_id)
            except Exception:
                log.exception("evaluation %s failed", eval_id)
                evaluation = self.store.evals.get(eval_id)
                if evaluation is not None:
                    self.store.upsert_eval(
                        {
                            **evaluation,
                            "Status": "failed",
                            "StatusDescription": "scheduler error; see stand-in log",
                        }
                    )
            # Let HTTP requests in between evaluations, so a burst of registers stays answerable.
            await asyncio.sleep(0)

    def process(self, eval_id: str) -> Plan | None:
        store = self.store
        evaluation = store.evals.get(eval_id)
        if evaluation is None or evaluation["Status"] not in ("pending", "blocked"):
            return None
        now = self.clock.now_ns()
        key = (evaluation["Namespace"], evaluation["JobID"])
        job = store.jobs.get(key)
        plan = compute_plan(
            store, evaluation, now, destructive_budget=deployments.destructive_budget(store, job)
        )
        pending = plan.held_back | {g for g, n in plan.queued.items() if n}
        deployment_writes = deployments.plan_deployment(
            store, job, evaluation, plan.placed, plan.updated, plan.stopped, pending, now
        )
        was_blocked = evaluation["Status"] == "blocked"
        result = plan.evaluation
        result["ModifyTime"] = now
        joined = [
            a for a in plan.updated if a.get("DeploymentID") != store.allocs[a["ID"]].get("DeploymentID")
        ]
        with store.batch():
            # Deployments first: the allocations placed into one move its counts.
            for deployment in deployment_writes:
                store.upsert_deployment(deployment)
                if deployment["Status"] == deployments.SUCCESSFUL and job is not None:
                    # A version that deployed successfully is stable (what auto-revert goes back to).
                    store.upsert_job({**store.jobs[key], "Stable": True})
            for alloc in plan.stopped:
                store.upsert_alloc(alloc, "PlanResult")
            for alloc in plan.updated:
                store.upsert_alloc(alloc)
            for alloc in plan.placed:
                store.upsert_alloc(alloc, "PlanResult")
            for followup in plan.new_evals:
                store.upsert_eval(followup)
            if plan.failed_tg and plan.block:
                result["FailedTGAllocs"] = plan.failed_tg
                if was_blocked:
                    # Re-blocked: the same evaluation waits again (`ReblockEval`).
                    result["Status"] = "blocked"
                else:
                    blocked = new_eval(
                        store.jobs[key],
                        "queued-allocs",
                        now,
                        Status="blocked",
                        StatusDescription=DESC_BLOCKED,
                        PreviousEval=eval_id,
                        NodeID=plan.blocked_node,
                        FailedTGAllocs=plan.failed_tg,
                        QueuedAllocations=dict(result.get("QueuedAllocations") or {}),
                    )
                    result["BlockedEval"] = blocked["ID"]
                    self._cancel_blocked(
                        key, f"existing blocked evaluation exists for job {evaluation['JobID']!r}"
                    )
                    store.upsert_eval(blocked)
                    self._blocked[key] = blocked["ID"]
            else:
                # A system job's filtered-out nodes are reported but wait for nothing.
                result["FailedTGAllocs"] = plan.failed_tg or None
                if was_blocked:
                    self._blocked.pop(key, None)
                # Everything fits now; an older blocked evaluation has nothing left to place.
                elif key in self._blocked:
                    self._cancel_blocked(key, "placed by a later evaluation")
            if plan.new_evals:
                result["NextEval"] = plan.new_evals[0]["ID"]
            store.upsert_eval(result)
            if result.get("QueuedAllocations") is not None:
                self._queued_allocs[key] = dict(result["QueuedAllocations"])
            job = store.jobs.get(key)
            if job is not None:
                self._refresh_job(job)
        for followup in plan.new_evals:
            self.submit(followup)
        self.processed += 1
        if self.health is not None:
            for alloc in [*plan.placed, *joined]:
                self.health.track(store.allocs[alloc["ID"]])
        if self.client is not None:
            for alloc in plan.stopped:
                self.client.stop_alloc(alloc["ID"])
            for alloc in plan.placed:
                self.client.start_alloc(alloc["ID"])
        if plan.stopped:
            self.capacity_changed()
        if evaluation.get("NodeID"):
            self.check_drain(evaluation["NodeID"])
        if self.on_processed is not None:
            self.on_processed(result)
        return plan

    # -- node drain (nomad/drainer)

    def check_drain(self, node_id: str) -> None:
        """Finish a drain once the node has nothing left that should run there."""
        node = self.store.nodes.get(node_id)
        if node is None or not node.get("DrainStrategy"):
            return
        ignore_system = bool(node["DrainStrategy"].get("IgnoreSystemJobs"))
        if any(
            a["DesiredStatus"] == "run"
            and a["ClientStatus"] not in TERMINAL_CLIENT
            and not (ignore_system and (a.get("Job") or {}).get("Type") == "system")
            for a in self.store.allocs_for_node(node_id)
        ):
            return
        now = self.clock.now_ns()
        last = dict(node.get("LastDrain") or {})
        last.update({"Status": "complete", "UpdatedAt": rfc3339(now)})
        self.store.upsert_node({**node, "DrainStrategy": None, "LastDrain": last}, "NodeDrain")
