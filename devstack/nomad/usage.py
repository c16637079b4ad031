"""What live allocations hold: per node (CPU, memory, disk, device instances, allocations per
job and group) and in host ports, kept up to date as allocations start and stop holding them.

Nomad's scheduler sums a node's allocations when it ranks that node (`scheduler/context.go`
`ProposedAllocs`, read through the state store's `allocs` table `node` index in
`nomad/state/state_store.go`). The stand-in ranks every ready node for every placement, so that
sum was a pass over every live allocation of the cluster per evaluation, and registering the
10,000th job cost ten times the 1,000th. The store keeps the sums instead (`LiveUsage`, changed
by each allocation write), and a placement works on a copy-on-write view of them
(`UsageView`): the plan's own stops taken out and its placements so far added, as Nomad's
`ProposedAllocs` does. The sums are exact, so every placement decision is the one a full pass
would have made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]

TERMINAL_CLIENT_STATUSES = frozenset({"complete", "failed", "lost"})


def alloc_is_live(alloc: Json) -> bool:
    """Counts against node capacity: wanted running and not finished on the client."""
    return alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") not in TERMINAL_CLIENT_STATUSES


def _task_usage(res: Json) -> tuple[int, int]:
    return int((res.get("Cpu") or {}).get("CpuShares") or 0), int(
        (res.get("Memory") or {}).get("MemoryMB") or 0
    )


def alloc_footprint(alloc: Json) -> tuple[int, int, int, list[str]]:
    """`AllocatedResources.Comparable()`: CPU and memory with lifecycle hooks taken into account
    (prestart tasks that exit do not add to the main tasks), disk, and device instance IDs."""
    ar = alloc.get("AllocatedResources") or {}
    lifecycles = ar.get("TaskLifecycles") or {}
    main = [0, 0]
    sidecar = [0, 0]
    ephemeral = [0, 0]
    poststop = [0, 0]
    devices: list[str] = []
    for name, res in (ar.get("Tasks") or {}).items():
        res = res or {}
        cpu, mem = _task_usage(res)
        hook = lifecycles.get(name) or {}
        if not hook:
            bucket = main
        elif hook.get("Hook") == "prestart":
            bucket = sidecar if hook.get("Sidecar") else ephemeral
        elif hook.get("Hook") == "poststop":
            bucket = poststop
        else:
            bucket = main  # poststart hooks are ignored by Nomad's Comparable; count them
        bucket[0] += cpu
        bucket[1] += mem
        for dev in res.get("Devices") or []:
            devices.extend(dev.get("DeviceIDs") or [])
    cpu = sidecar[0] + max(ephemeral[0], main[0], poststop[0])
    mem = sidecar[1] + max(ephemeral[1], main[1], poststop[1])
    disk = int((ar.get("Shared") or {}).get("DiskMB") or 0)
    return cpu, mem, disk, devices


def alloc_ports(alloc: Json) -> set[int]:
    """Every host port an allocation holds: group ports and (deprecated) task networks."""
    ar = alloc.get("AllocatedResources") or {}
    shared = ar.get("Shared") or {}
    ports = {int(p["Value"]) for p in shared.get("Ports") or [] if p.get("Value")}
    networks = list(shared.get("Networks") or [])
    for res in (ar.get("Tasks") or {}).values():
        networks.extend((res or {}).get("Networks") or [])
    for nw in networks:
        for p in (nw.get("DynamicPorts") or []) + (nw.get("ReservedPorts") or []):
            if p.get("Value"):
                ports.add(int(p["Value"]))
    return ports


# A placed allocation's AllocatedResources never change, so what it holds is computed once per
# allocation ID rather than on every placement. The store drops an entry once the allocation
# stops holding resources (`forget_footprint`). An entry also remembers the AllocatedResources
# object it was computed from and is used only for that same object, so a reused or hand-made
# ID can never return another allocation's footprint.
_Footprint = tuple[int, int, int, tuple[str, ...], frozenset[int]]
_FOOTPRINTS: dict[str, tuple[object, _Footprint]] = {}


def cached_footprint(alloc: Json) -> _Footprint:
    """(cpu, memory, disk, device IDs, ports) of a live allocation, cached by its ID."""
    alloc_id = alloc.get("ID") or ""
    resources = alloc.get("AllocatedResources")
    hit = _FOOTPRINTS.get(alloc_id) if alloc_id else None
    if hit is not None and hit[0] is resources:
        return hit[1]
    cpu, mem, disk, devices = alloc_footprint(alloc)
    entry = (cpu, mem, disk, tuple(devices), frozenset(alloc_ports(alloc)))
    if alloc_id and resources is not None:
        _FOOTPRINTS[alloc_id] = (resources, entry)
    return entry


def forget_footprint(alloc_id: str) -> None:
    _FOOTPRINTS.pop(alloc_id, None)


@dataclass(frozen=True)
class Held:
    """What one live allocation holds, and where: what is taken out again when it stops."""

    node: str
    job: tuple[str, str]  # (namespace, job ID)
    group: str
    cpu: int
    memory: int
    disk: int
    devices: tuple[str, ...]
    ports: frozenset[int]

    @classmethod
    def of(cls, alloc: Json) -> Held:
        cpu, mem, disk, devices, ports = cached_footprint(alloc)
        job = (alloc.get("Namespace") or "default", alloc.get("JobID") or "")
        return cls(alloc.get("NodeID", ""), job, alloc.get("TaskGroup") or "", cpu, mem, disk, devices, ports)


def _count(counter: Counter[Any], key: Any, sign: int) -> None:
    # Keys at zero are dropped, so `set(devices)` is exactly the instances in use.
    n = counter[key] + sign
    if n > 0:
        counter[key] = n
    else:
        del counter[key]


@dataclass
class NodeUsage:
    cpu: int = 0
    memory: int = 0
    disk: int = 0
    devices: Counter[str] = field(default_factory=Counter)
    jobs: Counter[tuple[str, str]] = field(default_factory=Counter)
    groups: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    def copy(self) -> NodeUsage:
        return NodeUsage(
            self.cpu, self.memory, self.disk, Counter(self.devices), Counter(self.jobs), Counter(self.groups)
        )

    def apply(self, held: Held, sign: int) -> None:
        self.cpu += sign * held.cpu
        self.memory += sign * held.memory
        self.disk += sign * held.disk
        for device in held.devices:
            _count(self.devices, device, sign)
        _count(self.jobs, held.job, sign)
        _count(self.groups, (*held.job, held.group), sign)


class LiveUsage:
    """The sums over every live allocation, changed one allocation at a time."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeUsage] = {}
        self.ports: Counter[int] = Counter()
        self.held: dict[str, Held] = {}
        # A job's live allocations, for distinct_property counts without a pass over all.
        self.by_job: dict[tuple[str, str], dict[str, Held]] = {}

    @classmethod
    def of(cls, allocs: Iterable[Json]) -> LiveUsage:
        """The sums over a list of allocations, each counted once per entry as a pass over
        the list would (hand-made lists may repeat an ID)."""
        usage = cls()
        for i, alloc in enumerate(allocs):
            if alloc_is_live(alloc):
                alloc_id = alloc.get("ID") or ""
                usage.add(alloc, alloc_id if alloc_id not in usage.held else f"{alloc_id}#{i}")
        return usage

    def add(self, alloc: Json, key: str | None = None) -> None:
        """The allocation holds resources (again, or with a new footprint)."""
        alloc_id = key if key is not None else alloc.get("ID") or ""
        self.discard(alloc_id)
        held = Held.of(alloc)
        self.held[alloc_id] = held
        self.by_job.setdefault(held.job, {})[alloc_id] = held
        self.nodes.setdefault(held.node, NodeUsage()).apply(held, 1)
        for port in held.ports:
            self.ports[port] += 1

    def discard(self, alloc_id: str) -> None:
        """The allocation no longer holds anything (stopped, finished or deleted)."""
        held = self.held.pop(alloc_id, None)
        if held is None:
            return
        job_allocs = self.by_job.get(held.job)
        if job_allocs is not None:
            job_allocs.pop(alloc_id, None)
            if not job_allocs:
                del self.by_job[held.job]
        self.nodes[held.node].apply(held, -1)
        for port in held.ports:
            _count(self.ports, port, -1)


class UsageView:
    """One placement's view of the sums: the base without the allocations the plan stops and
    with those it placed so far (and any ports it was told are taken), copied per node only
    where it differs, so building one costs the plan's changes, not the cluster's size."""

    def __init__(
        self,
        base: LiveUsage,
        without: Iterable[str] = (),
        extra: Iterable[Json] = (),
        used_ports: Iterable[int] = (),
    ) -> None:
        self.base = base
        self._nodes: dict[str, NodeUsage] = {}
        self._freed: Counter[int] = Counter()  # base ports released by the plan's stops
        self._taken: set[int] = set(used_ports)
        self._without: set[str] = set()
        self._extra: dict[tuple[str, str], list[Held]] = {}
        for alloc_id in without:
            held = base.held.get(alloc_id)
            if held is not None and alloc_id not in self._without:
                self._without.add(alloc_id)
                self.writable(held.node).apply(held, -1)
                self._freed.update(held.ports)
        for alloc in extra:
            if alloc_is_live(alloc):
                self.hold(Held.of(alloc))

    def get(self, node_id: str) -> NodeUsage | None:
        mine = self._nodes.get(node_id)
        return mine if mine is not None else self.base.nodes.get(node_id)

    def writable(self, node_id: str) -> NodeUsage:
        mine = self._nodes.get(node_id)
        if mine is None:
            base = self.base.nodes.get(node_id)
            mine = self._nodes[node_id] = base.copy() if base is not None else NodeUsage()
        return mine

    def hold(self, held: Held) -> None:
        self.writable(held.node).apply(held, 1)
        self._taken.update(held.ports)
        self._extra.setdefault(held.job, []).append(held)

    def take_ports(self, ports: Iterable[int]) -> None:
        self._taken.update(ports)

    def __contains__(self, port: object) -> bool:
        """Whether a host port is taken (every simulated node shares the loopback)."""
        if port in self._taken:
            return True
        return self.base.ports.get(port, 0) > self._freed.get(port, 0)  # type: ignore[call-overload]

    def job_held(self, job: tuple[str, str]) -> list[Held]:
        """What the job's live allocations hold, in this view."""
        base = [h for i, h in (self.base.by_job.get(job) or {}).items() if i not in self._without]
        return base + self._extra.get(job, [])
