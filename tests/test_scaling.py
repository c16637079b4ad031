"""The load rule (`watcher/scaling.py`) on its own: bursts, plateaus, drops, flapping load held
by the scale-down delay, the limits, busy replicas, starting replicas and parked models."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from nomad_driver.spec import parse_models
from nomad_driver.watcher.scaling import (
    Desired,
    LoadHistory,
    ScaleInputs,
    busy_floor,
    decide,
    time_weighted,
)

BASE = ScaleInputs(replicas_min=1, replicas_max=4, target_in_flight=8, scale_down_delay_s=300.0, count=1)


def inputs(**kw: Any) -> ScaleInputs:
    return dataclasses.replace(BASE, **kw)


class Sim:
    """The watcher's passes for one model: the history, the rule, and the count following it
    (as Nomad would after each scale call)."""

    def __init__(self, base: ScaleInputs = BASE, window: float = 6.0) -> None:
        self.base = base
        self.history = LoadHistory(window)
        self.count = base.count
        self.changed_at = -math.inf
        self.now = 0.0

    def step(self, in_flight: int, dt: float = 1.0, **kw: Any) -> Desired:
        self.now += dt
        load = self.history.observe("m", self.now, in_flight, self.count, self.base.scale_down_delay_s)
        d = decide(
            dataclasses.replace(
                self.base,
                count=self.count,
                in_flight=in_flight,
                average=load.average,
                held=load.held,
                asked=in_flight > 0 or kw.pop("asked", False),
                since_step_s=self.now - self.changed_at,
                **kw,
            )
        )
        self.history.record("m", self.now, d.recommendation)
        if d.count != self.count:
            self.count, self.changed_at = d.count, self.now
        return d


def test_plateau_takes_ceil_of_the_average_over_the_target() -> None:
    d = decide(inputs(count=2, in_flight=20, average=20.0))
    assert (d.count, d.reason) == (3, "load")
    assert d.detail == "load: 20 in flight / 8 per replica"


def test_a_burst_is_answered_at_once_without_waiting_for_the_average() -> None:
    sim = Sim()
    sim.step(2)
    # 40 in flight on one replica of 8 is past twice what it carries: up to max this pass.
    d = sim.step(40, dt=0.5)
    assert (d.count, d.reason) == (4, "max")
    assert "40 in flight" in d.detail and "at most 4" in d.detail


def test_a_short_spike_below_the_burst_line_is_averaged_away() -> None:
    sim = Sim(window=6.0)
    for _ in range(10):
        sim.step(4)
    # 12 for one second of a six-second window: the average stays under one replica's 8.
    assert sim.step(12).count == 1
    assert sim.step(4).count == 1


def test_a_drop_waits_for_the_scale_down_delay_then_steps_down() -> None:
    sim = Sim()
    sim.step(32)
    assert sim.count == 4
    # The pass that first sees the drop still averages the window before it.
    assert sim.step(8, dt=10).count == 4
    d = sim.step(8, dt=10)
    assert (d.count, d.reason) == (4, "held")
    assert "scale_down_delay 300s" in d.detail
    for _ in range(28):
        assert sim.step(8, dt=10).count == 4
    d = sim.step(8, dt=30)
    assert (d.count, d.reason) == (1, "min")


def test_flapping_load_is_held_by_the_delay() -> None:
    sim = Sim()
    counts = []
    for k in range(60):
        counts.append(sim.step(24 if k % 6 < 3 else 2, dt=5).count)
    # Up once to the peak's three, never back down while the peaks keep coming.
    assert max(counts) == 3 and counts[-20:] == [3] * 20
    changes = sum(1 for a, b in itertools.pairwise(counts) if a != b)
    assert changes <= 2


def test_limits_min_and_max() -> None:
    assert decide(inputs(count=1, average=0.0)).reason == "min"
    assert decide(inputs(count=2, replicas_min=2, average=0.0)).count == 2
    d = decide(inputs(count=4, in_flight=100, average=100.0))
    assert (d.count, d.reason) == (4, "max")


def test_never_below_the_replicas_with_requests_in_flight() -> None:
    # Nomad stops the highest index first: a request on [2] keeps three replicas.
    assert busy_floor([0, 2]) == 3
    d = decide(inputs(count=4, average=1.0, in_flight=1, held=0, busy_floor=3))
    assert (d.count, d.reason) == (3, "busy")


def test_no_scale_down_while_new_replicas_are_starting() -> None:
    d = decide(inputs(count=3, average=0.0, held=0, starting=1))
    assert (d.count, d.reason) == (3, "starting")


def test_a_parked_model_is_never_scaled_up() -> None:
    d = decide(inputs(count=0, in_flight=50, average=50.0, parked=True))
    assert (d.count, d.reason) == (0, "parked")


def test_on_demand_keeps_idle_timeout_asked_is_one_idle_is_zero() -> None:
    lazy = inputs(replicas_min=0, count=0)
    asked = decide(dataclasses.replace(lazy, asked=True))
    assert (asked.count, asked.reason) == (1, "asked")
    # Idle: the idle timeout was the hold; down to 0 even with a high recommendation held.
    idle = decide(dataclasses.replace(lazy, count=2, held=2, asked=False))
    assert (idle.count, idle.reason) == (0, "idle")


def test_steps_are_rate_limited_but_activation_is_not() -> None:
    d = decide(inputs(count=1, in_flight=12, average=12.0, since_step_s=2.0))
    assert (d.count, d.reason) == (1, "step") and "next step to 2" in d.detail
    assert decide(inputs(replicas_min=0, count=0, asked=True, since_step_s=0.0)).count == 1


def test_a_restarted_watcher_is_seeded_with_the_count_and_does_not_scale_down() -> None:
    sim = Sim(dataclasses.replace(BASE, count=3))
    d = sim.step(0)
    assert (d.count, d.reason) == (3, "held")


def test_time_weighted_average_of_a_step_function() -> None:
    assert time_weighted([(0.0, 0), (4.0, 12)], 0.0, 6.0) == 4.0
    assert time_weighted([(5.0, 3)], 0.0, 5.0) == 3.0
    assert time_weighted([], 0.0, 6.0) == 0.0


def test_default_target_is_the_engines_slots() -> None:
    text = """
profiles:
  slots2: {engine: llama.cpp, engine_version: b6500, gpus: 0, args: ["--parallel", "2"]}
  plain: {engine: llama.cpp, engine_version: b6500, gpus: 0}
  py: {engine: llama-cpp-python, engine_version: 0.3.36, gpus: 0}
models:
  a: {source: file:///a.gguf, profile: slots2}
  b: {source: file:///b.gguf, profile: plain}
  c: {source: file:///c.gguf, profile: py, replicas: {min: 1, max: 3, target_in_flight: 6, scale_down_delay: 90s}}
"""
    models = parse_models(text, "t").models
    assert [models[n].target_in_flight for n in "abc"] == [2, 4, 6]
    assert models["c"].scale_down_delay_s == 90.0 and models["a"].scale_down_delay_s == 300.0


@given(
    st.integers(0, 3),
    st.integers(1, 6),
    st.integers(1, 16),
    st.integers(0, 6),
    st.integers(0, 200),
    st.floats(0, 200),
    st.integers(0, 6),
    st.booleans(),
    st.integers(0, 6),
    st.integers(0, 3),
)
def test_desired_stays_within_limits_and_keeps_busy_replicas(
    lo: int,
    extra: int,
    target: int,
    count: int,
    in_flight: int,
    average: float,
    held: int,
    asked: bool,
    busy: int,
    starting: int,
) -> None:
    hi = lo + extra
    count = min(count, hi)
    i = ScaleInputs(lo, hi, target, 300.0, count, in_flight, average, held, asked, busy, starting)
    d = decide(i)
    assert 0 <= d.count <= hi
    if d.count < count and d.reason != "idle":
        # Any step down keeps the busy replicas and waits for the starting ones.
        assert d.count >= min(busy, count) and starting == 0
    if d.reason != "idle" and (asked or in_flight > 0):
        assert d.count >= min(max(lo, 1), hi) or d.count == count
    if d.reason not in ("idle", "step") and lo <= count:
        assert d.count >= lo


def test_the_busy_floor_keeps_every_known_busy_replica_when_one_is_unknown() -> None:
    """Nomad stops the highest allocation index first, so a busy `[3]` needs a count of 4. A
    busy replica the routers name that Nomad's allocations do not show (yet) must not lower
    that floor to what the requests alone need: it holds the current count instead."""
    from nomad_driver.watcher.replicas import busy_floor_of

    def alloc(aid: str, index: int) -> dict[str, object]:
        return {"ID": aid, "Name": f"llmgw-m.engine[{index}]"}

    a3 = "00000000-0000-4000-8000-000000000003"
    unknown = "00000000-0000-4000-8000-00000000000f"
    allocs = {a3: alloc(a3, 3)}
    replicas = {
        f"_nomad-task-{a3}-engine-llmgw-engine-http",
        f"_nomad-task-{unknown}-engine-llmgw-engine-http",
    }
    assert busy_floor_of({f"_nomad-task-{a3}-engine-llmgw-engine-http"}, allocs, 1, 4, count=5) == 4
    assert busy_floor_of(replicas, allocs, 2, 4, count=5) == 5
    assert busy_floor_of(set(), allocs, 0, 4, count=5) == 0


def test_a_replica_that_never_turns_ready_holds_a_scale_down_for_a_while_not_forever() -> None:
    from nomad_driver.watcher.reconcile import reconcile
    from nomad_driver.watcher.scaling import STARTING_HOLD_S
    from tests.test_reconcile import KEV, NOW, job, view

    def loading(aid: str, index: int, started_s_ago: float) -> dict[str, Any]:
        t = int((NOW - started_s_ago) * 1e9)
        return {
            "ID": aid,
            "Name": f"llmgw-kev.engine[{index}]",
            "ClientStatus": "running",
            "DesiredStatus": "run",
            "CreateTime": t,
            "TaskStates": {"engine": {"Events": [{"Type": "Started", "Time": t}]}},
        }

    # Scaled to 2 by a load that has gone; the second replica is still loading.
    fresh = view(
        job=job(KEV, 2),
        allocs=(loading("a", 0, 3600), loading("b", 1, 60)),
        ready=1,
        healthy_starts=frozenset({(int((NOW - 3600) * 1e9), "a")}),
    )
    assert reconcile(fresh).desired_reason == "starting"
    # Loading for longer than any model takes: it holds nothing, the count comes down.
    stuck = view(
        job=job(KEV, 2),
        allocs=(loading("a", 0, 3600), loading("b", 1, STARTING_HOLD_S + 60)),
        ready=1,
        healthy_starts=frozenset({(int((NOW - 3600) * 1e9), "a")}),
    )
    d = reconcile(stuck)
    assert d.desired == 1 and d.desired_reason != "starting"


def test_a_crash_looping_replica_holds_no_scale_down() -> None:
    """A replica restarting after a failed start is not about to turn ready: the count above
    what the load wants comes down instead of waiting for it."""
    from tests.test_reconcile import KEV, NOW, job, view

    t = int((NOW - 60) * 1e9)
    healthy = {
        "ID": "a",
        "Name": "llmgw-kev.engine[0]",
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "CreateTime": t - 10**12,
        "TaskStates": {"engine": {"Events": [{"Type": "Started", "Time": t - 10**12}]}},
    }
    looping = {
        "ID": "b",
        "Name": "llmgw-kev.engine[1]",
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "CreateTime": t,
        "TaskStates": {
            "engine": {
                "Events": [
                    {"Type": "Started", "Time": t},
                    {"Type": "Terminated", "Time": t + 1, "DisplayMessage": "Exit Code: 1"},
                    {"Type": "Restarting", "Time": t + 2},
                ]
            }
        },
    }
    v = view(
        job=job(KEV, 2), allocs=(healthy, looping), ready=1, healthy_starts=frozenset({(t - 10**12, "a")})
    )
    from nomad_driver.watcher.reconcile import reconcile

    d = reconcile(v)
    assert d.desired == 1 and d.desired_reason != "starting"
