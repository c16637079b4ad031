"""What the watcher's blocking-query loops read: one fetch per collection, each run by
`nomad_driver.blocking.Watch` (index rules, a token bucket, backoff; the router's loops are the
same).

An idle cluster costs one open long poll per collection, not a call per model per second: each
fetch asks "anything newer than index N?" and Consul or Nomad answers when there is, or when the
wait runs out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nomad_driver.consul import Consul, KVEntry
from nomad_driver.nomad import JOB_PREFIX, Nomad, NomadError

# The collections the watcher reads.

# Consul answers a prefix or a service whole: at 10,000 models the engines' answer is 15 MB, half
# a second of the event loop to decode, and a crash loop changes it twice a start. After a read
# that changed, a watch rests this many times what its decoding took, so a busy collection takes
# at most a quarter of the loop and passes keep the rest (the park at 10,000 models waited behind
# back-to-back decodes). A small answer decodes in a millisecond and rests three.
REST_PER_DECODE = 3.0


class Paced:
    """The rest a watch owes before its next read, from what its last read cost to decode."""

    def __init__(self, consul: Consul) -> None:
        self.consul = consul
        self.owed_s = 0.0

    async def rest(self) -> None:
        if self.owed_s > 0:
            await asyncio.sleep(self.owed_s)

    def decoded(self) -> None:
        """Right after the read returned: `Consul.last_decode_s` is still this read's."""
        self.owed_s = self.consul.last_decode_s * REST_PER_DECODE


def kv_fetch(
    consul: Consul, prefix: str, wait_s: float
) -> Callable[[int], Awaitable[tuple[int, dict[str, KVEntry]]]]:
    paced = Paced(consul)

    async def fetch(index: int) -> tuple[int, dict[str, KVEntry]]:
        await paced.rest()
        new_index, entries = await consul.kv_changes(prefix, recurse=True, index=index, wait_s=wait_s)
        paced.decoded()
        # Unchanged (None): the watch keeps its reading at this index, whatever is returned.
        return new_index, {e.key: e for e in entries or ()}

    return fetch


def engines_fetch(
    consul: Consul, service: str, wait_s: float
) -> Callable[[int], Awaitable[tuple[int, tuple[dict[str, Any], ...]]]]:
    paced = Paced(consul)

    async def fetch(index: int) -> tuple[int, tuple[dict[str, Any], ...]]:
        await paced.rest()
        new_index, entries = await consul.health_changes(service, index=index, wait_s=wait_s)
        paced.decoded()
        return new_index, tuple(entries or ())

    return fetch


# Allocations of other jobs that still hold what they were given (the client has not let go).
_HOLDING = frozenset({"pending", "running", "unknown"})


def kept_allocation(alloc: Mapping[str, Any]) -> bool:
    """What the watcher keeps of the allocations: llmgw's, and other jobs' that hold their
    resources. A GPU another team's job holds is not free, and a node with one is no room for a
    multi-node replica, which needs entirely free nodes."""
    if str(alloc.get("JobID", "")).startswith(JOB_PREFIX):
        return True
    return alloc.get("ClientStatus") in _HOLDING


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
