"""A multi-node replica's starts: its leader's, each failed too when one of its shards failed.

The leader cannot serve without every shard: its shell waits, listening on nothing, until all
of them are registered, and llama-server aborts when one goes. So a shard that crash-loops
leaves the leader waiting in one long start that never fails by itself, and counting only the
leader's exits would never park it. A replica start is therefore one start of the leader, and
it failed when the leader failed or when any shard failed during it: counted once, whichever
shard failed, and the shard (its allocation, node and words) named as the cause. A leader
that restarts in place into a shard already dead and aborts is that same failed start. A
leader that starts while a shard is down between its restarts (its group service stays
registered, so the leader is given its address) and aborts failed because of that shard too,
and is named for it.

Pure, like the rest of the count: a function of Nomad's allocations alone.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nomad_driver.render import SHARD_GROUP
from nomad_driver.watcher.parking import Start, StartId, current_start, starts_of


@dataclass(frozen=True)
class ShardFailure:
    """One failed start of a shard, for the leader start it broke."""

    alloc_id: str
    node: str
    task: str
    time_ns: int  # when it failed, in Nomad's clock
    error: str  # what Nomad's events said about it

    @property
    def shard(self) -> str:
        return f"shard {self.alloc_id[:8]} on node {self.node or '(unknown)'}"


@dataclass(frozen=True)
class ReplicaStarts:
    starts: tuple[Start, ...]
    # Leader starts that a shard failed, by start: the first shard failure during each.
    causes: Mapping[StartId, ShardFailure]


def is_shard(alloc: Mapping[str, Any]) -> bool:
    return alloc.get("TaskGroup") == SHARD_GROUP


def shard_failures(allocs: Iterable[Mapping[str, Any]]) -> list[ShardFailure]:
    out = []
    for alloc in allocs:
        if not is_shard(alloc):
            continue
        node = str(alloc.get("NodeName") or alloc.get("NodeID") or "")
        for s in starts_of(alloc):
            if s.ended and s.failed:
                out.append(ShardFailure(s.alloc_id, node, s.task, s.ended_ns or s.time_ns, s.error))
    out.sort(key=lambda f: (f.time_ns, f.alloc_id))
    return out


def replica_starts(allocs: Iterable[Mapping[str, Any]]) -> ReplicaStarts:
    """The leader's starts, with each shard failure laid on the leader start it happened in:
    the newest one that began at or before it, or, for a shard that failed before the leader
    ever started (the leader still fetching its weights), the first one after it."""
    allocs = list(allocs)
    leader: list[Start] = []
    for alloc in allocs:
        if not is_shard(alloc):
            leader.extend(starts_of(alloc))
    leader.sort(key=lambda s: (s.time_ns, s.alloc_id, s.task))
    times = [s.time_ns for s in leader]
    causes: dict[StartId, ShardFailure] = {}
    for failure in shard_failures(allocs):
        if not leader:
            break
        i = max(0, bisect.bisect_right(times, failure.time_ns) - 1)
        causes.setdefault(leader[i].ident, failure)
    absorbed = _aborts_into_dead_shards(leader, causes) | _shard_failures_again_in_place(leader, causes)
    down = _DownShards(allocs)
    for s in leader:
        if s.ended and s.failed and s.ident not in causes and s.ident not in absorbed:
            down_then = down.at(s.time_ns)
            if down_then is not None:
                causes[s.ident] = down_then
    starts = []
    for s in leader:
        cause = causes.get(s.ident)
        if s.ident in absorbed:
            # Already counted, and named, as the start before it: the same shard's failure.
            s = dataclasses.replace(s, failed=False)
        elif cause is not None:
            s = dataclasses.replace(
                s,
                ended=True,
                failed=True,
                error=f"{cause.shard}: {cause.error}",
                ended_ns=s.ended_ns or cause.time_ns,
            )
        starts.append(s)
    return ReplicaStarts(tuple(starts), causes)


class _DownShards:
    """Which shard was down but still to restart at a given moment: its last start before it
    had failed and its next had not begun. Its group service outlives the task's restarts, so
    a leader starting then is handed the dead shard's address and llama-server aborts."""

    def __init__(self, allocs: Iterable[Mapping[str, Any]]) -> None:
        self._shards: list[tuple[str, bool, list[Start]]] = []
        for alloc in allocs:
            if is_shard(alloc):
                node = str(alloc.get("NodeName") or alloc.get("NodeID") or "")
                live = alloc.get("ClientStatus") in ("pending", "running")
                self._shards.append((node, live, sorted(starts_of(alloc), key=lambda s: s.time_ns)))

    def at(self, time_ns: int) -> ShardFailure | None:
        newest: ShardFailure | None = None
        for node, live, starts in self._shards:
            before = [s for s in starts if s.time_ns <= time_ns]
            if not before:
                continue
            last = before[-1]
            ended_ns = last.ended_ns or last.time_ns
            restarts_after = len(before) < len(starts) or live
            if last.ended and last.failed and ended_ns <= time_ns and restarts_after:
                failure = ShardFailure(last.alloc_id, node, last.task, ended_ns, last.error)
                if newest is None or failure.time_ns > newest.time_ns:
                    newest = failure
        return newest


def _aborts_into_dead_shards(leader: list[Start], causes: Mapping[StartId, ShardFailure]) -> set[StartId]:
    """Leader starts whose own failure is the shard failure of the start before them.

    A shard that registers and dies at once can die before the leader's template renders its
    registration: the leader then restarts in place (a restart asked for, not a failure) into a
    shard set that is already gone, and llama-server aborts. The shard's failure lies on the
    start it happened in, the one that restarted; the abort that follows in the same
    allocation is that failure's consequence, not a second failed replica start, and its words
    (a backtrace) would hide the shard's. Decided by the earlier start's cause, which a watcher
    sees first, so a count taken between the two does not change when the abort shows."""
    out: set[StartId] = set()
    for i, s in enumerate(leader):
        if s.ident not in causes or not s.ended or s.failed:
            continue
        after = next((n for n in leader[i + 1 :] if (n.alloc_id, n.task) == (s.alloc_id, s.task)), None)
        if after is not None and after.ended and after.failed and after.ident not in causes:
            out.add(after.ident)
    return out


def _shard_failures_again_in_place(
    leader: list[Start], causes: Mapping[StartId, ShardFailure]
) -> set[StartId]:
    """Leader starts failed only by a shard, after an earlier start of the same allocation was.

    A shard that fails is restarted by Nomad; its registration re-renders the leader's template,
    which restarts the leader in place (asked for, not a failure), and the shard can fail again
    in that new start before the watcher's pass restarts the replica whole: under load, a
    second of the watcher's time is many of a shard's restarts. The replica never started
    again, so that is the same failed replica start. A leader start that failed by itself (its
    engine aborted) still counts as its own."""
    out: set[StartId] = set()
    failed_by_shard: set[tuple[str, str]] = set()
    for s in leader:
        if s.ident not in causes or s.failed:
            continue
        where = (s.alloc_id, s.task)
        if where in failed_by_shard:
            out.add(s.ident)
        failed_by_shard.add(where)
    return out


def stuck_start(
    allocs: Iterable[Mapping[str, Any]], replica: ReplicaStarts
) -> tuple[StartId, ShardFailure] | None:
    """A live leader whose current start a shard failed: it waits for a shard that is gone and
    will wait forever, or serves nothing, so the replica is restarted whole."""
    for alloc in allocs:
        if is_shard(alloc) or alloc.get("DesiredStatus") != "run":
            continue
        start = current_start(alloc)
        if start is not None and start in replica.causes:
            return start, replica.causes[start]
    return None


def start_key(start: StartId) -> str:
    """How a start is written in the state: `<alloc>@<Started ns>`."""
    return f"{start[1]}@{start[0]}"
