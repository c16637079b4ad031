"""The watches' readings as a pass uses them, indexed per model, and the models each new
reading touched.

Each index is made again only when its reading is a new one (readings are never changed once
taken, so `is` tells), and only when a pass builds a view from it: a change that touches no model
costs its comparison, not an index of the fleet.

What a change touches:
- KV: a model's state or activity key that moved, its model; a router's record, the models whose
  requests in flight, busy replicas or asks came out different (and every model when the routers'
  grace for the idle clock moved); the definitions, the models whose definition changed
  (`views.py`). Consul answers a prefix whole, so finding the keys that moved costs a look at each.
- Engines: the models whose entries (their checks' indexes and statuses) moved; also one look
  at each entry, since Consul answers the service whole.
- Jobs, allocations, evaluations: the jobs Nomad's event stream named (`feeds.py` hands them over
  with the reading they made); an allocation of another job that changed what it holds touches
  the multi-node models, whose room it changes. A reading that came with no such hint (a list)
  touches every model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from math import inf
from typing import Any

from nomad_driver.consul import KVEntry
from nomad_driver.state import ACTIVITY_PREFIX, INFLIGHT_PREFIX, STATE_PREFIX, Ask
from nomad_driver.watcher.feeds import OTHER_JOBS
from nomad_driver.watcher.in_flight import asks, requests_in_flight, routers_change_at
from nomad_driver.watcher.replicas import entry_model
from nomad_driver.watcher.sightings import Passing, StartSightings

Everything = None  # a change that touches every model


class Readings:
    def __init__(self, activity_interval_s: float) -> None:
        self.activity_interval_s = activity_interval_s
        self._kv: object = None
        self._kv_index: dict[str, int] = {}
        self._routers: dict[str, KVEntry] = {}
        self._routers_at = -inf  # `now` the in-flight figures were worked out at
        self._routers_due = inf
        self.in_flight: dict[str, int] = {}
        self.busy: dict[str, set[str]] = {}
        self.grace = activity_interval_s
        self.asked: dict[str, tuple[Ask, ...]] = {}
        self._engines: object = None
        self._engine_seen: dict[str, tuple[str, Any]] = {}
        self.engines_by_model: dict[str, list[Mapping[str, Any]]] = {}
        self._allocs: object = None
        self.allocs_by_job: dict[str, list[dict[str, Any]]] = {}
        self.allocs_by_id: dict[str, dict[str, Any]] = {}
        self._evals: object = None
        self.evals_by_job: dict[str, list[dict[str, Any]]] = {}
        self._passing_of: tuple[object, object] = (None, None)
        self._passing = Passing({}, frozenset())

    # What changed

    def kv_touched(self, kv: Mapping[str, KVEntry], now: float) -> set[str] | None:
        """The models whose state, activity or routers' figures a new KV reading (or the clock,
        for a router's record going stale) changed."""
        touched: set[str] = set()
        routers_moved = now >= self._routers_due
        if kv is not self._kv:
            self._kv = kv
            index = {k: e.modify_index for k, e in kv.items()}
            moved = {k for k, _ in index.items() ^ self._kv_index.items()}
            self._kv_index = index
            for key in moved:
                if key.startswith(STATE_PREFIX):
                    touched.add(key[len(STATE_PREFIX) :])
                elif key.startswith(ACTIVITY_PREFIX):
                    touched.add(key[len(ACTIVITY_PREFIX) :])
                elif key.startswith(INFLIGHT_PREFIX):
                    routers_moved = True
            if routers_moved:
                self._routers = {k: e for k, e in kv.items() if k.startswith(INFLIGHT_PREFIX)}
        if routers_moved:
            changed = self._work_out_in_flight(now)
            if changed is Everything:
                return Everything
            touched |= changed
        return touched

    def _work_out_in_flight(self, now: float) -> set[str] | None:
        before = (self.in_flight, self.busy, self.asked, self.grace)
        self.in_flight, self.busy, self.grace = requests_in_flight(
            self._routers, now, self.activity_interval_s
        )
        self.asked = asks(self._routers, now)
        self._routers_at = now
        self._routers_due = routers_change_at(self._routers, now)
        if self.grace != before[3]:
            return Everything
        pairs: list[tuple[Mapping[str, Any], Mapping[str, Any]]] = [
            (before[0], self.in_flight),
            (before[1], self.busy),
            (before[2], self.asked),
        ]
        return {m for old, new in pairs for m in old.keys() | new.keys() if old.get(m) != new.get(m)}

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
        self._engine_seen, self.engines_by_model = seen, by_model
        touched = {m for sid, (m, fp) in seen.items() if before.get(sid) != (m, fp)}
        touched |= {m for sid, (m, _) in before.items() if sid not in seen}
        return touched

    # The indexes a pass builds views from

    def index(
        self,
        kv: Mapping[str, KVEntry],
        now: float,
        allocs: Sequence[dict[str, Any]] | None,
        evals: Sequence[dict[str, Any]],
    ) -> None:
        if kv is not self._kv or now != self._routers_at:
            # Views are built at `now`: what the routers say is worked out for it.
            self.kv_touched(kv, now)
            self._work_out_in_flight(now)
        if allocs is not self._allocs:
            self._allocs = allocs
            by_job: dict[str, list[dict[str, Any]]] = {}
            by_id: dict[str, dict[str, Any]] = {}
            for a in allocs or ():
                by_job.setdefault(str(a.get("JobID")), []).append(a)
                by_id[str(a.get("ID"))] = a
            self.allocs_by_job, self.allocs_by_id = by_job, by_id
        if evals is not self._evals:
            self._evals = evals
            evals_by_job: dict[str, list[dict[str, Any]]] = {}
            for e in evals:
                evals_by_job.setdefault(str(e.get("JobID")), []).append(e)
            self.evals_by_job = evals_by_job

    def passing(self, sightings: StartSightings, engines: Sequence[Mapping[str, Any]]) -> Passing:
        """The starts passing their check now (`sightings.py`), worked out again only when the
        engines or the allocations are a new reading."""
        if self._passing_of != (engines, self._allocs):
            self._passing = sightings.passing(engines, self.allocs_by_id)
            self._passing_of = (engines, self._allocs)
        return self._passing


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
