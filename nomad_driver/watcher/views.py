"""What the watcher knows of each model beyond one pass's readings, and the views made from both.

The readings (KV, jobs, allocations, evaluations, engines, nodes) are the watches'; what outlives
a pass is kept here: the definitions last read (and the last good copy, to put back if the keys
disappear), when each job's count was first seen and last changed (the scale-down delay and the
step limit), the load over recent passes, the last pass that saw requests in flight, and which
start each passing check vouches for. `build` makes every defined model's `ModelView`, which
`reconcile` decides from.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from math import inf
from typing import Any

from nomad_driver.config_kv import CONFIG_PREFIX, LEGACY_MODELS_KEY, StoredDefinitions, definition_keys
from nomad_driver.config_store import StoreConflict, store_keys
from nomad_driver.consul import Consul, ConsulError, KVEntry
from nomad_driver.placement import FabricRoom, eligible_nodes, fabric_rooms
from nomad_driver.spec import Model, SpecError, decode_models_text
from nomad_driver.state import (
    ACTIVITY_PREFIX,
    MalformedState,
    ModelState,
    parse_activity,
    parse_state,
    state_key,
)
from nomad_driver.watcher.decisions import ModelView, PreviousJob
from nomad_driver.watcher.feeds import ByJob
from nomad_driver.watcher.fenced import FencedStates
from nomad_driver.watcher.job_facts import job_def_hash, job_group
from nomad_driver.watcher.readings import KVParts, Readings
from nomad_driver.watcher.replicas import busy_floor_of
from nomad_driver.watcher.rollout import choose_jobs, job_ids
from nomad_driver.watcher.scaling import Load, LoadHistory
from nomad_driver.watcher.sightings import StartSightings

log = logging.getLogger("llmgw.watcher")


class Definitions(StoredDefinitions):
    """The definitions as last read from `llmgw/config/` (`config_kv.py`), and the last good
    values, to put back if they disappear: without them the routers forget every model and
    answer 404 until someone re-applies, while the watchers still know exactly what was
    defined."""

    def __init__(self) -> None:
        super().__init__()
        self._kv_index: int | None = -1

    def load(self, kv: Mapping[str, KVEntry], kv_index: int | None = None) -> None:
        # The KV snapshot is all of `llmgw/`: most of its changes are states and activity, and
        # a snapshot at the index already read holds no new definitions.
        if kv_index is not None and kv_index == self._kv_index:
            return
        self._kv_index = kv_index
        self.read(kv)

    async def restore(self, consul: Consul) -> None:
        # Create-only: an operator's apply in the meantime always wins over this copy.
        raw = self.raw
        try:
            if LEGACY_MODELS_KEY in raw:
                raw = definition_keys(decode_models_text(raw[LEGACY_MODELS_KEY], LEGACY_MODELS_KEY))
            result = await store_keys(consul, raw, create_only=True)
        except (ConsulError, StoreConflict, SpecError) as exc:
            log.warning("event=definitions_restore_failed prefix=%s error=%r", CONFIG_PREFIX, str(exc))
            return
        self.missing = False
        if result.changed:
            log.warning("event=definitions_restored prefix=%s models=%d", CONFIG_PREFIX, len(self.models))


class ViewBuilder:
    """Each model's memory across passes, and the views a pass makes from it."""

    def __init__(
        self,
        states: FencedStates,
        *,
        up_window_s: float,
        activity_interval_s: float,
        scale_step_interval_s: float,
    ) -> None:
        self.states = states
        self.activity_interval_s = activity_interval_s
        self.scale_step_interval_s = scale_step_interval_s
        self.definitions = Definitions()
        self.scaled_at: dict[str, tuple[int, float]] = {}
        # When the watcher saw each job's count change (-inf: not since it started), for the
        # step rate limit; and the load each model had over the recent passes.
        self.stepped_at: dict[str, tuple[int, float]] = {}
        self.load = LoadHistory(up_window_s)
        # The last pass that saw requests in flight per model: a request the watcher saw is
        # activity, whatever (or however poisoned) the router's activity key says after it.
        self.last_in_flight: dict[str, float] = {}
        # Which start each allocation's passing check vouches for (`sightings.py`).
        self.sightings = StartSightings()
        # The readings indexed per model, each made again only when it changed (`readings.py`).
        self.readings = Readings(activity_interval_s)
        self.malformed_reported: set[tuple[str, int]] = set()

    def keep_only_defined(self) -> None:
        models = self.definitions.models
        self.load.keep_only(models)
        self.last_in_flight = {m: t for m, t in self.last_in_flight.items() if m in models}

    def state_for(self, model: str, kv: Mapping[str, KVEntry]) -> tuple[ModelState | None, int, str]:
        key = state_key(model)
        entry = kv.get(key)
        index = entry.modify_index if entry else 0
        written = self.states.pending(model)
        if written is not None and written[0] > index:
            return written[1], written[0], ""
        if entry is None:
            return None, 0, ""
        try:
            return parse_state(key, entry.value), index, ""
        except MalformedState as exc:
            if (key, index) not in self.malformed_reported:
                self.malformed_reported.add((key, index))
                log.error(
                    "event=state_malformed model=%s key=%s error=%r action=replace", model, key, str(exc)
                )
            return None, index, str(exc)

    def build(
        self,
        now: float,
        kv: KVParts,
        jobs: Mapping[str, Mapping[str, Any]],
        allocs: Sequence[dict[str, Any]] | None,
        evals: Sequence[dict[str, Any]],
        engines: Sequence[Mapping[str, Any]],
        nodes: Sequence[Mapping[str, Any]] | None,
        jobs_read: bool = True,
        only: Collection[str] | None = None,
        indexes: Sequence[ByJob] = (),
    ) -> dict[str, ModelView]:
        """Every defined model's view from one pass's readings (`allocs`/`nodes` None: not
        read yet, which multi-node rooms wait for). Before Nomad's jobs are read
        (`jobs_read` False) every model looks absent: its views are built, but nothing is
        remembered as first seen, or a watcher's start would seed its holds with no replicas.
        `only`: the models to build (None: every one)."""
        if kv.states_index is not None:
            self.states.settle(kv.states_index)
        self.definitions.load(kv.config, kv.config_index)
        readings = self.readings
        readings.index(kv, now, allocs, evals, engines, indexes)
        allocs_by_job = readings.allocs_by_job
        evals_by_job = readings.evals_by_job

        if only is None:
            self.sightings.forget_gone({str(a.get("ID")) for a in allocs or ()})

        in_flight, busy, grace = readings.figures.in_flight, readings.figures.busy, readings.figures.grace
        asked = readings.figures.asked
        defined = self.definitions.models
        chosen = defined.items() if only is None else ((n, defined[n]) for n in sorted(only) if n in defined)
        views: dict[str, ModelView] = {}
        for name, model in chosen:
            # The starts passing their check now: a fact of these snapshots, not a memory. Which
            # start was ever healthy outlives it only through the model's stored count (baseline).
            allocs_by_id = readings.allocs_of(job_ids(model))
            passing_now = readings.passing(self.sightings, name, allocs_by_id)
            ready, healthy = passing_now.ready, passing_now.healthy
            job_id, previous_id = choose_jobs(model, jobs, passing_now.ready_by_job)
            job = jobs.get(job_id)
            previous = None
            if previous_id is not None:
                previous_allocs = allocs_by_job.get(previous_id, ())
                # Its replicas by the definition their service carries, not by their allocation:
                # an engine whose allocation this reading lacks is still the old definition's.
                previous_hash = job_def_hash(jobs[previous_id])
                previous = PreviousJob(
                    previous_id,
                    jobs[previous_id],
                    passing_now.ready_by_definition.get((name, previous_hash), 0),
                    sum(
                        1
                        for a in previous_allocs
                        if a.get("DesiredStatus") == "run" and a.get("ClientStatus") in ("pending", "running")
                    ),
                )
            _, count = job_group(job)
            seen = self.scaled_at.get(job_id)
            if not jobs_read:
                seen = (count, now)
            elif seen is None or seen[0] != count:
                # First sight after a start counts as "just scaled", which only delays a
                # scale-down by one idle timeout; never the other way round.
                self.scaled_at[job_id] = seen = (count, now)
            stepped = self.stepped_at.get(job_id)
            if not jobs_read:
                stepped = (count, -inf)
            elif stepped is None or stepped[0] != count:
                self.stepped_at[job_id] = stepped = (count, -inf if stepped is None else now)
            state, index, problem = self.state_for(name, kv.states)
            activity_entry = kv.activity.get(f"{ACTIVITY_PREFIX}{name}")
            requests = in_flight.get(name, 0)
            if requests > 0:
                self.last_in_flight[name] = now
            activity = parse_activity(activity_entry.value, now) if activity_entry else None
            seen_busy = self.last_in_flight.get(name)
            if seen_busy is not None:
                activity = seen_busy if activity is None else max(activity, seen_busy)
            if jobs_read:
                # Its last decision stood until now, which is what it asked for until now.
                self.load.stood_until(name, now)
            load = (
                self.load.observe(name, now, requests, count, model.scale_down_delay_s)
                if jobs_read
                else Load(float(requests), count)
            )
            model_allocs = allocs_by_job.get(job_id, ())
            views[name] = ModelView(
                model=model,
                job=job,
                allocs=tuple(model_allocs),
                evals=tuple(evals_by_job.get(job_id, ())),
                # The current definition's: a previous one's serving replicas are not its own.
                ready=max(0, ready.get(name, 0) - (previous.ready if previous is not None else 0)),
                healthy_starts=healthy,
                state=state,
                state_index=index,
                state_problem=problem,
                activity=activity,
                scaled_at=seen[1],
                now=now,
                in_flight=requests,
                busy_replicas=len(busy.get(name, ())),
                in_flight_average=load.average,
                load_held=load.held,
                busy_floor=busy_floor_of(
                    busy.get(name, set()), allocs_by_id, requests, model.target_in_flight, count=count
                ),
                since_step_s=now - stepped[1],
                step_interval_s=self.scale_step_interval_s,
                asks=asked.get(name, ()),
                activity_grace_s=grace,
                fabric_rooms=self._fabric_rooms(model, job_id, nodes, allocs),
                job_id=job_id,
                previous=previous,
            )
        return views

    def _fabric_rooms(
        self,
        model: Model,
        job_id: str,
        nodes: Sequence[Mapping[str, Any]] | None,
        allocs: Sequence[dict[str, Any]] | None,
    ) -> tuple[FabricRoom, ...] | None:
        """A multi-node model's room in each fabric, the nodes of its current job's replica
        counted as free (a previous definition's, rolled out beside, are taken)."""
        if model.profile.nodes <= 1 or nodes is None or allocs is None:
            return None
        others = [dict(a) for a in allocs if a.get("JobID") != job_id]
        eligible = eligible_nodes(nodes, model.profile)
        return tuple(fabric_rooms(eligible, others, model.name))
