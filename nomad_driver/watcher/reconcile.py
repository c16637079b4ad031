"""What one model should have now, against what it has: a pure function of a snapshot.

`reconcile` reads only what it is given and returns the next steps; the watcher applies them.
Running it twice on the same snapshot asks for the same steps, and a step the watcher missed
is asked for again on the next pass, so a lost event or a failed call heals itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from nomad_driver.placement import latest_placement_failure
from nomad_driver.render import SHARD_GROUP
from nomad_driver.spec import Model
from nomad_driver.state import ModelState
from nomad_driver.watcher.parking import Ledger, StartId, count_start_failures

DEFAULT_MAX_START_FAILURES = 5
HealthStatus = Literal["passing", "warning", "critical"]

# Allocations that hold or will hold a replica; everything else is history.
_LIVE_CLIENT = {"pending", "running"}


@dataclass(frozen=True)
class ModelView:
    """Everything the watcher knows about one model at one moment."""

    model: Model
    job: Mapping[str, Any] | None = None
    allocs: tuple[Mapping[str, Any], ...] = ()
    evals: tuple[Mapping[str, Any], ...] = ()
    ready: int = 0  # engine instances passing their Consul check
    # The starts whose engine passes its Consul check now, as (Started time, allocation ID).
    healthy_starts: frozenset[StartId] = frozenset()
    state: ModelState | None = None
    state_index: int = 0  # the state key's ModifyIndex; 0 when it does not exist
    state_problem: str = ""  # a malformed stored state, to report and replace
    activity: float | None = None  # last request, Unix time, from the routers
    scaled_at: float | None = None  # when the watcher first saw the job's current count
    now: float = 0.0
    # Requests in flight on its replicas, summed over routers, and how many distinct replicas
    # they are on (`llmgw/inflight/`).
    in_flight: int = 0
    busy_replicas: int = 0
    # How late the routers' activity can reach the watcher: their publishing interval.
    activity_grace_s: float = 0.0


@dataclass(frozen=True)
class RegisterJob:
    model: str
    count: int


@dataclass(frozen=True)
class Scale:
    model: str
    job_id: str
    group: str
    count: int
    message: str


@dataclass(frozen=True)
class Park:
    """Scale to 0 and write the parked state; the watcher first reads the failed replica's
    stderr so that the stored error is the engine's own words."""

    model: str
    job_id: str
    group: str
    failures: int
    alloc_id: str
    task: str
    event_error: str
    state: ModelState  # to write with last_error filled in
    cas: int


@dataclass(frozen=True)
class WriteState:
    model: str
    state: ModelState
    cas: int


Action = RegisterJob | Scale | Park | WriteState
# The actions that call Nomad, whose refusals become the model's `last_action_error`.
NomadAction = (RegisterJob, Scale, Park)


@dataclass(frozen=True)
class Decision:
    model: str
    desired: int
    ready: int
    starting: int
    state: ModelState
    health: HealthStatus
    health_output: str
    actions: tuple[Action, ...] = field(default=())


def job_group(job: Mapping[str, Any] | None) -> tuple[str, int]:
    """The job's one task group and its count; ("", 0) for a job that is missing or odd."""
    if not isinstance(job, Mapping):
        return "", 0
    groups = job.get("TaskGroups")
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping):
        return "", 0
    try:
        count = int(groups[0].get("Count") or 0)
    except (TypeError, ValueError):
        count = 0
    return str(groups[0].get("Name", "")), count


def job_def_hash(job: Mapping[str, Any] | None) -> str:
    if not isinstance(job, Mapping) or not isinstance(job.get("Meta"), Mapping):
        return ""
    return str(job["Meta"].get("llmgw_def_hash", ""))


def job_scaling_max(job: Mapping[str, Any] | None) -> int | None:
    groups = job.get("TaskGroups") if isinstance(job, Mapping) else None
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping):
        return None
    scaling = groups[0].get("Scaling")
    if not isinstance(scaling, Mapping) or not isinstance(scaling.get("Max"), int):
        return None
    return int(scaling["Max"])


def job_makes_deployments(job: Mapping[str, Any] | None) -> bool:
    """A group of the job has an update strategy that makes Nomad deploy it (max_parallel > 0),
    as a model job rendered before llmgw opted out has (or a multi-node job's shard group did):
    Nomad would refuse to scale it while a deployment runs."""
    groups = job.get("TaskGroups") if isinstance(job, Mapping) else None
    if not isinstance(groups, list):
        return False
    for group in groups:
        update = group.get("Update") if isinstance(group, Mapping) else None
        max_parallel = update.get("MaxParallel") if isinstance(update, Mapping) else None
        if isinstance(max_parallel, int) and max_parallel > 0:
            return True
    return False


def job_is_current(job: Mapping[str, Any] | None, model: Model) -> bool:
    """The job in Nomad runs this definition. Replicas are not in the definition hash (scaling
    is not a new definition, and must not unpark), but Nomad refuses to scale past the job's
    scaling maximum, so a raised `replicas.max` needs the job registered again; a job that still
    makes deployments is registered again to opt out (an update in place, nothing restarts)."""
    return (
        job_def_hash(job) == model.def_hash
        and job_scaling_max(job) == model.replicas_max
        and not job_makes_deployments(job)
    )


def job_version(job: Mapping[str, Any] | None) -> int:
    if not isinstance(job, Mapping):
        return 0
    try:
        return int(job.get("Version") or 0)
    except (TypeError, ValueError):
        return 0


def job_conflict(job: Mapping[str, Any] | None, model: Model) -> str:
    """Why the Nomad job with this model's ID is not llmgw's to change, or "" when it is: a
    job that llmgw did not render for this model (its meta `llmgw_model` missing or naming
    another model) is someone else's, and registering over it would replace their service."""
    if not isinstance(job, Mapping):
        return ""
    meta = job.get("Meta")
    owner = meta.get("llmgw_model") if isinstance(meta, Mapping) else None
    if owner == model.name:
        return ""
    whose = f"its meta names model {owner!r}" if owner else "its meta has no llmgw_model"
    return (
        f"Nomad job {model.job_id} was not registered by llmgw for model {model.name} ({whose}); "
        f"llmgw leaves it alone: rename the model or remove that job"
    )


def ledger_of(state: ModelState) -> Ledger:
    through = (state.counted_through_ns, state.counted_through_alloc) if state.counted_through_alloc else None
    return Ledger(state.failures_after_ns, through, state.counted_failures, state.count_job_version)


def with_ledger(state: ModelState, ledger: Ledger) -> ModelState:
    through_ns, through_alloc = ledger.through or (0, "")
    return state.model_copy(
        update={
            "failures_after_ns": ledger.after_ns,
            "counted_through_alloc": through_alloc,
            "counted_through_ns": through_ns,
            "counted_failures": ledger.counted,
            "count_job_version": ledger.job_version,
        }
    )


def cleared(state: ModelState, baseline_ns: int) -> ModelState:
    """Unparked with the count at 0: failures up to `baseline_ns` are forgiven, because a retry
    or a new definition is a fresh start, not the sixth attempt of the old one."""
    state = state.model_copy(
        update={"parked": False, "consecutive_failures": 0, "last_error": "", "parked_def_hash": ""}
    )
    return with_ledger(state, Ledger(after_ns=baseline_ns, job_version=state.count_job_version))


def newest_start_ns(view: ModelView) -> int:
    return count_start_failures(view.allocs, frozenset()).newest_start_ns


def retried(view: ModelView) -> ModelState:
    """The state `llmgw ctl retry` writes."""
    state = view.state or ModelState()
    return cleared(state, max(newest_start_ns(view), state.failures_after_ns))


def counted_definition(view: ModelView, state: ModelState) -> ModelState:
    """The state with its count belonging to the model's current definition.

    A new definition starts its own count: the old count and every start Nomad shows now are
    forgiven, and allocations of job versions older than the first that runs the new definition
    never count (until Nomad has that version, nothing counts)."""
    m = view.model
    if not state.count_def_hash:
        # Written by an llmgw that kept no definition with the count: the count is the current
        # definition's, or that of the definition it was parked under.
        held = state.parked_def_hash if state.parked and state.parked_def_hash else m.def_hash
        state = state.model_copy(update={"count_def_hash": held})
    if state.count_def_hash != m.def_hash:
        state = cleared(state, max(newest_start_ns(view), state.failures_after_ns))
        state = state.model_copy(update={"count_def_hash": m.def_hash, "count_job_version": -1})
    if state.count_job_version < 0 and job_def_hash(view.job) == m.def_hash:
        state = state.model_copy(update={"count_job_version": job_version(view.job)})
    return state


def same_state(a: ModelState, b: ModelState) -> bool:
    """Equal but for when it was written: an unchanged state is not written again."""
    return a.model_dump(exclude={"updated_at"}) == b.model_dump(exclude={"updated_at"})


def desired_replicas(view: ModelView, count: int) -> int:
    """Its minimum, or more while it is asked for: a request in flight, or one that ended
    within idle_timeout, keeps an on-demand model at 1 and keeps the count a router scaled to;
    after that, back to the minimum. Never fewer than the replicas that have requests in flight,
    so a long stream is not cut by its own replica being stopped."""
    m = view.model
    # The idle clock runs from the end of the last request, as the routers last published it;
    # the grace covers a request that began after their last write.
    asked = view.in_flight > 0 or (
        view.activity is not None and view.now - view.activity < m.idle_timeout_s + view.activity_grace_s
    )
    # A router scales up before its request finishes and writes activity; the count it chose
    # counts as asked-for from when the watcher first saw it, so it is not undone at once.
    just_scaled = view.scaled_at is not None and view.now - view.scaled_at < m.idle_timeout_s
    want = m.replicas_min
    if asked:
        want = max(want, 1)
    if count > want and (asked or just_scaled):
        want = count
    want = max(want, min(view.busy_replicas, count))
    return max(0, min(want, m.replicas_max))


def replica_view(view: ModelView) -> ModelView:
    """A multi-node replica counts as one start, whichever shard failed: its leader cannot run
    without every shard (llama-server aborts when one goes), so the leader's starts are the
    replica's starts, and the shards' allocations are left out of the count."""
    if view.model.profile.nodes <= 1:
        return view
    leaders = tuple(a for a in view.allocs if a.get("TaskGroup") != SHARD_GROUP)
    return dataclasses.replace(view, allocs=leaders)


def reconcile(view: ModelView, max_start_failures: int = DEFAULT_MAX_START_FAILURES) -> Decision:
    view = replica_view(view)
    m = view.model
    stored = view.state or ModelState()
    state = stored
    actions: list[Action] = []
    group, count = job_group(view.job)

    conflict = job_conflict(view.job, m)
    if conflict:
        return _conflicted(view, state.model_copy(update={"job_conflict": conflict}))
    state = counted_definition(view, state.model_copy(update={"job_conflict": ""}))

    failures = count_start_failures(view.allocs, view.healthy_starts, ledger_of(state))
    if not state.parked:
        error = state.last_error
        if failures.consecutive == 0:
            error = ""
        elif failures.consecutive != state.consecutive_failures and failures.last_failed is not None:
            error = failures.last_failed.error
        state = with_ledger(state, failures.ledger).model_copy(
            update={"consecutive_failures": failures.consecutive, "last_error": error}
        )

    park_now = not state.parked and failures.consecutive >= max_start_failures
    if park_now:
        state = state.model_copy(
            update={
                "parked": True,
                "parked_def_hash": m.def_hash,
                "unplaceable": False,
                "placement_reason": "",
                "placement_eval": "",
            }
        )

    desired = 0 if state.parked else desired_replicas(view, count)

    if view.job is None or not job_is_current(view.job, m):
        actions.append(RegisterJob(m.name, desired))
    elif count != desired and not park_now and not view.job.get("Stop"):
        if state.parked:
            why = f"llmgw: {m.name} is parked; not placing it again until its definition changes or a retry"
        elif count > desired:
            why = f"llmgw: {m.name} idle for {int(m.idle_timeout_s)}s, scaling down to {desired}"
        else:
            why = f"llmgw: {m.name} should have {desired} replicas"
        actions.append(Scale(m.name, m.job_id, group, desired, why))

    # Placement: only while something is meant to run and the job is the current definition.
    failure = None
    if (
        not state.parked
        and max(count, desired) > 0
        and view.job is not None
        and job_def_hash(view.job) == m.def_hash
    ):
        failure = latest_placement_failure(view.evals, dict(view.job))
    state = state.model_copy(
        update={
            "unplaceable": failure is not None,
            "placement_reason": failure.reason if failure else "",
            "placement_eval": failure.eval_id if failure else "",
        }
    )

    if park_now and view.job is not None:
        # Park writes the state itself, after reading the engine's stderr for the real error.
        last = failures.last_failed
        actions.insert(
            0,
            Park(
                m.name,
                m.job_id,
                group,
                failures.consecutive,
                last.alloc_id if last else "",
                last.task if last else "",
                last.error if last else "",
                state,
                view.state_index,
            ),
        )
    elif view.state_problem or not same_state(state, stored):
        actions.append(WriteState(m.name, state, view.state_index))

    live = sum(
        1 for a in view.allocs if a.get("DesiredStatus") == "run" and a.get("ClientStatus") in _LIVE_CLIENT
    )
    starting = max(0, live - view.ready)
    health, output = model_health(m.name, state, desired, view.ready, starting)
    return Decision(m.name, desired, view.ready, starting, state, health, output, tuple(actions))


def _conflicted(view: ModelView, state: ModelState) -> Decision:
    """Someone else's job holds the model's job ID: nothing is registered, scaled or counted
    (its allocations are not this model's starts); the model shows why, critical."""
    m = view.model
    desired = 0 if state.parked else desired_replicas(view, 0)
    actions: tuple[Action, ...] = ()
    if view.state_problem or not same_state(state, view.state or ModelState()):
        actions = (WriteState(m.name, state, view.state_index),)
    health, output = model_health(m.name, state, desired, view.ready, 0)
    return Decision(m.name, desired, view.ready, 0, state, health, output, actions)


def model_health(
    model: str, state: ModelState, desired: int, ready: int, starting: int
) -> tuple[HealthStatus, str]:
    """The status and text of the model's entry in the Consul UI: why, in one line."""
    if state.job_conflict:
        return "critical", state.job_conflict
    if state.parked:
        return "critical", (
            f"parked after {state.consecutive_failures} consecutive start failures: "
            f"{state.last_error or 'no error recorded'}; fix the source or profile, "
            f"or run 'llmgw ctl retry {model}'"
        )
    refused = state.last_action_error
    if refused is not None:
        return "critical", (
            f"Nomad refuses to {refused.action} it (HTTP {refused.status}) since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(refused.since))}: {refused.message}; "
            "fix the job or llmgw's Nomad token; cleared when Nomad next accepts"
        )
    if state.unplaceable:
        return "critical", f"unplaceable: {state.placement_reason}"
    if desired > 0 and ready == 0 and starting == 0:
        return "critical", f"nothing ready: 0 of {desired} replicas"
    if ready >= desired:
        if desired == 0 and ready == 0:
            return "passing", "on demand: no replica running, none asked for"
        return "passing", f"{ready} of {desired} replicas ready"
    note = f", {state.consecutive_failures} start failures in a row" if state.consecutive_failures else ""
    return "warning", f"starting: {ready} of {desired} replicas ready, {starting} starting{note}"
