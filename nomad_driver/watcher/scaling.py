"""How many replicas a model should have for its load: a pure rule and the little history it
needs.

The signal is requests in flight, summed over every router (`llmgw/inflight/<router>`): each
request is counted from the moment a router takes it until its last byte, so it is what the
engines are carrying or queueing, whatever the engine. The rule:

    desired = clamp(ceil(average in flight / target_in_flight), min, max)

with the average taken over a short window (seconds), so a burst is answered quickly but one
spike between two scrapes is not a replica; a burst of twice what the replicas can carry is
answered at once. A lower figure takes effect only after it has held for `scale_down_delay`
(minutes), because a stopped replica loses its loaded weights and KV cache and the next wave
would pay for the reload. Steps are at most one per `step_interval`, so Nomad sees a few scale
calls, not one per pass.

What the rule never does: stop a replica that has requests in flight (Nomad stops the highest
allocation index first, so the busy index counts, not the number of busy replicas), scale down
while new replicas are still starting (they are what the load was asked for; for 15 minutes at most, so
a replica that never turns ready holds nothing), or scale a parked
model. Models with `min: 0` keep their idle timeout: asked for means at least 1, and only a
whole idle timeout without requests takes them to 0.
"""

from __future__ import annotations

import math
import typing
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

DEFAULT_UP_WINDOW_S = 6.0
DEFAULT_STEP_INTERVAL_S = 5.0
# Replicas still starting hold a scale-down for this long after they were placed, at most: a
# 70B model loads well within it on a healthy node, and a replica that never turns ready (a
# hung load, a check that never passes) must not hold the count up forever. One restarting
# after a failed start holds nothing (reconcile.py).
STARTING_HOLD_S = 900.0

Reason = Literal["parked", "idle", "min", "asked", "load", "max", "held", "busy", "starting", "step"]
REASONS: tuple[Reason, ...] = typing.get_args(Reason)


@dataclass(frozen=True)
class ScaleInputs:
    """One model at one moment, as the rule sees it."""

    replicas_min: int
    replicas_max: int
    target_in_flight: int
    scale_down_delay_s: float
    count: int  # the job's count now
    in_flight: int = 0  # requests in flight now, over all routers
    average: float = 0.0  # in flight, time-weighted over the up window
    # The highest recommendation of the last scale_down_delay (seeded with the count the
    # watcher first saw), which a lower one must outlast.
    held: int = 0
    asked: bool = False  # requested within idle_timeout (or in flight now)
    # The count a scale-down must keep so no replica with requests in flight is stopped.
    busy_floor: int = 0
    # Allocations placed but not yet ready, for at most STARTING_HOLD_S since they were placed,
    # and not crash-looping: a replica stuck loading or failing holds nothing.
    starting: int = 0
    parked: bool = False
    since_step_s: float = math.inf  # since the job's count last changed
    step_interval_s: float = DEFAULT_STEP_INTERVAL_S


@dataclass(frozen=True)
class Desired:
    count: int
    reason: Reason
    detail: str  # one line for people: `load: 37 in flight / 8 per replica`
    # What the load alone asks for (clamped), for the history the next passes hold against.
    recommendation: int = 0


def _figure(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def load_replicas(i: ScaleInputs) -> tuple[int, bool]:
    """Replicas the load asks for before the limits, and whether it is a burst: twice what the
    running replicas carry in flight now is answered without waiting for the average."""
    target = max(1, i.target_in_flight)
    want = math.ceil(i.average / target - 1e-9)
    burst = i.in_flight >= 2 * target * max(i.count, 1)
    if burst:
        want = max(want, math.ceil(i.in_flight / target))
    return want, burst


def decide(i: ScaleInputs) -> Desired:
    if i.parked:
        return Desired(0, "parked", "parked: not placed again until its definition changes or a retry")
    lo, hi = max(0, i.replicas_min), max(0, i.replicas_max)
    wanted, burst = load_replicas(i)
    shown = i.in_flight if burst else i.average
    load = f"{_figure(shown)} in flight / {i.target_in_flight} per replica"
    if lo == 0 and not i.asked and i.in_flight == 0 and i.busy_floor == 0:
        # On demand and a whole idle timeout without requests: the hold is the idle timeout,
        # and no step limit either (a refused activation is undone at once).
        return Desired(0, "idle", "idle: no request within idle_timeout", 0)
    floor = max(lo, 1) if i.asked or i.in_flight > 0 else lo
    recommendation = max(floor, min(wanted, hi))
    if wanted > hi and hi > floor:
        out = Desired(hi, "max", f"max: {load} wants {wanted}, at most {hi}", recommendation)
    elif recommendation > floor:
        out = Desired(recommendation, "load", f"load: {load}", recommendation)
    elif lo == 0 and recommendation == 1:
        out = Desired(1, "asked", f"asked: on demand, requested within idle_timeout ({load})", 1)
    else:
        out = Desired(recommendation, "min", f"min: {load}", recommendation)

    if out.count < i.count:
        held = min(max(i.held, out.count), hi, i.count)
        if held > out.count:
            out = Desired(
                held,
                "held",
                f"held: {load} wants {out.count}; lower for less than scale_down_delay "
                f"{_figure(i.scale_down_delay_s)}s",
                recommendation,
            )
        if out.count < i.count and i.starting > 0:
            out = Desired(
                i.count,
                "starting",
                f"starting: {i.starting} replicas still starting; {load} wants {out.count}",
                recommendation,
            )
        busy = min(i.busy_floor, i.count)
        if busy > out.count:
            out = Desired(
                busy, "busy", f"busy: replicas up to {busy} have requests in flight; {load}", recommendation
            )
    return _limited(out, i)


def _limited(out: Desired, i: ScaleInputs) -> Desired:
    """At most one step per interval; bringing up a model that has nothing (0 -> n) is never
    held back, since a request waits for it."""
    if out.count == i.count or i.count == 0 or i.since_step_s >= i.step_interval_s:
        return out
    wait = i.step_interval_s - i.since_step_s
    return Desired(
        i.count,
        "step",
        f"step: {out.detail}; next step to {out.count} in {wait:.0f}s",
        out.recommendation,
    )


def busy_floor(busy_indexes: Iterable[int]) -> int:
    """The count that keeps every busy allocation: Nomad's reconciler stops the highest name
    indexes first (`allocNameIndex.Highest`), so a busy `[3]` needs a count of 4."""
    return max((n + 1 for n in busy_indexes), default=0)


@dataclass
class _ModelLoad:
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    # Recommendations of the last scale_down_delay, as a sliding maximum: each is kept only
    # while no later one is at least as high.
    peaks: deque[tuple[float, int]] = field(default_factory=deque)
    asked: int | None = None  # the latest recommendation recorded


@dataclass(frozen=True)
class Load:
    average: float
    held: int


class LoadHistory:
    """What the rule needs from earlier passes, per model: in flight over the up window and the
    recommendations of the scale-down delay. Kept in the watcher's memory only: a watcher that
    starts (or takes over) seeds each model with the count it finds, so a restart is never a
    scale-down."""

    def __init__(self, up_window_s: float = DEFAULT_UP_WINDOW_S) -> None:
        self.up_window_s = up_window_s
        self._models: dict[str, _ModelLoad] = {}

    def observe(self, model: str, now: float, in_flight: int, count: int, delay_s: float) -> Load:
        seen = self._models.get(model)
        if seen is None:
            seen = self._models[model] = _ModelLoad()
            seen.peaks.append((now, count))
        samples = seen.samples
        if not samples or samples[-1][1] != in_flight:
            samples.append((now, in_flight))
        start = now - self.up_window_s
        # The newest sample at or before the window's start gives the value the window opens on.
        while len(samples) > 1 and samples[1][0] <= start:
            samples.popleft()
        while seen.peaks and seen.peaks[0][0] < now - delay_s:
            seen.peaks.popleft()
        held = max((r for _, r in seen.peaks), default=0)
        return Load(time_weighted(samples, start, now), held)

    def record(self, model: str, now: float, recommendation: int) -> None:
        seen = self._models.setdefault(model, _ModelLoad())
        while seen.peaks and seen.peaks[-1][1] <= recommendation:
            seen.peaks.pop()
        seen.peaks.append((now, recommendation))
        seen.asked = recommendation

    def stood_until(self, model: str, now: float) -> None:
        """The latest recommendation was asked for until `now`: a model whose decision stood
        (no pass reconciled it, nothing changed) asked for the same all along, and a lower
        figure now must outlast the scale-down delay from here, not from its last pass."""
        seen = self._models.get(model)
        if seen is not None and seen.asked is not None:
            self.record(model, now, seen.asked)

    def changes_at(self, model: str, delay_s: float) -> float:
        """When `observe` would next answer otherwise with the same in flight (inf: not while it
        stays): at once while the window still averages two values (the average moves with
        every tick until the older one leaves it), or when a held peak above the latest
        recommendation runs out. The latest recommendation is itself the last peak, and
        holding what the load asks for anyway changes no decision."""
        seen = self._models.get(model)
        if seen is None:
            return math.inf
        if len(seen.samples) > 1:
            return -math.inf
        if len(seen.peaks) > 1:
            return seen.peaks[0][0] + delay_s
        return math.inf

    def keep_only(self, models: Iterable[str]) -> None:
        keep = set(models)
        for name in [m for m in self._models if m not in keep]:
            del self._models[name]


def time_weighted(samples: Iterable[tuple[float, int]], start: float, now: float) -> float:
    """The average of a step function (each value holds until the next sample) over
    [start, now], or over the part of it the samples cover."""
    points = list(samples)
    if not points:
        return 0.0
    begin = max(start, points[0][0])
    span = now - begin
    if span <= 0:
        return float(points[-1][1])
    total = 0.0
    for k, (t, v) in enumerate(points):
        t_end = points[k + 1][0] if k + 1 < len(points) else now
        lo, hi = max(t, begin), min(t_end, now)
        if hi > lo:
            total += v * (hi - lo)
    return total / span
