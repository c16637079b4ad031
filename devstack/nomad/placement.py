"""Placing a task group's allocations the way Nomad's generic scheduler does.

Per allocation (`scheduler/feasible/stack.go` `GenericStack.Select`): the ready nodes of the
job's datacenters and pool, the feasibility chain (`feasible.py`), then bin-packing
(`rank.go` `BinPackIterator`): ports, device instances, CPU, memory and disk, scored with
`ScoreFitBinPack` so the most used node that still fits wins. A node that passes the chain but
has no room is *exhausted*, and the dimension that ran out is counted under Nomad's string
(`cpu`, `memory`, `disk`, `devices: no devices match request`, `network: ...`).

Differences from Nomad, on purpose:
- every candidate node is scored (Nomad stops after a log2(n) sample), and ties go to the node
  whose name sorts first, so a placement is reproducible from the fleet file alone;
- all simulated nodes share 127.0.0.1, so a dynamic port is unique across the whole fleet and
  is checked to be bindable right now, not merely free in Nomad's bookkeeping;
- no preemption (Nomad's default for service jobs), no `spread` blocks, and `Cores` asks are
  not modelled (use `CPU`).
"""

from __future__ import annotations

import errno
import math
import random
import socket
import time
from collections import Counter
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from devstack.nomad.feasible import (
    DISTINCT_HOSTS,
    AllocMetric,
    Constraint,
    DeviceGroup,
    DeviceRequest,
    Eligibility,
    GroupAsk,
    NodeView,
    check_attribute_constraint,
    check_constraint,
    device_matches,
    feasible,
    glob_match,
    instance_allowed,
    resolve_device_target,
    resolve_target,
    view_of,
)
from devstack.nomad.nodes import LOOPBACK, MAX_DYNAMIC_PORT, MIN_DYNAMIC_PORT
from devstack.nomad.usage import (
    Held,
    LiveUsage,
    NodeUsage,
    UsageView,
    alloc_footprint,
    alloc_is_live,
    alloc_ports,
    cached_footprint,
    forget_footprint,
)
from devstack.ports import worker_band

Json = dict[str, Any]

MAX_RETAINED_SCORES = 5  # structs.MaxRetainedNodeScores
BINPACK_MAX_FIT = 18.0
DEFAULT_CPU = 100
DEFAULT_MEMORY_MB = 300
DEFAULT_DISK_MB = 300

_rng = random.Random()


@dataclass
class Placement:
    node_id: str
    node_name: str
    allocated_resources: Json
    metrics: Json


@dataclass
class GroupPlacement:
    placed: list[Placement]
    failed: int
    metrics: Json  # Evaluation.FailedTGAllocs[group]; {} when everything was placed


# ----- ports ----------------------------------------------------------------------------------


def port_is_bindable(port: int) -> bool:
    """Whether a listener could take the port on 127.0.0.1 now (the engines set SO_REUSEADDR,
    so a port in TIME_WAIT counts as free, as it will for them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOOPBACK, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def _pick_dynamic(count: int, taken: Container[int]) -> list[int] | None:
    chosen: list[int] = []
    # Every stand-in on this machine shares its loopback: in parallel test workers each picks
    # from a band of its own (devstack/ports.py), so two stand-ins never hand out one port.
    low, high = worker_band(MIN_DYNAMIC_PORT, MAX_DYNAMIC_PORT + 1)
    tries = 0
    while len(chosen) < count and tries < 200:
        tries += 1
        port = low + _rng.randrange(high - low)
        if port in taken or port in chosen:
            continue
        if port_is_bindable(port):
            chosen.append(port)
    if len(chosen) < count:
        # Nearly full range: walk it once rather than keep guessing.
        for port in range(MIN_DYNAMIC_PORT, MAX_DYNAMIC_PORT + 1):
            if len(chosen) == count:
                break
            if port not in taken and port not in chosen and port_is_bindable(port):
                chosen.append(port)
    return chosen if len(chosen) == count else None


class _Either:
    """Ports taken in either of two sets, without copying the larger (the cluster's)."""

    def __init__(self, first: Container[int], second: Container[int]) -> None:
        self.first, self.second = first, second

    def __contains__(self, port: object) -> bool:
        return port in self.first or port in self.second


def _network_offer(network: Json, taken: Container[int]) -> tuple[Json | None, list[Json], str | None]:
    """`NetworkIndex.AssignPorts` for the group network: (network resource, port mappings,
    error)."""
    reserved = [dict(p) for p in network.get("ReservedPorts") or []]
    dynamic = [dict(p) for p in network.get("DynamicPorts") or []]
    for p in reserved:
        if int(p.get("Value") or 0) in taken:
            return None, [], f"reserved port collision {p.get('Label')}={p.get('Value')}"
    asked = _Either(taken, {int(p.get("Value") or 0) for p in reserved})
    values = _pick_dynamic(len(dynamic), asked)
    if values is None:
        return None, [], "dynamic port selection failed"
    for p, value in zip(dynamic, values, strict=True):
        p["Value"] = value
    mappings: list[Json] = []
    for p in dynamic + reserved:
        p.setdefault("To", 0)
        p["HostNetwork"] = p.get("HostNetwork") or "default"
        p.setdefault("IgnoreCollision", False)
        mapping = {"Label": p.get("Label", ""), "Value": p["Value"], "To": p["To"], "HostIP": LOOPBACK}
        if p["IgnoreCollision"]:
            mapping["IgnoreCollision"] = True
        mappings.append(mapping)
    resource = {
        "Mode": network.get("Mode") or "host",
        "Device": "",
        "CIDR": "",
        "IP": LOOPBACK,
        "MBits": int(network.get("MBits") or 0),
        "DNS": network.get("DNS"),
        "ReservedPorts": reserved or None,
        "DynamicPorts": dynamic or None,
        "CNI": network.get("CNI"),
    }
    return resource, mappings, None


# ----- devices --------------------------------------------------------------------------------


def _device_offer(
    view: NodeView, request: DeviceRequest, used: set[str]
) -> tuple[Json | None, float, float, str]:
    """`deviceAllocator.createOffer`: (AllocatedDeviceResource, matched affinity weight, total
    affinity weight, error)."""
    if not view.devices:
        return None, 0.0, 0.0, "no devices available"
    if request.count == 0:
        return None, 0.0, 0.0, "invalid request of zero devices"
    best: tuple[DeviceGroup, list[str], float, float] | None = None
    total_weight = sum(abs(w) for _, w in request.affinities)
    for group in view.devices:
        if not device_matches(group, request):
            continue
        assignable: list[str] = []
        for iid in group.healthy_ids:
            if iid in used or not instance_allowed(iid, request, group):
                continue
            assignable.append(iid)
            if len(assignable) == request.count:
                break
        if len(assignable) < request.count:
            continue
        matched = 0.0
        for aff, weight in request.affinities:
            left, lok = resolve_device_target(aff.ltarget, group)
            right, rok = resolve_device_target(aff.rtarget, group)
            if check_attribute_constraint(aff.operand, left, right, lok, rok):
                matched += weight
        score = matched / total_weight if total_weight else 0.0
        if best is None or score > best[2]:
            best = (group, assignable, score, matched)
    if best is None:
        return None, 0.0, 0.0, "no devices match request"
    group, ids, _, matched = best
    offer = {"Vendor": group.vendor, "Type": group.type, "Name": group.name, "DeviceIDs": ids}
    return offer, matched, total_weight, ""


# ----- one group ------------------------------------------------------------------------------


@dataclass
class _Task:
    name: str
    cpu: int
    memory: int
    devices: list[DeviceRequest]
    lifecycle: Json | None


def _tasks(group: Json) -> list[_Task]:
    out = []
    for task in group.get("Tasks") or []:
        res = task.get("Resources") or {}
        cpu = res.get("CPU")
        memory = res.get("MemoryMB")
        out.append(
            _Task(
                name=str(task.get("Name") or ""),
                cpu=DEFAULT_CPU if cpu is None else int(cpu),
                memory=(DEFAULT_MEMORY_MB if memory is None else int(memory))
                + int(res.get("SecretsMB") or 0),
                devices=[DeviceRequest.from_json(d) for d in res.get("Devices") or []],
                lifecycle=task.get("Lifecycle"),
            )
        )
    return out


def _score_fit(view: NodeView, cpu_used: int, mem_used: int) -> float:
    """`ScoreFitBinPack`, normalised to [0, 1]: fuller nodes score higher."""
    free_cpu = 1 - cpu_used / view.cpu if view.cpu > 0 else 0.0
    free_mem = 1 - mem_used / view.memory if view.memory > 0 else 0.0
    score = 20.0 - (math.pow(10, free_cpu) + math.pow(10, free_mem))
    return min(max(score, 0.0), BINPACK_MAX_FIT) / BINPACK_MAX_FIT


@dataclass
class _Candidate:
    view: NodeView
    score: float
    tasks: Json
    devices_used: list[str]
    scores: Json


class _GroupPlacer:
    def __init__(self, job: Json, group: Json, nodes: Iterable[Json], live_allocs: Iterable[Json] | UsageView,
                 count: int, used_ports: set[int] | None) -> None:  # fmt: skip
        self.job = job
        self.group = group
        self.ask = GroupAsk.build(job, group)
        self.group_name = str(group.get("Name") or "")
        self.tasks = _tasks(group)
        self.disk = int((group.get("EphemeralDisk") or {}).get("SizeMB") or DEFAULT_DISK_MB)
        networks = group.get("Networks") or []
        self.network: Json | None = networks[0] if networks else None
        self.pool = str(job.get("NodePool") or "default")
        datacenters = list(job.get("Datacenters") or []) or ["*"]
        self.desired = int(group.get("Count") or count or 1)
        self.affinities = [
            (Constraint.from_json(a), float(a.get("Weight") or 0))
            for a in (job.get("Affinities") or [])
            + (group.get("Affinities") or [])
            + [a for t in group.get("Tasks") or [] for a in t.get("Affinities") or []]
        ]

        views = [view_of(n) for n in nodes]
        self.by_id = {v.id: v for v in views}
        # readyNodesInDCsAndPool: nodes that are not ready, or outside the job's datacenters
        # and pool, never reach the scheduler and are not counted as evaluated.
        self.candidates = sorted(
            (
                v
                for v in views
                if (self.pool == "all" or v.pool == self.pool)
                and v.ready
                and any(glob_match(dc, v.datacenter) for dc in datacenters)
            ),
            key=lambda v: v.name,
        )
        self.by_dc = Counter(v.datacenter for v in self.candidates)

        # What live allocations hold, as the store keeps it (or summed from a list handed in).
        if isinstance(live_allocs, UsageView):
            self.usage = live_allocs
            self.usage.take_ports(used_ports or ())
        else:
            self.usage = UsageView(LiveUsage.of(live_allocs), used_ports=used_ports or ())
        # What one allocation of the group asks, the same on every node (devices aside, which
        # do not count here): summed once, not once per node ranked.
        asks = {t.name: {"Cpu": {"CpuShares": t.cpu}, "Memory": {"MemoryMB": t.memory}} for t in self.tasks}
        resources = {"Tasks": asks, "TaskLifecycles": self._lifecycles(), "Shared": {"DiskMB": self.disk}}
        self._proposed = alloc_footprint({"AllocatedResources": resources})
        self._property_list = self._compute_property_sets()
        self.property_use: dict[tuple[int, str], Counter[str]] = {}
        self._init_properties(self.usage.job_held((self.ask.namespace, self.ask.job_id)))
        self.elig = Eligibility()

    # distinct_property: how often each property value is already used by this job (or group)
    def _property_sets(self) -> list[tuple[int, Constraint, bool]]:
        return self._property_list

    def _compute_property_sets(self) -> list[tuple[int, Constraint, bool]]:
        sets = [(i, c, False) for i, c in enumerate(self.ask.distinct_property_job)]
        offset = len(sets)
        sets += [(offset + i, c, True) for i, c in enumerate(self.ask.distinct_property_group)]
        return sets

    def _init_properties(self, job_held: list[Held]) -> None:
        for idx, c, per_group in self._property_sets():
            counter: Counter[str] = Counter()
            for held in job_held:
                if per_group and held.group != self.group_name:
                    continue
                view = self.by_id.get(held.node)
                if view is None:
                    continue
                value, ok = resolve_target(c.ltarget, view)
                if ok:
                    counter[value] += 1
            self.property_use[(idx, c.ltarget)] = counter

    def _distinct_property_reason(self, view: NodeView) -> str | None:
        for idx, c, _ in self._property_sets():
            allowed = 1
            if c.rtarget:
                if not c.rtarget.isdigit():
                    return f'failed to convert RTarget "{c.rtarget}" to uint64'
                allowed = int(c.rtarget)
            value, ok = resolve_target(c.ltarget, view)
            if not ok:
                return f'missing property "{c.ltarget}"'
            used = self.property_use[(idx, c.ltarget)][value]
            if used >= allowed:
                return f"distinct_property: {c.ltarget}={value} used by {used} allocs"
        return None

    def _affinity_score(self, view: NodeView) -> float:
        total = sum(abs(w) for _, w in self.affinities)
        if not total:
            return 0.0
        matched = 0.0
        for aff, weight in self.affinities:
            left, lok = resolve_target(aff.ltarget, view)
            right, rok = resolve_target(aff.rtarget, view)
            if check_constraint(aff.operand, left, right, lok, rok):
                matched += weight
        return matched / total

    def _binpack(self, view: NodeView, metric: AllocMetric, net_error: str | None) -> _Candidate | None:
        usage = self.usage.get(view.id) or NodeUsage()
        if net_error is not None:
            metric.exhausted_node(view, f"network: {net_error}")
            return None
        used = set(usage.devices)
        tasks: Json = {}
        devices_used: list[str] = []
        matched_weight = 0.0
        total_weight = 0.0
        for task in self.tasks:
            offers = []
            for request in task.devices:
                offer, matched, weight, error = _device_offer(view, request, used)
                if offer is None:
                    metric.exhausted_node(view, f"devices: {error}")
                    return None
                used.update(offer["DeviceIDs"])
                devices_used.extend(offer["DeviceIDs"])
                offers.append(offer)
                matched_weight += matched
                total_weight += weight
            tasks[task.name] = {
                "Cpu": {"CpuShares": task.cpu, "ReservedCores": None},
                "Memory": {"MemoryMB": task.memory, "MemoryMaxMB": 0},
                "Networks": None,
                "Devices": offers or None,
            }
        proposed = self._proposed
        cpu_used = usage.cpu + proposed[0]
        mem_used = usage.memory + proposed[1]
        disk_used = usage.disk + proposed[2]
        # ComparableResources.Superset: the first dimension that does not fit is the one counted.
        for dimension, have, need in (("cpu", view.cpu, cpu_used), ("memory", view.memory, mem_used),
                                      ("disk", view.disk, disk_used)):  # fmt: skip
            if have < need:
                metric.exhausted_node(view, dimension)
                return None
        binpack = _score_fit(view, cpu_used, mem_used)
        scores: list[float] = [binpack]
        meta: Json = {"binpack": binpack}
        if total_weight:
            scores.append(matched_weight / total_weight)
            meta["devices"] = matched_weight / total_weight
        collisions = usage.groups[(self.ask.namespace, self.ask.job_id, self.group_name)]
        penalty = -(collisions + 1) / self.desired if collisions else 0.0
        if collisions:
            scores.append(penalty)
        meta["job-anti-affinity"] = penalty
        meta["node-reschedule-penalty"] = 0.0
        affinity = self._affinity_score(view)
        if affinity:
            scores.append(affinity)
        meta["node-affinity"] = affinity
        return _Candidate(view, sum(scores) / len(scores), tasks, devices_used, meta)

    def _lifecycles(self) -> Json:
        return {t.name: t.lifecycle for t in self.tasks}

    def select(self, only: NodeView | None = None) -> tuple[Placement | None, AllocMetric]:
        """The best node for one allocation; with `only`, that node or none (the system
        scheduler's one-node stack), still reporting the whole pool in the metric."""
        start = time.perf_counter_ns()
        metric = AllocMetric(
            nodes_in_pool=len(self.candidates), node_pool=self.pool, nodes_available=dict(self.by_dc)
        )
        net_resource: Json | None = None
        mappings: list[Json] = []
        net_error: str | None = None
        net_done = self.network is None
        best: _Candidate | None = None
        ranked: list[_Candidate] = []
        ask = self.ask
        for view in self.candidates if only is None else (only,):
            metric.nodes_evaluated += 1
            if not feasible(view, ask, self.elig, metric):
                continue
            usage = self.usage.get(view.id)
            if usage is not None and (
                (ask.distinct_hosts_job and usage.jobs[(ask.namespace, ask.job_id)])
                or (ask.distinct_hosts_group and usage.groups[(ask.namespace, ask.job_id, self.group_name)])
            ):
                metric.filter_node(view, DISTINCT_HOSTS)
                continue
            reason = self._distinct_property_reason(view)
            if reason is not None:
                metric.filter_node(view, reason)
                continue
            if not net_done:
                assert self.network is not None
                net_resource, mappings, net_error = _network_offer(self.network, self.usage)
                net_done = True
            candidate = self._binpack(view, metric, net_error)
            if candidate is None:
                continue
            ranked.append(candidate)
            if best is None or candidate.score > best.score:
                best = candidate
        for cand in sorted(ranked, key=lambda c: (-c.score, c.view.name))[:MAX_RETAINED_SCORES]:
            metric.score_meta.append({"NodeID": cand.view.id, "Scores": cand.scores, "NormScore": cand.score})
        metric.allocation_time_ns = time.perf_counter_ns() - start
        if best is None:
            return None, metric
        return self._commit(best, net_resource, mappings, metric), metric

    def _commit(
        self, best: _Candidate, net: Json | None, mappings: list[Json], metric: AllocMetric
    ) -> Placement:
        view = best.view
        usage = self.usage.writable(view.id)
        resources = {
            "Tasks": best.tasks,
            "TaskLifecycles": self._lifecycles(),
            "Shared": {"Networks": [net] if net else None, "DiskMB": self.disk, "Ports": mappings or None},
        }
        cpu, mem, disk, _ = alloc_footprint({"AllocatedResources": resources})
        usage.cpu += cpu
        usage.memory += mem
        usage.disk += disk
        usage.devices.update(best.devices_used)
        usage.jobs[(self.ask.namespace, self.ask.job_id)] += 1
        usage.groups[(self.ask.namespace, self.ask.job_id, self.group_name)] += 1
        self.usage.take_ports(m["Value"] for m in mappings)
        for idx, c, _ in self._property_sets():
            value, ok = resolve_target(c.ltarget, view)
            if ok:
                self.property_use[(idx, c.ltarget)][value] += 1
        return Placement(view.id, view.name, resources, metric.to_json())


def place_group(
    job: Json,
    group: Json,
    nodes: Iterable[Json],
    live_allocs: Iterable[Json] | UsageView,
    count: int,
    used_ports: set[int] | None = None,
) -> GroupPlacement:
    """Place `count` allocations of `group`, one at a time, each seeing the ones before it.

    As in Nomad's generic scheduler, the first allocation that fits nowhere ends the attempt:
    the rest are coalesced into its metric (`CoalescedFailures`) rather than tried again."""
    placer = _GroupPlacer(job, group, nodes, live_allocs, count, used_ports)
    placed: list[Placement] = []
    task_asks = [(t.name, t.cpu, t.memory) for t in placer.tasks]
    for _ in range(max(count, 0)):
        placement, metric = placer.select()
        if placement is None:
            failed = count - len(placed)
            for _ in range(failed):
                metric.exhaust_resources(task_asks)
            metric.coalesced_failures = failed - 1
            return GroupPlacement(placed, failed, metric.to_json())
        placed.append(placement)
    return GroupPlacement(placed, 0, {})


@dataclass
class SystemPlacement:
    placed: list[tuple[str, Placement]]  # (node ID, placement)
    exhausted_nodes: list[str]  # feasible but without room, in the order tried
    failed_metrics: Json  # FailedTGAllocs entry for the exhausted nodes; {} if none
    filtered_metrics: Json  # filter counts merged over the filtered nodes; {} if none
    filtered: int  # nodes the feasibility chain rejected


def place_system(
    job: Json,
    group: Json,
    nodes: Iterable[Json],
    live_allocs: Iterable[Json] | UsageView,
    targets: Iterable[str],
    used_ports: set[int] | None = None,
) -> SystemPlacement:
    """The system scheduler's placements: one allocation of `group` on each target node
    (`scheduler_system.go` `computePlacements`). A node the feasibility chain rejects is only
    counted (Nomad does not report filtered nodes to users); the first node that is feasible
    but full gives the failure metric, and later ones are coalesced into it."""
    placer = _GroupPlacer(job, group, nodes, live_allocs, 1, used_ports)
    task_asks = [(t.name, t.cpu, t.memory) for t in placer.tasks]
    result = SystemPlacement([], [], {}, {}, 0)
    failed: AllocMetric | None = None
    merged: Json = {}
    candidates = {v.id for v in placer.candidates}
    for node_id in targets:
        view = placer.by_id.get(node_id)
        if view is None or node_id not in candidates:
            continue
        placement, metric = placer.select(only=view)
        if placement is not None:
            result.placed.append((node_id, placement))
            continue
        if metric.nodes_filtered > 0:
            result.filtered += 1
            merged = _merge_filtered(merged, metric.to_json())
            continue
        result.exhausted_nodes.append(node_id)
        if failed is None:
            failed = metric
        else:
            failed.coalesced_failures += 1
        failed.exhaust_resources(task_asks)
    if failed is not None:
        result.failed_metrics = failed.to_json()
    result.filtered_metrics = merged
    return result


def _merge_filtered(into: Json, metric: Json) -> Json:
    """`mergeNodeFiltered`: the filter counts of several one-node attempts, summed."""
    if not into:
        return dict(metric)
    out = dict(into)
    for key in ("NodesEvaluated", "NodesFiltered"):
        out[key] = int(out.get(key) or 0) + int(metric.get(key) or 0)
    for key in ("ClassFiltered", "ConstraintFiltered"):
        merged = dict(out.get(key) or {})
        for k, v in (metric.get(key) or {}).items():
            merged[k] = merged.get(k, 0) + v
        out[key] = merged or None
    return out


__all__ = [
    "GroupPlacement",
    "Placement",
    "SystemPlacement",
    "alloc_footprint",
    "alloc_is_live",
    "alloc_ports",
    "cached_footprint",
    "forget_footprint",
    "place_group",
    "place_system",
    "port_is_bindable",
]
