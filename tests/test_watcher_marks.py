"""A pass reconciles only the models a change touched or whose clock came due
(`nomad_driver/watcher/marks.py`, `readings.py`), and decides for them what a pass over every
model would.

The world here is the watcher's readings set by hand, as its watches would publish them (Nomad's
with the jobs their events named), on a watcher that does not lead: what it decides is what a
leader would act on.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nomad_driver.blocking import Reading, Watch
from nomad_driver.config_kv import definition_keys, model_key
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.nomad import Nomad
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import ModelState, activity_key, inflight_key, state_key
from nomad_driver.watcher.admin import create_app
from nomad_driver.watcher.decisions import Park, Scale, WriteState
from nomad_driver.watcher.feeds import OTHER_JOBS, _Feed
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.watcher_support import BARE_CPU_PROFILE

NOW = 1_800_000_000.0
MODELS = 6


def fleet_text(n: int = MODELS) -> str:
    lines = [BARE_CPU_PROFILE.rstrip(), "  split:", "    engine: llama.cpp", "    engine_version: b6500",
             "    gpus: 0", "    nodes: 2", "models:"]  # fmt: skip
    for i in range(n):
        lines += [f"  m{i}:", f"    source: file:///tmp/m{i}.gguf", "    profile: cpu",
                  "    replicas: {min: 0, max: 2}", "    idle_timeout: 60s"]  # fmt: skip
    lines += [
        "  big:",
        "    source: file:///tmp/big.gguf",
        "    profile: split",
        "    replicas: {min: 0, max: 1}",
    ]
    return "\n".join(lines) + "\n"


class World:
    """A fleet of `MODELS` one-node models, each with one running, passing replica, and one
    multi-node model at 0; the readings published to a watcher as its watches would."""

    def __init__(self, watchers: int = 1) -> None:
        self.clock = NOW
        self.watchers = [
            Watcher(
                Consul("http://127.0.0.1:1"),
                Nomad("http://127.0.0.1:1"),
                WatcherConfig(),
                clock=lambda: self.clock,
            )
            for _ in range(watchers)
        ]
        for w in self.watchers:
            # The suite's check runs every pass over every model; these tests count what one takes.
            w._verify_skips = ""
        self.w = self.watchers[0]
        text = fleet_text()
        self.models = parse_models(text, "t").models
        self.index = 10
        self.kv = {k: KVEntry(k, v, 1) for k, v in definition_keys(text).items()}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.allocs: dict[str, dict[str, Any]] = {}
        self.engines: dict[str, dict[str, Any]] = {}
        self.evals: dict[str, dict[str, Any]] = {}
        for name, m in self.models.items():
            job = render_job(m)
            job["TaskGroups"][0]["Count"] = 0 if name == "big" else 1
            job["Version"] = 0
            self.jobs[m.job_id] = job
            if name != "big":
                self.kv[activity_key(name)] = KVEntry(activity_key(name), str(NOW - 1).encode(), 2)
                self.add_replica(name)
        for watch in ("kv", "engines", "nodes"):
            self.publish(watch)
        for watch in ("nomad-jobs", "nomad-allocations", "nomad-evaluations"):
            self.publish(watch, None)

    def next_index(self) -> int:
        self.index += 1
        return self.index

    def add_replica(self, name: str) -> str:
        m = self.models[name]
        i = self.next_index()
        alloc_id = str(uuid.UUID(int=i))  # never reused, as Nomad never reuses one
        self.allocs[alloc_id] = {
            "ID": alloc_id,
            "JobID": m.job_id,
            "Name": f"{m.job_id}.engine[0]",
            "NodeID": "n1",
            "NodeName": "n1",
            "JobVersion": 0,
            "CreateIndex": i,
            "ClientStatus": "running",
            "DesiredStatus": "run",
            "TaskStates": {
                "engine": {"State": "running", "Events": [{"Type": "Started", "Time": i * 10**9}]}
            },
        }
        self.engines[alloc_id] = {
            "Service": {
                "ID": f"_nomad-task-{alloc_id}-group-engine-llmgw-engine-http",
                "Meta": {"model": name, "def_hash": m.def_hash},
                "ModifyIndex": i,
            },
            "Checks": [{"CheckID": f"c-{alloc_id}", "ServiceID": "s", "Status": "passing", "ModifyIndex": i}],
        }
        return alloc_id

    def publish(self, watch: str, hint: set[str] | None = None) -> None:
        i = self.next_index()
        for w in self.watchers:
            self._publish(w, i, watch, hint)

    def _publish(self, w: Watcher, i: int, watch: str, hint: set[str] | None) -> None:
        if watch == "kv":
            w.kv.snapshot = Reading(i, dict(self.kv), 0.0)
        elif watch == "engines":
            w.engines.snapshot = Reading(i, tuple(dict(e) for e in self.engines.values()), 0.0)
        elif watch == "nodes":
            w.nodes.snapshot = Reading(i, ({"ID": "n1", "Name": "n1", "Meta": {}},), 0.0)
            w._nodes_read()
        else:
            feeds: dict[str, tuple[_Feed[Any], Watch[Any], Any]] = {
                "nomad-jobs": (w.job_feed, w.jobs, dict(self.jobs)),
                "nomad-allocations": (w.alloc_feed, w.allocs, tuple(self.allocs.values())),
                "nomad-evaluations": (w.eval_feed, w.evals, tuple(self.evals.values())),
            }
            feed, target, data = feeds[watch]
            feed._changes = None if hint is None else set(hint)
            target.snapshot = Reading(i, data, 0.0)
            w._feed_read(watch, feed)

    def write_state(self, name: str, state: ModelState) -> None:
        self.kv[state_key(name)] = KVEntry(state_key(name), state.to_kv(), self.next_index())

    def settle(self) -> None:
        """Passes until no decision has anything left to do, each state written as the leader
        would write it."""
        for _ in range(5):
            self.run_passes()
            writes = [
                a for d in self.w.decisions.values() for a in d.actions if isinstance(a, (WriteState, Park))
            ]
            if not writes:
                break
            for a in writes:
                self.write_state(a.model, a.state)
            self.publish("kv")
        left = {n: d.actions for n, d in self.w.decisions.items() if d.actions}
        assert not left, left

    def run_passes(self, act: bool = False) -> None:
        """A pass on each watcher: the first over the marked models, any other over every one.
        `act`: then what the first decided is done, as its leader and Nomad would."""
        for w in self.watchers[1:]:
            w.marks.all()
        for w in self.watchers:
            asyncio.run(w.run_pass())
        if act:
            self.act()

    def act(self) -> None:
        actions = [a for d in self.w.decisions.values() for a in d.actions]
        for a in actions:
            if isinstance(a, (WriteState, Park)):
                self.write_state(a.model, a.state)
            elif isinstance(a, Scale):
                job = self.jobs[a.job_id] = {**self.jobs[a.job_id]}
                job["TaskGroups"] = [{**job["TaskGroups"][0], "Count": a.count}]
                running = [i for i, al in self.allocs.items() if al["JobID"] == a.job_id]
                for alloc_id in running[a.count :]:
                    del self.allocs[alloc_id], self.engines[alloc_id]
                for _ in range(a.count - len(running)):
                    self.add_replica(a.model)
                self.publish("nomad-jobs", {a.job_id})
                self.publish("nomad-allocations", {a.job_id})
                self.publish("engines")
        if actions:
            self.publish("kv")

    def job_id(self, name: str) -> str:
        return self.models[name].job_id


# Each kind of change, made to model `m` (m3 below).


def alloc_fails(world: World, m: str) -> None:
    alloc = next((a for a in world.allocs.values() if a["JobID"] == world.job_id(m)), None)
    if alloc is None:
        return  # scaled to 0 by then
    i = world.next_index()
    alloc["TaskStates"]["engine"]["Events"].append({"Type": "Terminated", "Time": i * 10**9, "ExitCode": 1})
    alloc.update(ClientStatus="failed", ModifyIndex=i)
    world.publish("nomad-allocations", {world.job_id(m)})


def job_scaled(world: World, m: str) -> None:
    world.jobs[world.job_id(m)] = {**world.jobs[world.job_id(m)]}
    world.jobs[world.job_id(m)]["TaskGroups"][0]["Count"] = 2
    world.publish("nomad-jobs", {world.job_id(m)})


def evaluation_blocked(world: World, m: str) -> None:
    i = world.next_index()  # a new evaluation each time: Nomad never moves one to another job
    world.evals[f"e{i}"] = {"ID": f"e{i}", "JobID": world.job_id(m), "Status": "blocked", "CreateIndex": i}
    world.publish("nomad-evaluations", {world.job_id(m)})


def state_written(world: World, m: str) -> None:
    world.write_state(m, ModelState(consecutive_failures=2, last_error="boom"))
    world.publish("kv")


def request_served(world: World, m: str) -> None:
    world.kv[activity_key(m)] = KVEntry(activity_key(m), str(world.clock).encode(), world.next_index())
    world.publish("kv")


def router_busy(world: World, m: str) -> None:
    key = inflight_key("r1")
    body = f'{{"at": {world.clock}, "interval_s": 5, "models": {{"{m}": {{"requests": 3}}}}}}'
    world.kv[key] = KVEntry(key, body.encode(), world.next_index())
    world.publish("kv")


def check_fails(world: World, m: str) -> None:
    alloc_id = next((a for a, e in world.engines.items() if e["Service"]["Meta"]["model"] == m), None)
    if alloc_id is None:
        return
    world.engines[alloc_id]["Checks"] = [
        {"CheckID": "c", "ServiceID": "s", "Status": "critical", "ModifyIndex": world.next_index()}
    ]
    world.publish("engines")


def definition_changed(world: World, m: str) -> None:
    key = model_key(m)
    body = f'{{"source": "file:///tmp/{m}.gguf", "profile": "cpu", "replicas": {{"min": 0, "max": 3}}, "idle_timeout": "60s"}}'
    world.kv[key] = KVEntry(key, body.encode(), world.next_index())
    world.publish("kv")


CHANGES = [
    alloc_fails,
    job_scaled,
    evaluation_blocked,
    state_written,
    request_served,
    router_busy,
    check_fails,
    definition_changed,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_each_kind_of_change_marks_exactly_the_model_it_touches(change: Any) -> None:
    world = World()
    world.settle()
    assert not world.w._read_changes(world.clock), "a settled world has nothing to reconcile"
    before = dict(world.w.decisions)
    change(world, "m3")
    assert world.w._read_changes(world.clock)
    assert not world.w.marks.everything and world.w.marks.models == {"m3"}
    asyncio.run(world.w.run_pass())
    assert {n for n, d in world.w.decisions.items() if d is not before[n]} == {"m3"}


def test_healthz_shows_the_work_waiting_for_the_next_pass() -> None:
    world = World()

    async def healthz() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=create_app(world.w))
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as c:
            body: dict[str, Any] = (await c.get("/healthz")).json()
            return body

    assert asyncio.run(healthz())["full_pass_marked"] is True  # nothing reconciled yet
    world.settle()
    settled = asyncio.run(healthz())
    assert settled["models_marked"] == 0 and settled["full_pass_marked"] is False
    alloc_fails(world, "m3")
    world.w._read_changes(world.clock)
    waiting = asyncio.run(healthz())
    assert waiting["models_marked"] == 1 and waiting["full_pass_marked"] is False


def test_another_jobs_allocation_marks_only_the_multi_node_models() -> None:
    world = World()
    world.settle()
    world.publish("nomad-allocations", {OTHER_JOBS})
    assert world.w._read_changes(world.clock)
    assert world.w.marks.models == {"big"}


def test_a_list_with_no_hint_marks_every_model() -> None:
    world = World()
    world.settle()
    world.publish("nomad-allocations", None)
    world.w._read_changes(world.clock)
    assert world.w.marks.everything


def test_an_idle_timeout_marks_its_model_with_no_other_change_and_the_pass_scales_it_to_zero() -> None:
    world = World()
    world.settle()
    assert all(d.desired == 1 for n, d in world.w.decisions.items() if n != "big")
    world.clock = NOW + 30  # within the idle timeout (60 s) plus the routers' grace
    assert not world.w._read_changes(world.clock)
    world.clock = NOW + 70
    assert world.w._read_changes(world.clock)
    before = dict(world.w.decisions)
    asyncio.run(world.w.run_pass())
    assert {n for n, d in world.w.decisions.items() if d is not before[n]} == {f"m{i}" for i in range(MODELS)}
    assert all(d.desired == 0 for d in world.w.decisions.values())


def test_a_scale_down_delay_marks_its_model_when_it_runs_out() -> None:
    world = World()
    world.settle()
    router_busy(world, "m2")  # 3 in flight: more than one replica's target asks for 2
    world.clock += 1
    for _ in range(40):  # the up window averages the load in
        asyncio.run(world.w.run_pass())
        world.clock += 1
        if world.w.decisions["m2"].recommendation == 2:
            break
    assert world.w.decisions["m2"].recommendation == 2
    # The router's record now says nothing in flight; the lower figure must hold for the delay.
    key = inflight_key("r1")
    world.kv[key] = KVEntry(
        key, f'{{"at": {world.clock}, "interval_s": 5, "models": {{}}}}'.encode(), world.next_index()
    )
    world.publish("kv")
    asyncio.run(world.w.run_pass())
    delay = world.models["m2"].scale_down_delay_s
    due = world.w.marks.next_due()
    assert world.clock < due <= world.clock + delay + 60


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([*CHANGES, "tick"]), st.integers(0, MODELS - 1), st.floats(0, 90)),
        min_size=1,
        max_size=10,
    )
)
def test_passes_over_the_marked_models_decide_what_passes_over_every_model_do(
    steps: list[tuple[Any, int, float]],
) -> None:
    """Two watchers read the same random changes and clock moves: one reconciles the models
    marked, the other every model at every pass. Every model's decision is the same on both."""
    world = World(watchers=2)
    world.settle()
    marked, full = world.watchers
    left_out = 0
    for change, model, seconds in steps:
        world.clock += seconds
        if change != "tick":
            change(world, f"m{model}")
        passes = marked.marks.model_passes
        world.run_passes(act=True)
        left_out += len(world.models) - (marked.marks.model_passes - passes)
        assert marked.decisions == full.decisions
    assert left_out > 0, "every pass took every model: nothing was left to compare"
