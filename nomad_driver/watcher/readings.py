"""The watches' readings as a pass uses them, indexed per model, and the models each new
reading touched.

Each index is made again only when its reading is a new one (readings are never changed once
taken, so `is` tells), and only when a pass builds a view from it: a change that touches no model
costs its comparison, not an index of the fleet.

What a change touches:
- KV: a model's state or activity key that moved, its model; a router's record, the models whose
  requests in flight, busy replicas or asks came out different (and every model when the routers'
  grace for the idle clock moved); the definitions, the models whose definition changed
  (`marks.py`). Consul answers a prefix whole, so finding the keys that moved costs a look at each.
- Engines: the models whose entries (their checks' indexes and statuses) moved; also one look
  at each entry, since Consul answers the service whole.
- Jobs, allocations, evaluations: the jobs Nomad's event stream named (`feeds.py` hands them over
  with the reading they made); an allocation of another job that changed what it holds touches
  the multi-node models, whose room it changes. A reading that came with no such hint (a list)
  touches every model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from math import inf
from typing import Any

from nomad_driver.consul import KVEntry
from nomad_driver.state import ACTIVITY_PREFIX, STATE_PREFIX, Ask
from nomad_driver.watcher.feeds import OTHER_JOBS, ByJob
from nomad_driver.watcher.in_flight import asks, requests_in_flight, routers_change_at
from nomad_driver.watcher.replicas import entry_model
from nomad_driver.watcher.sightings import Passing, StartSightings

log = logging.getLogger("llmgw.watcher")

Everything = None  # a change that touches every model


@dataclass(frozen=True)
class KVParts:
    """A reading of each `llmgw/` prefix the watcher decides from (`kv_watches.py`)."""

    config: Mapping[str, KVEntry] = field(default_factory=dict)
    config_index: int | None = None
    states: Mapping[str, KVEntry] = field(default_factory=dict)
    states_index: int | None = None
    activity: Mapping[str, KVEntry] = field(default_factory=dict)
    routers: Mapping[str, KVEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class Figures:
    """What the routers' records say at one moment (`in_flight.py`)."""

    in_flight: dict[str, int]
    busy: dict[str, set[str]]
    asked: dict[str, tuple[Ask, ...]]
    grace: float

    def differences(self, other: Figures) -> set[str]:
        """The models whose requests in flight, busy replicas or asks differ."""
        pairs: list[tuple[Mapping[str, Any], Mapping[str, Any]]] = [
            (self.in_flight, other.in_flight),
            (self.busy, other.busy),
            (self.asked, other.asked),
        ]
        return {m for old, new in pairs for m in old.keys() | new.keys() if old.get(m) != new.get(m)}


def figures(routers: Mapping[str, KVEntry], now: float, least_grace_s: float) -> Figures:
    in_flight, busy, grace = requests_in_flight(routers, now, least_grace_s)
    return Figures(in_flight, busy, asks(routers, now), grace)


class Readings:
    def __init__(self, activity_interval_s: float) -> None:
        self.activity_interval_s = activity_interval_s
        # What the last look at each KV prefix saw: the base the next one is compared with.
        self._seen: dict[str, tuple[object, dict[str, int]]] = {}
        self._routers_seen: object = None
        self._routers_due = inf
        self._figures_seen: Figures = Figures({}, {}, {}, activity_interval_s)
        # What the routers say, worked out at the `now` a pass builds its views at.
        self._figures_of: tuple[object, float] = (None, -inf)
        self.figures = self._figures_seen
        self._engines: object = None
        self._engine_seen: dict[str, tuple[str, Any]] = {}
        self.engines_by_model: dict[str, list[Mapping[str, Any]]] = {}
        self._engines_indexed: object = None
        self._allocs: object = None
        self.allocs_by_job: Mapping[str, Sequence[dict[str, Any]]] = {}
        self._evals: object = None
        self.evals_by_job: Mapping[str, Sequence[dict[str, Any]]] = {}

    # What changed

    def kv_touched(self, kv: KVParts, now: float) -> set[str] | None:
        """The models whose state, activity or routers' figures a new KV reading (or the clock,
        for a router's record going stale) changed."""
        touched: set[str] = set()
        for prefix, data in ((STATE_PREFIX, kv.states), (ACTIVITY_PREFIX, kv.activity)):
            seen = self._seen.get(prefix)
            if seen is not None and data is seen[0]:
                continue
            index = {k: e.modify_index for k, e in data.items()}
            moved = {k for k, _ in index.items() ^ (seen[1] if seen else {}).items()}
            self._seen[prefix] = (data, index)
            touched |= {k[len(prefix) :] for k in moved}
        if kv.routers is not self._routers_seen or now >= self._routers_due:
            self._routers_seen = kv.routers
            self._routers_due = routers_change_at(kv.routers, now)
            before, after = self._figures_seen, figures(kv.routers, now, self.activity_interval_s)
            self._figures_seen = after
            if after.grace != before.grace:
                return Everything
            touched |= before.differences(after)
        return touched

    def routers_due(self) -> float:
        """When a router's record next changes what it says with nothing written."""
        return self._routers_due

    def engines_touched(self, entries: Sequence[Mapping[str, Any]]) -> set[str]:
        if entries is self._engines:
            return set()
        self._engines = entries
        seen: dict[str, tuple[str, Any]] = {}
        by_model: dict[str, list[Mapping[str, Any]]] = {}
        for e in entries:
            svc = e.get("Service")
            sid = str(svc.get("ID", "")) if isinstance(svc, dict) else ""
            checks = e.get("Checks")
            marks = (
                tuple(
                    (c.get("CheckID"), c.get("Status"), c.get("ModifyIndex"))
                    for c in checks
                    if isinstance(c, dict)
                )
                if isinstance(checks, list)
                else None
            )
            model = entry_model(e)
            by_model.setdefault(model, []).append(e)
            seen[sid] = (model, (svc.get("ModifyIndex") if isinstance(svc, dict) else None, marks))
        before = self._engine_seen
        self._engine_seen, self.engines_by_model, self._engines_indexed = seen, by_model, entries
        moved = [sid for sid, mark in seen.items() if before.get(sid) != mark]
        gone = [sid for sid in before if sid not in seen]
        touched = {seen[sid][0] for sid in moved} | {before[sid][0] for sid in gone}
        # Consul answers the service whole (15 MB at 10,000 instances): say what moved, so a
        # read that changed nothing, or a wave, can be traced to its cause (debug: one a read).
        example = moved[0] if moved else gone[0] if gone else ""
        log.debug(
            "event=engines_changed instances=%d changed=%d gone=%d models=%d e.g.=%r was=%r now=%r",
            len(seen),
            len(moved),
            len(gone),
            len(touched),
            example,
            before.get(example),
            seen.get(example),
        )
        return touched

    # The indexes a pass builds views from

    def index(
        self,
        kv: KVParts,
        now: float,
        allocs: Sequence[dict[str, Any]] | None,
        evals: Sequence[dict[str, Any]],
        engines: Sequence[Mapping[str, Any]],
        indexes: Sequence[ByJob] = (),
    ) -> None:
        """Index the readings a pass builds views from; `indexes`: the feeds' own, used for the
        reading each was made with."""
        if engines is not self._engines_indexed:
            by_model: dict[str, list[Mapping[str, Any]]] = {}
            for e in engines:
                by_model.setdefault(entry_model(e), []).append(e)
            self.engines_by_model, self._engines_indexed = by_model, engines
        if self._figures_of != (kv.routers, now):
            # Views are built at `now`: what the routers say is worked out for it.
            self.figures = figures(kv.routers, now, self.activity_interval_s)
            self._figures_of = (kv.routers, now)
        if allocs is not self._allocs:
            self._allocs = allocs
            indexed = next((i for i in indexes if i.data is allocs), None)
            if indexed is not None:
                # The feed's, made with this reading as events came: nothing to go over.
                self.allocs_by_job = indexed.by_job
            else:
                by_job: dict[str, list[dict[str, Any]]] = {}
                for a in allocs or ():
                    by_job.setdefault(str(a.get("JobID")), []).append(a)
                self.allocs_by_job = by_job
        if evals is not self._evals:
            self._evals = evals
            indexed = next((i for i in indexes if i.data is evals), None)
            if indexed is not None:
                self.evals_by_job = indexed.by_job
            else:
                evals_by_job: dict[str, list[dict[str, Any]]] = {}
                for e in evals:
                    evals_by_job.setdefault(str(e.get("JobID")), []).append(e)
                self.evals_by_job = evals_by_job

    def allocs_of(self, job_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The allocations of a model's jobs, by ID: all a view looks up by ID (its engines'
        and its busy replicas' allocations are its own)."""
        return {str(a.get("ID")): a for job in job_ids for a in self.allocs_by_job.get(job, ())}

    def passing(self, sightings: StartSightings, model: str, allocs_by_id: Mapping[str, Any]) -> Passing:
        """One model's engines passing their check now, and the starts they vouch for
        (`sightings.py`): worked out when its view is built, from its own entries only."""
        return sightings.passing(self.engines_by_model.get(model, ()), allocs_by_id)


def touched_models(
    hints: Iterable[str] | None, job_models: Mapping[str, str], multinode: Iterable[str]
) -> set[str] | None:
    """The models a batch of Nomad's events named (job IDs; `OTHER_JOBS` for another job's
    allocation), or Everything."""
    if hints is None:
        return Everything
    touched: set[str] = set()
    for job_id in hints:
        if job_id == OTHER_JOBS:
            touched.update(multinode)
        elif job_id in job_models:
            touched.add(job_models[job_id])
    return touched
