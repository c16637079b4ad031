"""How many replicas a model should have now: `scaling.decide` over one view (load, asks,
holds and floors), the inputs read from what the pass saw."""

from __future__ import annotations

from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.scaling import (
    Desired,
    ScaleInputs,
    decide,
)


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
