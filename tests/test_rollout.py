"""Which of a model's two jobs runs its definition, and what becomes of the other: the rules of
watcher/rollout.py, on jobs as Nomad's JSON has them (end to end: tests/router/test_rollout_e2e.py)."""

from __future__ import annotations

import textwrap
from typing import Any

from nomad_driver.render import render_job
from nomad_driver.spec import Model, parse_models
from nomad_driver.state import ModelState
from nomad_driver.watcher.decisions import ModelView, Park, PreviousJob, RegisterJob, Scale, StopJob
from nomad_driver.watcher.health_text import model_health
from nomad_driver.watcher.reconcile import reconcile
from nomad_driver.watcher.rollout import choose_jobs, job_ids, previous_steps
from tests.test_reconcile import crashed

MODELS = textwrap.dedent(
    """
    profiles:
      small:
        engine: llama.cpp
        engine_version: b6500
        gpus: 1
    models:
      m:
        source: file:///models/{file}
        profile: small
        replicas: {{min: 2, max: 2}}
    """
)


def model(file: str = "new.gguf") -> Model:
    return parse_models(MODELS.format(file=file)).models["m"]


NEW, OLD = model("new.gguf"), model("old.gguf")
FIRST, SECOND = job_ids(NEW)


def job(m: Model, job_id: str, count: int = 2, stop: bool = False) -> dict[str, Any]:
    j = render_job(m, job_id=job_id)
    j["TaskGroups"][0]["Count"] = count
    j["Stop"] = stop
    return j


def test_the_second_job_id_is_one_no_model_name_can_take() -> None:
    assert (FIRST, SECOND) == ("llmgw-m", "llmgw-m~b")
    assert job(NEW, SECOND)["ID"] == SECOND


def test_a_first_definition_and_one_over_a_job_serving_nothing_go_in_place() -> None:
    assert choose_jobs(NEW, {}, {}) == (FIRST, None)
    # Crash-looping or idle: nothing to protect, nothing to overlap.
    assert choose_jobs(NEW, {FIRST: job(OLD, FIRST)}, {}) == (FIRST, None)
    assert choose_jobs(NEW, {SECOND: job(OLD, SECOND), FIRST: job(OLD, FIRST, stop=True)}, {}) == (
        SECOND,
        None,
    )


def test_a_new_definition_of_a_serving_model_goes_beside_it() -> None:
    assert choose_jobs(NEW, {FIRST: job(OLD, FIRST)}, {FIRST: 2}) == (SECOND, FIRST)
    # Once registered, it is current by its definition, whatever serves.
    jobs = {FIRST: job(OLD, FIRST), SECOND: job(NEW, SECOND)}
    assert choose_jobs(NEW, jobs, {FIRST: 2}) == (SECOND, FIRST)
    assert choose_jobs(NEW, jobs, {SECOND: 2}) == (SECOND, FIRST)
    # And it alternates: the next one goes back to the first ID.
    newer = model("newer.gguf")
    jobs = {FIRST: job(OLD, FIRST, count=0, stop=True), SECOND: job(NEW, SECOND)}
    assert choose_jobs(newer, jobs, {SECOND: 2}) == (FIRST, SECOND)
    # The drained job is stopped: no previous.
    assert choose_jobs(NEW, {FIRST: job(OLD, FIRST, stop=True), SECOND: job(NEW, SECOND)}, {}) == (
        SECOND,
        None,
    )


def test_applying_the_previous_definition_again_takes_its_serving_job_back() -> None:
    jobs = {FIRST: job(OLD, FIRST), SECOND: job(NEW, SECOND, count=0)}
    assert choose_jobs(OLD, jobs, {FIRST: 2}) == (FIRST, SECOND)


def test_someone_elses_job_at_the_second_id_is_never_used() -> None:
    theirs = {"ID": SECOND, "Meta": {"owner": "ops"}, "TaskGroups": [{"Name": "web", "Count": 1}]}
    assert choose_jobs(NEW, {FIRST: job(OLD, FIRST), SECOND: theirs}, {FIRST: 2}) == (FIRST, None)


def test_a_multi_node_models_new_definition_goes_beside_it_too() -> None:
    text = MODELS.format(file="new.gguf").replace("gpus: 1", "gpus: 1\n    nodes: 2")
    wide = parse_models(text.replace("{min: 2, max: 2}", "{min: 1, max: 1}")).models["m"]
    old_job = job(OLD, FIRST)
    assert choose_jobs(wide, {FIRST: old_job}, {FIRST: 1}) == (SECOND, FIRST)
    # Serving nothing, it is replaced in place, as a single-node model is.
    assert choose_jobs(wide, {FIRST: old_job}, {}) == (FIRST, None)


def previous(count: int = 2, live: int = 2, ready: int = 2) -> PreviousJob:
    return PreviousJob(FIRST, job(OLD, FIRST, count=count), ready, live)


def test_the_previous_job_serves_until_the_new_one_is_ready_then_drains_then_stops() -> None:
    state = ModelState()
    assert previous_steps(NEW, previous(), state, ready=1, desired=2) == []
    (scale,) = previous_steps(NEW, previous(), state, ready=2, desired=2)
    assert isinstance(scale, Scale) and (scale.job_id, scale.count) == (FIRST, 0)
    # Scaled to 0, its replicas still draining: nothing yet; then stopped.
    assert previous_steps(NEW, previous(count=0, live=2, ready=0), state, ready=2, desired=2) == []
    (stop,) = previous_steps(NEW, previous(count=0, live=0, ready=0), state, ready=2, desired=2)
    assert stop == StopJob("m", FIRST, "llmgw: m's previous definition is drained")


def test_a_parked_new_definition_leaves_the_previous_serving() -> None:
    parked = ModelState(parked=True, consecutive_failures=5, last_error="boom")
    assert previous_steps(NEW, previous(), parked, ready=0, desired=2) == []


def test_reconcile_registers_the_new_definition_at_the_second_id_and_parks_it_alone() -> None:
    old_job = job(OLD, FIRST)
    view = ModelView(model=NEW, job=None, job_id=SECOND, previous=previous(), now=1e6)
    d = reconcile(view)
    assert RegisterJob("m", 2, job_id=SECOND) in d.actions
    assert d.state.rollout_from == FIRST
    assert d.health == "passing" and "previous definition (llmgw-m) serves" in d.health_output
    # Five failed starts of the new job: parked, the previous untouched, and said so.
    allocs = tuple({**crashed(f"a{i}", 10 * i + 10), "JobID": SECOND} for i in range(5))
    new_job = job(NEW, SECOND)
    d = reconcile(
        ModelView(model=NEW, job=new_job, allocs=allocs, job_id=SECOND, previous=previous(), now=1e6)
    )
    (park,) = [a for a in d.actions if isinstance(a, Park)]
    assert park.job_id == SECOND
    assert not [a for a in d.actions if getattr(a, "job_id", "") == FIRST]
    assert d.state.parked and d.state.rollout_from == FIRST
    health, text = model_health(
        "m", d.state.model_copy(update={"last_error": "unknown model architecture"}), 2, 0, 0
    )
    assert health == "warning"
    assert text.startswith("update failed: unknown model architecture") and "serving the previous" in text
    assert old_job["ID"] == FIRST


def test_rolling_with_no_room_stops_one_old_replica_per_new_one_ready() -> None:
    text = MODELS.format(file="new.gguf").replace("gpus: 1", "gpus: 1\n    update: rolling")
    rolling = parse_models(text).models["m"]
    assert rolling.def_hash == NEW.def_hash, "how it rolls out is not part of the definition"
    no_room = ModelState(unplaceable=True, placement_reason="no room")
    (scale,) = previous_steps(rolling, previous(count=2), no_room, ready=0, desired=2)
    assert isinstance(scale, Scale) and (scale.job_id, scale.count) == (FIRST, 1)
    # The room made, the new replica loads: nothing more stops until it is ready.
    assert previous_steps(rolling, previous(count=1), no_room, ready=0, desired=2) == []
    (scale,) = previous_steps(rolling, previous(count=1), ModelState(short=True), ready=1, desired=2)
    assert isinstance(scale, Scale) and scale.count == 0
    # With room, rolling surges: nothing stops while the new replicas load.
    assert previous_steps(rolling, previous(count=2), ModelState(), ready=0, desired=2) == []
    # Surge waits for room, whatever it takes.
    assert previous_steps(NEW, previous(count=2), no_room, ready=0, desired=2) == []


def test_a_definition_changed_again_mid_rollout_replaces_the_unfinished_one_not_the_serving_one() -> None:
    # def OLD serves on the first ID, NEW is still loading on the second; NEWER is applied.
    newer = model("newer.gguf")
    jobs = {FIRST: job(OLD, FIRST), SECOND: job(NEW, SECOND)}
    assert choose_jobs(newer, jobs, {FIRST: 2}) == (SECOND, FIRST)
    # A watcher that takes over in the middle decides the same from the same facts.
    assert choose_jobs(newer, jobs, {FIRST: 2}) == choose_jobs(
        newer, dict(reversed(jobs.items())), {FIRST: 2}
    )
