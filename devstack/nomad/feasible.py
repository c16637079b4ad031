"""Nomad's feasibility chain: which nodes may run a task group at all, and why the others may not.

Follows `scheduler/feasible/feasible.go`: job constraints, then the group's drivers, constraints
and devices, then `distinct_hosts` and `distinct_property`. Every rejection is counted in the
placement metrics under the string Nomad uses (`missing drivers`, `missing devices`, a
constraint's `LTarget Operand RTarget`, `computed class ineligible`), because llmgw turns those
counts into the "fits nowhere" reason an operator reads; a stand-in with its own wording would
test a summariser that fails on the real thing.

Like Nomad, the result of the job and group checks is remembered per computed node class for the
rest of the placement call, so the second and later nodes of a class that failed are counted as
`computed class ineligible` rather than under the original reason. One deliberate difference:
Nomad's class hash leaves device health out, so there a node whose GPUs died can make its healthy
twins look infeasible for the rest of an evaluation; here the number of healthy instances is part
of the class, so a placement never depends on which twin happened to be visited first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from devstack.nomad.attributes import (
    Attribute,
    attribute_from_json,
    compare,
    parse_attribute,
    parse_go_bool,
    string_attr,
    version_matches,
)
from devstack.nomad.nodes import computed_class

Json = dict[str, Any]

FILTER_DRIVERS = "missing drivers"
FILTER_DEVICES = "missing devices"
FILTER_NETWORK = "missing network"
FILTER_CLASS_INELIGIBLE = "computed class ineligible"
FILTER_HOST_VOLUMES = "missing compatible host volumes"  # FilterConstraintHostVolumes
DISTINCT_HOSTS = "distinct_hosts"
DISTINCT_PROPERTY = "distinct_property"

# Supported operands (structs.Constraint*): the comparison operators plus these.
OPERANDS = frozenset(
    {"=", "==", "is", "!=", "not", "<", "<=", ">", ">=", "regexp", "version", "semver",
     "set_contains", "set_contains_all", "set_contains_any", "is_set", "is_not_set",
     DISTINCT_HOSTS, DISTINCT_PROPERTY}
)  # fmt: skip

_ESCAPING_PREFIXES = ("${unique.", "${node.unique.", "${attr.unique.", "${meta.unique.")


@dataclass(frozen=True, slots=True)
class Constraint:
    ltarget: str
    rtarget: str
    operand: str

    @classmethod
    def from_json(cls, raw: Json) -> Constraint:
        return cls(
            str(raw.get("LTarget") or ""), str(raw.get("RTarget") or ""), str(raw.get("Operand") or "")
        )

    def __str__(self) -> str:
        # structs.Constraint.String(): the key of ConstraintFiltered.
        return f"{self.ltarget} {self.operand} {self.rtarget}"

    @property
    def escapes_class(self) -> bool:
        return self.ltarget.startswith(_ESCAPING_PREFIXES) or self.rtarget.startswith(_ESCAPING_PREFIXES)


def constraints_of(raw: Any) -> list[Constraint]:
    return [Constraint.from_json(c) for c in raw or [] if isinstance(c, dict)]


# ----- per-node facts, computed once per node object ---------------------------------------


@dataclass(slots=True)
class DeviceGroup:
    vendor: str
    type: str
    name: str
    attributes: dict[str, Attribute]
    instance_ids: tuple[str, ...]
    healthy_ids: tuple[str, ...]  # node order, so assignments are reproducible


@dataclass(slots=True)
class NodeView:
    """What the scheduler needs from a node, parsed once. Node dicts are treated as immutable
    (the store replaces them on every change); status, eligibility and drain are nevertheless
    read from the dict on every call, since they are cheap and change most often."""

    node: Json
    id: str
    name: str
    datacenter: str
    pool: str
    node_class: str
    attributes: dict[str, str]
    meta: dict[str, str]
    drivers: dict[str, Any]
    cpu: int
    memory: int
    disk: int
    devices: list[DeviceGroup]
    class_key: str

    @property
    def ready(self) -> bool:
        """`Node.Ready()`: only these are handed to the scheduler at all."""
        n = self.node
        return (
            n.get("Status") == "ready"
            and n.get("DrainStrategy") is None
            and n.get("SchedulingEligibility") == "eligible"
        )


_VIEWS: dict[int, tuple[Json, NodeView]] = {}


def view_of(node: Json) -> NodeView:
    cached = _VIEWS.get(id(node))
    # The cache holds the dict itself, so its id cannot be reused while the entry exists.
    if cached is not None and cached[0] is node:
        return cached[1]
    view = _build_view(node)
    if len(_VIEWS) > 16384:
        _VIEWS.clear()
    _VIEWS[id(node)] = (node, view)
    return view


def _build_view(node: Json) -> NodeView:
    name = node.get("Name", "")
    res = node.get("NodeResources") or {}
    reserved = node.get("ReservedResources") or {}
    devices: list[DeviceGroup] = []
    for i, d in enumerate(res.get("Devices") or []):
        where = f"node {name!r}: NodeResources.Devices[{i}]"
        attrs = {
            k: attribute_from_json(v, f"{where}.Attributes.{k}")
            for k, v in (d.get("Attributes") or {}).items()
        }
        instances = d.get("Instances") or []
        devices.append(
            DeviceGroup(
                vendor=d.get("Vendor", ""),
                type=d.get("Type", ""),
                name=d.get("Name", ""),
                attributes=attrs,
                instance_ids=tuple(inst["ID"] for inst in instances),
                healthy_ids=tuple(inst["ID"] for inst in instances if inst.get("Healthy")),
            )
        )
    health = ",".join(str(len(g.healthy_ids)) for g in devices)
    try:
        base_class = computed_class(node)
    except (KeyError, TypeError):
        base_class = node.get("ComputedClass") or f"node:{node.get('ID')}"
    return NodeView(
        node=node,
        id=node.get("ID", ""),
        name=name,
        datacenter=node.get("Datacenter", ""),
        pool=node.get("NodePool") or "default",
        node_class=node.get("NodeClass", ""),
        attributes=node.get("Attributes") or {},
        meta=node.get("Meta") or {},
        drivers=node.get("Drivers") or {},
        cpu=int((res.get("Cpu") or {}).get("CpuShares", 0))
        - int((reserved.get("Cpu") or {}).get("CpuShares", 0)),
        memory=int((res.get("Memory") or {}).get("MemoryMB", 0))
        - int((reserved.get("Memory") or {}).get("MemoryMB", 0)),
        disk=int((res.get("Disk") or {}).get("DiskMB", 0))
        - int((reserved.get("Disk") or {}).get("DiskMB", 0)),
        devices=devices,
        class_key=f"{base_class}/{health}",
    )


def glob_match(pattern: str, value: str) -> bool:
    """ryanuber/go-glob, which Nomad uses for datacenters: `*` is the only wildcard."""
    if "*" not in pattern:
        return pattern == value
    parts = pattern.split("*")
    if not value.startswith(parts[0]) or not value.endswith(parts[-1]):
        return False
    pos = len(parts[0])
    end = len(value) - len(parts[-1])
    if pos > end:
        return False
    for part in parts[1:-1]:
        found = value.find(part, pos, end)
        if found < 0:
            return False
        pos = found + len(part)
    return True


# ----- node constraints ----------------------------------------------------------------------


def resolve_target(target: str, view: NodeView) -> tuple[str, bool]:
    """`resolveTarget`: a literal, or one of the node interpolations."""
    if not target.startswith("${"):
        return target, True
    if target == "${node.unique.id}":
        return view.id, True
    if target == "${node.datacenter}":
        return view.datacenter, True
    if target == "${node.unique.name}":
        return view.name, True
    if target == "${node.class}":
        return view.node_class, True
    if target == "${node.pool}":
        return view.pool, True
    if target.startswith("${attr."):
        key = target[len("${attr.") :].removesuffix("}")
        return (view.attributes[key], True) if key in view.attributes else ("", False)
    if target.startswith("${meta."):
        key = target[len("${meta.") :].removesuffix("}")
        return (view.meta[key], True) if key in view.meta else ("", False)
    return "", False


_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?)\Z")
_REGEXPS: dict[str, re.Pattern[str] | None] = {}


def _regexp(pattern: str) -> re.Pattern[str] | None:
    if pattern not in _REGEXPS:
        try:
            _REGEXPS[pattern] = re.compile(pattern)
        except re.error:
            _REGEXPS[pattern] = None  # Nomad: an invalid regexp never matches
    return _REGEXPS[pattern]


def _order(op: str, left: str, right: str) -> bool:
    """`checkOrder`: as integers if both parse, else as floats, else lexically."""
    lv: Any
    rv: Any
    if _INT.match(left) and _INT.match(right):
        lv, rv = int(left), int(right)
    elif _FLOAT.match(left) and _FLOAT.match(right):
        lv, rv = float(left), float(right)
    else:
        lv, rv = left, right
    if op == "<":
        return bool(lv < rv)
    if op == "<=":
        return bool(lv <= rv)
    if op == ">":
        return bool(lv > rv)
    return bool(lv >= rv)


def _set(text: str) -> set[str]:
    return {part.strip() for part in text.split(",")}


def set_contains_all(left: str, right: str) -> bool:
    return _set(right) <= _set(left)


def set_contains_any(left: str, right: str) -> bool:
    return bool(_set(right) & _set(left))


def check_constraint(operand: str, left: str, right: str, lfound: bool, rfound: bool) -> bool:
    """`checkConstraint` for node targets (string values)."""
    if operand in (DISTINCT_HOSTS, DISTINCT_PROPERTY):
        return True  # handled by their own iterators
    if operand in ("=", "==", "is"):
        return lfound and rfound and left == right
    if operand in ("!=", "not"):
        # reflect.DeepEqual on the resolved strings: a missing target resolves to "".
        return left != right
    if operand in ("<", "<=", ">", ">="):
        return lfound and rfound and _order(operand, left, right)
    if operand == "is_set":
        return lfound
    if operand == "is_not_set":
        return not lfound
    if not (lfound and rfound):
        return False
    if operand == "version":
        return version_matches(left, right, strict=False)
    if operand == "semver":
        return version_matches(left, right, strict=True)
    if operand == "regexp":
        compiled = _regexp(right)
        return compiled is not None and compiled.search(left) is not None
    if operand in ("set_contains", "set_contains_all"):
        return set_contains_all(left, right)
    if operand == "set_contains_any":
        return set_contains_any(left, right)
    return False


def meets(constraint: Constraint, view: NodeView) -> bool:
    left, lok = resolve_target(constraint.ltarget, view)
    right, rok = resolve_target(constraint.rtarget, view)
    return check_constraint(constraint.operand, left, right, lok, rok)


# ----- devices --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """`structs.RequestedDevice`: `gpu`, `nvidia/gpu` or `nvidia/gpu/<model>`."""

    name: str
    count: int
    constraints: tuple[Constraint, ...]
    affinities: tuple[tuple[Constraint, float], ...]

    @classmethod
    def from_json(cls, raw: Json) -> DeviceRequest:
        count = raw.get("Count")
        affinities = tuple(
            (Constraint.from_json(a), float(a.get("Weight") or 0)) for a in raw.get("Affinities") or []
        )
        return cls(
            name=str(raw.get("Name") or ""),
            count=1 if count is None else int(count),
            constraints=tuple(constraints_of(raw.get("Constraints"))),
            affinities=affinities,
        )

    def id_matches(self, group: DeviceGroup) -> bool:
        """`DeviceIdTuple.Matches`: only the parts the request names are compared, exactly."""
        parts = self.name.split("/", 2)
        if len(parts) == 1:
            vendor, type_, name = "", parts[0], ""
        elif len(parts) == 2:
            vendor, type_, name = parts[0], parts[1], ""
        else:
            vendor, type_, name = parts
        return (
            (not name or name == group.name)
            and (not vendor or vendor == group.vendor)
            and (not type_ or type_ == group.type)
        )


def resolve_device_target(target: str, group: DeviceGroup) -> tuple[Attribute | None, bool]:
    """`resolveDeviceTarget`: literals are parsed with their units ("80 GiB")."""
    if not target.startswith("${"):
        return parse_attribute(target), True
    if target == "${device.ids}":
        return string_attr(",".join(group.instance_ids)), True
    if target == "${device.model}":
        return string_attr(group.name), True
    if target == "${device.vendor}":
        return string_attr(group.vendor), True
    if target == "${device.type}":
        return string_attr(group.type), True
    if target.startswith("${device.attr."):
        key = target[len("${device.attr.") :].removesuffix("}")
        value = group.attributes.get(key)
        return value, value is not None
    return None, False


def check_attribute_constraint(
    operand: str, left: Attribute | None, right: Attribute | None, lfound: bool, rfound: bool
) -> bool:
    """`checkAttributeConstraint`: typed, unit-aware comparison for device constraints."""
    if operand in (DISTINCT_HOSTS, DISTINCT_PROPERTY):
        return True
    if operand in ("!=", "not"):
        if not (lfound or rfound):
            return False
        if lfound != rfound:
            return True
        assert left is not None and right is not None
        cmp = compare(left, right)
        return cmp is not None and cmp != 0
    if operand in ("<", "<=", ">", ">=", "=", "==", "is"):
        if not (lfound and rfound):
            return False
        assert left is not None and right is not None
        cmp = compare(left, right)
        if cmp is None:
            return False
        return {
            "=": cmp == 0, "==": cmp == 0, "is": cmp == 0,
            "<": cmp == -1, "<=": cmp != 1, ">": cmp == 1, ">=": cmp != -1,
        }[operand]  # fmt: skip
    if operand == "is_set":
        return lfound
    if operand == "is_not_set":
        return not lfound
    if not (lfound and rfound):
        return False
    assert left is not None and right is not None
    if operand in ("version", "semver"):
        if left.string is not None:
            text = left.string
        elif left.int_ is not None:
            text = str(left.int_)
        else:
            return False
        return right.string is not None and version_matches(text, right.string, operand == "semver")
    if left.string is None or right.string is None:
        return False
    if operand == "regexp":
        compiled = _regexp(right.string)
        return compiled is not None and compiled.search(left.string) is not None
    if operand in ("set_contains", "set_contains_all"):
        return set_contains_all(left.string, right.string)
    if operand == "set_contains_any":
        return set_contains_any(left.string, right.string)
    return False


def device_matches(group: DeviceGroup, request: DeviceRequest) -> bool:
    """`nodeDeviceMatches`: name parts and constraints, not the count."""
    if not request.id_matches(group):
        return False
    for c in request.constraints:
        left, lok = resolve_device_target(c.ltarget, group)
        right, rok = resolve_device_target(c.rtarget, group)
        if not check_attribute_constraint(c.operand, left, right, lok, rok):
            return False
    return True


def instance_allowed(instance_id: str, request: DeviceRequest, group: DeviceGroup) -> bool:
    """`deviceIDMatchesConstraint`: `${device.ids}` constraints pick individual instances."""
    for c in request.constraints:
        if c.ltarget == "${device.ids}":
            target, _ = resolve_device_target(c.rtarget, group)
        elif c.rtarget == "${device.ids}":
            target, _ = resolve_device_target(c.ltarget, group)
        else:
            continue
        if not check_attribute_constraint(c.operand, target, string_attr(instance_id), True, True):
            return False
    return True


def has_devices(view: NodeView, requests: Iterable[DeviceRequest]) -> bool:
    """`DeviceChecker.hasDevices`: enough healthy instances in matching groups, ignoring what
    other allocations use (that is bin-packing's job, and counts as exhaustion, not filtering)."""
    requests = list(requests)
    if not requests:
        return True
    available = {i: len(g.healthy_ids) for i, g in enumerate(view.devices) if g.healthy_ids}
    if not available:
        return False
    for req in requests:
        for i, unused in available.items():
            if unused and unused >= req.count and device_matches(view.devices[i], req):
                available[i] -= req.count
                break
        else:
            return False
    return True


# ----- the placement metric ---------------------------------------------------------------


@dataclass
class AllocMetric:
    """`structs.AllocMetric`, with Nomad's counting rules (`FilterNode`, `ExhaustedNode`)."""

    nodes_evaluated: int = 0
    nodes_filtered: int = 0
    nodes_in_pool: int = 0
    node_pool: str = ""
    nodes_available: dict[str, int] = field(default_factory=dict)
    class_filtered: dict[str, int] = field(default_factory=dict)
    constraint_filtered: dict[str, int] = field(default_factory=dict)
    nodes_exhausted: int = 0
    class_exhausted: dict[str, int] = field(default_factory=dict)
    dimension_exhausted: dict[str, int] = field(default_factory=dict)
    resources_exhausted: dict[str, Json] = field(default_factory=dict)
    score_meta: list[Json] = field(default_factory=list)
    allocation_time_ns: int = 0
    coalesced_failures: int = 0

    def filter_node(self, view: NodeView, reason: str) -> None:
        self.nodes_filtered += 1
        if view.node_class:
            self.class_filtered[view.node_class] = self.class_filtered.get(view.node_class, 0) + 1
        if reason:
            self.constraint_filtered[reason] = self.constraint_filtered.get(reason, 0) + 1

    def exhausted_node(self, view: NodeView, dimension: str) -> None:
        self.nodes_exhausted += 1
        if view.node_class:
            self.class_exhausted[view.node_class] = self.class_exhausted.get(view.node_class, 0) + 1
        if dimension:
            self.dimension_exhausted[dimension] = self.dimension_exhausted.get(dimension, 0) + 1

    def exhaust_resources(self, tasks: Iterable[tuple[str, int, int]]) -> None:
        """`ExhaustResources`: per task, what was asked for on the dimensions that ran out."""
        if not self.dimension_exhausted:
            return
        for name, cpu, memory in tasks:
            entry = self.resources_exhausted.setdefault(name, _empty_resources())
            if self.dimension_exhausted.get("memory", 0) > 0:
                entry["MemoryMB"] += memory
            if self.dimension_exhausted.get("cpu", 0) > 0:
                entry["CPU"] += cpu

    def to_json(self) -> Json:
        return {
            "NodesEvaluated": self.nodes_evaluated,
            "NodesFiltered": self.nodes_filtered,
            "NodesInPool": self.nodes_in_pool,
            "NodePool": self.node_pool,
            "NodesAvailable": dict(self.nodes_available),
            "ClassFiltered": dict(self.class_filtered) or None,
            "ConstraintFiltered": dict(self.constraint_filtered) or None,
            "NodesExhausted": self.nodes_exhausted,
            "ClassExhausted": dict(self.class_exhausted) or None,
            "DimensionExhausted": dict(self.dimension_exhausted) or None,
            "QuotaExhausted": None,
            "ResourcesExhausted": {k: dict(v) for k, v in self.resources_exhausted.items()} or None,
            "Scores": None,
            "ScoreMetaData": [dict(m, Scores=dict(m["Scores"])) for m in self.score_meta] or None,
            "AllocationTime": self.allocation_time_ns,
            "CoalescedFailures": self.coalesced_failures,
        }


def _empty_resources() -> Json:
    return {
        "CPU": 0, "Cores": 0, "MemoryMB": 0, "MemoryMaxMB": 0, "DiskMB": 0, "IOPS": 0,
        "Networks": None, "Devices": None, "NUMA": None, "SecretsMB": 0,
    }  # fmt: skip


# ----- the job and group side of the chain --------------------------------------------------


@dataclass
class GroupAsk:
    """A task group's requirements, parsed once per placement call."""

    job_id: str
    namespace: str
    job_constraints: list[Constraint]
    group_constraints: list[Constraint]  # group + task constraints, as TaskGroupConstraints()
    drivers: set[str]
    device_requests: list[DeviceRequest]
    job_escaped: bool
    group_escaped: bool
    distinct_hosts_job: bool
    distinct_hosts_group: bool
    distinct_property_job: list[Constraint]
    distinct_property_group: list[Constraint]
    network_mode: str
    host_volumes: tuple[tuple[str, bool], ...] = ()  # (source, read_only) of each host volume ask

    @classmethod
    def build(cls, job: Json, group: Json) -> GroupAsk:
        job_c = constraints_of(job.get("Constraints"))
        group_c = constraints_of(group.get("Constraints"))
        tasks = group.get("Tasks") or []
        all_group_c = list(group_c)
        drivers: set[str] = set()
        devices: list[DeviceRequest] = []
        for task in tasks:
            all_group_c.extend(constraints_of(task.get("Constraints")))
            if task.get("Driver"):
                drivers.add(str(task["Driver"]))
            for dev in (task.get("Resources") or {}).get("Devices") or []:
                devices.append(DeviceRequest.from_json(dev))
        return cls(
            job_id=str(job.get("ID") or ""),
            namespace=str(job.get("Namespace") or "default"),
            job_constraints=job_c,
            group_constraints=all_group_c,
            drivers=drivers,
            device_requests=devices,
            job_escaped=any(c.escapes_class for c in job_c),
            group_escaped=any(c.escapes_class for c in all_group_c),
            distinct_hosts_job=_distinct_hosts(job_c),
            distinct_hosts_group=_distinct_hosts(group_c),
            distinct_property_job=[c for c in job_c if c.operand == DISTINCT_PROPERTY],
            distinct_property_group=[c for c in group_c if c.operand == DISTINCT_PROPERTY],
            network_mode=str(((group.get("Networks") or [{}])[0] or {}).get("Mode") or "host"),
            host_volumes=tuple(
                (str(v.get("Source") or ""), bool(v.get("ReadOnly")))
                for v in (group.get("Volumes") or {}).values()
                if (v.get("Type") or "host") == "host"
            ),
        )


def _distinct_hosts(constraints: list[Constraint]) -> bool:
    for c in constraints:
        if c.operand == DISTINCT_HOSTS:
            if c.rtarget == "":
                return True
            # An unparsable value keeps the old behaviour: the constraint applies.
            enabled = parse_go_bool(c.rtarget)
            return True if enabled is None else enabled
    return False


def has_drivers(view: NodeView, drivers: Iterable[str]) -> bool:
    """`DriverChecker.hasDrivers`: DriverInfo when present, else the `driver.<name>` attribute."""
    for driver in drivers:
        info = view.drivers.get(driver)
        if driver in view.drivers:
            if not (isinstance(info, dict) and info.get("Detected") and info.get("Healthy")):
                return False
            continue
        if not parse_go_bool(view.attributes.get(f"driver.{driver}", "")):
            return False
    return True


class Eligibility:
    """`EvalEligibility`: job- and group-level verdicts per computed class, kept for one
    placement call (one evaluation)."""

    def __init__(self) -> None:
        self.job: dict[str, bool] = {}
        self.group: dict[str, bool] = {}


def feasible(view: NodeView, ask: GroupAsk, elig: Eligibility, metric: AllocMetric) -> bool:
    """The wrapped checks of the generic stack, in Nomad's order; records why a node fails."""
    cls = view.class_key
    if not ask.job_escaped:
        verdict = elig.job.get(cls)
        if verdict is False:
            metric.filter_node(view, FILTER_CLASS_INELIGIBLE)
            return False
    else:
        verdict = None
    if verdict is None:
        for c in ask.job_constraints:
            if not meets(c, view):
                metric.filter_node(view, str(c))
                if not ask.job_escaped:
                    elig.job[cls] = False
                return False
        if not ask.job_escaped:
            elig.job[cls] = True

    if not ask.group_escaped:
        verdict = elig.group.get(cls)
        if verdict is False:
            metric.filter_node(view, FILTER_CLASS_INELIGIBLE)
            return False
        if verdict is True:
            return _has_host_volumes(view, ask, metric)
    reason = _group_reason(view, ask)
    if reason is not None:
        metric.filter_node(view, reason)
        if not ask.group_escaped:
            elig.group[cls] = False
        return False
    if not ask.group_escaped:
        elig.group[cls] = True
    return _has_host_volumes(view, ask, metric)


def _has_host_volumes(view: NodeView, ask: GroupAsk, metric: AllocMetric) -> bool:
    """`HostVolumeChecker` (scheduler/feasible/feasible.go): every host volume the group asks
    for is declared on the node, and one the node offers read-only only to read-only asks.
    Like Nomad's, it runs after the class-cached checks on every node, since host volumes are
    no part of the computed class (scheduler/stack.go puts it among the "available" checkers)."""
    volumes = view.node.get("HostVolumes") or {}
    for source, read_only in ask.host_volumes:
        offered = volumes.get(source)
        if offered is None or (offered.get("ReadOnly") and not read_only):
            metric.filter_node(view, FILTER_HOST_VOLUMES)
            return False
    return True


def _group_reason(view: NodeView, ask: GroupAsk) -> str | None:
    if not has_drivers(view, ask.drivers):
        return FILTER_DRIVERS
    for c in ask.group_constraints:
        if not meets(c, view):
            return str(c)
    if not has_devices(view, ask.device_requests):
        return FILTER_DEVICES
    # NetworkChecker: simulated nodes only have the host network (no bridge, no CNI).
    if ask.network_mode not in ("host", "none"):
        return FILTER_NETWORK
    return None
