"""A partial failure: some replicas serve while a slot keeps failing.

The rule (docs/watcher.md, "Partial failure"): a model with a serving replica is never parked.
Parking stops a model that cannot start anywhere; one bad node or GPU under one slot is not
that, and parking would take the serving replicas down with it, turning a partial failure into
an outage. So while a replica serves, no start counts towards parking (`parking.count_starts`),
and the model is shown `degraded`: which slot, on which node, and why. Nomad restarts and
reschedules that slot by its own policy (a reschedule avoids the node it failed on), and its
budgets bound how often; when they are spent, llmgw does not force more attempts beside a
serving replica unless an operator asks (`llmgw ctl retry`). If the serving replicas go, the
count starts from there, and five failed starts park the model as usual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nomad_driver.watcher.parking import Start, StartId

# Allocations that hold a slot: running or starting, or failed and not yet replaced.
_HOLDING = {"pending", "running", "failed"}


@dataclass(frozen=True)
class FailingSlot:
    alloc_id: str
    task: str
    node: str
    failures: int  # failed starts in a row in this allocation, newest last
    error: str  # what Nomad's task event said; the watcher reads the engine's own words after


def failing_slots(
    allocs: Iterable[Mapping[str, Any]],
    starts: Iterable[Start],
    healthy: frozenset[StartId],
    job_version: int,
) -> list[FailingSlot]:
    """The slots of the current definition whose newest finished start failed and that do not
    pass now; a failed allocation Nomad already replaced is not a slot any more (its
    replacement is judged on its own)."""
    by_alloc: dict[str, list[Start]] = {}
    for s in starts:
        by_alloc.setdefault(s.alloc_id, []).append(s)
    out = []
    for alloc in allocs:
        alloc_id = str(alloc.get("ID") or "")
        if alloc.get("DesiredStatus") != "run" or alloc.get("ClientStatus") not in _HOLDING:
            continue
        if alloc.get("NextAllocation"):
            continue
        mine = sorted(by_alloc.get(alloc_id, ()), key=lambda s: s.time_ns)
        if not mine or mine[0].job_version < job_version or any(s.ident in healthy for s in mine):
            continue
        ended = [s for s in mine if s.ended]
        in_a_row = 0
        for s in reversed(ended):
            if not s.failed:
                break
            in_a_row += 1
        if in_a_row:
            node = str(alloc.get("NodeName") or alloc.get("NodeID") or "(unknown)")
            out.append(FailingSlot(alloc_id, ended[-1].task, node, in_a_row, ended[-1].error))
    return sorted(out, key=lambda f: (f.node, f.alloc_id))


@dataclass(frozen=True)
class Degraded:
    """A partial failure as a pass decided it: the failing slots (the first is named) and the
    spent ones among them, for restating it with the engine's own words."""

    slots: tuple[FailingSlot, ...]
    spent: tuple[str, ...]

    def text(self, model: str, error: str = "") -> str:
        slots = list(self.slots)
        if slots and error:
            slots[0] = dataclasses.replace(slots[0], error=error)
        return degraded_text(model, slots, self.spent)


def degraded_text(model: str, slots: list[FailingSlot], spent: Iterable[str]) -> str:
    """What `ctl status`, the admin API and the Consul UI say of a degraded model."""
    if not slots:
        return ""
    first = slots[0]
    text = (
        f"the replica {first.alloc_id[:8]} on node {first.node} failed {first.failures} "
        f"start(s) in a row: {first.error or 'no error recorded'}"
    )
    if len(slots) > 1:
        text += f" (and {len(slots) - 1} more failing slot(s))"
    given_up = [a for a in spent if a in {s.alloc_id for s in slots}]
    if given_up:
        text += (
            "; Nomad's reschedule attempts for it are spent, so it stays down beside the serving "
            f"replicas: fix the node, or run 'llmgw ctl retry {model}' to ask Nomad again"
        )
    else:
        text += "; Nomad restarts or moves it"
    return text
