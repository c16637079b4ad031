"""The next step for a multi-node model: where its replica goes and whether it runs whole.

Nomad places each allocation on its own, so nothing but llmgw's fabric constraint keeps one
replica's shards in one fabric, and nothing but llmgw restarts a replica whose shard failed.
This is `reconcile`'s multi-node half, pure like it: the fabrics' room is measured by the pass
(`ModelView.fabric_rooms`), and every answer here follows from the view and the stored state.

- The job is never registered without a fabric: before the nodes are read it waits; when no
  fabric has room, an on-demand model's job is pinned to the fabric that could hold it once
  free, at count 0, and a model that should run is unplaceable with every fabric's largest
  free block named.
- When Nomad's newest failed placement was on the pinned fabric, the job moves to the next
  fabric with room; the fabrics tried are kept until the replica is healthy or redefined.
- The leader and its shards run together or not at all: a shard group whose count does not
  match the leader's is scaled to match, and a leader whose current start a shard failed is
  stopped, so the next pass starts the replica again, whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nomad_driver.placement import (
    FabricRoom,
    PlacementFailure,
    choose_fabric,
    fallback_fabric,
    job_fabric,
    no_fabric_reason,
)
from nomad_driver.render import SHARD_GROUP
from nomad_driver.spec import Model
from nomad_driver.state import ModelState
from nomad_driver.watcher.parking import StartId
from nomad_driver.watcher.replica_starts import ShardFailure, start_key


@dataclass(frozen=True)
class ReplicaStep:
    register_fabric: str = ""  # register the job pinned to this fabric, at register_count
    register_count: int = 0
    scale_to: int | None = None  # scale the leader and its shards to this many replicas
    scale_message: str = ""
    no_fabric: str = ""  # why no fabric can hold it now ("" when one can)
    fabrics_tried: tuple[str, ...] = ()
    replica_restarted: str = ""


def group_count(job: Mapping[str, Any] | None, name: str) -> int:
    groups = job.get("TaskGroups") if isinstance(job, Mapping) else None
    for g in groups if isinstance(groups, list) else ():
        if isinstance(g, Mapping) and g.get("Name") == name:
            try:
                return int(g.get("Count") or 0)
            except (TypeError, ValueError):
                return 0
    return 0


def leader_count(job: Mapping[str, Any] | None) -> int:
    groups = job.get("TaskGroups") if isinstance(job, Mapping) else None
    first = groups[0] if isinstance(groups, list) and groups else None
    return group_count(job, str(first.get("Name", ""))) if isinstance(first, Mapping) else 0


def _room(rooms: Sequence[FabricRoom], fabric: str) -> int:
    return next((r.largest_free_block for r in rooms if r.fabric == fabric), 0)


def replica_step(
    model: Model,
    job: Mapping[str, Any] | None,
    *,
    current: bool,
    rooms: Sequence[FabricRoom] | None,
    latest_failure: PlacementFailure | None,
    desired: int,
    ready: int,
    state: ModelState,
    stuck: tuple[StartId, ShardFailure] | None,
    scale_why: str,
) -> ReplicaStep:
    """`current`: the job runs this definition (pinned included); `latest_failure`: Nomad's
    newest failed placement of this definition's job, whatever its count; `stuck`: a live
    leader start that a shard failed; `scale_why`: the message for a scale to `desired`."""
    n = model.profile.nodes
    parked = state.parked
    pinned = job_fabric(job)
    meta = job.get("Meta") if isinstance(job, Mapping) else None
    redefined = not isinstance(meta, Mapping) or meta.get("llmgw_def_hash") != model.def_hash
    # A healthy replica or a new definition starts the fabrics afresh.
    tried = [] if ready > 0 or redefined else list(state.fabrics_tried)
    failed_here = latest_failure is not None and bool(pinned) and latest_failure.fabric == pinned
    if failed_here and pinned not in tried:
        tried.append(pinned)
    choice = choose_fabric(rooms, n, tried) if rooms is not None else None
    no_fabric = no_fabric_reason(rooms, n) if rooms is not None and choice is None else ""
    keep = ReplicaStep(
        no_fabric=no_fabric, fabrics_tried=tuple(tried), replica_restarted=state.replica_restarted
    )

    if not current:
        if rooms is None:
            return keep  # the nodes are not read yet: never register it unpinned
        fabric = choice or fallback_fabric(rooms, n)
        if fabric is None:
            return keep  # no node reports a fabric: nowhere to pin it
        return replace(keep, register_fabric=fabric, register_count=desired if choice else 0)
    if parked:
        return _scale_to(job, n, 0, scale_why, keep)
    if failed_here and choice and choice != pinned:
        return replace(keep, register_fabric=choice, register_count=desired)

    count = leader_count(job)
    if stuck is not None and count > 0 and start_key(stuck[0]) != state.replica_restarted:
        start, failure = stuck
        keep = replace(keep, replica_restarted=start_key(start))
        message = (
            f"llmgw: restarting {model.name}'s replica: {failure.shard} failed ({failure.error}); "
            "a replica runs with all its shards or not at all"
        )
        return replace(keep, scale_to=0, scale_message=message)

    want = 1 if desired > 0 else 0
    if want and count == 0 and rooms is not None:
        if choice is None:
            return keep  # nowhere has room: placing it now would only wait
        if _room(rooms, pinned) < n:
            # Nothing runs yet, so moving costs nothing: start it where it fits.
            return replace(keep, register_fabric=choice, register_count=desired)
    return _scale_to(job, n, want, scale_why, keep)


def _scale_to(job: Mapping[str, Any] | None, n: int, want: int, why: str, keep: ReplicaStep) -> ReplicaStep:
    if job is None or job.get("Stop"):
        return keep
    leader = leader_count(job)
    shards = group_count(job, SHARD_GROUP)
    if leader == want and shards == want * (n - 1):
        return keep
    # A router's activation may have scaled the leader alone (it scales the first group): the
    # shards follow the leader, so a leader that runs has every shard with it.
    if leader == want:
        why = f"{why} (its shards with it: {want * (n - 1)} of {n - 1})"
    return replace(keep, scale_to=want, scale_message=why)
