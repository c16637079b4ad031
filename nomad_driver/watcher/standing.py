"""What stands between passes, per model: its last view and decision, its replicas, the jobs
whose evaluations it reads, the failed starts whose stderr it quotes.

A pass reconciles only the models marked for it (`marks.py`); what it makes of them replaces
their entries here, and every other model's entries stand as its last pass left them. A full
pass replaces everything, and so forgets the models no longer defined.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nomad_driver.watcher.decisions import Decision, ModelView, Park
from nomad_driver.watcher.engine_errors import StartKey
from nomad_driver.watcher.evaluations import jobs_needing_evaluations
from nomad_driver.watcher.replicas import Since, list_replicas
from nomad_driver.watcher.rollout import job_ids


def parks_of(d: Decision) -> set[StartKey]:
    """The failed starts a decision quotes the engine's words for."""
    parks = {(a.alloc_id, a.task, a.failures) for a in d.actions if isinstance(a, Park)}
    if d.degraded is not None:
        parks |= {(s.alloc_id, s.task, s.failures) for s in d.degraded.slots[:1]}
    return parks


class Standing:
    def __init__(self) -> None:
        self.views: dict[str, ModelView] = {}
        self.decisions: dict[str, Decision] = {}
        self._replicas: dict[str, list[dict[str, Any]]] = {}
        self._since: dict[str, Since] = {}
        self._evaluations: dict[str, frozenset[str]] = {}
        self._parks: dict[str, set[StartKey]] = {}

    def merge(self, views: dict[str, ModelView], decisions: dict[str, Decision], *, full: bool) -> None:
        """A pass's views and decisions as it made them; `acted` adds what acting made of them."""
        if full:
            self.views, self.decisions = views, decisions
            for kept in (self._replicas, self._since, self._evaluations, self._parks):
                for name in [n for n in kept if n not in views]:
                    del kept[name]
        else:
            self.views.update(views)
            self.decisions.update(decisions)
        for name, view in views.items():
            needed = jobs_needing_evaluations([view])
            if needed:
                self._evaluations[name] = needed
            else:
                self._evaluations.pop(name, None)
            parks = parks_of(decisions[name])
            if parks:
                self._parks[name] = parks
            else:
                self._parks.pop(name, None)

    def acted(self, decisions: Mapping[str, Decision]) -> None:
        """What acting made of a pass's decisions (a refused park is not parked, a write shows
        in the Consul UI's words). A full pass's dict is the standing one already; a pass over
        some models copied its entries in at `merge`, before acting."""
        if decisions is self.decisions:
            return
        for name, d in decisions.items():
            if name in self.decisions:
                self.decisions[name] = d

    def forget(self, models: Iterable[str]) -> None:
        """Models no longer defined, found by a pass that did not reconcile every model."""
        for name in models:
            for kept in (
                self.views,
                self.decisions,
                self._replicas,
                self._since,
                self._evaluations,
                self._parks,
            ):
                kept.pop(name, None)

    def evaluations_needed(self) -> frozenset[str]:
        return frozenset().union(*self._evaluations.values())

    def parks(self) -> set[StartKey]:
        return set().union(*self._parks.values())

    def update_replicas(
        self,
        views: Mapping[str, ModelView],
        engines_by_model: Mapping[str, list[Mapping[str, Any]]],
        allocs_by_job: Mapping[str, Sequence[dict[str, Any]]],
        now: float,
        fabrics: Mapping[str, str],
    ) -> None:
        """The replicas of the models a pass reconciled, from only their engines and jobs."""
        for name, view in views.items():
            allocs = [a for jid in job_ids(view.model) for a in allocs_by_job.get(jid, ())]
            rows, since = list_replicas(
                {name: view}, engines_by_model.get(name, ()), allocs, self._since.get(name, {}), now, fabrics
            )
            self._replicas[name], self._since[name] = rows, since

    @property
    def replicas(self) -> list[dict[str, Any]]:
        """Every replica of every defined model, in list_replicas' order."""
        return [row for name in sorted(self._replicas) for row in self._replicas[name]]
