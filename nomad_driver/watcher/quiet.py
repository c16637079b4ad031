"""When a model's decision stands with nothing new to read: the clock's part in `marks.py`.

`reconcile` is a pure function of its view, and the clock reaches a view only through a few
deadlines: a request's idle timeout running out, the step interval, the load history's window
and held peak, a router's in-flight record going stale (the watcher adds the last two). A model
none of whose readings changed and none of whose deadlines passed would decide exactly what it
did; it is left out of the pass. What is never left out: a model whose last decision had
something to do (an action, which may have failed and is asked again), saw requests in flight
(the routers rewrite their records meanwhile anyway) or held a step back (its message counts the
seconds down).

`LLMGW_VERIFY_SKIPPED_PASSES=<file>` reconciles every model at every pass anyway and appends a
line to the file for every model left out whose decision came out different; the test suite sets
it and fails on any line (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from math import inf

from nomad_driver.watcher.decisions import Decision, ModelView

log = logging.getLogger("llmgw.watcher")

VERIFY_ENV = "LLMGW_VERIFY_SKIPPED_PASSES"


def model_quiet_until(view: ModelView, d: Decision, now: float) -> float:
    """Until when one model's decision stands with nothing new to read: -inf when the next pass
    must decide it again, inf when no deadline of its own moves it."""
    if d.actions or view.in_flight > 0 or d.desired_reason == "step":
        return -inf
    m = view.model
    deadlines = []
    if view.activity is not None:
        # `asked_for` turns false here.
        deadlines.append(view.activity + m.idle_timeout_s + view.activity_grace_s)
    if view.since_step_s < view.step_interval_s:
        deadlines.append(now - view.since_step_s + view.step_interval_s)
    if view.load_held is None and view.scaled_at is not None:
        # A view without load history holds a count it just saw (`desired_for`).
        deadlines.append(view.scaled_at + m.scale_down_delay_s)
    return min((t for t in deadlines if t > now), default=inf)


def verify_file() -> str:
    return os.environ.get(VERIFY_ENV, "")


def record_differences(path: str, before: Mapping[str, Decision], after: Mapping[str, Decision]) -> int:
    """Append each model whose decision a skippable pass changed to `path`; how many."""
    # The test that ran it: a watcher process inherits it from the test that started it.
    during = os.environ.get("PYTEST_CURRENT_TEST", "")
    lines = [
        json.dumps(
            {
                "model": name,
                "during": during,
                "differs": differing_fields(before.get(name), after.get(name)),
                "skipped": repr(before.get(name)),
                "ran": repr(after.get(name)),
            }
        )
        for name in sorted(before.keys() | after.keys())
        if before.get(name) != after.get(name)
    ]
    if lines:
        log.error("event=skipped_pass_differs models=%d file=%s", len(lines), path)
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
    return len(lines)


def differing_fields(a: Decision | None, b: Decision | None) -> list[str]:
    """Which of two decisions' fields differ (a state's, one by one): what the check prints."""
    if a is None or b is None:
        return ["missing"]
    names = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    if "state" in names and a.state is not None and b.state is not None:
        names.remove("state")
        names += [
            f"state.{k}" for k in type(a.state).model_fields if getattr(a.state, k) != getattr(b.state, k)
        ]
    return names
