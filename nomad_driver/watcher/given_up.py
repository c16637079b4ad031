"""Slots Nomad has given up on: a failed allocation that Nomad will not replace.

Nomad's own retries are budgets: one restart in place per 30 minutes, two reschedules per 24
hours (render.py). Crashes earlier that day spend them, and a healthy start resets llmgw's count
but not Nomad's budgets, so a model can run out of them before its count reaches five. The failed
allocation then keeps its slot (Nomad never places over it), the job's count equals what llmgw
wants, and nothing asks again: the model is down, neither parked nor serving.

The rule: llmgw asks Nomad again, with `nomad job eval -force-reschedule` (`Job.Evaluate` with
`ForceReschedule`), which replaces such an allocation now, whatever its policy has left. Each
replacement is another start, counted like any other, so a model that keeps failing is parked
after five, with its cause; one whose failures were passing serves again. Until the replacement
shows, the model's state says so (`nomad_gave_up`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nomad_driver.fields import as_int
from nomad_driver.render import RESCHEDULE_POLICY


def _policy(job: Mapping[str, Any] | None, group: str) -> Mapping[str, Any]:
    """The group's reschedule policy as the job in Nomad has it; llmgw's own when not shown."""
    for g in (job or {}).get("TaskGroups") or []:
        if (
            isinstance(g, Mapping)
            and g.get("Name") == group
            and isinstance(g.get("ReschedulePolicy"), Mapping)
        ):
            return g["ReschedulePolicy"]
    return RESCHEDULE_POLICY


def _fail_time_ns(alloc: Mapping[str, Any]) -> int:
    """When it failed, as Nomad's eligibility reads it: the latest task event."""
    latest = 0
    for state in (alloc.get("TaskStates") or {}).values():
        if isinstance(state, Mapping):
            for ev in state.get("Events") or []:
                if isinstance(ev, Mapping):
                    latest = max(latest, as_int(ev.get("Time")))
    return latest or as_int(alloc.get("ModifyTime"))


def reschedule_eligible(alloc: Mapping[str, Any], policy: Mapping[str, Any]) -> bool:
    """Nomad's `Allocation.RescheduleEligible` (nomad/structs/structs.go): attempts left in the
    policy's interval, counted back from the failure."""
    attempts = as_int(policy.get("Attempts"))
    if policy.get("Unlimited"):
        return True
    if attempts <= 0:
        return False
    interval = as_int(policy.get("Interval"))
    failed_at = _fail_time_ns(alloc)
    events = ((alloc.get("RescheduleTracker") or {}).get("Events")) or []
    recent = sum(
        1 for e in events if isinstance(e, Mapping) and failed_at - as_int(e.get("RescheduleTime")) < interval
    )
    return recent < attempts


def rescheduling_enabled(policy: Mapping[str, Any]) -> bool:
    """Nomad's `ReschedulePolicy.Enabled`: `Job.Evaluate` forces a reschedule only for a group
    whose policy is enabled (nomad/job_endpoint.go), so with attempts 0 asking does nothing."""
    return as_int(policy.get("Attempts")) > 0 or bool(policy.get("Unlimited"))


def disabled_slots(job: Mapping[str, Any] | None, allocs: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Failed allocations holding a slot in a group whose reschedule policy is disabled: Nomad
    will not replace them, asked or not."""
    return tuple(
        sorted(
            str(a.get("ID") or "")
            for a in allocs
            if a.get("ClientStatus") == "failed"
            and a.get("DesiredStatus") == "run"
            and not a.get("NextAllocation")
            and not rescheduling_enabled(_policy(job, str(a.get("TaskGroup") or "")))
        )
    )


def spent_slots(job: Mapping[str, Any] | None, allocs: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """IDs of the failed allocations that hold a slot Nomad will not fill again, that asking
    can fill (their group may be rescheduled), and that llmgw has not already asked for."""
    spent = []
    for alloc in allocs:
        if alloc.get("ClientStatus") != "failed" or alloc.get("DesiredStatus") != "run":
            continue
        if alloc.get("NextAllocation") or alloc.get("FollowupEvalID"):
            continue  # replaced, or a delayed reschedule is on its way
        if (alloc.get("DesiredTransition") or {}).get("ForceReschedule"):
            continue  # asked already; the replacement is coming
        policy = _policy(job, str(alloc.get("TaskGroup") or ""))
        if rescheduling_enabled(policy) and not reschedule_eligible(alloc, policy):
            spent.append(str(alloc.get("ID") or ""))
    return tuple(sorted(spent))


def gave_up_reason(spent: Sequence[str], disabled: Sequence[str] = ()) -> str:
    parts = []
    if spent:
        parts.append(
            f"Nomad will not replace failed allocation(s) {', '.join(a[:8] for a in spent)}: their "
            "reschedule attempts are spent; llmgw asks Nomad to reschedule them (nomad job eval "
            "-force-reschedule)"
        )
    if disabled:
        parts.append(
            f"Nomad will not replace failed allocation(s) {', '.join(a[:8] for a in disabled)}: the "
            "job's reschedule policy is disabled (attempts 0), and Nomad ignores a request to "
            "reschedule such a group; give it attempts (llmgw's own job has two a day)"
        )
    return "; ".join(parts)
