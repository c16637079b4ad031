"""Replicas as the watcher lists them (`GET /v1/admin/replicas`, `ctl replicas`), and the reading
of Consul's engine entries that the listing and the pass share: which model an entry serves,
whether it passes, and which Nomad allocation it is."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from nomad_driver.node_meta import FABRIC_KEY
from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.replica_starts import is_shard
from nomad_driver.watcher.rollout import job_ids
from nomad_driver.watcher.scaling import busy_floor

_ALLOC_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

# Alloc ID -> (state, since): when each replica entered the state it was last listed in.
Since = dict[str, tuple[str, float]]


def passing(entry: Mapping[str, Any]) -> bool:
    checks = entry.get("Checks")
    return isinstance(checks, list) and all(
        isinstance(c, dict) and c.get("Status") == "passing" for c in checks
    )


def entry_def_hash(entry: Mapping[str, Any]) -> str:
    """The definition an engine's service says it runs (its meta `def_hash`), "" if none."""
    svc = entry.get("Service")
    meta = svc.get("Meta") if isinstance(svc, dict) else None
    return str(meta.get("def_hash") or "") if isinstance(meta, dict) else ""


def entry_model(entry: Mapping[str, Any]) -> str:
    svc = entry.get("Service")
    if not isinstance(svc, dict):
        return ""
    meta = svc.get("Meta")
    if isinstance(meta, dict) and meta.get("model"):
        return str(meta["model"])
    for tag in svc.get("Tags") or []:
        if isinstance(tag, str) and tag.startswith("model="):
            return tag[len("model=") :]
    return ""


def entry_alloc_id(entry: Mapping[str, Any]) -> str | None:
    """The Nomad allocation an engine entry belongs to, from the ID Nomad gave the service."""
    svc = entry.get("Service") or {}
    found = _ALLOC_ID.search(str(svc.get("ID", "")))
    return found.group(0) if found else None


def replica_alloc_id(service_id: str) -> str | None:
    """The allocation in a replica's Consul service ID (`_nomad-task-<alloc>-...`), as routers
    name the replicas their requests are on."""
    found = _ALLOC_ID.search(service_id)
    return found.group(0) if found else None


_NAME_INDEX = re.compile(r"\[(\d+)\]$")


def alloc_index(alloc: Mapping[str, Any]) -> int | None:
    """The index in an allocation's name (`llmgw-m.engine[2]` is 2), the order Nomad stops them
    in when scaling down (highest first)."""
    found = _NAME_INDEX.search(str(alloc.get("Name", "")))
    return int(found.group(1)) if found else None


def alloc_time(alloc: Mapping[str, Any], state: str) -> float | None:
    """When Nomad says the allocation entered `state`: its engine's last start, or for a failed
    one its last change. Unix seconds."""
    if state == "failed":
        stamp = alloc.get("ModifyTime")
    else:
        starts = [
            e.get("Time")
            for ts in (alloc.get("TaskStates") or {}).values()
            if isinstance(ts, dict)
            for e in ts.get("Events") or []
            if isinstance(e, dict) and e.get("Type") == "Started"
        ]
        stamp = max((s for s in starts if isinstance(s, int)), default=None) or alloc.get("CreateTime")
    return stamp / 1e9 if isinstance(stamp, int) and stamp > 0 else None


def node_fabrics(nodes: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Node ID -> the fabric its meta names (`llmgw_fabric`)."""
    out = {}
    for node in nodes:
        meta = node.get("Meta")
        if isinstance(meta, Mapping) and meta.get(FABRIC_KEY):
            out[str(node.get("ID", ""))] = str(meta[FABRIC_KEY])
    return out


def shard_state(alloc: Mapping[str, Any]) -> str | None:
    """A shard as its allocation stands: running, starting, or failed and not replaced; None
    for one that is over (stopped, or replaced by another)."""
    if alloc.get("DesiredStatus") != "run":
        return None
    client = alloc.get("ClientStatus")
    if client == "running":
        return "running"
    if client == "pending":
        return "starting"
    if client == "failed" and not alloc.get("NextAllocation"):
        return "failed"
    return None


def replica_shards(
    allocs: Iterable[Mapping[str, Any]], fabrics: Mapping[str, str]
) -> dict[str, list[dict[str, Any]]]:
    """Job ID -> the shards of its replica (a multi-node model runs one replica per job), as
    listed beside their leader: allocation, node, its fabric, state."""
    out: dict[str, list[dict[str, Any]]] = {}
    for a in allocs:
        state = shard_state(a) if is_shard(a) else None
        if state is None:
            continue
        node_id = str(a.get("NodeID") or "")
        out.setdefault(str(a.get("JobID")), []).append(
            {
                "alloc_id": str(a.get("ID", "")),
                "node": str(a.get("NodeName") or ""),
                "node_id": node_id,
                "fabric": fabrics.get(node_id, ""),
                "state": state,
            }
        )
    for shards in out.values():
        shards.sort(key=lambda s: (s["node"], s["alloc_id"]))
    return out


def list_replicas(
    views: Mapping[str, ModelView],
    engines: Iterable[Mapping[str, Any]],
    allocs: Iterable[Mapping[str, Any]],
    previous: Since,
    now: float,
    fabrics: Mapping[str, str] | None = None,
) -> tuple[list[dict[str, Any]], Since]:
    """Every replica of every defined model: placed and live (ready or starting), or failed
    and waiting for Nomad to restart or replace it; and since when each is in its state, to
    pass back in next time. A multi-node replica is one row, its leader's, with its shards
    (`shards`) and its fabric; `fabrics` maps node IDs to their `llmgw_fabric`."""
    fabrics = fabrics or {}
    allocs = list(allocs)
    shards_of = replica_shards(allocs, fabrics)
    # Both of a model's job IDs: a rollout runs the new definition beside the previous one.
    by_job = {jid: name for name, v in views.items() for jid in job_ids(v.model)}
    passing_by_alloc: dict[str, Mapping[str, Any]] = {}
    for entry in engines:
        alloc_id = entry_alloc_id(entry)
        if alloc_id and passing(entry):
            passing_by_alloc[alloc_id] = entry
    out: list[dict[str, Any]] = []
    seen: Since = {}
    for a in allocs:
        model = by_job.get(str(a.get("JobID")))
        alloc_id = str(a.get("ID", ""))
        if model is None or a.get("DesiredStatus") != "run" or is_shard(a):
            continue
        client = a.get("ClientStatus")
        if client in ("pending", "running"):
            state = "ready" if alloc_id in passing_by_alloc else "starting"
        elif client == "failed" and not a.get("NextAllocation"):
            state = "failed"
        else:
            continue
        held = previous.get(alloc_id)
        if held is not None and held[0] == state:
            since = held[1]
        elif held is None:
            # First sight (a watcher just started): Nomad's own time is nearer the truth.
            since = alloc_time(a, state) or now
        else:
            since = now
        seen[alloc_id] = (state, since)
        svc = (passing_by_alloc.get(alloc_id) or {}).get("Service") or {}
        address = f"{svc.get('Address')}:{svc.get('Port')}" if svc.get("Address") else ""
        node_id = str(a.get("NodeID") or "")
        # Only a live leader has shards: a failed one's were its replica's, now restarted.
        shards = shards_of.get(str(a.get("JobID")), []) if state != "failed" else []
        out.append(
            {
                "model": model,
                "alloc_id": alloc_id,
                "node": str(a.get("NodeName") or ""),
                "node_id": node_id,
                "address": address,
                "state": state,
                "ready": state == "ready",
                "since": since,
                "last_request_at": views[model].activity,
                "fabric": fabrics.get(node_id, ""),
                "shards": shards,
            }
        )
    out.sort(key=lambda r: (r["model"], r["node"], r["alloc_id"]))
    return out, seen


def busy_floor_of(
    replicas: set[str],
    allocs_by_id: Mapping[str, Mapping[str, Any]],
    requests: int,
    target: int,
    *,
    count: int,
) -> int:
    """The count below which Nomad would stop a replica with requests in flight: Nomad stops
    the highest allocation index first, so it is one past the highest busy index. A busy
    replica the routers name that is not in Nomad's allocations (yet) has an index nobody
    knows: the current `count` is held until Nomad shows it, and never less than the known
    busy ones and what the requests need at the target."""
    indexes = []
    unknown = False
    for replica in replicas:
        alloc = allocs_by_id.get(replica_alloc_id(replica) or "")
        index = alloc_index(alloc) if alloc is not None else None
        if index is None:
            unknown = True
        else:
            indexes.append(index)
    floor = busy_floor(indexes)
    if unknown:
        floor = max(floor, count, len(replicas), -(-requests // max(1, target)))
    return floor
