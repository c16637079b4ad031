"""Reading Nomad's evaluations into an answer an operator can act on.

Nomad already knows why a model fits nowhere: the failed evaluation's `FailedTGAllocs` carries
the placement metrics, counted per reason, the same way Nomad's feasibility checkers recorded
them. What it does not do is say it anywhere an operator looks, so a model that fitted on no
node logged "no placement" for two days. This module turns those metrics into one line that
names what was asked for and why each node said no, and decides from a job's evaluations
whether the model is unplaceable right now.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from nomad_driver.fields import as_int
from nomad_driver.node_meta import FABRIC_KEY, GPU_COUNT_KEY, interpolated, models_cached
from nomad_driver.spec import Profile
from nomad_driver.state import ModelState
from nomad_driver.summary import fleet_summary

log = logging.getLogger("llmgw.watcher")

# Evaluations that say nothing about placement yet (pending) or were superseded (canceled).
_UNDECIDED = {"pending", "canceled", "cancelled"}

_ATTR = re.compile(r"^\$\{device\.attr\.([\w.-]+)\}$")


@dataclass(frozen=True)
class PlacementFailure:
    """The newest evaluation of a job that could not place every replica."""

    eval_id: str
    reason: str
    # The fabric the failed job was pinned to, when Nomad's metrics name the constraint (nodes
    # of other fabrics filtered by it): a multi-node replica then moves to another fabric.
    fabric: str = ""


def summarize_placement(failed_tg_allocs: dict[str, Any] | None, job: dict[str, Any] | None = None) -> str:
    """One line per task group, joined with '; ', e.g.
    `no node has 2 x nvidia/gpu with memory >= 80 GiB: 3 nodes filtered (missing devices),
    2 exhausted (devices: no devices match request)`.

    Never raises: a summary of garbage is still a summary, and the watcher must keep going.
    """
    if not isinstance(failed_tg_allocs, dict) or not failed_tg_allocs:
        return "placement failed (Nomad gave no placement metrics)"
    lines = []
    for group in sorted(failed_tg_allocs, key=str):
        metric = failed_tg_allocs[group]
        if not isinstance(metric, dict):
            metric = {}
        want = _describe_request(job, str(group))
        head = f"no node has {want}" if want else f"no node fits task group '{group}'"
        lines.append(f"{head}: {_describe_metric(metric)}")
    return "; ".join(lines)


def latest_placement_failure(
    evaluations: Sequence[Mapping[str, Any]], job: dict[str, Any] | None = None
) -> PlacementFailure | None:
    """The job's placement outcome from its evaluations, newest decided one first.

    A blocked evaluation, or a finished one with `FailedTGAllocs`, means replicas are waiting
    for room; a later evaluation that placed everything (Nomad re-runs the blocked one when a
    node joins) means the model fits again, so the state clears as soon as it is placed.
    """
    decided = [
        e
        for e in evaluations
        if isinstance(e, Mapping) and str(e.get("Status", "")).lower() not in _UNDECIDED
    ]
    if not decided:
        return None
    newest = max(decided, key=_eval_order)
    failed = newest.get("FailedTGAllocs")
    if not (isinstance(failed, dict) and failed):
        if newest.get("Status") != "blocked":
            return None
        # A blocked eval copies its parent's metrics; one without them still blocks.
        failed = _metrics_of_parent(newest, evaluations)
    return PlacementFailure(
        eval_id=str(newest.get("ID", "")),
        reason=summarize_placement(failed, job),
        fabric=failed_fabric(failed),
    )


def _metrics_of_parent(
    blocked: Mapping[str, Any], evaluations: Sequence[Mapping[str, Any]]
) -> dict[str, Any] | None:
    parent = blocked.get("PreviousEval")
    for e in evaluations:
        if isinstance(e, Mapping) and e.get("ID") == parent and isinstance(e.get("FailedTGAllocs"), dict):
            failed: dict[str, Any] = e["FailedTGAllocs"]
            return failed
    return None


def _eval_order(e: Mapping[str, Any]) -> tuple[int, int]:
    def num(key: str) -> int:
        try:
            return int(e.get(key) or 0)
        except (TypeError, ValueError):
            return 0

    return (num("CreateIndex"), num("ModifyIndex"))


def _describe_metric(m: dict[str, Any]) -> str:
    evaluated = as_int(m.get("NodesEvaluated"))
    filtered = as_int(m.get("NodesFiltered"))
    exhausted = as_int(m.get("NodesExhausted"))
    parts: list[str] = []
    if evaluated == 0 and filtered == 0 and exhausted == 0:
        available = m.get("NodesAvailable")
        if isinstance(available, dict) and available and all(as_int(v) == 0 for v in available.values()):
            dcs = ", ".join(sorted(str(dc) for dc in available))
            return f"no nodes are available in datacenter {dcs}"
        pool = m.get("NodePool")
        return f"no nodes were eligible for evaluation{f' in node pool {pool}' if pool else ''}"
    if filtered:
        why = _reasons(m.get("ConstraintFiltered")) or _reasons(m.get("ClassFiltered"), "class ")
        parts.append(f"{_nodes(filtered)} filtered" + (f" ({why})" if why else ""))
    if exhausted:
        why = _reasons(m.get("DimensionExhausted"))
        # "3 nodes filtered (...), 2 exhausted (...)": the noun once is enough.
        count = str(exhausted) if parts else _nodes(exhausted)
        parts.append(f"{count} exhausted" + (f" ({why})" if why else ""))
    if not parts:
        parts.append(f"{_nodes(evaluated)} evaluated, none had room")
    quota = m.get("QuotaExhausted")
    if isinstance(quota, list) and quota:
        parts.append("quota limit hit (" + ", ".join(str(q) for q in quota) + ")")
    return ", ".join(parts)


def _reasons(counts: Any, prefix: str = "") -> str:
    """`missing devices` alone when there is one reason; counted when several share the nodes."""
    if not isinstance(counts, dict) or not counts:
        return ""
    items = sorted(((str(k), as_int(v)) for k, v in counts.items()), key=lambda kv: (-kv[1], kv[0]))
    if len(items) == 1:
        return f"{prefix}{items[0][0]}"
    return ", ".join(f"{n} {prefix}{k}" for k, n in items)


def _nodes(n: int) -> str:
    return f"{n} node{'s' if n != 1 else ''}"


def _describe_request(job: dict[str, Any] | None, group: str) -> str:
    """What the group asks for that a node could lack: GPUs first, since that is almost always
    the answer on this cluster, then CPU and memory."""
    if not isinstance(job, dict):
        return ""
    groups = job.get("TaskGroups")
    if not isinstance(groups, list):
        return ""
    tg = next((g for g in groups if isinstance(g, dict) and g.get("Name") == group), None)
    if tg is None:
        return ""
    wants: list[str] = []
    for task in tg.get("Tasks") or []:
        if not isinstance(task, dict):
            continue
        res = task.get("Resources")
        if not isinstance(res, dict):
            continue
        for dev in res.get("Devices") or []:
            if isinstance(dev, dict) and dev.get("Name"):
                wants.append(_describe_device(dev))
    return " and ".join(wants)


def _describe_device(dev: dict[str, Any]) -> str:
    count = as_int(dev.get("Count")) or 1
    text = f"{count} x {dev.get('Name')}"
    conds = []
    for c in dev.get("Constraints") or []:
        if not isinstance(c, dict):
            continue
        left = str(c.get("LTarget", ""))
        op = str(c.get("Operand", ""))
        right = str(c.get("RTarget", ""))
        attr = _ATTR.match(left)
        if attr:
            conds.append(f"{attr.group(1)} {op} {right}")
        elif left == "${device.model}":
            conds.append(f"model {'matching' if op == 'regexp' else op} {right}")
        elif left:
            conds.append(f"{left} {op} {right}")
    if conds:
        text += " with " + " and ".join(conds)
    return text


class PlacementWarnings:
    """Says when to log a model's placement warning: when its reason changes, or every
    `every_s` while it stays the same. Never on every pass, which is how one unplaceable model
    logged "no placement" 250 times and drowned out everything else."""

    def __init__(self, clock: Callable[[], float], every_s: float = 600.0) -> None:
        self.clock = clock
        self.every_s = every_s
        self._last: dict[str, tuple[str, float]] = {}

    def should_log(self, model: str, reason: str) -> bool:
        now = self.clock()
        last = self._last.get(model)
        if last is not None and last[0] == reason and now - last[1] < self.every_s:
            return False
        self._last[model] = (reason, now)
        return True

    def log_decision(self, model: str, state: ModelState) -> None:
        """Log a model's placement warning when due (`should_log`); a placed model's is cleared."""
        if not state.unplaceable:
            self.clear(model)
        elif self.should_log(model, state.placement_reason):
            log.warning(
                "event=unplaceable model=%s eval=%s reason=%r",
                model,
                state.placement_eval,
                state.placement_reason,
            )

    def clear(self, model: str) -> None:
        """Placed: the next failure is news again."""
        self._last.pop(model, None)

    def due(self, now: float) -> list[str]:
        """The models whose warning is due to be logged again (a pass decides them again)."""
        return [m for m, (_, at) in self._last.items() if at + self.every_s <= now]

    def next_due(self) -> float:
        """When a warning that stays the same is next logged again (inf: none logged)."""
        return min((at + self.every_s for _, at in self._last.values()), default=math.inf)


# --- fabrics for multi-node replicas --------------------------------------------------------
#
# Nomad has no gang scheduling: it places each allocation of a job on its own, so nothing but a
# constraint keeps the shards of one replica inside one fabric (nodes on different fabrics are
# not connected to one another). The watcher picks the fabric and pins the replica to it.


@dataclass(frozen=True)
class FabricRoom:
    """One fabric as a multi-node replica sees it: how many of its nodes are entirely free (the
    largest block a replica can take) and whether any of them already holds the weights."""

    fabric: str
    largest_free_block: int
    has_weights: bool = False
    nodes: int = 0  # all its nodes, free or not


def eligible_nodes(nodes: Sequence[Mapping[str, Any]], profile: Profile) -> list[dict[str, Any]]:
    """The nodes a multi-node replica of `profile` may land on, as its job says: its node pool
    (`default` when it names none, every pool for `all`), its datacenters (globs, `*` when it
    names none), and, for a model that asks for GPUs, exactly `gpus` of them per node
    (`llmgw_gpu_count`), since a shard takes its whole node. A fabric's room counts only these:
    free nodes the replica cannot use are no room for it."""
    pool = profile.node_pool or "default"
    datacenters = list(profile.datacenters or ()) or ["*"]
    out = []
    for node in nodes:
        if not isinstance(node, Mapping):
            continue
        if pool != "all" and str(node.get("NodePool") or "default") != pool:
            continue
        if not any(fnmatchcase(str(node.get("Datacenter") or ""), dc) for dc in datacenters):
            continue
        meta = node.get("Meta")
        count = meta.get(GPU_COUNT_KEY) if isinstance(meta, Mapping) else None
        if profile.gpus > 0 and str(count or "") != str(profile.gpus):
            continue
        out.append(dict(node))
    return out


def gpu_count_constraint(gpus: int) -> dict[str, Any]:
    """The job constraint that puts each shard of a replica on a node with exactly `gpus` GPUs:
    it asks for all of them, so the node is entirely its own."""
    return {"LTarget": interpolated(GPU_COUNT_KEY), "RTarget": str(gpus), "Operand": "="}


def fabric_rooms(nodes: list[dict[str, Any]], allocs: list[dict[str, Any]], model: str) -> list[FabricRoom]:
    """Each fabric's room, from Nomad's nodes and allocations, counted exactly as the fleet
    summary counts it (so `ctl summary` shows the numbers the choice was made on)."""
    fabrics = fleet_summary(nodes, allocs, [], {}, 0.0)["fabrics"]
    with_weights = set()
    for node in nodes:
        meta = node.get("Meta") if isinstance(node, dict) else None
        if not isinstance(meta, dict) or node.get("Status") != "ready":
            continue
        if model in models_cached(meta) and meta.get(FABRIC_KEY):
            with_weights.add(str(meta[FABRIC_KEY]))
    return [
        FabricRoom(
            fabric=str(f["fabric"]),
            largest_free_block=as_int(f.get("largest_free_block")),
            has_weights=str(f["fabric"]) in with_weights,
            nodes=as_int(f.get("nodes")),
        )
        for f in fabrics
    ]


def choose_fabric(rooms: Sequence[FabricRoom], nodes: int, tried: Sequence[str] = ()) -> str | None:
    """The fabric for a replica of `nodes` shards, or None when none can hold it.

    Only fabrics whose largest free block is at least `nodes`; among them the one that already
    holds the weights (tens of gigabytes not copied), then the best fit (the smallest block that
    is big enough, so a large block stays whole for a larger model), then the name, so that two
    watchers choose alike. Fabrics in `tried` (where Nomad could not place the replica after all)
    come last, so the replica moves on instead of waiting on the same fabric forever."""
    fits = [r for r in rooms if r.largest_free_block >= nodes]
    if not fits:
        return None
    best = min(fits, key=lambda r: (r.fabric in tried, not r.has_weights, r.largest_free_block, r.fabric))
    return best.fabric


def fabric_constraint(fabric: str) -> dict[str, Any]:
    """The job constraint that keeps every shard of a replica in `fabric`."""
    return {"LTarget": interpolated(FABRIC_KEY), "RTarget": fabric, "Operand": "="}


def no_fabric_reason(rooms: Sequence[FabricRoom], nodes: int) -> str:
    """Why no fabric can hold a replica, naming each fabric and its largest free block:
    `needs 3 entirely free nodes in one fabric; largest free blocks: ib-a 2, ib-b 2`."""
    head = f"needs {nodes} entirely free nodes in one fabric"
    if not rooms:
        return f"{head}; no node reports a fabric ({FABRIC_KEY})"
    blocks = ", ".join(f"{r.fabric} {r.largest_free_block}" for r in sorted(rooms, key=lambda r: r.fabric))
    return f"{head}; largest free blocks: {blocks}"


def fallback_fabric(rooms: Sequence[FabricRoom], nodes: int) -> str | None:
    """Where to pin a replica that no fabric has room for now, so that its job still never
    spans two: the fabric with the most nodes (it can hold the replica once they are free),
    then the name. None when no node reports a fabric."""
    if not rooms:
        return None
    best = min(rooms, key=lambda r: (r.nodes < nodes, -r.nodes, r.fabric))
    return best.fabric


_FABRIC_CONSTRAINT = re.compile(r"^\$\{meta\." + re.escape(FABRIC_KEY) + r"\} = (?P<fabric>.+)$")


def failed_fabric(failed_tg_allocs: Any) -> str:
    """The fabric a failed placement was pinned to, from the constraint that filtered the other
    fabrics' nodes (`${meta.llmgw_fabric} = ib-a`, as Nomad's `Constraint.String()` keys
    `ConstraintFiltered`); "" when the metrics do not say."""
    if not isinstance(failed_tg_allocs, dict):
        return ""
    for metric in failed_tg_allocs.values():
        filtered = metric.get("ConstraintFiltered") if isinstance(metric, dict) else None
        for key in filtered if isinstance(filtered, dict) else ():
            found = _FABRIC_CONSTRAINT.match(str(key))
            if found:
                return found.group("fabric")
    return ""


def job_fabric(job: Mapping[str, Any] | None) -> str:
    """The fabric a job is pinned to by `fabric_constraint`, or "" when it is not pinned."""
    constraints = job.get("Constraints") if isinstance(job, Mapping) else None
    for c in constraints if isinstance(constraints, list) else ():
        if (
            isinstance(c, Mapping)
            and c.get("LTarget") == interpolated(FABRIC_KEY)
            and c.get("Operand") == "="
            and c.get("RTarget")
        ):
            return str(c["RTarget"])
    return ""
