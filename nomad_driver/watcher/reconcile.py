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

from nomad_driver.fields import as_int
from nomad_driver.placement import FabricRoom, PlacementFailure, job_fabric, latest_placement_failure
from nomad_driver.render import SHARD_GROUP
from nomad_driver.spec import Model
from nomad_driver.state import CountedStart, ModelState
from nomad_driver.watcher.given_up import disabled_slots, gave_up_reason, spent_slots
from nomad_driver.watcher.parking import (
    FailureCount,
    Ledger,
    StartId,
    count_start_failures,
    count_starts,
    starts_of,
)
from nomad_driver.watcher.partial import Degraded, failing_slots
from nomad_driver.watcher.replica_starts import ReplicaStarts, replica_starts, stuck_start
from nomad_driver.watcher.replica_steps import ReplicaStep, replica_step
from nomad_driver.watcher.scaling import (
    DEFAULT_STEP_INTERVAL_S,
    STARTING_HOLD_S,
    Desired,
    ScaleInputs,
    decide,
)

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
    # Load scaling (`scaling.LoadHistory`): in flight averaged over the up window, the highest
    # recommendation of the scale-down delay, and the count that keeps every busy allocation
    # (from the replicas the routers name). None: no history (a hand-built view), which holds
    # the count for a scale-down delay after it was first seen, as a watcher's first sight does.
    in_flight_average: float | None = None
    load_held: int | None = None
    busy_floor: int | None = None
    # Since the job's count last changed, for the step rate limit (inf: not seen changing).
    since_step_s: float = float("inf")
    step_interval_s: float = DEFAULT_STEP_INTERVAL_S
    # The latest ask of any router for this model (Unix time, the router's clock), or None.
    asked_at: float | None = None
    # How late the routers' activity can reach the watcher: their publishing interval.
    activity_grace_s: float = 0.0
    # A multi-node model's fabrics as the pass measured them, without its own allocations (the
    # nodes its replica holds are its room); None until the nodes are read, or for one node.
    fabric_rooms: tuple[FabricRoom, ...] | None = None


@dataclass(frozen=True)
class RegisterJob:
    model: str
    count: int
    fabric: str = ""  # a multi-node model's job is pinned to this fabric
    # The JobModifyIndex of the job the decision saw (0: none): Nomad registers only over that
    # one, so a leader acting on an old view cannot undo a newer registration.
    job_modify_index: int = 0


@dataclass(frozen=True)
class Scale:
    model: str
    job_id: str
    group: str
    count: int
    message: str
    reason: str = ""  # scaling.Reason, for the log line


@dataclass(frozen=True)
class Activate:
    """Answer a router's ask: scale (to the same count too, so Nomad evaluates afresh), read
    the evaluation at once, and record the attempt in the state for the waiting requests."""

    model: str
    job_id: str
    group: str
    count: int
    asked: float
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
    # Who failed, when it was not the engine named by alloc_id/task itself: a multi-node
    # replica's shard (`shard 1a2b3c4d on node ib-a-1`), whose stderr alloc_id/task then name.
    cause: str = ""


@dataclass(frozen=True)
class WriteState:
    model: str
    state: ModelState
    cas: int


@dataclass(frozen=True)
class ForceReschedule:
    """Ask Nomad to replace failed allocations it has given up on (`given_up.py`)."""

    model: str
    job_id: str
    allocs: tuple[str, ...]


Action = RegisterJob | Scale | Activate | Park | WriteState | ForceReschedule
# The actions that call Nomad, whose refusals become the model's `last_action_error`.
NomadAction = (RegisterJob, Scale, Activate, Park, ForceReschedule)


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
    # Why desired is what it is (`scaling.Reason`) and the line people read for it.
    desired_reason: str = "min"
    desired_detail: str = ""
    recommendation: int = 0
    # A partial failure (partial.py), for the watcher to name with the engine's own words.
    degraded: Degraded | None = None


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
        # A multi-node job that is not pinned (registered by `llmgw apply`, or by an llmgw
        # before pinning was sure) could put one replica's shards in two fabrics.
        and (model.profile.nodes <= 1 or bool(job_fabric(job)))
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
    later = tuple((c.started_ns, c.alloc) for c in state.counted_later)
    decided = tuple((c.started_ns, c.alloc) for c in state.counted_decided)
    floor = state.counted_decided_floor
    decided_floor = (floor.started_ns, floor.alloc) if floor is not None else None
    if through is not None and not decided:
        # Stored before starts were named as decided: everything up to `through` was.
        decided_floor = through
    return Ledger(
        state.failures_after_ns,
        through,
        state.counted_failures,
        state.count_job_version,
        later,
        decided,
        decided_floor,
        state.count_job_create_index,
        state.count_def_index,
        state.count_def_after_ns,
    )


def with_ledger(state: ModelState, ledger: Ledger) -> ModelState:
    through_ns, through_alloc = ledger.through or (0, "")
    return state.model_copy(
        update={
            "failures_after_ns": ledger.after_ns,
            "counted_through_alloc": through_alloc,
            "counted_through_ns": through_ns,
            "counted_failures": ledger.counted,
            "count_job_version": ledger.job_version,
            "counted_later": [CountedStart(alloc=alloc, started_ns=ns) for ns, alloc in ledger.later],
            "counted_decided": [CountedStart(alloc=alloc, started_ns=ns) for ns, alloc in ledger.decided],
            "counted_decided_floor": (
                CountedStart(alloc=ledger.decided_floor[1], started_ns=ledger.decided_floor[0])
                if ledger.decided_floor
                else None
            ),
            "count_def_index": ledger.def_index,
            "count_def_after_ns": ledger.def_after_ns,
        }
    )


def cleared(state: ModelState, baseline_ns: int) -> ModelState:
    """Unparked with the count at 0: failures up to `baseline_ns` are forgiven, because a retry
    or a new definition is a fresh start, not the sixth attempt of the old one."""
    state = state.model_copy(
        update={"parked": False, "consecutive_failures": 0, "last_error": "", "parked_def_hash": ""}
    )
    return with_ledger(
        state,
        Ledger(
            after_ns=baseline_ns,
            job_version=state.count_job_version,
            job_created=state.count_job_create_index,
            def_index=state.count_def_index,
            def_after_ns=state.count_def_after_ns,
        ),
    )


def newest_start_ns(view: ModelView, *, created_by: int | None = None) -> int:
    """The newest start Nomad shows; with `created_by`, of allocations created at or before
    that Nomad index only."""
    starts = count_start_failures(
        (a for a in view.allocs if created_by is None or as_int(a.get("CreateIndex")) <= created_by),
        frozenset(),
    )
    return starts.newest_start_ns


def retried(view: ModelView) -> ModelState:
    """The state `llmgw ctl retry` writes."""
    state = view.state or ModelState()
    # Every start Nomad shows or the ledger names, including those Nomad has forgotten since.
    named = [state.failures_after_ns, state.counted_through_ns, *(c.started_ns for c in state.counted_later)]
    newest = max(newest_start_ns(view), *named)
    return cleared(state, newest).model_copy(update={"retried_through_ns": newest})


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
        if held == m.def_hash and (view.state is None or job_def_hash(view.job) != m.def_hash):
            # Nothing counted yet, or no job in Nomad runs it yet: its count begins with the
            # job that runs it, as for a definition that changed.
            state = state.model_copy(update={"count_job_version": -1})
    if state.count_def_hash != m.def_hash:
        # The old definition's starts never count (their job versions are older); the new
        # one's count from the version that brought it, even those that failed before any
        # watcher saw the change (`llmgw apply` registers the job itself).
        state = cleared(state, state.failures_after_ns)
        state = state.model_copy(update={"count_def_hash": m.def_hash, "count_job_version": -1})
    if state.count_job_version < 0 and job_def_hash(view.job) == m.def_hash:
        sighting = _definition_sighting(view)
        if view.state is None:
            # Nothing stored: no watcher has counted this model, and the job's allocations of
            # this version on all count (the definition did not change under them).
            sighting.update(count_def_index=0, count_def_after_ns=0)
        state = state.model_copy(update={"count_job_version": job_version(view.job), **sighting})
    elif job_def_hash(view.job) == m.def_hash and job_recreated(view.job, state):
        # Purged and registered again (`nomad job stop -purge`, Nomad's job GC, a rebuilt
        # cluster): the new job's versions start over at 0, and every one of them counts. Kept
        # at the old version, the ledger would drop each new start, and a crash-looping model
        # would never park.
        # The purged job's allocations ran the same definition: counted as before (the ledger
        # names what it counted), and the new job's are created later than any of them.
        state = state.model_copy(
            update={"count_job_version": 0, "count_job_create_index": job_create_index(view.job)}
        )
    elif not state.count_job_create_index and job_create_index(view.job):
        state = state.model_copy(update={"count_job_create_index": job_create_index(view.job)})
    return state


def _definition_sighting(view: ModelView) -> dict[str, int]:
    """Where the definition's count begins in the job the watcher sees first with it: the
    allocations Nomad created for it count from their first start; those created before (the
    old definition's, updated in place) from their next."""
    index = as_int(view.job.get("JobModifyIndex")) if isinstance(view.job, Mapping) else 0
    return {
        "count_job_create_index": job_create_index(view.job),
        "count_def_index": index,
        # Without Nomad's index (a view built by hand) nothing tells the two apart: what Nomad
        # shows now is forgiven.
        "count_def_after_ns": newest_start_ns(view, created_by=index or None),
    }


def _modify_index(job: Mapping[str, Any] | None) -> int:
    return as_int(job.get("JobModifyIndex")) if isinstance(job, Mapping) else 0


def job_create_index(job: Mapping[str, Any] | None) -> int:
    return as_int(job.get("CreateIndex")) if isinstance(job, Mapping) else 0


def job_recreated(job: Mapping[str, Any] | None, state: ModelState) -> bool:
    """The job is not the one the count's version was taken from: another CreateIndex, or, where
    the state predates knowing it, a version below the one recorded (Nomad never lowers one)."""
    created = job_create_index(job)
    if state.count_job_create_index and created:
        return created != state.count_job_create_index
    return job_version(job) < state.count_job_version


def same_state(a: ModelState, b: ModelState) -> bool:
    """Equal but for when it was written: an unchanged state is not written again."""
    return a.model_dump(exclude={"updated_at"}) == b.model_dump(exclude={"updated_at"})


def asked_for(view: ModelView) -> bool:
    """A request in flight, or one that ended within idle_timeout (plus the routers' publishing
    interval, for a request that began after their last write)."""
    m = view.model
    return view.in_flight > 0 or (
        view.activity is not None and view.now - view.activity < m.idle_timeout_s + view.activity_grace_s
    )


def desired_for(view: ModelView, count: int, starting: int = 0, parked: bool = False) -> Desired:
    """What the model should have now, and why (`scaling.decide` over this view)."""
    m = view.model
    # With no load history (a hand-built view), a count the watcher has just seen is held for
    # the scale-down delay, as a watcher's first sight of it is (`LoadHistory`).
    held = view.load_held
    if held is None:
        fresh = view.scaled_at is not None and view.now - view.scaled_at < m.scale_down_delay_s
        held = count if fresh else 0
    busy = view.busy_floor
    if busy is None:
        busy = max(view.busy_replicas, -(-view.in_flight // max(1, m.target_in_flight)))
    return decide(
        ScaleInputs(
            replicas_min=m.replicas_min,
            replicas_max=m.replicas_max,
            target_in_flight=m.target_in_flight,
            scale_down_delay_s=m.scale_down_delay_s,
            count=count,
            in_flight=view.in_flight,
            average=float(view.in_flight if view.in_flight_average is None else view.in_flight_average),
            held=held,
            # Not "just scaled": the watcher itself raised the count, for an ask whose request
            # is in flight while it waits, and a placed one writes its activity at once; a
            # refused one must not hold the count up for a client that was told no.
            asked=asked_for(view),
            busy_floor=busy,
            starting=starting,
            parked=parked,
            since_step_s=view.since_step_s,
            step_interval_s=view.step_interval_s,
        )
    )


def desired_replicas(view: ModelView, count: int) -> int:
    """The count alone (see `desired_for`)."""
    return desired_for(view, count).count


def replica_view(view: ModelView) -> ModelView:
    """A multi-node model's view with its leaders' allocations only: a replica is one leader,
    so `starting` counts replicas, not processes (its starts are counted by `replica_starts`)."""
    if view.model.profile.nodes <= 1:
        return view
    leaders = tuple(a for a in view.allocs if a.get("TaskGroup") != SHARD_GROUP)
    return dataclasses.replace(view, allocs=leaders)


def _count(view: ModelView, replica: ReplicaStarts | None, ledger: Ledger, *, remember: int) -> FailureCount:
    if replica is None:
        return count_start_failures(view.allocs, view.healthy_starts, ledger, remember=remember)
    return count_starts(replica.starts, view.healthy_starts, ledger, remember=remember)


def reconcile(view: ModelView, max_start_failures: int = DEFAULT_MAX_START_FAILURES) -> Decision:
    multinode = view.model.profile.nodes > 1
    replica = replica_starts(view.allocs) if multinode else None
    all_allocs = view.allocs
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

    failures = _count(view, replica, ledger_of(state), remember=2 * max_start_failures)
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

    live = sum(
        1 for a in view.allocs if a.get("DesiredStatus") == "run" and a.get("ClientStatus") in _LIVE_CLIENT
    )
    starting = max(0, live - view.ready)
    wanted = desired_for(view, count, min(starting, _recently_started(view)), parked=state.parked)
    desired = wanted.count
    why = _scale_message(m, state, count, desired, wanted)
    step: ReplicaStep | None = None
    current = view.job is not None and job_is_current(view.job, m)
    if multinode:
        step = _replica_step(view, all_allocs, replica, state, desired, current, why)
        state = state.model_copy(
            update={"fabrics_tried": list(step.fabrics_tried), "replica_restarted": step.replica_restarted}
        )
        if step.register_fabric:
            actions.append(
                RegisterJob(m.name, step.register_count, step.register_fabric, _modify_index(view.job))
            )
        elif step.scale_to is not None and not park_now:
            actions.append(Scale(m.name, m.job_id, group, step.scale_to, step.scale_message))
    elif not current:
        actions.append(RegisterJob(m.name, desired, job_modify_index=_modify_index(view.job)))
    elif count != desired and not park_now and view.job is not None and not view.job.get("Stop"):
        actions.append(Scale(m.name, m.job_id, group, desired, why, wanted.reason))

    ask = _unanswered_ask(view, state)
    if ask is not None and current and not park_now and view.job is not None and not view.job.get("Stop"):
        # The router's 0 -> 1 goes through the same rule: the count is what the rule says,
        # at least 1, and the call is made even at the same count, for a fresh evaluation.
        target = min(max(desired, 1), m.replicas_max)
        message = f"llmgw: a request for {m.name} found no ready replica; asking for {target}"
        actions = [a for a in actions if not isinstance(a, Scale)]
        actions.append(Activate(m.name, m.job_id, group, target, ask, message))

    # Placement: only while something is meant to run and the job is the current definition.
    failure = None
    if not state.parked and max(count, desired) > 0:
        failure = _latest_failure(view)
    if step is not None and step.no_fabric and desired > 0 and not state.parked:
        # No fabric has room: that is the reason, whatever Nomad said of the fabric it was
        # pinned to before.
        failure = PlacementFailure(eval_id="", reason=step.no_fabric)
    # Short, not unplaceable: Nomad cannot place more, but the minimum runs and serves, so
    # requests must not be refused for it; the scale-up stays asked and Nomad's blocked
    # evaluation places it when room frees.
    short = failure is not None and count > max(m.replicas_min, 1) and live >= max(m.replicas_min, 1)
    state = state.model_copy(
        update={
            "unplaceable": failure is not None and not short,
            "placement_reason": failure.reason if failure and not short else "",
            "placement_eval": failure.eval_id if failure else "",
            "short": short,
            "short_reason": failure.reason if failure and short else "",
        }
    )

    # Nomad's budgets ran out before the count reached the threshold: ask again, never leave it
    # silently down (given_up.py). Beside a serving replica, only after an operator's retry
    # (partial.py): the slot's failures are then a bad node's, and Nomad's budgets bound them.
    spent: tuple[str, ...] = ()
    if not state.parked and not park_now and not multinode and current and desired > 0:
        spent = spent_slots(view.job, view.allocs)
    slots = []
    if failures.serving and not state.parked:
        starts = replica.starts if replica is not None else [s for a in view.allocs for s in starts_of(a)]
        slots = failing_slots(view.allocs, starts, view.healthy_starts, state.count_job_version)
    forced = spent
    if failures.serving:
        forced = tuple(a for a in spent if _newest_start_of(view, a) <= state.retried_through_ns)
    degraded = Degraded(tuple(slots), tuple(a for a in spent if a not in forced)) if slots else None
    disabled: tuple[str, ...] = ()
    if (
        not state.parked
        and not park_now
        and not multinode
        and current
        and desired > 0
        and not failures.serving
    ):
        disabled = disabled_slots(view.job, view.allocs)
    state = state.model_copy(
        update={
            "nomad_gave_up": gave_up_reason(forced, disabled),
            "degraded": degraded.text(m.name) if degraded else "",
        }
    )
    if forced:
        actions.append(ForceReschedule(m.name, m.job_id, forced))

    if park_now and view.job is not None:
        # Park writes the state itself, after reading the engine's stderr for the real error.
        last = failures.last_failed
        shard = replica.causes.get(last.ident) if replica is not None and last is not None else None
        actions.insert(
            0,
            Park(
                m.name,
                m.job_id,
                group,
                failures.consecutive,
                shard.alloc_id if shard else last.alloc_id if last else "",
                shard.task if shard else last.task if last else "",
                shard.error if shard else last.error if last else "",
                state,
                view.state_index,
                cause=shard.shard if shard else "",
            ),
        )
    elif view.state_problem or not same_state(state, stored):
        actions.append(WriteState(m.name, state, view.state_index))

    health, output = model_health(m.name, state, desired, view.ready, starting, wanted.detail)
    return Decision(
        m.name,
        desired,
        view.ready,
        starting,
        state,
        health,
        output,
        tuple(actions),
        desired_reason=wanted.reason,
        desired_detail=wanted.detail,
        recommendation=wanted.recommendation,
        degraded=degraded,
    )


def _recently_started(view: ModelView) -> int:
    """Live allocations not passing their check that may still turn ready: placed within
    STARTING_HOLD_S, and not restarting after a failed start (a crash loop never turns ready,
    and must not hold the count up). Nomad's clock against the watcher's, so only for a quarter
    of an hour's bound (NTP keeps them within a second)."""
    since_ns = (view.now - STARTING_HOLD_S) * 1e9
    passing = {alloc for _, alloc in view.healthy_starts}
    fresh = 0
    for a in view.allocs:
        if a.get("DesiredStatus") != "run" or a.get("ClientStatus") not in _LIVE_CLIENT:
            continue
        if str(a.get("ID") or "") in passing:
            continue
        starts = starts_of(a)
        ended = [s for s in starts if s.ended]
        if ended and ended[-1].failed:
            continue
        placed = as_int(a.get("CreateTime")) or min((s.time_ns for s in starts), default=0)
        if placed == 0 or placed >= since_ns:
            fresh += 1  # no time known (a view built by hand) counts as fresh
    return fresh


def _newest_start_of(view: ModelView, alloc_id: str) -> int:
    allocs = [a for a in view.allocs if a.get("ID") == alloc_id]
    return count_start_failures(allocs, frozenset()).newest_start_ns


def _scale_message(m: Model, state: ModelState, count: int, desired: int, wanted: Desired) -> str:
    """The scaling event's message in Nomad: the reason, so `nomad job scaling-events` says why."""
    if state.parked:
        return f"llmgw: {m.name} is parked; not placing it again until its definition changes or a retry"
    if wanted.reason == "idle":
        if state.attempt is not None and state.attempt.result == "unplaceable":
            # Nomad's blocked evaluation would start it later for a client that was told no.
            return f"llmgw: undo the activation of {m.name}: Nomad could not place it"
        return f"llmgw: {m.name} idle for {int(m.idle_timeout_s)}s, scaling down to {desired}"
    return f"llmgw: {m.name} should have {desired} replicas ({wanted.detail})"


def _unanswered_ask(view: ModelView, state: ModelState) -> float | None:
    """The routers' latest ask when the leader has not answered it yet (parked models are
    answered by their state: routers refuse them as parked)."""
    if view.asked_at is None or state.parked:
        return None
    if state.attempt is not None and state.attempt.asked >= view.asked_at:
        return None
    return view.asked_at


def _latest_failure(view: ModelView) -> PlacementFailure | None:
    """Nomad's newest failed placement of the current definition's job, whatever its count."""
    if view.job is None or job_def_hash(view.job) != view.model.def_hash:
        return None
    return latest_placement_failure(view.evals, dict(view.job))


def _replica_step(
    view: ModelView,
    allocs: tuple[Mapping[str, Any], ...],
    replica: ReplicaStarts | None,
    state: ModelState,
    desired: int,
    current: bool,
    why: str,
) -> ReplicaStep:
    stuck = stuck_start(allocs, replica) if replica is not None else None
    # A start already forgiven (healthy once, or before a retry) restarts nothing.
    if stuck is not None and stuck[0][0] <= state.failures_after_ns:
        stuck = None
    return replica_step(
        view.model,
        view.job,
        current=current,
        rooms=view.fabric_rooms,
        latest_failure=_latest_failure(view),
        desired=desired,
        ready=view.ready,
        state=state,
        stuck=stuck,
        scale_why=why,
    )


def _conflicted(view: ModelView, state: ModelState) -> Decision:
    """Someone else's job holds the model's job ID: nothing is registered, scaled or counted
    (its allocations are not this model's starts); the model shows why, critical."""
    m = view.model
    wanted = desired_for(view, 0, parked=state.parked)
    actions: tuple[Action, ...] = ()
    if view.state_problem or not same_state(state, view.state or ModelState()):
        actions = (WriteState(m.name, state, view.state_index),)
    health, output = model_health(m.name, state, wanted.count, view.ready, 0)
    return Decision(
        m.name,
        wanted.count,
        view.ready,
        0,
        state,
        health,
        output,
        actions,
        desired_reason=wanted.reason,
        desired_detail=wanted.detail,
    )


def model_health(
    model: str, state: ModelState, desired: int, ready: int, starting: int, why: str = ""
) -> tuple[HealthStatus, str]:
    """The status and text of the model's entry in the Consul UI: why, in one line; `why` is
    why it should have `desired` (`load: 37 in flight / 8 per replica`)."""
    status, text = _health(model, state, desired, ready, starting)
    return status, f"{text} ({why})" if why and not state.parked and not state.job_conflict else text


def utc_text(seconds: float) -> str:
    """A stored Unix time for people; a value no calendar holds (a hand-edited 1e300) reads as
    such, rather than failing the pass that shows it."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return f"an unreadable time ({seconds!r})"


def _health(
    model: str, state: ModelState, desired: int, ready: int, starting: int
) -> tuple[HealthStatus, str]:
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
            f"{utc_text(refused.since)}: {refused.message}; "
            "fix the job or llmgw's Nomad token; cleared when Nomad next accepts"
        )
    if state.unplaceable:
        return "critical", f"unplaceable: {state.placement_reason}"
    if state.nomad_gave_up:
        return "critical", state.nomad_gave_up
    if state.degraded:
        # Replicas serve: a warning, not an outage (partial.py).
        return "warning", f"degraded: {ready} of {desired} replicas ready; {state.degraded}"
    if state.short:
        # The minimum serves: a warning, not an outage.
        return (
            "warning",
            f"short: {ready} of {desired} replicas ready, Nomad cannot place more: {state.short_reason}",
        )
    if desired > 0 and ready == 0 and starting == 0:
        return "critical", f"nothing ready: 0 of {desired} replicas"
    if ready >= desired:
        if desired == 0 and ready == 0:
            return "passing", "on demand: no replica running, none asked for"
        return "passing", f"{ready} of {desired} replicas ready"
    note = f", {state.consecutive_failures} start failures in a row" if state.consecutive_failures else ""
    return "warning", f"starting: {ready} of {desired} replicas ready, {starting} starting{note}"
