"""The watcher against the Nomad stand-in and a real Consul: parking, unparking, retry and
unplaceable models, end to end through Nomad's HTTP API."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, inflight_key, state_key
from nomad_driver.watcher.decisions import Decision
from nomad_driver.watcher.loop import Watcher
from tests.watcher_support import (
    engines_dir,
    mock_job,
    models_text,
    node,
    read_state,
    terminated,
    until,
    watchers_on_standin,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def starts(nomad: Nomad, job_id: str) -> tuple[int, int]:
    """(allocations, Started events) of a job, as Nomad reports them."""
    allocs = nomad._json(nomad._request("job", job_id, "allocations", params={"all": "true"}), "allocs")
    started = 0
    for a in allocs:
        for state in (a.get("TaskStates") or {}).values():
            started += sum(1 for e in state.get("Events") or [] if e.get("Type") == "Started")
            started += sum(1 for e in state.get("Events") or [] if e.get("Type") == "Driver Failure")
    return len(allocs), started


class World:
    def __init__(self, consul: Consul, nomad: Nomad, watcher: Watcher, standin: Any) -> None:
        self.consul, self.nomad, self.watcher, self.standin = consul, nomad, watcher, standin

    async def state(self, model: str) -> ModelState | None:
        return await read_state(self.consul, model)

    async def parked(self, model: str) -> ModelState | None:
        s = await self.state(model)
        return s if s is not None and s.parked else None


@pytest.fixture
async def world_factory(
    consul_url: str, start_standin: Callable[..., Any]
) -> AsyncIterator[Callable[..., Awaitable[World]]]:
    async with watchers_on_standin(consul_url, start_standin) as start:

        async def make(text: str, nodes: Any = None, clock_speed: float = 20.0) -> World:
            standin, consul, nomad, watcher = await start(
                text, ident="w1", clock_speed=clock_speed, nodes=nodes
            )
            return World(consul, nomad, watcher, standin)

        yield make


async def test_a_model_that_exits_1_is_parked_after_exactly_five_start_failures(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    text = models_text(crash=("file:///tmp/crash.gguf", "cpu", 1))
    model = parse_models(text).models["crash"]
    world = await world_factory(text)
    world.nomad.register_job(mock_job(model, 1, run_for="1s", exit_code=1))
    await world.watcher.start()

    # When the fifth failure happened, as seen from outside, against when the state said parked.
    probe = Nomad(world.nomad.address)
    fifth = await until(lambda: terminated(probe, model.job_id) >= 5, 90, "five failures", every=0.05)
    fifth_at = time.monotonic()
    state = await until(lambda: world.parked("crash"), 30, "crash parked", every=0.05)
    took = time.monotonic() - fifth_at
    assert fifth and took < 4.0, f"parked {took:.2f}s after the fifth failure (target 2 s)"
    assert state.consecutive_failures == 5
    assert state.parked_def_hash == model.def_hash
    assert "Exit Code: 1" in state.last_error
    # The drain (the group's shutdown_delay, nomad_driver/draining.py) keeps the allocation up
    # for 15 s after the scale to 0, and Nomad's restart policy may start the engine once more
    # in it: not counted, the model is parked.
    await asyncio.sleep(1.5)  # 30 s of the stand-in's clock: the drain is over
    allocs, started = starts(world.nomad, model.job_id)
    assert started in (5, 6), f"{started} starts in {allocs} allocations"

    # Parked means no more attempts: watched for 4 s (80 s of the stand-in's clock).
    await asyncio.sleep(4)
    assert starts(world.nomad, model.job_id) == (allocs, started)
    job = world.nomad.get_job(model.job_id)
    assert job is not None and job["TaskGroups"][0]["Count"] == 0
    scale = world.nomad._json(world.nomad._request("job", model.job_id, "scale"), "scale")
    messages = [e.get("Message", "") for e in scale["TaskGroups"]["engine"]["Events"] or []]
    assert any("parked crash after 5 consecutive start failures" in m for m in messages), messages
    d = world.watcher.decisions["crash"]
    assert d.health == "critical" and "llmgw ctl retry crash" in d.health_output

    # Retry restores its replica and clears the count; the next failure is the first again.
    await world.watcher.retry("crash")
    await until(
        lambda: (world.nomad.get_job(model.job_id) or {})["TaskGroups"][0]["Count"] == 1, 20, "restored"
    )
    after = await world.state("crash")
    assert after is not None and not after.parked
    await until(lambda: starts(world.nomad, model.job_id)[1] > started, 30, "a new start after retry")


async def test_an_unknown_architecture_is_parked_with_the_engines_own_error_and_a_new_source_unparks(
    world_factory: Callable[..., Awaitable[World]], make_gguf: Any, tmp_path: Path
) -> None:
    kev = make_gguf(architecture="kev", name="kev")
    text = models_text(kev=(f"file://{kev}", "cpu", 1))
    engines = engines_dir(tmp_path)
    world = await world_factory(text, nodes=[node("cpu-0", engines)], clock_speed=20.0)
    await world.watcher.start()  # registers the job itself: it is not in Nomad yet

    state = await until(lambda: world.parked("kev"), 150, "kev parked", every=0.3)
    assert "unknown model architecture: 'kev'" in state.last_error
    assert state.consecutive_failures == 5

    # A new source is a new definition: the model is unparked and placed again.
    good = make_gguf(architecture="llama", name="good")
    new_text = models_text(kev=(f"file://{good}", "cpu", 1))
    await world.consul.kv_put(CONFIG_MODELS_KEY, new_text)
    new_hash = parse_models(new_text).models["kev"].def_hash

    def placed_again() -> bool:
        job = world.nomad.get_job("llmgw-kev") or {}
        return (job.get("Meta") or {}).get("llmgw_def_hash") == new_hash and job["TaskGroups"][0][
            "Count"
        ] == 1

    await until(placed_again, 30, "re-registered with the new definition")
    after = await until(lambda: _unparked(world), 30, "unparked state")
    assert after.consecutive_failures == 0
    # And this time the engine loads: a ready replica, the model satisfied.
    await until(lambda: world.watcher.decisions["kev"].ready == 1, 90, "a ready replica", every=0.3)
    assert world.watcher.decisions["kev"].health == "passing"


async def _unparked(world: World) -> ModelState | None:
    s = await world.state("kev")
    return s if s is not None and not s.parked else None


async def test_a_model_too_big_for_any_node_is_unplaceable_until_a_node_fits(
    world_factory: Callable[..., Awaitable[World]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.watcher")
    text = models_text(big=("file:///tmp/big.gguf", "huge", 1))
    model = parse_models(text).models["big"]
    engines = engines_dir(tmp_path)
    small_gpu = [{"model": "NVIDIA L4", "memory_mib": 24564, "count": 2}]
    fleet = [node("cpu-0", engines), node("l4-0", engines, small_gpu)]
    world = await world_factory(text, nodes=fleet, clock_speed=1.0)
    world.nomad.register_job(mock_job(model, 1, run_for="1h"))
    await world.watcher.start()

    async def unplaceable() -> ModelState | None:
        s = await world.state("big")
        return s if s is not None and s.unplaceable else None

    state = await until(unplaceable, 30, "big unplaceable")
    assert state.placement_reason.startswith("no node has 2 x nvidia/gpu with memory >= 81920 MiB: ")
    assert "missing devices" in state.placement_reason
    assert world.watcher.decisions["big"].health == "critical"

    # Many passes later, still one warning for the one reason.
    passes = world.watcher.passes
    await until(lambda: world.watcher.passes > passes + 10, 30, "more passes")
    world.watcher.wake()
    await asyncio.sleep(1)
    warnings = [r for r in caplog.records if "event=unplaceable model=big" in r.getMessage()]
    assert len(warnings) == 1

    # Room appears: Nomad re-runs the blocked evaluation, places it, and the state clears.
    big_gpu = [{"model": "NVIDIA H200", "memory_mib": 143771, "count": 2}]
    world.standin.add_node(node("h200-0", engines, big_gpu))

    async def cleared() -> ModelState | None:
        s = await world.state("big")
        return s if s is not None and not s.unplaceable else None

    await until(cleared, 30, "unplaceable cleared")


async def test_two_routers_whose_clocks_disagree_both_have_their_asks_answered(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    """Router "ahead" runs 30 s ahead, router "behind" 10 s behind. The watcher answers the
    first's ask; the second asks later, at a time by its clock well below that attempt's. By
    time its ask looked answered and it waited for nothing; by number it gets its own
    attempt, which answers both."""
    text = models_text(od=("file:///tmp/od.gguf", "cpu", 0))
    model = parse_models(text).models["od"]
    world = await world_factory(text)
    world.nomad.register_job(mock_job(model, 0, run_for="2h"))
    await world.watcher.start()

    async def ask(router: str, skew: float) -> None:
        at = round(time.time() + skew, 3)
        record = {
            "router": router,
            "asker": f"{router}/1a2b3c4d",
            "at": at,
            "interval_s": 10,
            "models": {"od": {"requests": 1, "replicas": [], "asked": at, "ask_seq": 1}},
        }
        await world.consul.kv_put(inflight_key(router), json.dumps(record))

    async def answered(*askers: str) -> ModelState | None:
        state = await world.state("od")
        attempt = state.attempt if state is not None else None
        numbers = (attempt.answered or {}) if attempt is not None else {}
        return state if all(numbers.get(f"{a}/1a2b3c4d") == 1 for a in askers) else None

    await ask("ahead", 30.0)
    first = await until(lambda: answered("ahead"), 20, "the attempt for the first ask")
    assert first.attempt is not None and first.attempt.result == "placed"
    await ask("behind", -10.0)
    second = await until(lambda: answered("ahead", "behind"), 15, "an attempt for the second ask")
    assert second.attempt is not None and second.attempt.at > first.attempt.at
    assert second.attempt.asked == first.attempt.asked  # the times alone said "answered"


async def test_an_idle_fleet_costs_a_handful_of_long_polls_not_calls_per_model(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    names = {f"m{i}": ("file:///tmp/m.gguf", "cpu", 1) for i in range(20)}
    text = models_text(**names)
    world = await world_factory(text, clock_speed=1.0)
    for m in parse_models(text).models.values():
        world.nomad.register_job(mock_job(m, 1, run_for="1h"))
    await world.watcher.start()

    def all_running() -> bool:
        d = world.watcher.decisions
        return len(d) == 20 and all(x.starting == 1 for x in d.values())

    await until(all_running, 60, "20 replicas running")
    await asyncio.sleep(3)  # let the last writes (state, UI entries) settle
    watches = (
        world.watcher.kv,
        world.watcher.engines,
        world.watcher.jobs,
        world.watcher.allocs,
        world.watcher.evals,
    )
    before = sum(w.calls for w in watches)
    await asyncio.sleep(10)  # one blocking wait (wait_s=10) of each loop
    calls = sum(w.calls for w in watches) - before
    # Five loops, each at most a couple of returns in one wait, whatever the number of models.
    assert calls <= 15, f"{calls} watch calls in 10 idle seconds for 20 models"


def test_the_watchers_register_only_lands_over_the_job_version_it_saw(
    start_standin: Callable[..., Any],
) -> None:
    """A leader acting on an old view (a Nomad answer from before another writer's register)
    must not undo the newer job: its register carries the JobModifyIndex it saw, as `nomad job
    run -check-index` does, and Nomad refuses it."""
    from nomad_driver.nomad import NomadError
    from nomad_driver.render import render_job

    standin = start_standin(consul=False)
    nomad = Nomad(standin.url)
    model = parse_models(models_text(m=("file:///tmp/m.gguf", "cpu", 1))).models["m"]
    job = render_job(model)
    nomad.register_job(job, enforce_index=0)  # new: only if there is none
    seen = int(nomad.get_job(model.job_id)["JobModifyIndex"])
    newer = {**job, "Meta": {**job["Meta"], "note": "newer"}}
    nomad.register_job(newer, enforce_index=seen)
    with pytest.raises(NomadError, match="Enforcing job modify index"):
        nomad.register_job(job, enforce_index=seen)  # the old view's register
    with pytest.raises(NomadError, match="Enforcing job modify index 0"):
        nomad.register_job(job, enforce_index=0)
    assert nomad.get_job(model.job_id)["Meta"]["note"] == "newer"


def quiet_and_parked(d: Decision) -> bool:
    return d.state.parked and not d.actions and d.ready == d.starting == 0


async def test_the_pass_after_a_retry_decides_the_model_from_the_retry_not_a_pass_later(
    world_factory: Callable[..., Awaitable[World]], tmp_path: Path
) -> None:
    # The retry's write is the leader's own: the pass it wakes must decide the model from it,
    # not from the state watch's read-back, which a busy state prefix holds back a tenth of a
    # second (that pass would leave the model out, and show it parked one pass longer). Every
    # watcher in the suite also runs the passes the marks leave out and writes down each
    # decision that came out different: here, into this file.
    text = models_text(crash=("file:///tmp/crash.gguf", "cpu", 1))
    model = parse_models(text).models["crash"]
    world = await world_factory(text)
    world.nomad.register_job(mock_job(model, 0))
    differences = tmp_path / "differences.jsonl"
    world.watcher._verify_skips = str(differences)
    await world.watcher.start()
    watcher = world.watcher
    await until(lambda: watcher.leadership.is_leader and "crash" in watcher.decisions, 30, "a first pass")
    for round_ in range(6):
        parked = ModelState(
            parked=True, consecutive_failures=5, last_error=f"boom {round_}", parked_def_hash=model.def_hash
        )
        await world.consul.kv_put(state_key("crash"), parked.to_kv())
        # Parked and settled: nothing left to do, so no clock of its own marks it again.
        await until(lambda: quiet_and_parked(watcher.decisions["crash"]), 20, "crash parked", every=0.01)
        await asyncio.sleep(0.3)
        for i in range(3):  # a busy state prefix: the watch spends its burst of reads
            await world.consul.kv_put(state_key(f"elsewhere-{i}"), b"{}")
        await watcher.retry("crash")
        passes = watcher.passes
        await until(lambda p=passes: watcher.passes >= p + 2, 10, "two passes after the retry", every=0.01)
        assert not watcher.decisions["crash"].state.parked, round_
    lines = differences.read_text().splitlines() if differences.exists() else []
    assert not lines, lines[:2]


async def test_the_consul_ui_entry_written_with_a_state_is_the_one_the_next_pass_keeps(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    # A pass that writes a model's state shows its entry from that state; the next pass, with
    # the state read back, must show the same words, or at 10,000 models the leader rewrites
    # every entry a second time a moment after taking over (and the UI text flickers).
    text = models_text(idle=("file:///tmp/idle.gguf", "cpu", 0))
    model = parse_models(text).models["idle"]
    world = await world_factory(text)
    world.nomad.register_job(mock_job(model, 0))
    await world.watcher.start()
    watcher = world.watcher
    await until(lambda: watcher.leadership.is_leader and "idle" in watcher.decisions, 30, "a first pass")
    await until(lambda: world.consul and read_state(world.consul, "idle"), 10, "idle's first state")
    passes = watcher.passes
    await until(lambda: watcher.passes >= passes + 3, 20, "passes after the state is read back")
    checks = [
        c for c in await world.consul.health_node("llmgw-models") if c.get("ServiceID") == "llmgw-model-idle"
    ]
    assert len(checks) == 1
    check = checks[0]
    assert check["Output"] == watcher.decisions["idle"].health_output
    assert "(idle: no request within idle_timeout)" in check["Output"]
    assert check["ModifyIndex"] == check["CreateIndex"], "the entry was written twice"
