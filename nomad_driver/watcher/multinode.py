"""Carrying out a multi-node replica's steps on Nomad: it is registered and scaled as a whole,
its leader and its shards together. Where it goes is decided by `replica_steps`.

A multi-node model runs one replica (its job `llmgw-<name>`) for now: `replicas.max` above 1 is
refused in the definition until the watcher manages a job per replica.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nomad_driver.nomad import Nomad
from nomad_driver.placement import choose_fabric, fabric_constraint, fabric_rooms
from nomad_driver.render import SHARD_GROUP
from nomad_driver.spec import Model


def set_replica_count(job: dict[str, Any], count: int) -> None:
    """The job's count as the watcher wants it: a single-node job's group runs `count`
    replicas; a replica job runs its leader and all its shards, or nothing."""
    groups = job["TaskGroups"]
    shards = next((g for g in groups if g.get("Name") == SHARD_GROUP), None)
    if shards is None:
        groups[0]["Count"] = count
        return
    on = 1 if count > 0 else 0
    groups[0]["Count"] = on
    shards["Count"] = on * int(shards["Scaling"]["Max"])


def pin_to_fabric(
    job: dict[str, Any],
    model: Model,
    nodes: Sequence[dict[str, Any]],
    allocs: Sequence[dict[str, Any]],
    tried: Sequence[str] = (),
) -> str | None:
    """Add the fabric constraint to a multi-node model's job; returns the fabric, or None when
    no fabric has room (the job is then registered unpinned, and Nomad's failed placement says
    so) or the model runs on one node."""
    if model.profile.nodes <= 1:
        return None
    # Its own running shards are not room taken from it: count the fleet without this job.
    others = [dict(a) for a in allocs if a.get("JobID") != job["ID"]]
    fabric = choose_fabric(
        fabric_rooms([dict(n) for n in nodes], others, model.name), model.profile.nodes, tried
    )
    if fabric:
        job.setdefault("Constraints", []).append(fabric_constraint(fabric))
    return fabric


def scale_replica(
    nomad: Nomad,
    job_id: str,
    group: str,
    count: int,
    message: str,
    model: Model,
    *,
    check_lease: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Scale the leader group and, for a multi-node model, its shards with it: parking or
    idling a replica must free every node it holds, not only the leader's.

    `check_lease` runs right before each Nomad call (it raises when this watcher may no longer
    lead): the first call can take long enough for the lease to run out, and a deposed leader's
    shard scale would undo what the new leader just decided. Returns Nomad's answers (each
    with the `EvalID` of the evaluation it made)."""
    if model.profile.nodes > 1:
        on = 1 if count > 0 else 0
        check_lease(f"scaling {job_id} group {group} to {on}")
        leader = nomad.scale(job_id, group, on, message)
        shards = on * (model.profile.nodes - 1)
        check_lease(f"scaling {job_id} group {SHARD_GROUP} to {shards}")
        return [leader, nomad.scale(job_id, SHARD_GROUP, shards, message)]
    check_lease(f"scaling {job_id} group {group} to {count}")
    return [nomad.scale(job_id, group, count, message)]
