"""The scheduler's pure step: an evaluation in, a plan out (`scheduler/generic_sched.go`,
`scheduler/reconciler/`), plus the rules it shares with the loop: rescheduling delays
(`nomad/structs/alloc.go`) and job status and summary (`nomad/state/state_store.go`).

Nothing here writes: `compute_plan` reads the store at one index and returns what should change,
so tests can drive it with a hand-built store and no HTTP, client or clock.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from devstack.nomad.canonical import group_spec
from devstack.nomad.encode import ZERO_TIME, parse_rfc3339_ns, rfc3339
from devstack.nomad.feasible import glob_match, view_of
from devstack.nomad.placement import place_group, place_system
from devstack.nomad.state import StateStore
from devstack.nomad.usage import LiveUsage, UsageView

Json = dict[str, Any]

SECOND = 1_000_000_000
# An allocation due to be rescheduled within this window is rescheduled now
# (reconciler `rescheduleWindowSize`).
RESCHEDULE_WINDOW_NS = SECOND
# Follow-up evaluations for failed allocations due within this window share one evaluation
# (`batchedFailedAllocWindowSize`).
FOLLOWUP_BATCH_NS = 5 * SECOND
# With unlimited rescheduling Nomad keeps only the newest few reschedule events.
MAX_PAST_RESCHEDULE_EVENTS = 5

DESC_NOT_NEEDED = "alloc not needed due to job update"
DESC_RESCHEDULED = "alloc was rescheduled because it failed"
DESC_MIGRATING = "alloc is being migrated"
DESC_UPDATING = "alloc is being updated due to job update"
DESC_LOST = "alloc is lost since its node is down"
DESC_NODE_TAINTED = "alloc not needed as node is tainted"
DESC_BLOCKED = "created to place remaining allocations"
DESC_FOLLOWUP = "created for delayed rescheduling"

TERMINAL_CLIENT = ("complete", "failed", "lost")
TERMINAL_EVAL = ("complete", "failed", "canceled")


# ----- evaluations --------------------------------------------------------------------------


def new_eval(job: Json, triggered_by: str, now_ns: int, **fields: Any) -> Json:
    """An evaluation with every field of `structs.Evaluation`, as Nomad returns it."""
    evaluation: Json = {
        "ID": str(uuid.uuid4()),
        "Namespace": job["Namespace"],
        "Priority": job.get("Priority", 50),
        "Type": job.get("Type", "service"),
        "TriggeredBy": triggered_by,
        "JobID": job["ID"],
        "JobModifyIndex": job.get("JobModifyIndex", 0),
        "NodeID": "",
        "NodeModifyIndex": 0,
        "DeploymentID": "",
        "Status": "pending",
        "StatusDescription": "",
        "Wait": 0,
        "WaitUntil": ZERO_TIME,
        "NextEval": "",
        "PreviousEval": "",
        "BlockedEval": "",
        "RelatedEvals": None,
        "FailedTGAllocs": None,
        "PlanAnnotations": None,
        "ClassEligibility": None,
        "QuotaLimitReached": "",
        "MissingNonNodeResources": None,
        "EscapedComputedClass": False,
        "AnnotatePlan": False,
        "QueuedAllocations": None,
        "LeaderACL": "",
        "SnapshotIndex": 0,
        "CreateTime": now_ns,
        "ModifyTime": now_ns,
    }
    evaluation.update(fields)
    return evaluation


# ----- rescheduling (nomad/structs/alloc.go) ---------------------------------------------


def last_event_time(alloc: Json) -> int:
    """When the allocation last changed on its client: the latest task finish, else ModifyTime."""
    latest = 0
    for state in (alloc.get("TaskStates") or {}).values():
        latest = max(latest, parse_rfc3339_ns(state.get("FinishedAt")))
    return latest or int(alloc.get("ModifyTime") or 0)


def _events(alloc: Json) -> list[Json]:
    tracker = alloc.get("RescheduleTracker") or {}
    return list(tracker.get("Events") or [])


def reschedule_eligible(alloc: Json, policy: Json | None, fail_time: int) -> bool:
    if not policy:
        return False
    attempts = policy.get("Attempts") or 0
    if policy.get("Unlimited"):
        return True
    if attempts <= 0:
        return False
    interval = policy.get("Interval") or 0
    attempted = sum(1 for e in _events(alloc) if fail_time - e["RescheduleTime"] < interval)
    return attempted < attempts


def next_delay(alloc: Json, policy: Json) -> int:
    delay = int(policy.get("Delay") or 0)
    events = _events(alloc)
    if not events:
        return delay
    func = policy.get("DelayFunction")
    max_delay = int(policy.get("MaxDelay") or 0)
    if func == "exponential":
        delay = int(events[-1]["Delay"]) * 2
    elif func == "fibonacci":
        if len(events) >= 2:
            n1, n2 = int(events[-1]["Delay"]), int(events[-2]["Delay"])
            # A series that hit the ceiling and was reset starts again from the base delay.
            delay = n1 if (n2 == max_delay and n1 == policy.get("Delay")) else n1 + n2
    else:
        return delay
    if max_delay > 0 and delay > max_delay:
        delay = max_delay
        if last_event_time(alloc) - events[-1]["RescheduleTime"] > delay:
            delay = int(policy.get("Delay") or 0)
    return delay


def next_reschedule_time(alloc: Json, policy: Json | None) -> tuple[int, bool, int]:
    """(when, eligible, delay) for a failed allocation."""
    fail_time = last_event_time(alloc)
    if not policy or not reschedule_eligible(alloc, policy, fail_time):
        return 0, False, 0
    delay = next_delay(alloc, policy)
    return fail_time + delay, True, delay


def _tracker_for_replacement(prev: Json, policy: Json, now_ns: int, delay: int) -> Json:
    events = _events(prev)
    if policy.get("Unlimited"):
        events = events[-(MAX_PAST_RESCHEDULE_EVENTS - 1) :] if MAX_PAST_RESCHEDULE_EVENTS > 1 else []
    else:
        interval = policy.get("Interval") or 0
        events = [e for e in events if now_ns - e["RescheduleTime"] < interval]
    events.append(
        {
            "RescheduleTime": now_ns,
            "PrevAllocID": prev["ID"],
            "PrevNodeID": prev["NodeID"],
            "Delay": delay,
        }
    )
    return {"Events": events}


# ----- the plan -----------------------------------------------------------------------------


@dataclass
class Plan:
    evaluation: Json
    placed: list[Json] = field(default_factory=list)
    stopped: list[Json] = field(default_factory=list)
    updated: list[Json] = field(default_factory=list)  # attribute changes, no start or stop
    new_evals: list[Json] = field(default_factory=list)
    blocked: Json | None = None
    failed_tg: dict[str, Json] = field(default_factory=dict)
    # Whether the failures ask for a blocked evaluation: a system job's nodes that were all
    # filtered out are reported but wait for nothing. `blocked_node`: the system scheduler's
    # blocked evaluation names the full node it failed on.
    block: bool = True
    blocked_node: str = ""
    queued: dict[str, int] = field(default_factory=dict)
    # Groups whose destructive updates wait for the deployment (max_parallel at a time).
    held_back: set[str] = field(default_factory=set)


@dataclass
class _Slot:
    name: str
    index: int
    alloc: Json | None = None  # the allocation holding the slot, if one stays
    previous: Json | None = None  # replacement for this allocation
    stop_previous: bool = False  # stop `previous` even if the replacement cannot be placed
    reschedule: tuple[Json, int] | None = None  # (policy, delay) when rescheduling


def _name_index(name: str) -> int:
    try:
        return int(name[name.rindex("[") + 1 : -1])
    except ValueError:
        return 0


def _stop(alloc: Json, desc: str, now_ns: int, client_status: str | None = None) -> Json:
    out = dict(alloc)
    out["DesiredStatus"] = "stop"
    out["DesiredDescription"] = desc
    if client_status:
        out["ClientStatus"] = client_status
    out["ModifyTime"] = now_ns
    return out


def _needs_replacement(alloc: Json, job: Json, group: Json) -> bool:
    """A destructive update (`tasksUpdated`): the group changed apart from its count."""
    old_job = alloc.get("Job") or {}
    if old_job.get("Version") == job.get("Version"):
        return False
    old_group = next((g for g in old_job.get("TaskGroups") or [] if g.get("Name") == group["Name"]), None)
    if old_group is None:
        return True
    return group_spec(old_group) != group_spec(group) or old_job.get("Meta") != job.get("Meta")


def compute_plan(
    store: StateStore,
    evaluation: Json,
    now_ns: int,
    live_allocs: list[Json] | None = None,
    destructive_budget: dict[str, int] | None = None,
) -> Plan:
    """What the evaluation should change: the reconciler and the placement, without writing.
    `live_allocs` are what placement packs against (default: the store's live allocations);
    `destructive_budget` caps the replacements per group (a rolling update; absent: no cap)."""
    plan = Plan(evaluation=dict(evaluation))
    # The store's running sums, not a pass over every live allocation: see usage.py.
    live = store.live_usage if live_allocs is None else LiveUsage.of(live_allocs)
    ns, job_id = evaluation["Namespace"], evaluation["JobID"]
    job = store.jobs.get((ns, job_id))
    allocs = store.allocs_for_job(ns, job_id)
    stopped_job = job is None or job.get("Stop")
    groups = {g["Name"]: g for g in (job or {}).get("TaskGroups") or []}

    # Allocations of groups the job no longer has, or of a stopped or purged job.
    for alloc in allocs:
        if alloc["DesiredStatus"] != "run":
            continue
        if stopped_job or alloc["TaskGroup"] not in groups:
            lost = alloc["ClientStatus"] not in TERMINAL_CLIENT and _node_down(store, alloc)
            plan.stopped.append(_stop(alloc, DESC_NOT_NEEDED, now_ns, "lost" if lost else None))
    if stopped_job or job is None:
        plan.evaluation["Status"] = "complete"
        return plan

    if job["Type"] == "system":
        _system_plan(plan, store, job, groups, allocs, live, now_ns)
        plan.evaluation["Status"] = "complete"
        return plan

    # Placement itself keeps only ready, eligible, not draining nodes (`readyNodesInDCsAndPool`).
    nodes = list(store.nodes.values())
    placed_so_far: list[Json] = []
    later: list[tuple[Json, int]] = []
    for name, group in groups.items():
        group_allocs = [a for a in allocs if a["TaskGroup"] == name]
        budget = (destructive_budget or {}).get(name)
        slots, stops, inplace = _reconcile_group(
            store, job, group, group_allocs, now_ns, evaluation["ID"], later, budget, plan.held_back
        )
        plan.stopped.extend(stops)
        plan.updated.extend(inplace)
        _place(plan, job, group, slots, nodes, live, placed_so_far, now_ns)

    if later:
        _followups(plan, job, later, now_ns)
    plan.evaluation["QueuedAllocations"] = {g: plan.queued.get(g, 0) for g in groups}
    plan.evaluation["Status"] = "complete"
    return plan


# ----- system jobs (scheduler/scheduler_system.go, reconciler/reconcile_node.go) ------------


def _system_plan(
    plan: Plan,
    store: StateStore,
    job: Json,
    groups: dict[str, Json],
    allocs: list[Json],
    live: LiveUsage,
    now_ns: int,
) -> None:
    """One allocation of each group on every ready node of the job's datacenters and pool.

    As Nomad's node reconciler: allocations on nodes that are gone or down are lost; on a
    draining node they stay until the drain marks them to migrate; on an ineligible node they
    stay unless the job changed; on a node the job no longer targets they stop. A failed
    allocation is not rescheduled elsewhere: the next evaluation places a new one on the same
    node, chained to it through PreviousAllocation."""
    pool = str(job.get("NodePool") or "default")
    datacenters = list(job.get("Datacenters") or []) or ["*"]
    ready: dict[str, Json] = {}
    not_ready: set[str] = set()
    for node in store.nodes.values():
        if pool != "all" and (node.get("NodePool") or "default") != pool:
            continue
        if not view_of(node).ready:
            not_ready.add(node["ID"])
        elif any(glob_match(dc, node.get("Datacenter") or "") for dc in datacenters):
            ready[node["ID"]] = node
    # Count 0 (scaled to zero) asks for no allocation; count is otherwise at most 1.
    required = {
        f"{job['ID']}.{name}[{i}]": group
        for name, group in groups.items()
        for i in range(max(int(group.get("Count") or 0), 0))
    }

    existing: set[tuple[str, str]] = set()  # (node, name) that keep or get an allocation
    replace: dict[tuple[str, str], Json] = {}  # destructive updates, placed on the same node
    terminal: dict[tuple[str, str], Json] = {}  # newest finished allocation per (node, name)
    for alloc in allocs:
        key = (alloc["NodeID"], alloc["Name"])
        if alloc["DesiredStatus"] != "run" or alloc["ClientStatus"] in TERMINAL_CLIENT:
            if key not in terminal or terminal[key]["CreateIndex"] < alloc.get("CreateIndex", 0):
                terminal[key] = alloc
            continue
        group = required.get(alloc["Name"])
        if group is None:
            plan.stopped.append(_stop(alloc, DESC_NOT_NEEDED, now_ns))
            continue
        if (alloc.get("DesiredTransition") or {}).get("Migrate"):
            plan.stopped.append(_stop(alloc, DESC_NODE_TAINTED, now_ns))
            existing.add(key)
            continue
        found = store.nodes.get(alloc["NodeID"])
        if found is None or found.get("Status") == "down":
            plan.stopped.append(_stop(alloc, DESC_LOST, now_ns, "lost"))
            continue
        node_id = found["ID"]
        changed = (alloc.get("Job") or {}).get("JobModifyIndex") != job.get("JobModifyIndex")
        if found.get("DrainStrategy") or found.get("Status") == "disconnected":
            existing.add(key)  # tainted: the drain decides when it goes
            continue
        if node_id in not_ready:
            if changed:
                plan.stopped.append(_stop(alloc, DESC_NOT_NEEDED, now_ns))
            existing.add(key)
            continue
        if node_id not in ready:
            plan.stopped.append(_stop(alloc, DESC_NOT_NEEDED, now_ns))
            continue
        existing.add(key)
        if changed:
            if _needs_replacement(alloc, job, group):
                plan.stopped.append(_stop(alloc, DESC_UPDATING, now_ns))
                replace[key] = alloc
            else:
                plan.updated.append({**alloc, "Job": job, "ModifyTime": now_ns})

    stopping = {a["ID"] for a in plan.stopped}
    packed: list[Json] = []  # placed by this plan so far
    node_order = sorted(ready.values(), key=lambda n: n.get("Name") or "")
    for name, group in groups.items():
        names = [n for n, g in required.items() if g is group]
        for alloc_name in names:
            targets: list[str] = []
            previous: dict[str, Json | None] = {}
            for node in node_order:
                key = (node["ID"], alloc_name)
                if key in replace:
                    targets.append(node["ID"])
                    previous[node["ID"]] = replace[key]
                elif key not in existing:
                    targets.append(node["ID"])
                    previous[node["ID"]] = terminal.get(key)
            if not targets:
                plan.queued[name] = plan.queued.get(name, 0)
                continue
            view = UsageView(live, without=stopping, extra=packed)
            result = place_system(job, group, list(ready.values()), view, targets)
            for node_id, placement in result.placed:
                prev = previous[node_id]
                slot = _Slot(alloc_name, _name_index(alloc_name), previous=prev)
                alloc = _new_alloc(plan.evaluation, job, group, slot, placement, now_ns)
                plan.placed.append(alloc)
                packed.append(alloc)
                if prev is not None and prev["ID"] in stopping:
                    for stopped in plan.stopped:
                        if stopped["ID"] == prev["ID"]:
                            stopped["NextAllocation"] = alloc["ID"]
            plan.queued[name] = plan.queued.get(name, 0) + len(result.exhausted_nodes)
            if result.failed_metrics:
                plan.failed_tg[name] = result.failed_metrics
                if not plan.blocked_node:
                    plan.blocked_node = result.exhausted_nodes[0]
            elif (
                result.filtered
                and not result.placed
                and not any(a["TaskGroup"] == name for a in allocs if (a["NodeID"], a["Name"]) in existing)
            ):
                # Every node was filtered out and none runs the group: Nomad reports the
                # filter counts, but there is no room to wait for, so nothing blocks.
                plan.failed_tg[name] = result.filtered_metrics
    plan.block = bool(plan.blocked_node)
    plan.evaluation["QueuedAllocations"] = {g: plan.queued.get(g, 0) for g in groups}


def _node_down(store: StateStore, alloc: Json) -> bool:
    node = store.nodes.get(alloc["NodeID"])
    return node is None or node.get("Status") == "down"


def _reconcile_group(
    store: StateStore,
    job: Json,
    group: Json,
    allocs: list[Json],
    now_ns: int,
    eval_id: str,
    later: list[tuple[Json, int]],
    budget: int | None = None,
    held_back: set[str] | None = None,
) -> tuple[list[_Slot], list[Json], list[Json]]:
    """Slots (name indexes) the group should hold after this evaluation, the stops, and the
    allocations updated in place to the job's current version. With a `budget`, at most that
    many are replaced now; the rest keep running and the group is added to `held_back`."""
    batch = job["Type"] == "batch"
    policy = group.get("ReschedulePolicy")
    slots: list[_Slot] = []
    stops: list[Json] = []
    inplace: list[Json] = []
    for alloc in allocs:
        if alloc["DesiredStatus"] != "run":
            continue
        status = alloc["ClientStatus"]
        idx = _name_index(alloc["Name"])
        if status == "complete":
            if batch:  # a finished batch allocation has done its work and keeps its slot
                slots.append(_Slot(alloc["Name"], idx, alloc=alloc))
            continue
        if status == "lost":
            continue
        if status == "failed":
            if alloc.get("NextAllocation"):
                continue
            if (alloc.get("DesiredTransition") or {}).get("ForceReschedule") and policy:
                # `nomad job eval -force-reschedule`: replaced now, whatever the policy has left
                # (reconciler `updateByReschedulable`, ShouldForceReschedule).
                slots.append(_Slot(alloc["Name"], idx, previous=alloc, reschedule=(policy, 0)))
                continue
            when, eligible, delay = next_reschedule_time(alloc, policy)
            if eligible and (alloc.get("FollowupEvalID") == eval_id or when - now_ns <= RESCHEDULE_WINDOW_NS):
                assert policy is not None
                slots.append(_Slot(alloc["Name"], idx, previous=alloc, reschedule=(policy, delay)))
            else:
                if eligible and not alloc.get("FollowupEvalID"):
                    later.append((alloc, when))
                # A failed allocation that may not be rescheduled keeps its slot, which is why a
                # job whose policy is spent runs with fewer allocations rather than replacing it.
                slots.append(_Slot(alloc["Name"], idx, alloc=alloc))
            continue
        node = store.nodes.get(alloc["NodeID"])
        if node is None or node.get("Status") == "down":
            stops.append(_stop(alloc, DESC_LOST, now_ns, "lost"))
            slots.append(_Slot(alloc["Name"], idx, previous=alloc))
        elif (alloc.get("DesiredTransition") or {}).get("Migrate"):
            stops.append(_stop(alloc, DESC_MIGRATING, now_ns))
            slots.append(_Slot(alloc["Name"], idx, previous=alloc))
        elif _needs_replacement(alloc, job, group):
            if budget is not None and budget <= 0:
                if held_back is not None:
                    held_back.add(group["Name"])
                slots.append(_Slot(alloc["Name"], idx, alloc=alloc))
                continue
            if budget is not None:
                budget -= 1
            stops.append(_stop(alloc, DESC_UPDATING, now_ns))
            slots.append(_Slot(alloc["Name"], idx, previous=alloc))
        else:
            if (alloc.get("Job") or {}).get("JobModifyIndex") != job.get("JobModifyIndex"):
                # An in-place update: the allocation keeps running under the new job version.
                alloc = {**alloc, "Job": job, "ModifyTime": now_ns}
                inplace.append(alloc)
            slots.append(_Slot(alloc["Name"], idx, alloc=alloc))

    count = group["Count"]
    if len(slots) > count:
        # Scale down from the highest index, as the reconciler's name index does.
        slots.sort(key=lambda s: s.index)
        for slot in slots[count:]:
            # A replacement that is no longer wanted is not placed; a failed predecessor that
            # was waiting for it is stopped with the rest (a migrating one already is).
            held = slot.alloc if slot.alloc is not None else (slot.previous if slot.reschedule else None)
            if held is not None:
                stops.append(_stop(held, DESC_NOT_NEEDED, now_ns))
        del slots[count:]
        kept = {s.alloc["ID"] for s in slots if s.alloc is not None}
        later[:] = [(a, t) for a, t in later if a["TaskGroup"] != group["Name"] or a["ID"] in kept]
    elif len(slots) < count:
        used = {s.index for s in slots}
        i = 0
        while len(slots) < count:
            if i not in used:
                slots.append(_Slot(f"{job['ID']}.{group['Name']}[{i}]", i))
            i += 1
    stopped_ids = {a["ID"] for a in stops}
    return slots, stops, [a for a in inplace if a["ID"] not in stopped_ids]


def _place(
    plan: Plan,
    job: Json,
    group: Json,
    slots: list[_Slot],
    nodes: list[Json],
    store_live: LiveUsage,
    placed_so_far: list[Json],
    now_ns: int,
) -> None:
    want = [s for s in slots if s.alloc is None]
    if not want:
        plan.queued[group["Name"]] = 0
        return
    # Replacements first: a rescheduled or migrated allocation is restoring what ran before.
    want.sort(key=lambda s: (s.previous is None, s.index))
    stopping = {a["ID"] for a in plan.stopped}
    live = UsageView(store_live, without=stopping, extra=placed_so_far)
    result = place_group(job, group, nodes, live, len(want))
    for slot, placement in zip(want, result.placed, strict=False):
        alloc = _new_alloc(plan.evaluation, job, group, slot, placement, now_ns)
        plan.placed.append(alloc)
        placed_so_far.append(alloc)
        prev = slot.previous
        if prev is not None:
            if slot.reschedule is not None:
                plan.stopped.append({**_stop(prev, DESC_RESCHEDULED, now_ns), "NextAllocation": alloc["ID"]})
            else:
                # Migrated, lost or replaced by an update: already stopped in this plan.
                for stopped in plan.stopped:
                    if stopped["ID"] == prev["ID"]:
                        stopped["NextAllocation"] = alloc["ID"]
    failed = len(want) - len(result.placed)
    plan.queued[group["Name"]] = max(failed, 0)
    if failed > 0:
        plan.failed_tg[group["Name"]] = result.metrics


def _new_alloc(evaluation: Json, job: Json, group: Json, slot: _Slot, placement: Any, now_ns: int) -> Json:
    prev = slot.previous
    tracker = None
    if prev is not None and slot.reschedule is not None:
        policy, delay = slot.reschedule
        tracker = _tracker_for_replacement(prev, policy, now_ns, delay)
    return {
        "ID": str(uuid.uuid4()),
        "Namespace": job["Namespace"],
        "EvalID": evaluation["ID"],
        "Name": slot.name,
        "NodeID": placement.node_id,
        "NodeName": placement.node_name,
        "JobID": job["ID"],
        "Job": job,
        "TaskGroup": group["Name"],
        "Resources": None,
        "SharedResources": None,
        "TaskResources": None,
        "AllocatedResources": placement.allocated_resources,
        "Metrics": placement.metrics,
        "DesiredStatus": "run",
        "DesiredDescription": "",
        "DesiredTransition": {
            "Migrate": None,
            "Reschedule": None,
            "ForceReschedule": None,
            "NoShutdownDelay": None,
        },
        "ClientStatus": "pending",
        "ClientDescription": "",
        "TaskStates": None,
        "AllocStates": None,
        "PreviousAllocation": prev["ID"] if prev is not None else "",
        "NextAllocation": "",
        "DeploymentID": "",
        "DeploymentStatus": None,
        "RescheduleTracker": tracker,
        "NetworkStatus": None,
        "FollowupEvalID": "",
        "PreemptedAllocations": None,
        "PreemptedByAllocation": "",
        "SigningKeyID": "",
        "CreateTime": now_ns,
        "ModifyTime": now_ns,
    }


def _followups(plan: Plan, job: Json, later: list[tuple[Json, int]], now_ns: int) -> None:
    """Delayed reschedules: one follow-up evaluation per batch of failures due close together."""
    later.sort(key=lambda item: item[1])
    current: Json | None = None
    batch_start = 0
    for alloc, when in later:
        if current is None or when - batch_start >= FOLLOWUP_BATCH_NS:
            batch_start = when
            current = new_eval(
                job,
                "alloc-failure",
                now_ns,
                StatusDescription=DESC_FOLLOWUP if not plan.new_evals else "",
                WaitUntil=rfc3339(when),
                PreviousEval=plan.evaluation["ID"],
            )
            plan.new_evals.append(current)
        plan.updated.append({**alloc, "FollowupEvalID": current["ID"]})


# ----- job status and summary (nomad/state/state_store.go) ----------------------------------


def job_status(store: StateStore, job: Json) -> str:
    """`getJobStatus`: running while any allocation is not terminal, pending while any
    evaluation is not, dead once everything is finished."""
    if job["Type"] in ("system", "sysbatch") or job.get("Periodic") or job.get("ParameterizedJob"):
        return "dead" if job.get("Stop") else "running"
    allocs = store.allocs_for_job(job["Namespace"], job["ID"])
    for alloc in allocs:
        if alloc["DesiredStatus"] == "run" and alloc["ClientStatus"] not in TERMINAL_CLIENT:
            return "running"
    evals = store.evals_for_job(job["Namespace"], job["ID"])
    if any(e["Status"] not in TERMINAL_EVAL for e in evals):
        return "pending"
    return "dead" if (allocs or evals) else "pending"


def job_summary(store: StateStore, job: Json, queued: dict[str, int]) -> Json:
    """`structs.JobSummary`: allocations of each group counted by client status."""
    summary: dict[str, dict[str, int]] = {
        g["Name"]: {
            "Queued": queued.get(g["Name"], 0),
            "Complete": 0,
            "Failed": 0,
            "Running": 0,
            "Starting": 0,
            "Lost": 0,
            "Unknown": 0,
        }
        for g in job.get("TaskGroups") or []
    }
    key = {
        "pending": "Starting",
        "running": "Running",
        "complete": "Complete",
        "failed": "Failed",
        "lost": "Lost",
        "unknown": "Unknown",
    }
    for alloc in store.allocs_for_job(job["Namespace"], job["ID"]):
        tg = summary.get(alloc["TaskGroup"])
        if tg is not None and alloc["ClientStatus"] in key:
            tg[key[alloc["ClientStatus"]]] += 1
    return {
        "JobID": job["ID"],
        "Namespace": job["Namespace"],
        "Summary": summary,
        "Children": {"Pending": 0, "Running": 0, "Dead": 0},
    }
