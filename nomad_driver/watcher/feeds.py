"""Allocations and the model jobs, followed through Nomad's event stream (`/v1/event/stream`)
instead of listed again at every change.

A blocking `/v1/allocations` answers every allocation of the namespace again whenever any one
changes (2.9 MB a change at 1,000 models, bench/watcher_bench.py), and `/v1/jobs` wakes at every
job summary change, so at every allocation's too (600 kB a change). Here each collection is
listed once, then followed from the list's index by its topic's events. A change costs its event
and, for an allocation of llmgw's, a read of that one allocation's list entry: the event carries
the allocation without its job, so without the `JobVersion` each counted start is tied to. An
allocation of another job costs nothing more, and wakes no pass unless what the watcher reads of
it (whether it holds what it was given, where, and what) changed.

Nomad sends no event when it garbage-collects an allocation, and a subscriber that fell behind,
or that asked for an index older than the server's event buffer, is told nothing: it just gets
fewer events. So every end of the stream lists again, and so does the passing of `RESYNC_S`: a
collected allocation lingers that long at most, and so would anything a gap hid.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from math import inf
from typing import Any, Generic, TypeVar

from nomad_driver.fields import as_int
from nomad_driver.nomad import JOB_PREFIX, EventStream, Nomad

T = TypeVar("T")

# A change hint's stand-in for "another job's allocation": it touches the multi-node models.
OTHER_JOBS = ""

RESYNC_S = 300.0
# Past this many of llmgw's allocations changed in one batch of frames (a fleet rescheduled after
# a node died), one list costs less than a read each.
READ_EACH_UP_TO = 32
# What the watcher reads of another job's allocation that it keeps (that holds what it was
# given, pending, running or unknown alike): where, and what. A restart in place flips its
# client status between running and pending, which changes neither.
_HOLDING_FIELDS = ("NodeID", "NodeName", "AllocatedResources")


class _Feed(Generic[T]):
    """One collection: listed, then followed by one topic's events. `fetch` is a
    `nomad_driver.blocking.Watch` fetch: index 0 (a first call, or one after a failure) lists
    again; otherwise it waits for events, and returns a new index only when what it holds
    changed, so a change the watcher does not read wakes no pass."""

    topic = ""

    def __init__(
        self,
        nomad: Nomad,
        wait_s: float,
        *,
        resync_s: float = RESYNC_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nomad = nomad
        self.wait_s = wait_s
        self.resync_s = resync_s
        self.clock = clock
        self.stream: EventStream | None = None
        self.index = 0  # what a reader was last told
        self.applied = 0  # the newest frame taken in (frames at or below it are replays)
        self.listed_at = -inf
        self.lists = 0  # full lists made, for tests and the benchmark
        # The jobs whose entries changed since the watcher last took them (`readings.py`), or
        # None: a list that changed what is held, which may touch any of them.
        self._changes: set[str] | None = set()

    def take_changes(self) -> set[str] | None:
        changes, self._changes = self._changes, set()
        return changes

    def changed(self, job_id: str) -> None:
        if self._changes is not None:
            self._changes.add(job_id)

    async def fetch(self, index: int) -> tuple[int, T]:
        try:
            if index == 0 or self.stream is None or self.clock() - self.listed_at >= self.resync_s:
                return await self._list()
            frame = await self.stream.next(self.wait_s)
            if frame is None:
                return self.index, self.data()
            frames = [frame, *self.stream.pending()]
            events: list[dict[str, Any]] = []
            for f in frames:
                at = as_int(f.get("Index"))
                if at <= self.applied:
                    continue
                self.applied = at
                events += [
                    e for e in f.get("Events") or () if isinstance(e, dict) and e.get("Topic") == self.topic
                ]
            if events and await self.apply(events):
                self.index = max(self.index + 1, self.applied)
            return self.index, self.data()
        except BaseException:
            self.close()
            raise

    async def _list(self) -> tuple[int, T]:
        self.close()
        held = self.data() if self.lists else None
        index = await self.list_all()
        self.lists += 1
        self.listed_at = self.clock()
        # Events after the list's index; one at it, replayed by a server whose buffer starts
        # there, is skipped as already listed.
        self.applied = index
        # A list again (the resync, a stream that ended) that finds what is held is handed on
        # under the index the reader has: the namespace's index moves for every job's changes,
        # and a new one would wake a pass over every model for nothing.
        if held is None or self.index == 0 or self.data() != held:
            self.index = index
            self._changes = None
        self.stream = EventStream(self.nomad, [self.topic], index + 1)
        return self.index, self.data()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    async def list_all(self) -> int:
        raise NotImplementedError

    async def apply(self, events: list[dict[str, Any]]) -> bool:
        """Take in one batch of the topic's events; whether what is held changed."""
        raise NotImplementedError

    def data(self) -> T:
        raise NotImplementedError


class AllocationFeed(_Feed[tuple[dict[str, Any], ...]]):
    """The allocations of llmgw's jobs, and other jobs' that hold what they were given (`kept`),
    as `/v1/allocations?resources=true` lists them."""

    topic = "Allocation"

    def __init__(
        self, nomad: Nomad, wait_s: float, kept: Callable[[Mapping[str, Any]], bool], **kw: Any
    ) -> None:
        super().__init__(nomad, wait_s, **kw)
        self.kept = kept
        self.by_id: dict[str, dict[str, Any]] = {}
        self._data: tuple[dict[str, Any], ...] = ()
        # The reading per job and by ID, kept up as events come (`readings.py` uses them for
        # the reading they were made with: a change costs its job's entry, not the fleet's).
        self.indexed = ByJob((), {})
        self._job_allocs: dict[str, dict[str, dict[str, Any]]] = {}

    async def list_all(self) -> int:
        index, items = await asyncio.to_thread(
            self.nomad.blocking_list, "allocations", params={"resources": "true"}
        )
        self.by_id = {str(a.get("ID", "")): a for a in items if self.kept(a)}
        self._job_allocs = {}
        for alloc_id, a in self.by_id.items():
            self._job_allocs.setdefault(str(a.get("JobID")), {})[alloc_id] = a
        self._publish(None)
        return index

    def _put(self, alloc_id: str, alloc: dict[str, Any] | None, jobs: set[str]) -> None:
        """Hold `alloc` under its ID (None: drop it), noting the jobs whose entries moved."""
        held = self.by_id.get(alloc_id)
        job = str(alloc.get("JobID")) if alloc is not None else None
        if held is not None and str(held.get("JobID")) != job:
            jobs.add(str(held.get("JobID")))
            self._job_allocs.get(str(held.get("JobID")), {}).pop(alloc_id, None)
        if alloc is None:
            self.by_id.pop(alloc_id, None)
        else:
            # Replaced in place: a reading keeps the order Nomad listed them in.
            self.by_id[alloc_id] = alloc
            jobs.add(str(job))
            self._job_allocs.setdefault(str(job), {})[alloc_id] = alloc

    def _publish(self, jobs: set[str] | None) -> None:
        """A new reading (`jobs`: those whose entries moved; None: every one)."""
        self._data = tuple(self.by_id.values())
        self.indexed = ByJob(self._data, per_job(self.indexed.by_job, self._job_allocs, jobs))
        for job in jobs or ():
            if not self._job_allocs.get(job):
                self._job_allocs.pop(job, None)

    async def apply(self, events: list[dict[str, Any]]) -> bool:
        changed = False
        jobs: set[str] = set()
        ours: dict[str, None] = {}
        for event in events:
            payload = event.get("Payload")
            alloc = payload.get("Allocation") if isinstance(payload, dict) else None
            if not isinstance(alloc, dict):
                continue
            alloc_id = str(alloc.get("ID") or event.get("Key") or "")
            if str(alloc.get("JobID", "")).startswith(JOB_PREFIX):
                ours[alloc_id] = None
                self.changed(str(alloc.get("JobID")))
                continue
            held = self.by_id.get(alloc_id)
            if self.kept(alloc):
                if held is None or _holding(held) != _holding(alloc):
                    self._put(alloc_id, alloc, jobs)
                    changed = True
            elif held is not None:
                self._put(alloc_id, None, jobs)
                changed = True
        if changed:
            self.changed(OTHER_JOBS)
        if len(ours) > READ_EACH_UP_TO:
            await self.list_all()
            self._changes = None
            return True
        for alloc_id in ours:
            _, stubs = await asyncio.to_thread(
                self.nomad.blocking_list, "allocations", params={"prefix": alloc_id, "resources": "true"}
            )
            stub = next((s for s in stubs if s.get("ID") == alloc_id), None)
            # None: collected since its event.
            self._put(alloc_id, stub, jobs)
            changed = True
        if changed:
            self._publish(jobs)
        return changed

    def data(self) -> tuple[dict[str, Any], ...]:
        return self._data


@dataclass(frozen=True)
class ByJob:
    """A feed's reading (`data`), per job and by ID: made with it, never changed after."""

    data: tuple[dict[str, Any], ...]
    by_job: dict[str, tuple[dict[str, Any], ...]]


def per_job(
    held: Mapping[str, tuple[dict[str, Any], ...]],
    entries: Mapping[str, Mapping[str, dict[str, Any]]],
    jobs: Iterable[str] | None,
) -> dict[str, tuple[dict[str, Any], ...]]:
    """A new per-job index: `held`'s, with the `jobs` whose entries moved made again from
    `entries` (job -> entries by ID); every job made again when `jobs` is None. A copy, so a
    reading handed out before never changes."""
    by_job = dict(held) if jobs is not None else {}
    for job in entries if jobs is None else jobs:
        found = entries.get(job)
        if found:
            by_job[job] = tuple(found.values())
        else:
            by_job.pop(job, None)
    return by_job


def _holding(alloc: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(alloc.get(k) for k in _HOLDING_FIELDS)


class JobFeed(_Feed[Mapping[str, dict[str, Any]]]):
    """llmgw's jobs, in full, by ID. A job event carries the whole job, so a scale or a register
    costs only its event; a deregister reads the job, which may be gone (purged) or stopped."""

    topic = "Job"

    def __init__(
        self,
        nomad: Nomad,
        wait_s: float,
        list_jobs: Callable[[int], Any],
        **kw: Any,
    ) -> None:
        super().__init__(nomad, wait_s, **kw)
        self._list_jobs = list_jobs
        self.by_id: dict[str, dict[str, Any]] = {}

    async def list_all(self) -> int:
        index, jobs = await self._list_jobs(0)
        self.by_id = dict(jobs)
        return int(index)

    async def apply(self, events: Iterable[dict[str, Any]]) -> bool:
        # A new mapping: the one handed out before is a reading, never changed once taken.
        by_id = dict(self.by_id)
        changed = False
        for event in events:
            payload = event.get("Payload")
            job = payload.get("Job") if isinstance(payload, dict) else None
            job_id = str((job or {}).get("ID") or event.get("Key") or "")
            if not job_id.startswith(JOB_PREFIX):
                continue
            if event.get("Type") != "JobRegistered" or not isinstance(job, dict):
                # A deregister (stop or purge), or an event without its job: ask Nomad.
                job = await asyncio.to_thread(self.nomad.get_job, job_id)
            if job is None:
                changed |= by_id.pop(job_id, None) is not None
            else:
                by_id[job_id] = job
                changed = True
            self.changed(job_id)
        self.by_id = by_id
        return changed

    def data(self) -> Mapping[str, dict[str, Any]]:
        return self.by_id
