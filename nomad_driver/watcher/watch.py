"""One blocking-query loop per collection, each keeping the latest immutable snapshot.

An idle cluster costs one open long poll per collection, not a call per model per second: each
loop asks "anything newer than index N?" and Consul or Nomad answers when there is, or when the
wait runs out. The index rules (reset when it goes backwards, never below 1) live in
`blocking.py`; here each loop is also rate-limited with a small token bucket, because an index
that moves on every write of an unrelated key would otherwise turn a long poll into a busy loop.

When the far side is down, a loop logs once, backs off with jitter, and keeps its last snapshot
marked stale; it never raises, so the watcher keeps serving what it knew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from nomad_driver.blocking import backoff_delay
from nomad_driver.consul import Consul, ConsulError, KVEntry
from nomad_driver.nomad import JOB_PREFIX, Nomad, NomadError
from nomad_driver.state import KV_PREFIX

log = logging.getLogger("llmgw.watch")

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot(Generic[T]):
    index: int
    data: T
    taken_at: float  # monotonic


class TokenBucket:
    """Burst of 2, then at most `rate` calls a second (Consul's advice for blocking loops)."""

    def __init__(self, rate: float, burst: int = 2) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    async def take(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


class Watch(Generic[T]):
    def __init__(
        self,
        name: str,
        fetch: Callable[[int], Awaitable[tuple[int, T]]],
        *,
        on_change: Callable[[], None],
        rate: float = 10.0,
    ) -> None:
        self.name = name
        self.fetch = fetch
        self.on_change = on_change
        self.bucket = TokenBucket(rate)
        self.snapshot: Snapshot[T] | None = None
        self.ok = False  # the last call succeeded
        self.calls = 0

    async def run(self) -> None:
        index = 0
        failures = 0
        while True:
            await self.bucket.take()
            self.calls += 1
            try:
                new_index, data = await self.fetch(index)
            except asyncio.CancelledError:
                raise
            except (ConsulError, NomadError, ValueError, KeyError, TypeError) as exc:
                if failures == 0:
                    # Once per outage: a log line per retry would bury everything else.
                    log.warning("event=watch_failed watch=%s error=%r", self.name, str(exc))
                failures += 1
                self.ok = False
                # Start over from a plain read: the far side may have been reset meanwhile.
                index = 0
                await asyncio.sleep(backoff_delay(failures, base=0.5, cap=15.0))
                continue
            if failures:
                log.info("event=watch_recovered watch=%s after_failures=%d", self.name, failures)
                failures = 0
            self.ok = True
            if self.snapshot is None or new_index != self.snapshot.index or new_index != index:
                self.snapshot = Snapshot(new_index, data, time.monotonic())
                self.on_change()
            index = new_index


# The collections the watcher reads.


def kv_fetch(consul: Consul, wait_s: float) -> Callable[[int], Awaitable[tuple[int, dict[str, KVEntry]]]]:
    async def fetch(index: int) -> tuple[int, dict[str, KVEntry]]:
        new_index, entries = await consul.kv_get(KV_PREFIX, recurse=True, index=index, wait_s=wait_s)
        return new_index, {e.key: e for e in entries}

    return fetch


def engines_fetch(
    consul: Consul, service: str, wait_s: float
) -> Callable[[int], Awaitable[tuple[int, tuple[dict[str, Any], ...]]]]:
    async def fetch(index: int) -> tuple[int, tuple[dict[str, Any], ...]]:
        new_index, entries = await consul.health_service(service, index=index, wait_s=wait_s)
        return new_index, tuple(entries)

    return fetch


def nomad_list_fetch(
    nomad: Nomad, collection: str, wait_s: float, params: dict[str, Any] | None = None
) -> Callable[[int], Awaitable[tuple[int, tuple[dict[str, Any], ...]]]]:
    """Allocations or evaluations of llmgw's jobs (the others are dropped here, once)."""

    async def fetch(index: int) -> tuple[int, tuple[dict[str, Any], ...]]:
        new_index, items = await asyncio.to_thread(
            nomad.blocking_list, collection, index=index, wait_s=wait_s, params=params
        )
        return new_index, tuple(i for i in items if str(i.get("JobID", "")).startswith(JOB_PREFIX))

    return fetch


@dataclass
class JobCache:
    by_id: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)


def jobs_fetch(
    nomad: Nomad, wait_s: float, cache: JobCache | None = None
) -> Callable[[int], Awaitable[tuple[int, Mapping[str, dict[str, Any]]]]]:
    """llmgw's jobs, in full: the list says which changed (ModifyIndex) and only those are read
    again, so a scale of one model costs one read, not a thousand."""
    jobs = cache or JobCache()

    async def fetch(index: int) -> tuple[int, Mapping[str, dict[str, Any]]]:
        new_index, stubs = await asyncio.to_thread(nomad.llmgw_jobs, index=index, wait_s=wait_s)
        fresh: dict[str, tuple[int, dict[str, Any]]] = {}
        for stub in stubs:
            job_id = str(stub.get("ID", ""))
            modify = int(stub.get("ModifyIndex") or 0)
            held = jobs.by_id.get(job_id)
            if held is not None and held[0] == modify:
                fresh[job_id] = held
                continue
            full = await asyncio.to_thread(nomad.get_job, job_id)
            if full is not None:
                fresh[job_id] = (modify, full)
        jobs.by_id = fresh
        return new_index, {k: v[1] for k, v in fresh.items()}

    return fetch


def _read_node(nomad: Nomad, node_id: str) -> Any:
    return nomad.request_json("node", node_id, what=f"node {node_id}")


@dataclass
class NodeCache:
    by_id: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)


def nodes_fetch(
    nomad: Nomad, wait_s: float, cache: NodeCache | None = None
) -> Callable[[int], Awaitable[tuple[int, tuple[dict[str, Any], ...]]]]:
    """Every Nomad node with its devices (`/v1/nodes?resources=true`) and its meta.

    The list stub has no `Meta`, where the node agent publishes engines, GPU class, fabric and
    cached weights; so, as for jobs, a node is read in full only when its ModifyIndex moves,
    and an idle fleet of two hundred nodes costs one long poll, not two hundred reads.
    """
    nodes = cache or NodeCache()

    async def fetch(index: int) -> tuple[int, tuple[dict[str, Any], ...]]:
        new_index, stubs = await asyncio.to_thread(
            nomad.blocking_list, "nodes", index=index, wait_s=wait_s, params={"resources": "true"}
        )
        fresh: dict[str, tuple[int, dict[str, Any]]] = {}
        for stub in stubs:
            node_id = str(stub.get("ID", ""))
            modify = int(stub.get("ModifyIndex") or 0)
            held = nodes.by_id.get(node_id)
            if held is not None and held[0] == modify:
                fresh[node_id] = (modify, {**held[1], **stub})
                continue
            try:
                full = await asyncio.to_thread(_read_node, nomad, node_id)
            except NomadError as exc:
                if exc.status != 404:
                    raise
                continue  # garbage-collected between the list and the read
            if isinstance(full, dict):
                # The stub's fields win: they are the list's own answer at this index.
                fresh[node_id] = (modify, {**full, **stub})
        nodes.by_id = fresh
        return new_index, tuple(n for _, n in sorted(fresh.values(), key=lambda v: str(v[1].get("Name"))))

    return fetch
