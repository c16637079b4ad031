"""reconcile() on hand-built snapshots: what a model should have now and the next step."""

from __future__ import annotations

import dataclasses
from typing import Any

from nomad_driver.spec import parse_models
from nomad_driver.state import Ask, Attempt, ModelState
from nomad_driver.watcher.counting import retried
from nomad_driver.watcher.decisions import Activate, ModelView, Park, RegisterJob, Scale, WriteState
from nomad_driver.watcher.reconcile import reconcile
from tests.watcher_support import BARE_CPU_PROFILE

MODELS = (
    BARE_CPU_PROFILE
    + """
models:
  kev:
    source: file:///tmp/kev.gguf
    profile: cpu
    replicas: {min: 1, max: 3}
    idle_timeout: 10m
  lazy:
    source: file:///tmp/lazy.gguf
    profile: cpu
    replicas: {min: 0, max: 2}
    idle_timeout: 10m
"""
)
SET = parse_models(MODELS, "test")
KEV = SET.models["kev"]
LAZY = SET.models["lazy"]
NOW = 1_000_000.0


def job(
    model: Any, count: int, def_hash: str | None = None, scaling_max: int | None = None
) -> dict[str, Any]:
    scaling = {"Min": 0, "Max": model.replicas_max if scaling_max is None else scaling_max}
    return {
        "ID": model.job_id,
        "Meta": {"llmgw_model": model.name, "llmgw_def_hash": def_hash or model.def_hash},
        "TaskGroups": [{"Name": "engine", "Count": count, "Scaling": scaling, "Tasks": []}],
    }


def crashed(aid: str, t: int) -> dict[str, Any]:
    events = [
        {"Type": "Started", "Time": t},
        {"Type": "Terminated", "Time": t + 1, "DisplayMessage": "Exit Code: 1"},
    ]
    return {
        "ID": aid,
        "ClientStatus": "failed",
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"Events": events}},
    }


def running(aid: str, t: int) -> dict[str, Any]:
    events = [{"Type": "Started", "Time": t}]
    return {
        "ID": aid,
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"Events": events}},
    }


def view(model: Any = KEV, **kw: Any) -> ModelView:
    kw.setdefault("job", job(model, model.replicas_min))
    kw.setdefault("now", NOW)
    return ModelView(model=model, **kw)


def test_missing_job_is_registered_at_its_minimum() -> None:
    d = reconcile(view(job=None))
    assert RegisterJob("kev", 1) in d.actions
    assert d.desired == 1


def test_a_changed_definition_is_registered_again() -> None:
    d = reconcile(view(job=job(KEV, 1, def_hash="old")))
    assert RegisterJob("kev", 1) in d.actions


def test_a_raised_replica_maximum_is_registered_again_without_unparking() -> None:
    # Nomad refuses to scale past the job's scaling maximum, so the job must carry the new one.
    d = reconcile(view(job=job(KEV, 1, scaling_max=1), allocs=(running("a", 5),), ready=1))
    assert RegisterJob("kev", 1) in d.actions
    parked = ModelState(parked=True, parked_def_hash=KEV.def_hash, consecutive_failures=5)
    d = reconcile(view(job=job(KEV, 0, scaling_max=1), state=parked))
    assert RegisterJob("kev", 0) in d.actions
    assert d.state.parked


def test_satisfied_model_needs_nothing_and_reads_passing() -> None:
    v = view(allocs=(running("a", 5),), ready=1, healthy_starts=frozenset({(5, "a")}))
    # The healthy start is written down once, as the count's baseline; then nothing is needed.
    first = reconcile(v)
    assert [type(a) for a in first.actions] == [WriteState]
    assert first.state.failures_after_ns == 5
    d = reconcile(dataclasses.replace(v, state=first.state, state_index=3))
    assert d.actions == ()
    assert (d.health, d.ready, d.starting) == ("passing", 1, 0)


def test_four_failures_count_but_do_not_park() -> None:
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(4))
    d = reconcile(view(allocs=allocs))
    assert not d.state.parked
    assert d.state.consecutive_failures == 4
    assert d.state.last_error == "Exit Code: 1"
    assert any(isinstance(a, WriteState) for a in d.actions)
    assert d.health == "critical"  # nothing ready, nothing starting


def test_the_fifth_failure_parks_and_scales_to_zero() -> None:
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(5))
    d = reconcile(view(allocs=allocs, state_index=7))
    park = [a for a in d.actions if isinstance(a, Park)]
    assert len(park) == 1
    assert (park[0].failures, park[0].alloc_id, park[0].cas) == (5, "a4", 7)
    assert park[0].state.parked and park[0].state.parked_def_hash == KEV.def_hash
    assert d.desired == 0
    assert not any(isinstance(a, Scale | WriteState) for a in d.actions)
    assert d.health == "critical" and "llmgw ctl retry kev" in d.health_output


def test_max_start_failures_is_configurable() -> None:
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(3))
    assert any(isinstance(a, Park) for a in reconcile(view(allocs=allocs), max_start_failures=3).actions)


def parked_state(def_hash: str = KEV.def_hash) -> ModelState:
    return ModelState(
        parked=True,
        consecutive_failures=5,
        last_error="boom",
        parked_def_hash=def_hash,
        count_def_hash=def_hash,
        counted_failures=5,
    )


def test_a_parked_model_stays_at_zero_even_if_scaled_up() -> None:
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(5))
    d = reconcile(view(job=job(KEV, 1), allocs=allocs, state=parked_state(), state_index=3))
    assert d.desired == 0
    scale = [a for a in d.actions if isinstance(a, Scale)]
    assert scale and scale[0].count == 0
    assert not any(isinstance(a, Park | WriteState) for a in d.actions)


def test_a_new_definition_unparks_and_forgives_old_failures() -> None:
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(5))
    d = reconcile(view(job=job(KEV, 0), allocs=allocs, state=parked_state("old-hash"), state_index=3))
    assert not d.state.parked
    assert d.state.consecutive_failures == 0
    assert d.desired == 1
    assert any(isinstance(a, WriteState) and a.cas == 3 for a in d.actions)
    # The job itself is at the new definition already, so it is scaled back up.
    assert Scale in {type(a) for a in d.actions}


def test_retry_clears_the_count_and_the_next_pass_restores_replicas() -> None:
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(5))
    v = view(job=job(KEV, 0), allocs=allocs, state=parked_state())
    state = retried(v)
    assert not state.parked and state.consecutive_failures == 0
    d = reconcile(view(job=job(KEV, 0), allocs=allocs, state=state))
    assert d.desired == 1 and not d.state.parked
    assert any(isinstance(a, Scale) and a.count == 1 for a in d.actions)
    # One more failure after the retry is one, not six.
    d2 = reconcile(view(job=job(KEV, 1), allocs=(*allocs, crashed("b", 200)), state=state))
    assert d2.state.consecutive_failures == 1 and not d2.state.parked


def test_recent_activity_keeps_an_on_demand_model_at_one_and_idle_scales_it_down() -> None:
    d = reconcile(view(LAZY, job=job(LAZY, 1), activity=NOW - 60))
    assert d.desired == 1 and not any(isinstance(a, Scale) for a in d.actions)
    idle = reconcile(view(LAZY, job=job(LAZY, 1), activity=NOW - 601, scaled_at=NOW - 700))
    assert idle.desired == 0
    assert [a.count for a in idle.actions if isinstance(a, Scale)] == [0]


def test_a_count_just_seen_is_held_for_the_scale_down_delay_then_follows_the_load() -> None:
    # The watcher is the one writer of the count: a count it has just seen change (its own
    # scale-up, or its first look after a start) is held for scale_down_delay, then the load
    # (none here) takes it to the minimum.
    fresh = reconcile(view(KEV, job=job(KEV, 3), activity=NOW - 5, scaled_at=NOW - 1))
    assert (fresh.desired, fresh.desired_reason) == (3, "held")
    assert not any(isinstance(a, Scale) for a in fresh.actions)
    later = reconcile(view(KEV, job=job(KEV, 2), activity=None, scaled_at=NOW - 900))
    assert (later.desired, later.desired_reason) == (1, "min")


def test_load_raises_the_count_and_the_health_check_says_why() -> None:
    d = reconcile(view(KEV, job=job(KEV, 1), in_flight=3, in_flight_average=3.0, busy_floor=1))
    assert (d.desired, d.desired_reason) == (3, "load")
    assert [a.count for a in d.actions if isinstance(a, Scale)] == [3]
    assert d.desired_detail == "load: 3 in flight / 1 per replica"
    assert "(load: 3 in flight / 1 per replica)" in d.health_output


def _blocked() -> dict[str, Any]:
    metric = {"NodesEvaluated": 2, "NodesFiltered": 2, "ConstraintFiltered": {"missing devices": 2}}
    return {"ID": "ev1", "CreateIndex": 5, "Status": "blocked", "FailedTGAllocs": {"engine": metric}}


def test_a_blocked_evaluation_makes_the_model_unplaceable_and_critical() -> None:
    d = reconcile(view(evals=(_blocked(),)))
    assert d.state.unplaceable and d.state.placement_eval == "ev1"
    assert "2 nodes filtered (missing devices)" in d.state.placement_reason
    assert d.health == "critical" and d.health_output.startswith("unplaceable: ")


def test_placed_clears_unplaceable() -> None:
    placed = {"ID": "ev2", "CreateIndex": 9, "Status": "complete", "FailedTGAllocs": None}
    prior = ModelState(unplaceable=True, placement_reason="x", placement_eval="ev1")
    d = reconcile(view(evals=(_blocked(), placed), state=prior, allocs=(running("a", 1),)))
    assert not d.state.unplaceable
    assert d.health == "warning"  # placed, still starting
    assert any(isinstance(a, WriteState) for a in d.actions)


def test_on_demand_model_at_zero_is_not_unplaceable_from_an_old_eval() -> None:
    d = reconcile(view(LAZY, job=job(LAZY, 0), evals=(_blocked(),)))
    assert not d.state.unplaceable and d.health == "passing"


def test_malformed_state_is_replaced() -> None:
    d = reconcile(view(state=None, state_index=12, state_problem="not JSON"))
    writes = [a for a in d.actions if isinstance(a, WriteState)]
    assert writes and writes[0].cas == 12


def test_reconcile_twice_asks_for_the_same_steps() -> None:
    v = view(allocs=tuple(crashed(f"a{i}", 10 + i * 10) for i in range(2)))
    assert reconcile(v).actions == reconcile(v).actions


def test_a_job_llmgw_did_not_render_for_the_model_is_left_alone_and_shown() -> None:
    """Someone else's `llmgw-kev` (no llmgw_model in its meta, or another model's): never
    registered over, scaled or counted, and the model says why."""
    theirs = job(KEV, 1, def_hash="x")
    theirs["Meta"] = {"owner": "team-b"}
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(6))
    d = reconcile(view(job=theirs, allocs=allocs, state_index=4))
    assert [type(a) for a in d.actions] == [WriteState]
    assert "Nomad job llmgw-kev was not registered by llmgw for model kev" in d.state.job_conflict
    assert "its meta has no llmgw_model" in d.state.job_conflict
    assert d.state.consecutive_failures == 0 and not d.state.parked
    assert d.health == "critical" and d.health_output == d.state.job_conflict
    other = job(KEV, 1)
    other["Meta"]["llmgw_model"] = "lazy"
    d = reconcile(view(job=other, allocs=allocs))
    assert "its meta names model 'lazy'" in d.state.job_conflict
    assert not any(isinstance(a, RegisterJob | Scale | Park) for a in d.actions)
    # Once that job is gone, the model is llmgw's again: registered, the condition cleared.
    d = reconcile(view(job=None, state=d.state))
    assert RegisterJob("kev", 1) in d.actions and d.state.job_conflict == ""


def test_a_new_definition_starts_its_own_count_even_unparked() -> None:
    """Four failures, the source is fixed, one more failure of the old job: not five."""
    old = dataclasses.replace(KEV, def_hash="old")
    allocs = tuple(dict(crashed(f"a{i}", 10 + i * 10), JobVersion=0) for i in range(4))
    d = reconcile(view(old, job=dict(job(old, 1), Version=0), allocs=allocs))
    assert d.state.consecutive_failures == 4 and d.state.count_def_hash == "old"
    # The new definition is not in Nomad yet: the old job's next failure does not count.
    more = (*allocs, dict(crashed("a4", 50), JobVersion=0))
    d = reconcile(view(job=dict(job(old, 1), Version=0), allocs=more, state=d.state))
    assert d.state.consecutive_failures == 0 and d.state.count_def_hash == KEV.def_hash
    assert d.state.count_job_version == -1
    assert RegisterJob("kev", 1) in d.actions
    # Registered as version 3; a late failure of an old allocation still does not count, the
    # new definition's own failures do (Nomad created b0 for it: a later Raft index).
    new_job = dict(job(KEV, 1), Version=3, JobModifyIndex=100)
    later = (
        *more,
        dict(crashed("a5", 60), JobVersion=1, CreateIndex=40),
        dict(crashed("b0", 70), JobVersion=3, CreateIndex=101),
    )
    d = reconcile(view(job=new_job, allocs=later, state=d.state))
    assert d.state.count_job_version == 3
    assert d.state.consecutive_failures == 1 and not d.state.parked


def test_a_new_definition_that_failed_before_any_watcher_saw_it_keeps_those_failures() -> None:
    """`llmgw apply` registers the job itself: with no leader running, the new definition can
    fail four times before a watcher first sees it. Those four are its own, not forgiven."""
    old = dataclasses.replace(KEV, def_hash="old")
    d = reconcile(view(old, job=dict(job(old, 1), Version=2, JobModifyIndex=50)))
    assert d.state.count_def_hash == "old"
    # The old definition's allocation, replaced; then four of the new one's, all failed.
    allocs = (
        dict(crashed("a0", 10), JobVersion=2, CreateIndex=51),
        *(dict(crashed(f"b{i}", 100 + 10 * i), JobVersion=3, CreateIndex=201 + i) for i in range(4)),
    )
    new_job = dict(job(KEV, 1), Version=3, JobModifyIndex=200)
    d = reconcile(view(job=new_job, allocs=allocs, state=d.state))
    assert d.state.count_job_version == 3
    assert d.state.consecutive_failures == 4 and not d.state.parked
    # The fifth parks it.
    more = (*allocs, dict(crashed("b4", 150), JobVersion=3, CreateIndex=205))
    d = reconcile(view(job=new_job, allocs=more, state=d.state, state_index=3))
    assert next(a for a in d.actions if isinstance(a, Park)).failures == 5


def test_an_allocation_updated_in_place_counts_for_the_new_definition_from_its_next_start() -> None:
    """A definition change Nomad applies in place (only a service's meta changed) keeps the
    allocation: its failures before the change were the old definition's."""
    old = dataclasses.replace(KEV, def_hash="old")
    looping = {
        "ID": "a0",
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "JobVersion": 2,
        "CreateIndex": 40,
        "TaskStates": {
            "engine": {
                "Events": [
                    *crashed("x", 10)["TaskStates"]["engine"]["Events"],
                    {"Type": "Started", "Time": 20},
                ]
            }
        },
    }
    d = reconcile(view(old, job=dict(job(old, 1), Version=2, JobModifyIndex=40), allocs=(looping,)))
    assert d.state.consecutive_failures == 1
    moved = dict(looping, JobVersion=3)  # updated in place into the new version
    d = reconcile(view(job=dict(job(KEV, 1), Version=3, JobModifyIndex=60), allocs=(moved,), state=d.state))
    assert d.state.consecutive_failures == 0 and d.state.count_def_after_ns == 20
    events = moved["TaskStates"]["engine"]["Events"]
    died = dict(moved, TaskStates={"engine": {"Events": [*events, {"Type": "Terminated", "Time": 30}]}})
    d = reconcile(view(job=dict(job(KEV, 1), Version=3, JobModifyIndex=60), allocs=(died,), state=d.state))
    # Its start at 20 began before the watcher saw the new definition: not counted as its.
    assert d.state.consecutive_failures == 0


def test_the_count_survives_nomad_forgetting_the_allocations_it_was_made_of() -> None:
    allocs = tuple(crashed(f"a{i}", 10 + i * 10) for i in range(3))
    d = reconcile(view(allocs=allocs))
    assert d.state.consecutive_failures == 3 and d.state.counted_failures == 3
    # All three garbage-collected; two more fail: five, parked.
    d = reconcile(view(allocs=(crashed("b0", 100), crashed("b1", 110)), state=d.state, state_index=9))
    park = [a for a in d.actions if isinstance(a, Park)]
    assert park and park[0].failures == 5 and park[0].alloc_id == "b1"


def test_a_job_that_still_makes_deployments_is_registered_again_even_when_parking() -> None:
    """A model job from before the opt-out has Nomad's default strategy (max_parallel 1): Nomad
    would refuse to scale it while a deployment runs, so it is registered again (which Nomad
    never refuses), with the count the model should have, parked or not. Should the Park's scale
    be refused, the registration at 0 still stops the model, and the next pass parks it."""
    old = job(KEV, 1)
    old["TaskGroups"][0]["Update"] = {"MaxParallel": 1, "HealthyDeadline": 300_000_000_000}
    d = reconcile(view(job=old))
    assert [type(a) for a in d.actions if not isinstance(a, WriteState)] == [RegisterJob]

    crashing = reconcile(view(job=old, allocs=[crashed(f"a{i}", 10 + i * 10) for i in range(5)]))
    (register,) = [a for a in crashing.actions if isinstance(a, RegisterJob)]
    assert register.count == 0 and crashing.state.parked

    opted_out = job(KEV, 1)
    opted_out["TaskGroups"][0]["Update"] = {"MaxParallel": 0}
    assert not any(isinstance(a, RegisterJob | Scale) for a in reconcile(view(job=opted_out)).actions)


def test_a_routers_ask_is_answered_by_one_activation_through_the_same_rule() -> None:
    d = reconcile(view(LAZY, job=job(LAZY, 0), in_flight=1, asks=(Ask("r/1", 3, NOW - 1),)))
    (activate,) = [a for a in d.actions if isinstance(a, Activate)]
    assert (activate.count, activate.asked) == (1, NOW - 1)
    assert "no ready replica" in activate.message
    # One call: the activation replaces the plain scale the same pass would have made.
    assert not any(isinstance(a, Scale) for a in d.actions)
    # Already at its count, the ask still makes Nomad evaluate afresh.
    again = reconcile(view(LAZY, job=job(LAZY, 1), in_flight=1, asks=(Ask("r/1", 3, NOW - 1),)))
    assert [a.count for a in again.actions if isinstance(a, Activate)] == [1]


def test_an_answered_ask_is_not_asked_again_and_a_parked_model_is_never_activated() -> None:
    attempt = Attempt(asked=NOW - 1, at=NOW - 0.5, eval="e1", result="placed", answered={"r/1": 3})
    answered = ModelState(attempt=attempt)
    d = reconcile(view(LAZY, job=job(LAZY, 1), in_flight=1, asks=(Ask("r/1", 3, NOW - 1),), state=answered))
    assert not any(isinstance(a, Activate) for a in d.actions)
    later = reconcile(
        view(LAZY, job=job(LAZY, 1), in_flight=1, asks=(Ask("r/1", 4, NOW - 1),), state=answered)
    )
    assert any(isinstance(a, Activate) for a in later.actions)
    parked = reconcile(view(job=job(KEV, 0), in_flight=1, asks=(Ask("r/1", 4, NOW),), state=parked_state()))
    assert not any(isinstance(a, Activate | Scale) for a in parked.actions) and parked.desired == 0


def test_a_scale_up_nomad_cannot_place_while_the_minimum_runs_is_short_not_unplaceable() -> None:
    allocs = (running("a", 5),)
    d = reconcile(view(job=job(KEV, 3), allocs=allocs, ready=1, evals=(_blocked(),), in_flight=3))
    assert d.state.short and not d.state.unplaceable
    assert "2 nodes filtered (missing devices)" in d.state.short_reason
    assert d.health == "warning" and d.health_output.startswith("short: 1 of 3 replicas ready")
    # With nothing running, the same evaluation is unplaceable.
    none = reconcile(view(job=job(KEV, 1), evals=(_blocked(),)))
    assert none.state.unplaceable and not none.state.short
