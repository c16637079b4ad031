"""The stand-in's server: the store, the scheduler, the client and the event broker on one loop,
and the write operations the HTTP layer calls (register, deregister, scale, node updates).

Each operation is what Nomad's RPC endpoint does (`nomad/job_endpoint.go`, `node_endpoint.go`):
check the request, write in one batch (one index), create the evaluation, hand it to the
scheduler. Errors are `ApiError`s carrying Nomad's status code and message text.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

from devstack.nomad import deployments, namespaces
from devstack.nomad.canonical import canonicalize_job, spec_changed
from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.encode import duration_ns, rfc3339
from devstack.nomad.events import EventBroker
from devstack.nomad.feasible import glob_match
from devstack.nomad.gc import Collected, GarbageCollector, GCConfig
from devstack.nomad.jobspec import JobspecError, parse_jobspec, parse_variables_file
from devstack.nomad.nodes import NodeSpecError, computed_class, node_from_spec
from devstack.nomad.operator import ERR_REGISTRATION_DISABLED, SchedulerConfiguration
from devstack.nomad.reconcile import TERMINAL_CLIENT, new_eval
from devstack.nomad.scheduler import Scheduler
from devstack.nomad.state import StateStore
from devstack.nomad.validate import JobError, multierror_text, validate_job

Json = dict[str, Any]
log = logging.getLogger("devstack.nomad.server")

NAMESPACE = "default"


NO_NODE_ID = (
    "No local Node and node_id not provided: the stand-in simulates many nodes behind one "
    "address, so name the node (NodeID in the body, or ?node_id=)"
)
_HCL_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
# Node fields the feasibility checks read; a change to any of them re-evaluates system jobs.
_FEASIBILITY_FIELDS = ("Datacenter", "Name", "NodeClass", "NodePool", "Attributes", "Meta", "Drivers")


def _should_create_node_eval(old: Json | None, new: Json) -> bool:
    """`shouldCreateNodeEval`: a new or newly ready node, or one whose feasibility inputs changed."""
    if old is None or old.get("Status") != new.get("Status"):
        return True
    return any(old.get(f) != new.get(f) for f in _FEASIBILITY_FIELDS)


class ApiError(Exception):
    """An answer Nomad gives as a plain-text body with a status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def write_meta(index: int) -> Json:
    return {"Index": index, "LastContact": 0, "KnownLeader": False, "NextToken": ""}


class NomadServer:
    def __init__(
        self,
        nodes: list[Json],
        consul_url: str | None,
        data_dir: Path,
        clock: Clock | None = None,
        gc: GCConfig | None = None,
    ) -> None:
        self.clock = clock or Clock()
        self.store = StateStore()
        self.scheduler = Scheduler(self.store, self.clock)
        self.gc = GarbageCollector(self.store, self.clock, gc)
        self.events = EventBroker(self.store)
        self.data_dir = data_dir
        self.consul_url = consul_url
        self._initial_nodes = nodes
        self.client: ClientRunner | None = None
        self.health: deployments.HealthWatcher | None = None
        # Dynamic node metadata per node (`/v1/client/metadata`), nulls included, as a client
        # keeps it in its state DB; it survives a node being replaced through /v1/devstack/node.
        self.dynamic_meta: dict[str, dict[str, str | None]] = {}
        self.static_meta: dict[str, dict[str, str]] = {n["ID"]: dict(n.get("Meta") or {}) for n in nodes}
        self.scheduler_config = SchedulerConfiguration()
        # Nomad's state store creates `default` at index 1 (`namespaceInit`).
        self.store.namespaces[NAMESPACE] = namespaces.namespace(
            NAMESPACE, namespaces.DEFAULT_DESCRIPTION, CreateIndex=1, ModifyIndex=1
        )

    async def start(self) -> None:
        self.events.start()
        with self.store.batch():
            for node in self._initial_nodes:
                self.store.upsert_node(copy.deepcopy(node))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.client = ClientRunner(
            self.store,
            self.clock,
            self.data_dir,
            self.consul_url,
            on_alloc_update=self.scheduler.on_alloc_update,
        )
        self.scheduler.client = self.client
        registry = self.client.registry
        self.health = deployments.HealthWatcher(
            self.store,
            self.clock,
            self.deployment_eval,
            registry.alloc_checks if registry.enabled else None,
            registry.refresh_check_statuses if registry.enabled else None,
        )
        self.scheduler.health = self.health
        self.scheduler.start()
        self.gc.start()
        self.health.start()

    async def stop(self) -> None:
        """Stop scheduling, then every allocation's processes, then the event stream."""
        await self.gc.stop()
        await self.scheduler.stop()
        if self.health is not None:
            await self.health.stop()
        if self.client is not None:
            await self.client.shutdown()
        await self.events.stop()

    # ----- jobs ----------------------------------------------------------------------------

    def admit(self, raw: Json, query_ns: str | None, now: int) -> Json:
        """What Nomad does to a submitted job before it registers or plans it: the namespace
        defaulted from the query, canonicalisation, then the admission validators in Nomad's
        order (the namespace exists and allows the job's drivers, the node pool exists, the job
        is valid), whose refusals come back together as one multierror with no status code (500)."""
        if not raw.get("Namespace") and query_ns:
            raw = {**raw, "Namespace": query_ns}
        try:
            job = canonicalize_job(raw, now)
        except JobError as exc:
            raise ApiError(exc.code, str(exc)) from None
        problems = [
            *namespaces.admission_problems(self.store, job),
            *self._node_pool_problems(job),
            *validate_job(job),
        ]
        if problems:
            raise ApiError(500, multierror_text(problems))
        return job

    def _node_pool_problems(self, job: Json) -> list[str]:
        # A node joining a pool creates it; a job in a pool that no node has is refused at
        # registration by Nomad's jobNodePoolValidatingHook.
        pool = job.get("NodePool") or "default"
        known = {"default", "all"} | {n.get("NodePool") or "default" for n in self.store.nodes.values()}
        if pool not in known:
            return [f'job "{job["ID"]}" is in nonexistent node pool "{pool}"']
        return []

    def _registrations_allowed(self) -> None:
        # `registrationsAreAllowed`: with RejectJobRegistration on, only a management token may
        # register or scale, and without ACLs there is none.
        if self.scheduler_config.rejects_registration:
            raise ApiError(403, ERR_REGISTRATION_DISABLED)

    # ----- namespaces ----------------------------------------------------------------------

    def upsert_namespace(self, body: Any, path_name: str) -> int:
        try:
            return namespaces.upsert(self.store, body, path_name)
        except namespaces.NamespaceError as exc:
            raise ApiError(exc.code, exc.message) from None

    def delete_namespace(self, name: str) -> int:
        try:
            return namespaces.delete(self.store, name)
        except namespaces.NamespaceError as exc:
            raise ApiError(exc.code, exc.message) from None

    def register(self, body: Any, path_id: str | None = None, query_ns: str | None = None) -> Json:
        if not isinstance(body, dict) or not isinstance(body.get("Job"), dict):
            raise ApiError(400, "Job must be specified")
        raw = body["Job"]
        if not raw.get("ID"):
            raise ApiError(400, "Job ID hasn't been provided")
        if path_id is not None and raw["ID"] != path_id:
            raise ApiError(400, "Job ID does not match name")
        if raw.get("Type") == "system" and any(
            isinstance(g, dict) and g.get("Scaling") for g in raw.get("TaskGroups") or []
        ):
            raise ApiError(400, "Task groups with job type system do not support scaling blocks")
        self._registrations_allowed()
        now = self.clock.now_ns()
        job = self.admit(raw, query_ns, now)
        key = (job["Namespace"], job["ID"])
        existing = self.store.jobs.get(key)
        if body.get("EnforceIndex"):
            want = int(body.get("JobModifyIndex") or 0)
            if want == 0 and existing is not None:
                raise ApiError(500, "Enforcing job modify index 0: job already exists")
            if want and existing is None:
                raise ApiError(500, f"Enforcing job modify index {want}: job does not exist")
            if want and existing is not None and existing["JobModifyIndex"] != want:
                raise ApiError(
                    500,
                    f"Enforcing job modify index {want}: job exists with conflicting job modify "
                    f"index: {existing['JobModifyIndex']}",
                )
        if existing is not None:
            old_groups = {g["Name"]: g for g in existing["TaskGroups"]}
            for group in job["TaskGroups"]:
                old = old_groups.get(group["Name"])
                if old is None:
                    continue
                if body.get("PreserveCounts"):
                    group["Count"] = old["Count"]
                if group.get("Scaling") and old.get("Scaling"):
                    group["Scaling"]["ID"] = old["Scaling"]["ID"]
        with self.store.batch():
            if existing is None or spec_changed(existing, job):
                job["Version"] = existing["Version"] + 1 if existing else 0
                job["Status"] = existing["Status"] if existing else "pending"
                job["JobModifyIndex"] = self.store.next_index()
                self.store.upsert_job(job)
            else:
                job = existing
            evaluation = new_eval(job, "job-register", now)
            self.store.upsert_eval(evaluation)
            self.scheduler.refresh_job_in_batch(job["Namespace"], job["ID"])
        self.scheduler.submit(evaluation)
        return {
            "EvalID": evaluation["ID"],
            "EvalCreateIndex": evaluation["CreateIndex"],
            "JobModifyIndex": self.store.jobs[key]["JobModifyIndex"],
            "Warnings": "",
            **write_meta(self.store.index),
        }

    def job(self, ns: str, job_id: str) -> Json:
        job = self.store.jobs.get((ns, job_id))
        if job is None:
            raise ApiError(404, "job not found")
        return job

    def deregister(self, ns: str, job_id: str, purge: bool) -> Json:
        key = (ns, job_id)
        job = self.store.jobs.get(key)
        if job is None:
            # Nomad answers a deregister of an unknown job without an evaluation.
            return {
                "EvalID": "",
                "EvalCreateIndex": 0,
                "JobModifyIndex": 0,
                "VolumeEvalID": "",
                "VolumeEvalIndex": 0,
                **write_meta(self.store.index),
            }
        now = self.clock.now_ns()
        with self.store.batch():
            index = self.store.next_index()
            if purge:
                self.store.delete_job(ns, job_id)
                eval_job = job
            else:
                # A stop keeps the version (`upsertJobImpl` with keepVersion).
                eval_job = {**job, "Stop": True, "JobModifyIndex": index}
                self.store.upsert_job(eval_job, "JobDeregistered")
            evaluation = new_eval(eval_job, "job-deregister", now, JobModifyIndex=index)
            self.store.upsert_eval(evaluation)
            self.scheduler.untrack(ns, job_id)
        self.scheduler.submit(evaluation)
        return {
            "EvalID": evaluation["ID"],
            "EvalCreateIndex": evaluation["CreateIndex"],
            "JobModifyIndex": index,
            "VolumeEvalID": "",
            "VolumeEvalIndex": 0,
            **write_meta(self.store.index),
        }

    def force_gc(self) -> Collected:
        """`PUT /v1/system/gc`: collect everything the GC rules allow, whatever its age."""
        return self.gc.collect(forced=True)

    def scale(self, ns: str, job_id: str, body: Any) -> Json:
        if not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        target = body.get("Target") or {}
        if not isinstance(target, dict):
            raise ApiError(400, "Request decode failed: Target must be an object")
        count = body.get("Count")
        if count is not None and (not isinstance(count, int) or isinstance(count, bool)):
            raise ApiError(400, "Request decode failed: Count must be an integer")
        self._registrations_allowed()  # in Job.Scale before its arguments are validated
        if target.get("Job") and target["Job"] != job_id:
            raise ApiError(400, "job ID in payload did not match URL")
        group_name = target.get("Group")
        if not group_name:
            raise ApiError(400, "missing task group name for scaling action")
        if count is not None and count < 0:
            raise ApiError(400, "scaling action count can't be negative")
        if count is not None and body.get("Error"):
            raise ApiError(400, "scaling action should not contain count if error is true")
        key = (ns, job_id)
        job = self.store.jobs.get(key)
        if job is None:
            raise ApiError(404, f'job "{job_id}" not found')
        group = next((g for g in job["TaskGroups"] if g["Name"] == group_name), None)
        if group is None:
            raise ApiError(400, f'task group "{group_name}" specified for scaling does not exist in job')
        scaling = group.get("Scaling")
        if count is not None and scaling and not body.get("PolicyOverride"):
            if scaling.get("Min") is not None and count < scaling["Min"]:
                raise ApiError(
                    400, f"group count was less than scaling policy minimum: {count} < {scaling['Min']}"
                )
            if scaling.get("Max") is not None and count > scaling["Max"]:
                raise ApiError(
                    400, f"group count was greater than scaling policy maximum: {count} > {scaling['Max']}"
                )
        if count is not None and job["Type"] == "system" and count > 1:
            raise ApiError(400, 'jobs of type "system" can only be scaled between 0 and 1')
        if count is not None and deployments.scale_blocked(self.store, job):
            raise ApiError(400, deployments.ERR_SCALE_BLOCKED)
        now = self.clock.now_ns()
        previous = group["Count"]
        evaluation: Json | None = None
        with self.store.batch():
            index = self.store.next_index()
            if count is not None:
                new_job = copy.deepcopy(job)
                for g in new_job["TaskGroups"]:
                    if g["Name"] == group_name:
                        g["Count"] = count
                new_job["Version"] = job["Version"] + 1
                new_job["JobModifyIndex"] = index
                new_job["SubmitTime"] = now
                self.store.upsert_job(new_job)
                evaluation = new_eval(new_job, "job-scaling", now)
                self.store.upsert_eval(evaluation)
            self.store.add_scaling_event(
                ns,
                job_id,
                group_name,
                {
                    "Time": now,
                    "Count": count,
                    "PreviousCount": previous,
                    "Message": body.get("Message") or "",
                    "Error": bool(body.get("Error")),
                    "Meta": body.get("Meta"),
                    "EvalID": evaluation["ID"] if evaluation else None,
                    "CreateIndex": index,
                },
            )
            if evaluation is not None:
                self.scheduler.refresh_job_in_batch(ns, job_id)
        if evaluation is not None:
            self.scheduler.submit(evaluation)
        job = self.store.jobs[key]
        return {
            "EvalID": evaluation["ID"] if evaluation else "",
            "EvalCreateIndex": evaluation["CreateIndex"] if evaluation else 0,
            "JobModifyIndex": job["JobModifyIndex"],
            "Warnings": "",
            **write_meta(self.store.index),
        }

    def evaluate(self, ns: str, job_id: str, body: Any) -> Json:
        """`Job.Evaluate` (`nomad job eval [-force-reschedule]`, nomad/job_endpoint.go): a new
        evaluation of the job; with `EvalOptions.ForceReschedule`, every failed allocation that
        Nomad has not replaced is marked `DesiredTransition.ForceReschedule`, and the
        reconciler replaces it now, whatever its reschedule policy has left."""
        if body is not None and not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        options = (body or {}).get("EvalOptions") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "Request decode failed: EvalOptions must be an object")
        job = self.store.jobs.get((ns, job_id))
        if job is None:
            raise ApiError(500, "job not found")
        if job.get("Periodic"):
            raise ApiError(500, "can't evaluate periodic job")
        if job.get("ParameterizedJob"):
            raise ApiError(500, "can't evaluate parameterized job")
        now = self.clock.now_ns()
        groups = {g["Name"]: g for g in job["TaskGroups"]}
        with self.store.batch():
            if options.get("ForceReschedule"):
                for alloc in self.store.allocs_for_job(ns, job_id):
                    policy = (groups.get(alloc["TaskGroup"]) or {}).get("ReschedulePolicy") or {}
                    # ReschedulePolicy.Enabled: attempts left to give, or unlimited.
                    if not ((policy.get("Attempts") or 0) > 0 or policy.get("Unlimited")):
                        continue
                    transition = alloc.get("DesiredTransition") or {}
                    if (
                        alloc["ClientStatus"] == "failed"
                        and not alloc.get("NextAllocation")
                        and not (transition.get("ForceReschedule"))
                    ):
                        updated = {**alloc, "DesiredTransition": {**transition, "ForceReschedule": True}}
                        self.store.upsert_alloc(updated, "AllocationUpdateDesiredStatus")
            evaluation = new_eval(job, "job-register", now, JobModifyIndex=job["ModifyIndex"])
            self.store.upsert_eval(evaluation)
        self.scheduler.submit(evaluation)
        return {
            "EvalID": evaluation["ID"],
            "EvalCreateIndex": evaluation["CreateIndex"],
            "JobModifyIndex": job["ModifyIndex"],
            "Warnings": "",
            **write_meta(self.store.index),
        }

    def scale_status(self, ns: str, job_id: str) -> Json:
        job = self.store.jobs.get((ns, job_id))
        if job is None:
            raise ApiError(404, "job not found")
        allocs = self.store.allocs_for_job(ns, job_id)
        events = self.store.scaling_events.get((ns, job_id), [])
        groups: Json = {}
        for group in job["TaskGroups"]:
            # `Job.ScaleStatus`: the group's allocations that are not terminal, health as their
            # DeploymentStatus says (set with or without a deployment), canaries left out.
            mine = [
                a
                for a in allocs
                if a["TaskGroup"] == group["Name"]
                and a["DesiredStatus"] == "run"
                and a["ClientStatus"] not in TERMINAL_CLIENT
                and not (a.get("DeploymentStatus") or {}).get("Canary")
            ]
            health = [(a.get("DeploymentStatus") or {}).get("Healthy") for a in mine]
            group_events = [
                {k: v for k, v in e.items() if k != "Group"} for e in events if e["Group"] == group["Name"]
            ]
            groups[group["Name"]] = {
                "Desired": group["Count"],
                "Placed": len(mine),
                "Running": sum(1 for a in mine if a["ClientStatus"] == "running"),
                "Healthy": sum(1 for h in health if h is True),
                "Unhealthy": sum(1 for h in health if h is False),
                "Events": list(reversed(group_events)) or None,
            }
        return {
            "JobID": job["ID"],
            "Namespace": job["Namespace"],
            "JobCreateIndex": job["CreateIndex"],
            "JobModifyIndex": job["JobModifyIndex"],
            "JobStopped": job["Stop"],
            "TaskGroups": groups,
        }

    def validate(self, body: Any) -> Json:
        if not isinstance(body, dict) or not isinstance(body.get("Job"), dict):
            raise ApiError(400, "Job must be specified")
        errors: list[str]
        try:
            job = canonicalize_job(body["Job"], self.clock.now_ns())
            errors = validate_job(job)
        except JobError as exc:
            errors = [str(exc)]
        return {
            "DriverConfigValidated": True,
            "ValidationErrors": errors or None,
            "Error": multierror_text(errors) if errors else "",
            "Warnings": "",
        }

    # ----- allocations ---------------------------------------------------------------------

    def stop_alloc(self, alloc_id: str) -> Json:
        """`Alloc.Stop`: mark the allocation to migrate and let the scheduler replace it."""
        alloc = self.store.allocs.get(alloc_id)
        if alloc is None:
            raise ApiError(404, "alloc not found")
        job = self.store.jobs.get((alloc["Namespace"], alloc["JobID"])) or alloc["Job"]
        with self.store.batch():
            transition = dict(alloc.get("DesiredTransition") or {})
            transition["Migrate"] = True
            self.store.upsert_alloc({**alloc, "DesiredTransition": transition})
            evaluation = new_eval(job, "alloc-stop", self.clock.now_ns())
            self.store.upsert_eval(evaluation)
        self.scheduler.submit(evaluation)
        return {"EvalID": evaluation["ID"], **write_meta(self.store.index)}

    # ----- nodes ---------------------------------------------------------------------------

    def node(self, node_id: str) -> Json:
        node = self.store.nodes.get(node_id)
        if node is None:
            # Nomad accepts a unique ID prefix here too.
            matches = [n for i, n in self.store.nodes.items() if i.startswith(node_id)] if node_id else []
            if len(matches) == 1:
                return matches[0]
            raise ApiError(404, "node not found")
        return node

    def set_eligibility(self, node_id: str, body: Any) -> Json:
        node = self.node(node_id)
        eligibility = body.get("Eligibility") if isinstance(body, dict) else None
        if eligibility not in ("eligible", "ineligible"):
            raise ApiError(400, "invalid scheduling eligibility")
        if eligibility == "eligible" and node.get("DrainStrategy"):
            raise ApiError(500, "can not set node's scheduling eligibility to eligible while it is draining")
        evals: list[Json] = []
        with self.store.batch():
            index = self.store.next_index()
            self.store.upsert_node({**node, "SchedulingEligibility": eligibility}, "NodeEligibility")
            if eligibility == "eligible" and node["SchedulingEligibility"] != "eligible":
                # A node that may take work again is evaluated for the system jobs
                # (`Node.UpdateEligibility` -> `createNodeEvals`).
                evals = self._system_node_evals(self.store.nodes[node["ID"]], index)
        self._submit_all(evals)
        if eligibility == "eligible":
            self.scheduler.capacity_changed()
        return {
            "EvalIDs": [e["ID"] for e in evals] or None,
            "EvalCreateIndex": evals[0]["CreateIndex"] if evals else 0,
            "NodeModifyIndex": index,
            **write_meta(self.store.index),
        }

    # ----- node evaluations and metadata ------------------------------------------------------

    def _system_node_evals(self, node: Json, index: int) -> list[Json]:
        """`createNodeEvals` for the system jobs that target the node (inside a batch): one
        `node-update` evaluation each, so a node that joins, becomes eligible or changes what
        constraints see gets (or loses) their allocations."""
        if node.get("Status") != "ready":
            return []
        now = self.clock.now_ns()
        evals: list[Json] = []
        for job in self.store.jobs.values():
            if job["Type"] != "system" or job.get("Stop"):
                continue
            pool = job.get("NodePool") or "default"
            if pool != "all" and pool != (node.get("NodePool") or "default"):
                continue
            if not any(
                glob_match(dc, node.get("Datacenter") or "") for dc in job.get("Datacenters") or ["*"]
            ):
                continue
            evaluation = new_eval(job, "node-update", now, NodeID=node["ID"], NodeModifyIndex=index)
            self.store.upsert_eval(evaluation)
            evals.append(evaluation)
        return evals

    def _submit_all(self, evals: list[Json]) -> None:
        for evaluation in evals:
            self.scheduler.submit(evaluation)

    def node_meta(self, node_id: str) -> Json:
        """`NodeMeta.Read`: the merged metadata, the dynamic part (nulls kept) and the static."""
        if not node_id:
            raise ApiError(400, NO_NODE_ID)
        node = self.store.nodes.get(node_id)
        if node is None:
            raise ApiError(404, f'Unknown node "{node_id}"')
        return {
            "Meta": dict(node.get("Meta") or {}),
            "Dynamic": dict(self.dynamic_meta.get(node_id, {})),
            "Static": dict(self.static_meta.get(node_id, {})),
        }

    def apply_node_meta(self, body: Any, query_node_id: str | None) -> Json:
        """`NodeMeta.Apply`: set or (with null) unset dynamic keys of one simulated node.

        Nomad's client batches these for up to 10s before it tells the servers; the stand-in
        writes the node at once: a `NodeRegistration` event, the node's ModifyIndex raised,
        evaluations for the system jobs and the blocked ones, since meta is what constraints
        see."""
        if not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        node_id = body.get("NodeID") or query_node_id or ""
        if not isinstance(node_id, str):
            raise ApiError(
                400,
                "json: cannot unmarshal number into Go struct field NodeMetaApplyRequest.NodeID of type string",
            )
        if not node_id:
            raise ApiError(400, NO_NODE_ID)
        meta = body.get("Meta")
        if meta is not None and not isinstance(meta, dict):
            raise ApiError(
                400,
                "json: cannot unmarshal value into Go struct field NodeMetaApplyRequest.Meta of type map[string]*string",
            )
        for value in (meta or {}).values():
            if value is not None and not isinstance(value, str):
                kind = (
                    "number"
                    if isinstance(value, int | float) and not isinstance(value, bool)
                    else type(value).__name__
                )
                raise ApiError(
                    400,
                    f"json: cannot unmarshal {kind} into Go struct field NodeMetaApplyRequest.Meta of type string",
                )
        node = self.store.nodes.get(node_id)
        if node is None:
            raise ApiError(404, f'Unknown node "{node_id}"')
        if not meta:
            raise ApiError(400, "missing required Meta object")
        for key in meta:
            if not key:
                raise ApiError(400, "metadata keys must not be empty")
            if not all(_HCL_IDENT.fullmatch(part) for part in key.split(".")):
                raise ApiError(400, f'"{key}" is invalid; metadata keys must be valid dotted hcl identifiers')
        dynamic = self.dynamic_meta.setdefault(node_id, {})
        dynamic.update(meta)
        merged = dict(node.get("Meta") or {})
        for key, value in meta.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        if merged != (node.get("Meta") or {}):
            self._write_node(node, {**node, "Meta": merged})
        return self.node_meta(node_id)

    def _write_node(self, old: Json, new: Json) -> None:
        """Replace a node whose attributes or meta changed: its computed class follows, the
        system jobs are re-evaluated and blocked evaluations re-run (`shouldCreateNodeEval`)."""
        new["ComputedClass"] = computed_class(new)
        with self.store.batch():
            index = self.store.next_index()
            self.store.upsert_node(new, "NodeRegistration")
            evals = self._system_node_evals(new, index)
        self._submit_all(evals)
        self.scheduler.capacity_changed()

    # ----- jobspecs ---------------------------------------------------------------------------

    def parse_job(self, body: Any) -> Json:
        """`/v1/jobs/parse`: HCL2 to the API's Job, canonicalised only when asked."""
        if not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        text = body.get("JobHCL") or ""
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "Job spec is empty")
        try:
            variables = parse_variables_file(str(body.get("Variables") or ""))
            # Lenient as Nomad's endpoint: its ParseConfig leaves Strict false (job_endpoint.go).
            job = parse_jobspec(text, variables, strict=False)
        except JobspecError as exc:
            message = str(exc)
            if not message.startswith("Failed to parse job"):
                message = f"Failed to parse job: {message}"
            raise ApiError(400, message) from None
        if body.get("Canonicalize"):
            try:
                job = canonicalize_job(job, self.clock.now_ns())
            except JobError as exc:
                raise ApiError(400, f"Failed to parse job: {exc}") from None
        return job

    def drain(self, node_id: str, body: Any) -> Json:
        """`Node.UpdateDrain`: with a spec, mark the node ineligible and migrate what runs there;
        without one, cancel the drain (and with MarkEligible, make it eligible again)."""
        node = self.node(node_id)
        if not isinstance(body, dict):
            raise ApiError(400, "Request decode failed: body must be a JSON object")
        spec = body.get("DrainSpec")
        if spec is not None and not isinstance(spec, dict):
            raise ApiError(400, "Request decode failed: DrainSpec must be an object")
        now = self.clock.now_ns()
        eval_ids: list[str] = []
        evals: list[Json] = []
        with self.store.batch():
            index = self.store.next_index()
            if spec:
                try:
                    deadline = duration_ns(spec.get("Deadline") or 0)
                except ValueError as exc:
                    raise ApiError(400, f"Request decode failed: {exc}") from None
                strategy = {
                    "Deadline": deadline,
                    "IgnoreSystemJobs": bool(spec.get("IgnoreSystemJobs")),
                    "ForceDeadline": rfc3339(now + deadline) if deadline > 0 else rfc3339(0),
                    "StartedAt": rfc3339(now),
                }
                last = {
                    "StartedAt": rfc3339(now),
                    "UpdatedAt": rfc3339(now),
                    "Status": "draining",
                    "AccessorID": "",
                    "Meta": body.get("Meta"),
                }
                self.store.upsert_node(
                    {
                        **node,
                        "DrainStrategy": strategy,
                        "SchedulingEligibility": "ineligible",
                        "LastDrain": last,
                    },
                    "NodeDrain",
                )
                jobs: dict[tuple[str, str], Json] = {}
                for alloc in self.store.allocs_for_node(node["ID"]):
                    if alloc["DesiredStatus"] != "run" or alloc["ClientStatus"] in TERMINAL_CLIENT:
                        continue
                    if strategy["IgnoreSystemJobs"] and (alloc.get("Job") or {}).get("Type") == "system":
                        continue
                    transition = dict(alloc.get("DesiredTransition") or {})
                    transition["Migrate"] = True
                    self.store.upsert_alloc({**alloc, "DesiredTransition": transition})
                    job = self.store.jobs.get((alloc["Namespace"], alloc["JobID"]))
                    if job is not None:
                        jobs[(job["Namespace"], job["ID"])] = job
                for job in jobs.values():
                    evaluation = new_eval(job, "node-drain", now, NodeID=node["ID"], NodeModifyIndex=index)
                    self.store.upsert_eval(evaluation)
                    evals.append(evaluation)
            else:
                last = dict(node.get("LastDrain") or {})
                if node.get("DrainStrategy"):
                    last.update({"Status": "canceled", "UpdatedAt": rfc3339(now)})
                eligibility = "eligible" if body.get("MarkEligible") else node["SchedulingEligibility"]
                self.store.upsert_node(
                    {
                        **node,
                        "DrainStrategy": None,
                        "SchedulingEligibility": eligibility,
                        "LastDrain": last or None,
                    },
                    "NodeDrain",
                )
            if not spec and body.get("MarkEligible") and node["SchedulingEligibility"] != "eligible":
                evals.extend(self._system_node_evals(self.store.nodes[node["ID"]], index))
        for evaluation in evals:
            eval_ids.append(evaluation["ID"])
            self.scheduler.submit(evaluation)
        if spec and not evals:
            self.scheduler.check_drain(node["ID"])
        if not spec and body.get("MarkEligible"):
            self.scheduler.capacity_changed()
        return {
            "EvalIDs": eval_ids or None,
            "EvalCreateIndex": evals[0]["CreateIndex"] if evals else 0,
            "NodeModifyIndex": index,
            **write_meta(self.store.index),
        }

    def put_node(self, spec: Any) -> Json:
        """Stand-in only: register or replace a simulated node from a fleet-file entry."""
        if not isinstance(spec, dict):
            raise ApiError(400, "node spec must be a JSON object")
        try:
            node = node_from_spec(spec)
        except NodeSpecError as exc:
            raise ApiError(400, str(exc)) from None
        existing = self.store.nodes.get(node["ID"])
        now = self.clock.now_ns()
        evals: list[Json] = []
        self.static_meta[node["ID"]] = dict(node.get("Meta") or {})
        dynamic = self.dynamic_meta.get(node["ID"])
        if dynamic:
            # A client that restarts keeps its dynamic metadata (its state DB).
            for meta_key, value in dynamic.items():
                if value is None:
                    node["Meta"].pop(meta_key, None)
                else:
                    node["Meta"][meta_key] = value
            node["ComputedClass"] = computed_class(node)
        with self.store.batch():
            index = self.store.upsert_node(node, "NodeRegistration")
            if _should_create_node_eval(existing, node):
                evals.extend(self._system_node_evals(node, index))
            if node["Status"] == "down" and (existing is None or existing["Status"] != "down"):
                # A node that went down takes its allocations with it: one node-update
                # evaluation per affected job replaces them elsewhere.
                jobs = {
                    (a["Namespace"], a["JobID"])
                    for a in self.store.allocs_for_node(node["ID"])
                    if a["DesiredStatus"] == "run" and a["ClientStatus"] not in TERMINAL_CLIENT
                }
                for key in sorted(jobs):
                    job = self.store.jobs.get(key)
                    if job is not None:
                        evaluation = new_eval(
                            job, "node-update", now, NodeID=node["ID"], NodeModifyIndex=index
                        )
                        self.store.upsert_eval(evaluation)
                        evals.append(evaluation)
        for evaluation in evals:
            self.scheduler.submit(evaluation)
        self.scheduler.capacity_changed()
        return {
            "NodeID": node["ID"],
            "EvalIDs": [e["ID"] for e in evals] or None,
            **write_meta(self.store.index),
        }

    # ----- deployments (nomad/deployment_endpoint.go, deploymentwatcher) ----------------------

    def deployment(self, deployment_id: str) -> Json:
        found = self.store.deployments.get(deployment_id)
        if found is None:
            raise ApiError(404, "deployment not found")
        return found

    def deployment_eval(self, deployment: Json, triggered_by: str = "deployment-watcher") -> Json | None:
        """The evaluation the deployment watcher creates so the scheduler acts on a change."""
        job = self.store.jobs.get((deployment["Namespace"], deployment["JobID"]))
        if job is None:
            return None
        evaluation = new_eval(job, triggered_by, self.clock.now_ns(), DeploymentID=deployment["ID"])
        self.store.upsert_eval(evaluation)
        self.scheduler.submit(evaluation)
        return evaluation

    def _deployment_write(
        self, deployment_id: str, status: str, description: str, terminal_error: str
    ) -> Json:
        with self.store.batch():
            found = self.store.deployments.get(deployment_id)
            if found is None:
                # Behind the RPC boundary, so Nomad answers 500 with the error's text.
                raise ApiError(500, "deployment not found")
            if not deployments.is_active(found):
                raise ApiError(500, terminal_error)
            self.store.upsert_deployment(
                deployments.with_status(found, status, description, self.clock.now_ns())
            )
            evaluation = self.deployment_eval(self.store.deployments[deployment_id])
        index = self.store.index
        return {
            "EvalID": evaluation["ID"] if evaluation else "",
            "EvalCreateIndex": index if evaluation else 0,
            "DeploymentModifyIndex": index,
            "RevertedJobVersion": None,
            **write_meta(index),
        }

    def fail_deployment(self, deployment_id: str) -> Json:
        return self._deployment_write(
            deployment_id, deployments.FAILED, deployments.DESC_FAILED_BY_USER, deployments.ERR_NO_FAIL
        )

    def pause_deployment(self, deployment_id: str, body: Any) -> Json:
        pause = bool(body.get("Pause")) if isinstance(body, dict) else False
        if pause:
            return self._deployment_write(
                deployment_id, deployments.PAUSED, deployments.DESC_PAUSED, deployments.ERR_NO_PAUSE
            )
        return self._deployment_write(
            deployment_id, deployments.RUNNING, deployments.DESC_RUNNING, deployments.ERR_NO_RESUME
        )

    def promote_deployment(self, deployment_id: str, body: Any) -> Json:
        """`UpdateDeploymentPromotion`: marks the named groups (or all) promoted and gives each a
        full progress deadline from now. The stand-in places no canaries, so no group waits for
        healthy ones; Nomad too accepts a promotion of groups that want none (it has no "no
        canaries" refusal), and still creates the watcher's evaluation."""
        body = body if isinstance(body, dict) else {}
        groups = set(body.get("Groups") or [])
        now = self.clock.now_ns()
        with self.store.batch():
            found = self.store.deployments.get(deployment_id)
            if found is None:
                raise ApiError(500, "deployment not found")
            if not deployments.is_active(found):
                raise ApiError(500, deployments.ERR_NO_PROMOTE)
            states = {
                name: deployments.promoted(state, now) if body.get("All") or name in groups else state
                for name, state in found["TaskGroups"].items()
            }
            self.store.upsert_deployment({**found, "TaskGroups": states, "ModifyTime": now})
            evaluation = self.deployment_eval(self.store.deployments[deployment_id])
        index = self.store.index
        return {
            "EvalID": evaluation["ID"] if evaluation else "",
            "EvalCreateIndex": index if evaluation else 0,
            "DeploymentModifyIndex": index,
            "RevertedJobVersion": None,
            **write_meta(index),
        }

    # ----- client --------------------------------------------------------------------------

    def log_path(self, alloc_id: str, task: str, kind: str) -> Path:
        if self.client is None:
            raise ApiError(500, "client not started")
        return self.client.log_path(alloc_id, task, kind)
