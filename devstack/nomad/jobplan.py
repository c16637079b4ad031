"""`/v1/job/<id>/plan` (`command/agent/job_endpoint.go` `jobPlan`, `nomad/job_endpoint.go`
`Job.Plan`): what registering a job would do, computed by the same scheduler step that places
for real, against a copy-on-read view of the store, and never written.

Nomad runs the plan in a state snapshot with the new job upserted into it and an in-memory
evaluation marked `AnnotatePlan`; nothing reaches the Raft log, so no index moves and no
evaluation is created. Here the job is laid over the store (`_Overlay`) for `compute_plan` to
read, and the plan it returns is turned into Nomad's `JobPlanResponse`: the placement failures
with their metrics, the desired updates per group, the evaluations the scheduler would have
created (a blocked one when something does not fit), and with `Diff` the annotated job diff.
"""

from __future__ import annotations

from typing import Any, cast

from aiohttp import web

from devstack.nomad.answers import ApiError
from devstack.nomad.canonical import spec_changed
from devstack.nomad.encode import ZERO_TIME
from devstack.nomad.httpbase import read_body, write_response
from devstack.nomad.placement import forget_footprint
from devstack.nomad.reconcile import (
    DESC_BLOCKED,
    DESC_MIGRATING,
    DESC_RESCHEDULED,
    DESC_UPDATING,
    TERMINAL_CLIENT,
    Plan,
    compute_plan,
    new_eval,
)
from devstack.nomad.server import NomadServer
from devstack.nomad.state import StateStore

Json = dict[str, Any]

# Job.Plan upserts a job that did not exist at this index (`snap.UpsertJob(..., 100, ...)`).
NEW_JOB_INDEX = 100

# `DesiredUpdates` (nomad/structs/structs.go), every field, in Nomad's order.
DESIRED_UPDATE_FIELDS = (
    "Ignore",
    "Place",
    "Migrate",
    "Stop",
    "InPlaceUpdate",
    "DestructiveUpdate",
    "Canary",
    "Preemptions",
    "Disconnect",
    "Reconnect",
    "RescheduleNow",
    "RescheduleLater",
)

# scheduler/annotate.go
UPDATE_TYPES = {
    "Ignore": "ignore",
    "Place": "create",
    "Migrate": "migrate",
    "Stop": "destroy",
    "Canary": "canary",
    "InPlaceUpdate": "in-place update",
    "DestructiveUpdate": "create/destroy update",
}
FORCES_CREATE = "forces create"
FORCES_DESTROY = "forces destroy"
FORCES_INPLACE = "forces in-place update"
FORCES_DESTRUCTIVE = "forces create/destroy update"


class _Overlay:
    """The store as the plan's snapshot sees it: the planned job in place of the stored one,
    everything else read through. Reads only, so the real store is never touched."""

    def __init__(self, store: StateStore, job: Json) -> None:
        self._store = store
        self.jobs = {**store.jobs, (job["Namespace"], job["ID"]): job}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def job_plan(request: web.Request, server: NomadServer, job_id: str, ns: str) -> web.StreamResponse:
    """The HTTP handler, hooked into `http.py`'s `/v1/job/<id>/<suffix>` dispatch."""
    if request.method not in ("PUT", "POST"):
        raise ApiError(405, "Invalid method")
    return write_response(
        plan(server, await read_body(request), job_id, request.query.get("namespace")), request
    )


def plan(server: NomadServer, body: Any, path_id: str | None = None, query_ns: str | None = None) -> Json:
    """`JobPlanResponse` for a `JobPlanRequest` body ({"Job", "Diff", "PolicyOverride"})."""
    if not isinstance(body, dict) or not isinstance(body.get("Job"), dict):
        raise ApiError(400, "Job must be specified")
    raw = body["Job"]
    if raw.get("ID") is None:
        raise ApiError(400, "Job must have a valid ID")
    if path_id and raw["ID"] != path_id:
        raise ApiError(400, "Job ID does not match")
    now = server.clock.now_ns()
    job = server.admit(raw, query_ns, now)

    store = server.store
    existing = store.jobs.get((job["Namespace"], job["ID"]))
    index = existing["JobModifyIndex"] if existing is not None else 0
    if existing is not None:
        _keep_scaling_ids(existing, job)
        if spec_changed(existing, job):
            planned = {
                **job,
                "Version": existing["Version"] + 1,
                "Status": existing["Status"],
                "CreateIndex": existing["CreateIndex"],
                "ModifyIndex": existing["JobModifyIndex"] + 1,
                "JobModifyIndex": existing["JobModifyIndex"] + 1,
            }
        else:
            planned = existing
    else:
        planned = {
            **job,
            "CreateIndex": NEW_JOB_INDEX,
            "ModifyIndex": NEW_JOB_INDEX,
            "JobModifyIndex": NEW_JOB_INDEX,
        }

    evaluation = new_eval(
        planned,
        "job-register",
        now,
        JobModifyIndex=planned["JobModifyIndex"] if planned is not existing else 0,
        AnnotatePlan=True,
    )
    result = compute_plan(cast(StateStore, _Overlay(store, planned)), evaluation, now)
    for alloc in result.placed:
        # Placement remembers what a live allocation holds by its ID; these never live.
        forget_footprint(alloc["ID"])

    annotations = {"DesiredTGUpdates": _desired_updates(store, planned, result), "PreemptedAllocs": None}
    # Never stored, so never indexed: Nomad answers them with 0 indexes.
    created = [{**e, "CreateIndex": 0, "ModifyIndex": 0} for e in result.new_evals]
    if result.failed_tg and result.block:
        created.append(
            new_eval(
                planned,
                "queued-allocs",
                now,
                Status="blocked",
                StatusDescription=DESC_BLOCKED,
                PreviousEval=evaluation["ID"],
                FailedTGAllocs=result.failed_tg,
                QueuedAllocations=dict(result.evaluation.get("QueuedAllocations") or {}),
                CreateIndex=0,
                ModifyIndex=0,
            )
        )
    diff = None
    if body.get("Diff"):
        diff = job_diff(existing, job)
        annotate(diff, annotations)
    return {
        "Annotations": annotations,
        "FailedTGAllocs": result.failed_tg or None,
        "JobModifyIndex": index,
        "CreatedEvals": created or None,
        "Diff": diff,
        "NextPeriodicLaunch": ZERO_TIME,
        "Warnings": "",
        "Index": index,
    }


def _keep_scaling_ids(existing: Json, job: Json) -> None:
    """`propagateScalingPolicyIDs`: a group's policy keeps its ID, so it is not a change."""
    old = {g["Name"]: g for g in existing["TaskGroups"]}
    for group in job["TaskGroups"]:
        prev = old.get(group["Name"])
        if prev and group.get("Scaling") and prev.get("Scaling"):
            group["Scaling"]["ID"] = prev["Scaling"]["ID"]


def _desired_updates(store: StateStore, job: Json, result: Plan) -> dict[str, Json]:
    """What the reconciler decided per group, counted as `DesiredUpdates`; a placement that
    failed still counts as a wanted placement, as in Nomad, whose failures are reported apart."""
    out: dict[str, Json] = {}
    stopped = {a["ID"]: a for a in result.stopped}
    inplace = {
        a["ID"] for a in result.updated if (a.get("Job") or {}).get("JobModifyIndex") == job["JobModifyIndex"]
    }
    for group in job["TaskGroups"]:
        name = group["Name"]
        counts = dict.fromkeys(DESIRED_UPDATE_FIELDS, 0)
        for alloc in store.allocs_for_job(job["Namespace"], job["ID"]):
            if alloc["TaskGroup"] != name or alloc["DesiredStatus"] != "run":
                continue
            stop = stopped.get(alloc["ID"])
            if stop is not None:
                desc = stop.get("DesiredDescription")
                if desc == DESC_UPDATING:
                    counts["DestructiveUpdate"] += 1
                elif desc == DESC_MIGRATING:
                    counts["Migrate"] += 1
                elif desc == DESC_RESCHEDULED:
                    counts["RescheduleNow"] += 1
                else:
                    counts["Stop"] += 1
            elif alloc["ID"] in inplace:
                counts["InPlaceUpdate"] += 1
            elif alloc["ClientStatus"] not in TERMINAL_CLIENT:
                counts["Ignore"] += 1
        wanted = sum(1 for a in result.placed if a["TaskGroup"] == name) + result.queued.get(name, 0)
        counts["Place"] = max(0, wanted - counts["DestructiveUpdate"] - counts["Migrate"])
        out[name] = counts
    return out


# ----- the job diff (nomad/structs/diff.go, scheduler/annotate.go) --------------------------

# Fields Job.Diff leaves out: server-set, and `Update`, a default copied into each group.
_JOB_FILTER = frozenset(
    {
        "ID",
        "Status",
        "StatusDescription",
        "Version",
        "Stable",
        "CreateIndex",
        "ModifyIndex",
        "JobModifyIndex",
        "Update",
        "SubmitTime",
        "NomadTokenID",
        "VaultToken",
        "TaskGroups",
    }
)
# Maps of strings Nomad diffs as primitive fields named `Meta[key]`.
_FLAT_MAPS = frozenset({"Meta", "Env"})
# A list's elements are objects named in the singular, as diff.go names them.
_SINGULAR = {
    "Constraints": "Constraint",
    "Affinities": "Affinity",
    "Spreads": "Spread",
    "Services": "Service",
    "Checks": "Check",
    "Networks": "Network",
    "Devices": "Device",
    "Artifacts": "Artifact",
    "Templates": "Template",
    "DynamicPorts": "Dynamic Port",
    "ReservedPorts": "Static Port",
    "VolumeMounts": "VolumeMount",
}


def _text(value: Any) -> str | None:
    """A primitive as Go's flatmap prints it; None for nil and for anything not primitive."""
    if value is None or isinstance(value, dict | list):
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _flatten(obj: Json | None, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in (obj or {}).items():
        if key in skip:
            continue
        if key in _FLAT_MAPS and isinstance(value, dict):
            for k, v in value.items():
                text = _text(v)
                if text is not None:
                    out[f"{key}[{k}]"] = text
            continue
        text = _text(value)
        if text is not None:
            out[key] = text
    return out


def _field_diffs(old: dict[str, str], new: dict[str, str], contextual: bool) -> list[Json]:
    out = []
    for name in sorted(old.keys() | new.keys()):
        before, after = old.get(name, ""), new.get(name, "")
        if name not in old:
            kind = "Added"
        elif name not in new:
            kind = "Deleted"
        elif before != after:
            kind = "Edited"
        elif contextual:
            kind = "None"
        else:
            continue
        out.append({"Type": kind, "Name": name, "Old": before, "New": after, "Annotations": None})
    return out


def _object_diff(name: str, old: Any, new: Any) -> Json | None:
    """`primitiveObjectDiff` with nested objects: None when nothing differs."""
    if old == new:
        return None
    old_d = old if isinstance(old, dict) else {}
    new_d = new if isinstance(new, dict) else {}
    kind = "Added" if old is None else "Deleted" if new is None else "Edited"
    fields = _field_diffs(_flatten(old_d) | _list_fields(old_d), _flatten(new_d) | _list_fields(new_d), True)
    return {
        "Type": kind,
        "Name": name,
        "Fields": fields,
        "Objects": _nested(old_d, new_d, frozenset(), True) or None,
    }


def _list_fields(obj: Json) -> dict[str, str]:
    """Lists of primitives inside an object (a task's `args`) as `args[0]`, `args[1]`..."""
    out: dict[str, str] = {}
    for key, value in obj.items():
        if isinstance(value, list) and all(_text(v) is not None for v in value):
            for i, v in enumerate(value):
                out[f"{key}[{i}]"] = cast(str, _text(v))
    return out


def _nested(old: Json, new: Json, skip: frozenset[str], in_object: bool = False) -> list[Json]:
    """Objects for the nested maps and lists of `old` and `new`, in key order. Inside an object,
    lists of primitives are its fields (`_list_fields`)."""
    out: list[Json] = []
    for key in sorted(old.keys() | new.keys()):
        if key in skip or key in _FLAT_MAPS:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) or isinstance(b, dict):
            if (d := _object_diff(key, a, b)) is not None:
                out.append(d)
        elif isinstance(a, list) or isinstance(b, list):
            items = (a or []) + (b or [])
            if in_object and all(_text(v) is not None for v in items):
                continue
            out.extend(_set_diff(key, a or [], b or []))
    return out


def _set_diff(key: str, old: list[Any], new: list[Any]) -> list[Json]:
    """`primitiveObjectSetDiff`: elements matched by equality; a changed element is one deleted
    and one added, as in Nomad."""
    if all(_text(v) is not None for v in old + new):
        if old == new:
            return []
        fields = [
            {"Type": "Deleted", "Name": key, "Old": cast(str, _text(v)), "New": "", "Annotations": None}
            for v in old
            if v not in new
        ] + [
            {"Type": "Added", "Name": key, "Old": "", "New": cast(str, _text(v)), "Annotations": None}
            for v in new
            if v not in old
        ]
        return [{"Type": "Edited", "Name": key, "Fields": fields, "Objects": None}] if fields else []
    name = _SINGULAR.get(key, key)
    out = [_object_diff(name, v, None) for v in old if v not in new]
    out += [_object_diff(name, None, v) for v in new if v not in old]
    return [d for d in out if d is not None]


def job_diff(old: Json | None, new: Json) -> Json:
    """`Job.Diff(new, contextual=true)`."""
    kind = "Added" if old is None else "None"
    old_d = old or {}
    fields = _field_diffs(_flatten(old_d, _JOB_FILTER), _flatten(new, _JOB_FILTER), False)
    objects = _nested(old_d, new, _JOB_FILTER)
    groups = _named_diffs(old_d.get("TaskGroups") or [], new.get("TaskGroups") or [], _group_diff)
    if kind == "None" and (
        any(f["Type"] != "None" for f in fields) or objects or any(g["Type"] != "None" for g in groups)
    ):
        kind = "Edited"
    return {
        "Type": kind,
        "ID": new["ID"],
        "Fields": fields or None,
        "Objects": objects or None,
        "TaskGroups": groups or None,
    }


def _named_diffs(old: list[Json], new: list[Json], diff: Any) -> list[Json]:
    old_by = {g["Name"]: g for g in old}
    new_by = {g["Name"]: g for g in new}
    return [diff(old_by.get(n), new_by.get(n), n) for n in sorted(old_by.keys() | new_by.keys())]


def _kind(old: Json | None, new: Json | None) -> str:
    if old is None:
        return "Added"
    if new is None:
        return "Deleted"
    return "None" if old == new else "Edited"


def _group_diff(old: Json | None, new: Json | None, name: str) -> Json:
    skip = frozenset({"Name", "Tasks"})
    o, n = old or {}, new or {}
    return {
        "Type": _kind(old, new),
        "Name": name,
        "Fields": _field_diffs(_flatten(o, skip), _flatten(n, skip), False) or None,
        "Objects": _nested(o, n, skip) or None,
        "Tasks": _named_diffs(o.get("Tasks") or [], n.get("Tasks") or [], _task_diff) or None,
        "Updates": None,
    }


def _task_diff(old: Json | None, new: Json | None, name: str) -> Json:
    skip = frozenset({"Name"})
    o, n = old or {}, new or {}
    return {
        "Type": _kind(old, new),
        "Name": name,
        "Fields": _field_diffs(_flatten(o, skip), _flatten(n, skip), False) or None,
        "Objects": _nested(o, n, skip) or None,
        "Annotations": None,
    }


def annotate(diff: Json, annotations: Json) -> None:
    """`scheduler.Annotate`: the groups' update counts, count changes, what each task forces."""
    for group in diff.get("TaskGroups") or []:
        updates = (annotations.get("DesiredTGUpdates") or {}).get(group["Name"])
        if updates is not None:
            group["Updates"] = {UPDATE_TYPES[k]: v for k, v in updates.items() if k in UPDATE_TYPES and v}
        for field in group.get("Fields") or []:
            if field["Name"] == "Count":
                before, after = int(field["Old"] or 0), int(field["New"] or 0)
                if before != after:
                    field["Annotations"] = [FORCES_CREATE if after > before else FORCES_DESTROY]
        for task in group.get("Tasks") or []:
            _annotate_task(task, group)


def _annotate_task(task: Json, group: Json) -> None:
    if task["Type"] == "None":
        return
    if group["Type"] in ("Added", "Deleted") and task["Type"] in ("Added", "Deleted"):
        task["Annotations"] = [FORCES_CREATE if task["Type"] == "Added" else FORCES_DESTROY]
        return
    destructive = any(f["Name"] != "KillTimeout" for f in task.get("Fields") or [])
    if not destructive:
        for obj in task.get("Objects") or []:
            if obj["Name"] in ("Service", "Constraint", "Affinity", "Spread"):
                continue
            if obj["Name"] == "LogConfig" and not any(f["Name"] == "Disabled" for f in obj["Fields"] or []):
                continue
            destructive = True
            break
    task["Annotations"] = [FORCES_DESTRUCTIVE if destructive else FORCES_INPLACE]
