"""Reading Nomad's answers to a plan, with no cluster needed: its `JobPlanResponse` as fits or
not (and why not, in the watcher's words), the nodes a model may land on, and the node pool a
job that names none lands in. `plan.py` asks; this module only reads.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nomad_driver.node_meta import FABRIC_KEY
from nomad_driver.placement import summarize_placement
from nomad_driver.render import SHARD_GROUP
from nomad_driver.spec import Model


@dataclass
class Candidate:
    """Where it may go: ready, eligible nodes with the GPUs asked for. Nomad's plan says whether
    it fits, not where; the rest of the request (engine version, node pool) is Nomad's to check."""

    node_class: str
    gpu_model: str
    nodes: int


@dataclass
class Placement:
    fits: bool
    count: int  # the replicas planned
    reason: str = ""  # the watcher's one line, when it fits nowhere
    candidates: list[Candidate] = field(default_factory=list)
    preempts: list[str] = field(default_factory=list)  # allocations Nomad would evict
    # DesiredTGUpdates, non-zero only, counted in replicas: a multi-node replica's leader and
    # shards are one replica re-placed, not several.
    updates: dict[str, int] = field(default_factory=dict)
    # A multi-node model: the fabric its nodes would share, chosen as the watcher chooses it;
    # None for a single-node model, and when no fabric has room.
    fabric: str | None = None
    nodes: int = 1  # per replica: a multi-node model's leader and shards


def read_plan(answer: Mapping[str, Any], job: Mapping[str, Any], count: int) -> Placement:
    """Nomad's `JobPlanResponse` as the operator wants it: fits or not, and why not in the same
    words the watcher uses once the model is applied."""
    failed = answer.get("FailedTGAllocs")
    annotations = answer.get("Annotations") if isinstance(answer.get("Annotations"), Mapping) else {}
    assert isinstance(annotations, Mapping)
    per_replica = _allocations_per_replica(job)
    updates: dict[str, int] = {}
    for name, group in (annotations.get("DesiredTGUpdates") or {}).items():
        if isinstance(group, Mapping):
            for key, value in group.items():
                if isinstance(value, int) and value:
                    # A replica is re-placed when any of its groups is: 1 leader and 2 shards
                    # replaced are 1 replica, not 3.
                    replicas = -(-value // per_replica.get(str(name), 1))
                    updates[key] = max(updates.get(key, 0), replicas)
    preempts = [
        f"{a.get('JobID', '?')}/{a.get('ID', '?')}"
        for a in annotations.get("PreemptedAllocs") or []
        if isinstance(a, Mapping)
    ]
    fits = not (isinstance(failed, Mapping) and failed)
    reason = "" if not isinstance(failed, Mapping) or fits else summarize_placement(dict(failed), dict(job))
    return Placement(fits=fits, count=count, reason=reason, preempts=preempts, updates=updates)


def _allocations_per_replica(job: Mapping[str, Any]) -> dict[str, int]:
    """Allocations of each group that make one replica: a multi-node replica's shard group
    runs `nodes - 1` of them (its scaling maximum), every other group one."""
    out: dict[str, int] = {}
    for group in job.get("TaskGroups") or []:
        if isinstance(group, Mapping) and group.get("Name") == SHARD_GROUP:
            scaling = group.get("Scaling") if isinstance(group.get("Scaling"), Mapping) else {}
            assert isinstance(scaling, Mapping)
            out[SHARD_GROUP] = max(1, int(scaling.get("Max") or 1))
    return out


def candidates(
    model: Model,
    nodes: Sequence[Mapping[str, Any]],
    *,
    default_pool: str = "default",
    fabric: str | None = None,
) -> list[Candidate]:
    """Ready, eligible nodes in the profile's node pool (or `default_pool`, where a job that
    names none lands) and datacenters with enough healthy GPUs of the memory and model asked
    for, and in `fabric` when given, grouped by node class and GPU model. The engine constraint
    is left to Nomad, whose plan has already said whether the model fits."""
    p = model.profile
    counts: dict[tuple[str, str], int] = {}
    pool = p.node_pool or default_pool
    datacenters = p.datacenters or ["*"]
    for node in nodes:
        if (
            node.get("Status") != "ready"
            or node.get("SchedulingEligibility") == "ineligible"
            or node.get("Drain")
        ):
            continue
        meta = node.get("Meta") if isinstance(node.get("Meta"), Mapping) else {}
        assert isinstance(meta, Mapping)
        if fabric is not None and meta.get(FABRIC_KEY) != fabric:
            continue
        # Where the profile places it (Nomad's pool `all` holds every node).
        if pool != "all" and str(node.get("NodePool") or "default") != pool:
            continue
        if not any(fnmatch.fnmatchcase(str(node.get("Datacenter", "")), dc) for dc in datacenters):
            continue
        node_class = str(node.get("NodeClass") or "")
        if p.gpus == 0:
            counts[(node_class, "")] = counts.get((node_class, ""), 0) + 1
            continue
        resources = node.get("NodeResources") if isinstance(node.get("NodeResources"), Mapping) else {}
        assert isinstance(resources, Mapping)
        for group in resources.get("Devices") or []:
            if (
                not isinstance(group, Mapping)
                or group.get("Type") != "gpu"
                or group.get("Vendor") != "nvidia"
            ):
                continue
            name = str(group.get("Name") or "")
            healthy = sum(
                1 for i in group.get("Instances") or [] if isinstance(i, Mapping) and i.get("Healthy")
            )
            memory = _memory_mib(group)
            if healthy < p.gpus or (p.gpu_memory_mib and memory < p.gpu_memory_mib):
                continue
            if p.gpu_models and name not in p.gpu_models:
                continue
            counts[(node_class, name)] = counts.get((node_class, name), 0) + 1
            break
    return [Candidate(c, g, n) for (c, g), n in sorted(counts.items())]


def _memory_mib(group: Mapping[str, Any]) -> int:
    attrs = group.get("Attributes") if isinstance(group.get("Attributes"), Mapping) else {}
    assert isinstance(attrs, Mapping)
    memory = attrs.get("memory")
    if not isinstance(memory, Mapping):
        return 0
    value = memory.get("Int")
    unit = str(memory.get("Unit") or "MiB")
    factor = {"MiB": 1, "GiB": 1024, "KiB": 1 / 1024}.get(unit, 1)
    return int((value or 0) * factor)


def namespace_default_pool(namespace: Any) -> str:
    """From Nomad's `Namespace`: its default node pool where Nomad Enterprise configures one
    (`node_pool_config`), else Nomad's own `default`, which is all Nomad CE ever uses."""
    config = namespace.get("NodePoolConfiguration") if isinstance(namespace, Mapping) else None
    default = config.get("Default") if isinstance(config, Mapping) else None
    return str(default) if default else "default"
