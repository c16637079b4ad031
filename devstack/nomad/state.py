"""The stand-in's state store: Nomad's tables, one raft-like index that every write raises,
per-table indexes, and a way to wait until a table passes an index (Nomad's memdb watch sets).

Everything runs on one asyncio loop, so writes need no locks: a writer mutates through the
methods here, each of which commits, and blocking readers wake within milliseconds because
every commit sets the events of the tables it touched. Objects are stored as Nomad's own JSON
(Go field names), so the HTTP layer serves them as they are.

Callers must treat stored dicts as owned by the store: replace them through an upsert rather
than mutating in place, so that the indexes and the event stream see every change.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from devstack.nomad import deployment_status
from devstack.nomad.encode import parse_rfc3339_ns, rfc3339
from devstack.nomad.usage import LiveUsage, forget_footprint

Json = dict[str, Any]

TABLES = (
    "jobs",
    "job_versions",
    "job_summary",
    "evals",
    "allocs",
    "nodes",
    "scaling_event",
    "scheduler_config",
    "namespaces",
    "variables",
    deployment_status.TABLE,
)


@dataclass(frozen=True)
class Event:
    """One entry of Nomad's event stream (`nomad/structs/event.go` `Event`)."""

    topic: str  # Job | Evaluation | Allocation | Node
    type: str  # JobRegistered, EvaluationUpdated, AllocationUpdated, NodeRegistration, ...
    key: str
    namespace: str
    index: int
    payload: Json

    def to_json(self) -> Json:
        return {
            "Topic": self.topic,
            "Type": self.type,
            "Key": self.key,
            "Namespace": self.namespace,
            "FilterKeys": None,
            "Index": self.index,
            "Payload": self.payload,
        }


@dataclass
class _Pending:
    tables: set[str] = field(default_factory=set)
    events: list[tuple[str, str, str, str, Json]] = field(default_factory=list)


class StateStore:
    def __init__(self) -> None:
        # Nomad's indexes start above zero; a blocking query with index 0 must return at once.
        self.index = 1
        self.table_index: dict[str, int] = dict.fromkeys(TABLES, 1)
        self.jobs: dict[tuple[str, str], Json] = {}
        self.job_versions: dict[tuple[str, str], list[Json]] = {}
        self.job_summaries: dict[tuple[str, str], Json] = {}
        self.evals: dict[str, Json] = {}
        self.allocs: dict[str, Json] = {}
        self.nodes: dict[str, Json] = {}
        self.scaling_events: dict[tuple[str, str], list[Json]] = {}
        self.deployments: dict[str, Json] = {}
        # Filled by the server with `default`, which Nomad creates at index 1.
        self.namespaces: dict[str, Json] = {}
        # Nomad Variables by (namespace, path); written by variables.py.
        self.variables: dict[tuple[str, str], Json] = {}
        self._deployments_by_job: dict[tuple[str, str], dict[str, Json]] = {}
        # Secondary indexes, as memdb keeps them: a job's or a node's allocations must not cost a
        # scan of every allocation, or a fleet of a thousand jobs answers slower with each one.
        self._allocs_by_job: dict[tuple[str, str], dict[str, Json]] = {}
        self._allocs_by_node: dict[str, dict[str, Json]] = {}
        self._evals_by_job: dict[tuple[str, str], dict[str, Json]] = {}
        # Allocations that hold resources on their node (desired "run", client not terminal):
        # what placement packs against, kept so no placement scans finished allocations.
        self.live_allocs: dict[str, Json] = {}
        # What they hold, summed per node and port as they come and go (usage.py).
        self.live_usage = LiveUsage()
        self._table_events: dict[str, asyncio.Event] = {t: asyncio.Event() for t in TABLES}
        self._subscribers: list[asyncio.Queue[list[Event]]] = []
        self._pending: _Pending | None = None

    # ----- indexes and waiting -------------------------------------------------------------

    def max_index(self, tables: Iterable[str]) -> int:
        return max(self.table_index[t] for t in tables)

    async def wait(self, tables: Iterable[str], min_index: int, timeout: float) -> int:
        """Return once any of `tables` has an index above `min_index`, or after `timeout`.
        Returns the tables' index, which is what `X-Nomad-Index` carries."""
        tables = tuple(tables)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.max_index(tables) <= min_index:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            waiters = [asyncio.ensure_future(self._table_events[t].wait()) for t in tables]
            try:
                await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        return self.max_index(tables)

    def subscribe(self) -> asyncio.Queue[list[Event]]:
        """A queue that receives the events of every later commit, one list per commit."""
        queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[list[Event]]) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)

    # ----- commits -------------------------------------------------------------------------

    def _touch(self, table: str, event: tuple[str, str, str, str, Json] | None = None) -> int:
        """Record a change; outside a `batch()` it commits at once. Returns the index the change
        will carry, so callers can stamp ModifyIndex before the commit."""
        if self._pending is None:
            pending = _Pending()
            pending.tables.add(table)
            if event:
                pending.events.append(event)
            return self._commit(pending)
        self._pending.tables.add(table)
        if event:
            self._pending.events.append(event)
        return self.index + 1

    def batch(self) -> _Batch:
        """Group several writes into one index, as one raft apply does in Nomad."""
        return _Batch(self)

    def _commit(self, pending: _Pending) -> int:
        if not pending.tables:
            return self.index
        self.index += 1
        for table in pending.tables:
            self.table_index[table] = self.index
            event = self._table_events[table]
            event.set()
            self._table_events[table] = asyncio.Event()
        if pending.events and self._subscribers:
            events = [
                Event(topic, type_, key, ns, self.index, payload)
                for topic, type_, key, ns, payload in pending.events
            ]
            for queue in self._subscribers:
                queue.put_nowait(events)
        return self.index

    def next_index(self) -> int:
        return self.index + 1

    def scheduler_config_changed(self) -> int:
        """The scheduler configuration (kept by `operator.SchedulerConfiguration`) was set: one
        raft write in Nomad, so it takes an index of its own."""
        return self._touch("scheduler_config")

    # ----- jobs ----------------------------------------------------------------------------

    def upsert_job(self, job: Json, event_type: str = "JobRegistered") -> int:
        if self._pending is None:
            with self.batch():
                self.upsert_job(job, event_type)
            return self.index
        key = (job["Namespace"], job["ID"])
        idx = self.index + 1
        existing = self.jobs.get(key)
        job["CreateIndex"] = existing["CreateIndex"] if existing else idx
        job["ModifyIndex"] = idx
        self.jobs[key] = job
        self.job_versions.setdefault(key, [])
        versions = self.job_versions[key]
        if not versions or versions[-1]["Version"] != job["Version"]:
            versions.append(copy.deepcopy(job))
        else:
            versions[-1] = copy.deepcopy(job)
        self._touch("job_versions")
        return self._touch("jobs", ("Job", event_type, job["ID"], job["Namespace"], {"Job": job}))

    def delete_job(self, namespace: str, job_id: str) -> int:
        if self._pending is None:
            with self.batch():
                self.delete_job(namespace, job_id)
            return self.index
        key = (namespace, job_id)
        job = self.jobs.pop(key, None)
        self.job_versions.pop(key, None)
        self.job_summaries.pop(key, None)
        self.scaling_events.pop(key, None)
        # A purged job takes its deployments with it (`deleteJobImpl`), whatever their status.
        self.delete_deployments([d["ID"] for d in self.deployments_for_job(namespace, job_id)])
        self._touch("job_summary")
        self._touch("job_versions")
        return self._touch("jobs", ("Job", "JobDeregistered", job_id, namespace, {"Job": job}))

    def upsert_job_summary(self, summary: Json) -> int:
        key = (summary["Namespace"], summary["JobID"])
        idx = self.index + 1
        existing = self.job_summaries.get(key)
        summary["CreateIndex"] = existing["CreateIndex"] if existing else idx
        summary["ModifyIndex"] = idx
        self.job_summaries[key] = summary
        return self._touch("job_summary")

    def add_scaling_event(self, namespace: str, job_id: str, group: str, event: Json) -> int:
        events = self.scaling_events.setdefault((namespace, job_id), [])
        events.append({"Group": group, **event})
        # Nomad keeps the newest 20 per group (structs.JobTrackedScalingEvents).
        group_events = [e for e in events if e["Group"] == group]
        if len(group_events) > 20:
            events.remove(group_events[0])
        return self._touch("scaling_event")

    # ----- evaluations and allocations ------------------------------------------------------

    def upsert_eval(self, evaluation: Json, event_type: str = "EvaluationUpdated") -> int:
        idx = self.index + 1
        existing = self.evals.get(evaluation["ID"])
        evaluation["CreateIndex"] = existing["CreateIndex"] if existing else idx
        evaluation["ModifyIndex"] = idx
        self.evals[evaluation["ID"]] = evaluation
        self._evals_by_job.setdefault((evaluation["Namespace"], evaluation["JobID"]), {})[
            evaluation["ID"]
        ] = evaluation
        return self._touch(
            "evals",
            ("Evaluation", event_type, evaluation["ID"], evaluation["Namespace"], {"Evaluation": evaluation}),
        )

    def upsert_alloc(self, alloc: Json, event_type: str = "AllocationUpdated") -> int:
        if self._pending is None and alloc.get("DeploymentID"):
            # The deployment's counts move with the allocation, at the same index.
            with self.batch():
                self.upsert_alloc(alloc, event_type)
            return self.index
        idx = self.index + 1
        existing = self.allocs.get(alloc["ID"])
        if alloc.get("DeploymentID"):
            update_deployment_with_alloc(self, alloc, existing, idx)
        alloc["CreateIndex"] = existing["CreateIndex"] if existing else idx
        alloc["ModifyIndex"] = idx
        alloc.setdefault("AllocModifyIndex", idx)
        self.allocs[alloc["ID"]] = alloc
        self._allocs_by_job.setdefault((alloc["Namespace"], alloc["JobID"]), {})[alloc["ID"]] = alloc
        self._allocs_by_node.setdefault(alloc["NodeID"], {})[alloc["ID"]] = alloc
        if alloc["DesiredStatus"] == "run" and alloc["ClientStatus"] in ("pending", "running"):
            self.live_allocs[alloc["ID"]] = alloc
            self.live_usage.add(alloc)
        elif self.live_allocs.pop(alloc["ID"], None) is not None:
            self.live_usage.discard(alloc["ID"])
            forget_footprint(alloc["ID"])
        # Nomad strips the embedded job from allocation events (state/events.go); it would make
        # every event as large as the job and repeat it once per allocation.
        payload = {"Allocation": {k: v for k, v in alloc.items() if k != "Job"}}
        return self._touch("allocs", ("Allocation", event_type, alloc["ID"], alloc["Namespace"], payload))

    def delete_evals_allocs(self, eval_ids: Iterable[str], alloc_ids: Iterable[str]) -> int:
        """Forget evaluations and allocations (`DeleteEval`, what the garbage collector reaps)."""
        for eval_id in eval_ids:
            evaluation = self.evals.pop(eval_id, None)
            if evaluation is not None:
                self._evals_by_job.get((evaluation["Namespace"], evaluation["JobID"]), {}).pop(eval_id, None)
                self._touch("evals")
        for alloc_id in alloc_ids:
            alloc = self.allocs.pop(alloc_id, None)
            if alloc is None:
                continue
            self._allocs_by_job.get((alloc["Namespace"], alloc["JobID"]), {}).pop(alloc_id, None)
            self._allocs_by_node.get(alloc["NodeID"], {}).pop(alloc_id, None)
            if self.live_allocs.pop(alloc_id, None) is not None:
                self.live_usage.discard(alloc_id)
                forget_footprint(alloc_id)
            self._touch("allocs")
        return self.index

    def allocs_for_job(self, namespace: str, job_id: str) -> list[Json]:
        return list(self._allocs_by_job.get((namespace, job_id), {}).values())

    def allocs_for_node(self, node_id: str) -> list[Json]:
        return list(self._allocs_by_node.get(node_id, {}).values())

    def evals_for_job(self, namespace: str, job_id: str) -> list[Json]:
        return list(self._evals_by_job.get((namespace, job_id), {}).values())

    # ----- deployments ---------------------------------------------------------------------

    def upsert_deployment(self, deployment: Json) -> int:
        idx = self.index + 1
        existing = self.deployments.get(deployment["ID"])
        deployment["CreateIndex"] = existing["CreateIndex"] if existing else idx
        deployment["ModifyIndex"] = idx
        self.deployments[deployment["ID"]] = deployment
        self._deployments_by_job.setdefault((deployment["Namespace"], deployment["JobID"]), {})[
            deployment["ID"]
        ] = deployment
        payload = {"Deployment": deployment}
        event = ("Deployment", "DeploymentStatusUpdate", deployment["ID"], deployment["Namespace"], payload)
        return self._touch(deployment_status.TABLE, event)

    def delete_deployments(self, deployment_ids: Iterable[str]) -> int:
        """Forget deployments (`DeleteDeploymentTxn`: what the garbage collector reaps)."""
        for deployment_id in deployment_ids:
            deployment = self.deployments.pop(deployment_id, None)
            if deployment is not None:
                key = (deployment["Namespace"], deployment["JobID"])
                self._deployments_by_job.get(key, {}).pop(deployment_id, None)
                self._touch(deployment_status.TABLE)
        return self.index

    def deployments_for_job(self, namespace: str, job_id: str) -> list[Json]:
        return list(self._deployments_by_job.get((namespace, job_id), {}).values())

    def active_deployments(self) -> list[Json]:
        return [d for d in self.deployments.values() if deployment_status.is_active(d)]

    # ----- namespaces ----------------------------------------------------------------------

    def upsert_namespace(self, namespace: Json) -> int:
        idx = self.index + 1
        existing = self.namespaces.get(namespace["Name"])
        namespace["CreateIndex"] = existing["CreateIndex"] if existing else idx
        namespace["ModifyIndex"] = idx
        self.namespaces[namespace["Name"]] = namespace
        return self._touch("namespaces")

    def delete_namespace(self, name: str) -> int:
        self.namespaces.pop(name, None)
        return self._touch("namespaces")

    # ----- nodes ---------------------------------------------------------------------------

    def upsert_node(self, node: Json, event_type: str = "NodeRegistration") -> int:
        idx = self.index + 1
        existing = self.nodes.get(node["ID"])
        node["CreateIndex"] = existing["CreateIndex"] if existing else idx
        node["ModifyIndex"] = idx
        self.nodes[node["ID"]] = node
        return self._touch("nodes", ("Node", event_type, node["ID"], "", {"Node": node}))

    def delete_node(self, node_id: str) -> int:
        node = self.nodes.pop(node_id, None)
        return self._touch("nodes", ("Node", "NodeDeregistration", node_id, "", {"Node": node}))


class _Batch:
    def __init__(self, store: StateStore) -> None:
        self._store = store

    def __enter__(self) -> StateStore:
        if self._store._pending is not None:
            raise RuntimeError("nested state batches are not supported")
        self._store._pending = _Pending()
        return self._store

    def __exit__(self, *exc: object) -> None:
        pending = self._store._pending
        self._store._pending = None
        if pending is not None:
            self._store._commit(pending)


def update_deployment_with_alloc(store: StateStore, alloc: Json, existing: Json | None, index: int) -> None:
    """`updateDeploymentWithAlloc`: a placement or a first health verdict moves the counts of
    the allocation's deployment, and the progress deadline with them (inside the caller's
    batch, so the deployment and the allocation carry one index)."""
    deployment_id = alloc.get("DeploymentID")
    if not deployment_id:
        return
    deployment = store.deployments.get(deployment_id)
    if deployment is None or alloc["TaskGroup"] not in deployment["TaskGroups"]:
        return
    placed = healthy = unhealthy = 0
    status = alloc.get("DeploymentStatus") or {}
    if existing is None or existing.get("DeploymentID") != deployment_id:
        placed = 1
    elif not deployment_status.has_health(existing) and deployment_status.has_health(alloc):
        if status["Healthy"]:
            healthy = 1
        else:
            unhealthy = 1
    elif (
        deployment_status.has_health(existing)
        and deployment_status.has_health(alloc)
        and existing["DeploymentStatus"]["Healthy"]
        and not status["Healthy"]
    ):
        healthy, unhealthy = -1, 1
    if not (placed or healthy or unhealthy):
        return
    if alloc.get("DeploymentStatus") is not None and (healthy or unhealthy):
        alloc["DeploymentStatus"]["ModifyIndex"] = index
    groups = {name: dict(state) for name, state in deployment["TaskGroups"].items()}
    state = groups[alloc["TaskGroup"]]
    state["PlacedAllocs"] += placed
    state["HealthyAllocs"] += healthy
    state["UnhealthyAllocs"] += unhealthy
    deadline = int(state.get("ProgressDeadline") or 0)
    if deadline:
        if placed and parse_rfc3339_ns(state["RequireProgressBy"]) == 0:
            # From the allocation's modify time: an in-place update joins a deployment late.
            state["RequireProgressBy"] = rfc3339(int(alloc.get("ModifyTime") or 0) + deadline)
        elif healthy > 0:
            by = parse_rfc3339_ns(status.get("Timestamp")) + deadline
            if by > parse_rfc3339_ns(state["RequireProgressBy"]):
                state["RequireProgressBy"] = rfc3339(by)
    store.upsert_deployment(
        {**deployment, "TaskGroups": groups, "ModifyTime": int(alloc.get("ModifyTime") or 0)}
    )
