"""What one model should have now, against what it has: a pure function of a snapshot.

`reconcile` reads only what it is given and returns the next steps; the watcher applies them.
Running it twice on the same snapshot asks for the same steps, and a step the watcher missed
is asked for again on the next pass, so a lost event or a failed call heals itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nomad_driver.fields import as_int
from nomad_driver.placement import PlacementFailure, latest_placement_failure
from nomad_driver.spec import Model
from nomad_driver.state import ModelState
from nomad_driver.watcher.counting import (
    counted_definition,
    failure_count,
    ledger_of,
    replica_view,
    with_ledger,
)
from nomad_driver.watcher.decisions import (
    Action,
    Activate,
    Decision,
    ForceReschedule,
    ModelView,
    Park,
    RegisterJob,
    Scale,
    WriteState,
)
from nomad_driver.watcher.desired import desired_for
from nomad_driver.watcher.given_up import disabled_slots, gave_up_reason, spent_slots
from nomad_driver.watcher.health_text import model_health
from nomad_driver.watcher.job_facts import (
    job_conflict,
    job_def_hash,
    job_group,
    job_is_current,
    job_modify_index,
)
from nomad_driver.watcher.parking import (
    count_start_failures,
    starts_of,
)
from nomad_driver.watcher.partial import Degraded, failing_slots
from nomad_driver.watcher.replica_starts import ReplicaStarts, replica_starts, stuck_start
from nomad_driver.watcher.replica_steps import ReplicaStep, replica_step
from nomad_driver.watcher.rollout import previous_steps
from nomad_driver.watcher.scaling import (
    STARTING_HOLD_S,
    Desired,
)

DEFAULT_MAX_START_FAILURES = 5

# Allocations that hold or will hold a replica; everything else is history.
_LIVE_CLIENT = {"pending", "running"}


def same_state(a: ModelState, b: ModelState) -> bool:
    """Equal but for when it was written: an unchanged state is not written again."""
    return a.model_dump(exclude={"updated_at"}) == b.model_dump(exclude={"updated_at"})


def reconcile(view: ModelView, max_start_failures: int = DEFAULT_MAX_START_FAILURES) -> Decision:
    multinode = view.model.profile.nodes > 1
    replica = replica_starts(view.allocs) if multinode else None
    all_allocs = view.allocs
    view = replica_view(view)
    m = view.model
    jid = view.job_id or m.job_id
    second_id = "" if jid == m.job_id else jid  # RegisterJob names only the second job ID
    stored = view.state or ModelState()
    state = stored
    actions: list[Action] = []
    group, count = job_group(view.job)

    conflict = job_conflict(view.job, m)
    if conflict:
        return _conflicted(view, state.model_copy(update={"job_conflict": conflict}))
    state = counted_definition(view, state.model_copy(update={"job_conflict": ""}))

    failures = failure_count(view, replica, ledger_of(state), remember=2 * max_start_failures)
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
                RegisterJob(
                    m.name,
                    step.register_count,
                    step.register_fabric,
                    job_modify_index(view.job),
                    job_id=second_id,
                )
            )
        elif step.scale_to is not None and not park_now:
            actions.append(Scale(m.name, jid, group, step.scale_to, step.scale_message))
    elif not current:
        actions.append(
            RegisterJob(m.name, desired, job_modify_index=job_modify_index(view.job), job_id=second_id)
        )
    elif count != desired and not park_now and view.job is not None and not view.job.get("Stop"):
        actions.append(Scale(m.name, jid, group, desired, why, wanted.reason))

    ask = _unanswered_ask(view, state)
    if ask is not None and current and not park_now and view.job is not None and not view.job.get("Stop"):
        # The router's 0 -> 1 goes through the same rule: the count is what the rule says,
        # at least 1, and the call is made even at the same count, for a fresh evaluation.
        target = min(max(desired, 1), m.replicas_max)
        message = f"llmgw: a request for {m.name} found no ready replica; asking for {target}"
        actions = [a for a in actions if not isinstance(a, Scale)]
        actions.append(Activate(m.name, jid, group, target, ask, message))

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
        actions.append(ForceReschedule(m.name, jid, forced))
    previous = view.previous
    state = state.model_copy(update={"rollout_from": previous.job_id if previous is not None else ""})
    if previous is not None:
        actions.extend(previous_steps(m, previous, state, view.ready, desired))

    if park_now and view.job is not None:
        # Park writes the state itself, after reading the engine's stderr for the real error.
        last = failures.last_failed
        shard = replica.causes.get(last.ident) if replica is not None and last is not None else None
        actions.insert(
            0,
            Park(
                m.name,
                jid,
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
    """The routers' latest ask time while the latest attempt does not answer every router's
    ask, by the rule the router itself waits by (parked models are answered by their state:
    routers refuse them as parked)."""
    if not view.asks or state.parked:
        return None
    attempt = state.attempt
    if attempt is not None and all(attempt.answers(ask) for ask in view.asks):
        return None
    return max(ask.at for ask in view.asks)


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
    health, output = model_health(m.name, state, wanted.count, view.ready, 0, wanted.detail)
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
