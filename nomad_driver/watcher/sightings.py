"""Which start an allocation's passing check vouches for.

A model's service is a group service: Nomad registers it once per allocation and keeps it, and
its check, across the engine's restarts in place. So a passing check says that some start of
the allocation answered, not which. Consul runs the check every few seconds; an engine that
dies and restarts between two runs leaves the last start's `passing` standing over the new one,
and a crash loop faster than the check would read as healthy starts, never counted, never
parked. Nor can the watcher tell by time: Nomad's allocations and Consul's checks come from two
watches, and either can be behind the other (the allocations while a Nomad server restarts, say).

What tells is the check's index. llmgw's readiness checks answer the same words every time, so
Consul moves a check's ModifyIndex only when its status changes, and a passing check at an
index no earlier start of the allocation was credited at comes from a new passing episode: the
current start's. Each allocation keeps the first index its check passed at under each start,
and a later start is credited only by a passing index above all of those. So a start that turned
healthy while the watcher's view of Nomad lagged is credited as soon as Nomad shows it (its
passing index is new, whenever Consul reported it), and a start under a check left over from the
last one is not. A watcher that has just started knows no earlier episode, and takes a passing
check for the start Nomad shows, as it always has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nomad_driver.fields import as_int
from nomad_driver.watcher import parking
from nomad_driver.watcher.replicas import entry_alloc_id, entry_def_hash, entry_model, passing


@dataclass(frozen=True)
class Passing:
    ready: dict[str, int]  # engines passing their check, per model
    healthy: frozenset[parking.StartId]  # the starts those checks vouch for
    # Of them, those whose allocation Nomad lists, per job (a rollout runs two per model), and
    # all of them per model and the definition their service says they run.
    ready_by_job: dict[str, int] = field(default_factory=dict)
    ready_by_definition: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass
class _Episodes:
    """One allocation's check as the watcher has read it."""

    start: parking.StartId | None  # the allocation's current start when last read
    floor: int  # passing at or below this index was an earlier start's
    first: int  # the index the check first passed at under `start` (0: not yet)


def check_index(entry: Mapping[str, Any]) -> int:
    """The index of the service's own check (the node's serfHealth moves with the node)."""
    checks = [c for c in entry.get("Checks") or [] if isinstance(c, Mapping)]
    own = [c for c in checks if c.get("ServiceID")] or checks
    return max((as_int(c.get("ModifyIndex")) for c in own), default=0)


class StartSightings:
    def __init__(self) -> None:
        self._episodes: dict[str, _Episodes] = {}

    def passing(
        self, entries: Iterable[Mapping[str, Any]], allocs_by_id: Mapping[str, Mapping[str, Any]]
    ) -> Passing:
        """The engines passing in Consul's answer (all of them, or one model's), and the starts
        they vouch for in Nomad's."""
        ready: dict[str, int] = {}
        ready_by_job: dict[str, int] = {}
        ready_by_definition: dict[tuple[str, str], int] = {}
        healthy: set[parking.StartId] = set()
        for entry in entries:
            ok = passing(entry)
            if ok:
                model = entry_model(entry)
                ready[model] = ready.get(model, 0) + 1
                defined = (model, entry_def_hash(entry))
                ready_by_definition[defined] = ready_by_definition.get(defined, 0) + 1
            alloc_id = entry_alloc_id(entry)
            alloc = allocs_by_id.get(alloc_id) if alloc_id else None
            if alloc_id is None or alloc is None:
                continue
            if ok:
                job_id = str(alloc.get("JobID") or "")
                ready_by_job[job_id] = ready_by_job.get(job_id, 0) + 1
            start = parking.current_start(alloc)
            known = self._episodes.get(alloc_id)
            if known is None:
                known = self._episodes[alloc_id] = _Episodes(start, 0, 0)
            elif known.start != start:
                known.start, known.floor, known.first = start, max(known.floor, known.first), 0
            if not ok or start is None:
                continue
            index = check_index(entry)
            if index > known.floor:
                healthy.add(start)
                known.first = known.first or index
        return Passing(ready, frozenset(healthy), ready_by_job, ready_by_definition)

    def forget_gone(self, listed: set[str]) -> None:
        """Allocations Nomad no longer lists are done with (a full pass's look at all of them)."""
        for gone in set(self._episodes) - listed:
            del self._episodes[gone]
