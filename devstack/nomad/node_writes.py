"""Node writes as `nomad/node_endpoint.go` and the client's `meta_endpoint.go` make them:
eligibility, drains, dynamic node metadata and the stand-in's own `/v1/devstack/node`, each
creating the `node-update` evaluations Nomad creates for system jobs."""

from __future__ import annotations

import re
from typing import Any

from devstack.nomad.answers import ApiError, write_meta
from devstack.nomad.encode import duration_ns, rfc3339
from devstack.nomad.feasible import glob_match
from devstack.nomad.getter import DEFAULT as DEFAULT_ARTIFACT_CONFIG
from devstack.nomad.getter import NODE_CONFIG_KEY
from devstack.nomad.nodes import NodeSpecError, computed_class, node_from_spec
from devstack.nomad.reconcile import TERMINAL_CLIENT, new_eval
from devstack.nomad.server_parts import Json, ServerParts

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


class NodeWrites(ServerParts):
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
        artifact_config = node.pop(NODE_CONFIG_KEY, DEFAULT_ARTIFACT_CONFIG)
        if self.client is not None:
            self.client.artifact_configs[node["ID"]] = artifact_config
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
