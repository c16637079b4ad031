"""The count's bookkeeping in the model's state: the ledger stored with it, what a retry and a
new definition forgive, and the count itself for a single- or multi-node model (the rules are
`parking.py`'s and `replica_starts.py`'s; docs/watcher.md states them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from nomad_driver.fields import as_int
from nomad_driver.render import SHARD_GROUP
from nomad_driver.state import CountedStart, ModelState
from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.job_facts import job_create_index, job_def_hash, job_recreated, job_version
from nomad_driver.watcher.parking import (
    FailureCount,
    Ledger,
    count_start_failures,
    count_starts,
)
from nomad_driver.watcher.replica_starts import ReplicaStarts


def ledger_of(state: ModelState) -> Ledger:
    through = (state.counted_through_ns, state.counted_through_alloc) if state.counted_through_alloc else None
    later = tuple((c.started_ns, c.alloc) for c in state.counted_later)
    decided = tuple((c.started_ns, c.alloc) for c in state.counted_decided)
    floor = state.counted_decided_floor
    decided_floor = (floor.started_ns, floor.alloc) if floor is not None else None
    if through is not None and not decided:
        # Stored before starts were named as decided: everything up to `through` was.
        decided_floor = through
    return Ledger(
        state.failures_after_ns,
        through,
        state.counted_failures,
        state.count_job_version,
        later,
        decided,
        decided_floor,
        state.count_job_create_index,
        state.count_def_index,
        state.count_def_after_ns,
    )


def with_ledger(state: ModelState, ledger: Ledger) -> ModelState:
    through_ns, through_alloc = ledger.through or (0, "")
    return state.model_copy(
        update={
            "failures_after_ns": ledger.after_ns,
            "counted_through_alloc": through_alloc,
            "counted_through_ns": through_ns,
            "counted_failures": ledger.counted,
            "count_job_version": ledger.job_version,
            "counted_later": [CountedStart(alloc=alloc, started_ns=ns) for ns, alloc in ledger.later],
            "counted_decided": [CountedStart(alloc=alloc, started_ns=ns) for ns, alloc in ledger.decided],
            "counted_decided_floor": (
                CountedStart(alloc=ledger.decided_floor[1], started_ns=ledger.decided_floor[0])
                if ledger.decided_floor
                else None
            ),
            "count_def_index": ledger.def_index,
            "count_def_after_ns": ledger.def_after_ns,
        }
    )


def cleared(state: ModelState, baseline_ns: int) -> ModelState:
    """Unparked with the count at 0: failures up to `baseline_ns` are forgiven, because a retry
    or a new definition is a fresh start, not the sixth attempt of the old one."""
    state = state.model_copy(
        update={"parked": False, "consecutive_failures": 0, "last_error": "", "parked_def_hash": ""}
    )
    return with_ledger(
        state,
        Ledger(
            after_ns=baseline_ns,
            job_version=state.count_job_version,
            job_created=state.count_job_create_index,
            def_index=state.count_def_index,
            def_after_ns=state.count_def_after_ns,
        ),
    )


def newest_start_ns(view: ModelView, *, created_by: int | None = None) -> int:
    """The newest start Nomad shows; with `created_by`, of allocations created at or before
    that Nomad index only."""
    starts = count_start_failures(
        (a for a in view.allocs if created_by is None or as_int(a.get("CreateIndex")) <= created_by),
        frozenset(),
    )
    return starts.newest_start_ns


def retried(view: ModelView) -> ModelState:
    """The state `llmgw ctl retry` writes."""
    state = view.state or ModelState()
    # Every start Nomad shows or the ledger names, including those Nomad has forgotten since.
    named = [state.failures_after_ns, state.counted_through_ns, *(c.started_ns for c in state.counted_later)]
    newest = max(newest_start_ns(view), *named)
    return cleared(state, newest).model_copy(update={"retried_through_ns": newest})


def counted_definition(view: ModelView, state: ModelState) -> ModelState:
    """The state with its count belonging to the model's current definition.

    A new definition starts its own count: the old count and every start Nomad shows now are
    forgiven, and allocations of job versions older than the first that runs the new definition
    never count (until Nomad has that version, nothing counts)."""
    m = view.model
    if not state.count_def_hash:
        # Written by an llmgw that kept no definition with the count: the count is the current
        # definition's, or that of the definition it was parked under.
        held = state.parked_def_hash if state.parked and state.parked_def_hash else m.def_hash
        state = state.model_copy(update={"count_def_hash": held})
        if held == m.def_hash and (view.state is None or job_def_hash(view.job) != m.def_hash):
            # Nothing counted yet, or no job in Nomad runs it yet: its count begins with the
            # job that runs it, as for a definition that changed.
            state = state.model_copy(update={"count_job_version": -1})
    if state.count_def_hash != m.def_hash:
        # The old definition's starts never count (their job versions are older); the new
        # one's count from the version that brought it, even those that failed before any
        # watcher saw the change (`llmgw apply` registers the job itself).
        state = cleared(state, state.failures_after_ns)
        state = state.model_copy(update={"count_def_hash": m.def_hash, "count_job_version": -1})
    if state.count_job_version < 0 and job_def_hash(view.job) == m.def_hash:
        sighting = _definition_sighting(view)
        if view.state is None:
            # Nothing stored: no watcher has counted this model, and the job's allocations of
            # this version on all count (the definition did not change under them).
            sighting.update(count_def_index=0, count_def_after_ns=0)
        state = state.model_copy(update={"count_job_version": job_version(view.job), **sighting})
    elif job_def_hash(view.job) == m.def_hash and job_recreated(view.job, state):
        # Purged and registered again (`nomad job stop -purge`, Nomad's job GC, a rebuilt
        # cluster): the new job's versions start over at 0, and every one of them counts. Kept
        # at the old version, the ledger would drop each new start, and a crash-looping model
        # would never park.
        # The purged job's allocations ran the same definition: counted as before (the ledger
        # names what it counted), and the new job's are created later than any of them.
        state = state.model_copy(
            update={"count_job_version": 0, "count_job_create_index": job_create_index(view.job)}
        )
    elif not state.count_job_create_index and job_create_index(view.job):
        state = state.model_copy(update={"count_job_create_index": job_create_index(view.job)})
    return state


def _definition_sighting(view: ModelView) -> dict[str, int]:
    """Where the definition's count begins in the job the watcher sees first with it: the
    allocations Nomad created for it count from their first start; those created before (the
    old definition's, updated in place) from their next."""
    index = as_int(view.job.get("JobModifyIndex")) if isinstance(view.job, Mapping) else 0
    return {
        "count_job_create_index": job_create_index(view.job),
        "count_def_index": index,
        # Without Nomad's index (a view built by hand) nothing tells the two apart: what Nomad
        # shows now is forgiven.
        "count_def_after_ns": newest_start_ns(view, created_by=index or None),
    }


def replica_view(view: ModelView) -> ModelView:
    """A multi-node model's view with its leaders' allocations only: a replica is one leader,
    so `starting` counts replicas, not processes (its starts are counted by `replica_starts`)."""
    if view.model.profile.nodes <= 1:
        return view
    leaders = tuple(a for a in view.allocs if a.get("TaskGroup") != SHARD_GROUP)
    return dataclasses.replace(view, allocs=leaders)


def failure_count(
    view: ModelView, replica: ReplicaStarts | None, ledger: Ledger, *, remember: int
) -> FailureCount:
    if replica is None:
        return count_start_failures(view.allocs, view.healthy_starts, ledger, remember=remember)
    return count_starts(replica.starts, view.healthy_starts, ledger, remember=remember)
