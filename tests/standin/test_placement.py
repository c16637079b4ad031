"""Bin-packing: device instances, CPU, memory, disk and ports, exhaustion counted under Nomad's
dimension strings, and allocations of one call seeing each other."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from devstack.nomad.nodes import load_nodes
from devstack.nomad.placement import Placement, alloc_is_live, place_group
from tests.standin.test_feasible import H100, make_job, node, small

LARGE = Path(__file__).resolve().parents[2] / "devstack" / "nodes" / "large-200.yaml"

METRIC_FIELDS = {
    "NodesEvaluated", "NodesFiltered", "NodesInPool", "NodePool", "NodesAvailable", "ClassFiltered",
    "ConstraintFiltered", "NodesExhausted", "ClassExhausted", "DimensionExhausted", "QuotaExhausted",
    "ResourcesExhausted", "Scores", "ScoreMetaData", "AllocationTime", "CoalescedFailures",
}  # fmt: skip


def as_alloc(job: dict[str, Any], placement: Placement, client_status: str = "running") -> dict[str, Any]:
    """What the store would hold for a placement."""
    return {
        "ID": f"alloc-{id(placement)}",
        "Namespace": "default",
        "JobID": job["ID"],
        "TaskGroup": "engine",
        "NodeID": placement.node_id,
        "DesiredStatus": "run",
        "ClientStatus": client_status,
        "AllocatedResources": placement.allocated_resources,
    }


def devices_of(p: Placement) -> list[str]:
    return [i for d in p.allocated_resources["Tasks"]["server"]["Devices"] or [] for i in d["DeviceIDs"]]


def test_gpu_job_gets_healthy_instances_and_nomads_allocated_resources_shape() -> None:
    nodes = small()
    job, group = make_job(gpus=7, device=f"nvidia/gpu/{H100}", cpu=4000, memory=8192, disk=1000)
    (p,) = place_group(job, group, nodes, [], 1).placed
    h100 = next(n for n in nodes if n["Name"] == "gpu-h100-0")
    healthy = {i["ID"] for i in h100["NodeResources"]["Devices"][0]["Instances"] if i["Healthy"]}
    assert p.node_id == h100["ID"] and p.node_name == "gpu-h100-0"
    task = p.allocated_resources["Tasks"]["server"]
    assert task["Cpu"]["CpuShares"] == 4000
    assert task["Memory"]["MemoryMB"] == 8192
    (dev,) = task["Devices"]
    assert (dev["Vendor"], dev["Type"], dev["Name"]) == ("nvidia", "gpu", H100)
    assert set(dev["DeviceIDs"]) == healthy
    shared = p.allocated_resources["Shared"]
    assert shared["DiskMB"] == 1000
    (port,) = shared["Ports"]
    assert port["Label"] == "http" and port["HostIP"] == "127.0.0.1"
    assert 20000 <= port["Value"] <= 32000
    assert shared["Networks"][0]["DynamicPorts"][0]["Value"] == port["Value"]
    assert set(p.metrics) == METRIC_FIELDS
    assert p.metrics["ScoreMetaData"][0]["NodeID"] == h100["ID"]
    assert p.metrics["AllocationTime"] > 0
    assert "TaskLifecycles" in p.allocated_resources


def test_unhealthy_instances_are_never_allocated() -> None:
    nodes = small()
    h100 = next(n for n in nodes if n["Name"] == "gpu-h100-0")
    bad = next(i["ID"] for i in h100["NodeResources"]["Devices"][0]["Instances"] if not i["Healthy"])
    job, group = make_job(gpus=1, device=f"nvidia/gpu/{H100}")
    result = place_group(job, group, nodes, [], 8)
    assert len(result.placed) == 7
    assert bad not in {i for p in result.placed for i in devices_of(p)}
    assert result.failed == 1


def test_allocations_of_one_call_see_each_others_devices() -> None:
    nodes = small()
    job, group = make_job(gpus=1, device_constraints=[("${device.model}", "=", "NVIDIA L4")])
    result = place_group(job, group, nodes, [], 2)
    assert [p.node_name for p in result.placed] == ["gpu-l4-0"]
    assert result.failed == 1
    m = result.metrics
    assert m["NodesExhausted"] == 1
    assert m["DimensionExhausted"] == {"devices: no devices match request": 1}
    assert m["ClassExhausted"] == {"l4": 1}
    # The other two nodes failed the device check for the first allocation already; Nomad
    # remembers that per computed class for the rest of the evaluation.
    assert m["ConstraintFiltered"] == {"computed class ineligible": 2}
    assert m["CoalescedFailures"] == 0


def test_live_allocations_hold_their_gpus_until_they_end() -> None:
    nodes = small()
    job, group = make_job("first", gpus=1, device="nvidia/gpu/NVIDIA L4")
    (p,) = place_group(job, group, nodes, [], 1).placed
    running = as_alloc(job, p)
    job2, group2 = make_job("second", gpus=1, device="nvidia/gpu/NVIDIA L4")
    assert place_group(job2, group2, nodes, [running], 1).failed == 1
    for status in ("complete", "failed", "lost"):
        assert place_group(job2, group2, nodes, [as_alloc(job, p, status)], 1).placed
    stopped = dict(running, DesiredStatus="stop")
    assert place_group(job2, group2, nodes, [stopped], 1).placed


def test_alloc_is_live() -> None:
    assert alloc_is_live({"DesiredStatus": "run", "ClientStatus": "pending"})
    assert alloc_is_live({"DesiredStatus": "run", "ClientStatus": "running"})
    assert not alloc_is_live({"DesiredStatus": "run", "ClientStatus": "failed"})
    assert not alloc_is_live({"DesiredStatus": "stop", "ClientStatus": "running"})


def test_job_without_devices_on_a_gpu_node_places_on_cpu_and_memory_alone() -> None:
    nodes = [n for n in small() if n["Name"] == "gpu-4090-0"]
    job, group = make_job(cpu=1000, memory=1024)
    (p,) = place_group(job, group, nodes, [], 1).placed
    assert p.node_name == "gpu-4090-0"
    assert p.allocated_resources["Tasks"]["server"]["Devices"] is None
    # The GPU is still free for a GPU job afterwards.
    gjob, ggroup = make_job("gpu", gpus=1)
    assert place_group(gjob, ggroup, nodes, [as_alloc(job, p)], 1).placed


def test_cpu_memory_and_disk_exhaustion_use_nomads_dimension_strings() -> None:
    nodes = [node(name="a", node_class="small", cpu_mhz=4000, memory_mib=8192, disk_mb=10000)]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"cpu": 5000}, "cpu"),
        ({"memory": 9000}, "memory"),
        ({"disk": 20000}, "disk"),
        ({"cpu": 5000, "memory": 9000}, "cpu"),  # the first dimension that does not fit
    ]
    for ask, dimension in cases:
        job, group = make_job(**ask)
        result = place_group(job, group, nodes, [], 3)
        m = result.metrics
        assert result.failed == 3
        assert m["NodesExhausted"] == 1 and m["DimensionExhausted"] == {dimension: 1}, ask
        assert m["ClassExhausted"] == {"small": 1}
        assert m["CoalescedFailures"] == 2
        if dimension == "cpu":
            assert m["ResourcesExhausted"]["server"]["CPU"] == 3 * ask["cpu"]
        if dimension == "memory":
            assert m["ResourcesExhausted"]["server"]["MemoryMB"] == 3 * ask["memory"]


def test_capacity_fills_up_across_one_call() -> None:
    nodes = [node(name="a", cpu_mhz=4000, memory_mib=8192)]
    job, group = make_job(cpu=1000, memory=1024)
    result = place_group(job, group, nodes, [], 5)
    assert len(result.placed) == 4
    assert result.metrics["DimensionExhausted"] == {"cpu": 1}


def test_reserved_resources_are_not_available() -> None:
    nodes = [node(name="a", cpu_mhz=4000, reserved={"cpu_mhz": 3500})]
    job, group = make_job(cpu=1000)
    assert place_group(job, group, nodes, [], 1).metrics["DimensionExhausted"] == {"cpu": 1}


def test_binpacking_prefers_the_fuller_node_and_ties_go_by_name() -> None:
    nodes = [node(name="b"), node(name="a"), node(name="c")]
    job, group = make_job("first", cpu=2000, memory=4096)
    (first,) = place_group(job, group, nodes, [], 1).placed
    assert first.node_name == "a"
    other, ogroup = make_job("other", cpu=2000, memory=4096)
    busy = [dict(as_alloc(job, first), NodeID=next(n["ID"] for n in nodes if n["Name"] == "c"))]
    (second,) = place_group(other, ogroup, nodes, busy, 1).placed
    assert second.node_name == "c"
    scores = second.metrics["ScoreMetaData"]
    assert scores[0]["NormScore"] > scores[1]["NormScore"]
    assert {"binpack", "job-anti-affinity", "node-reschedule-penalty", "node-affinity"} <= set(
        scores[0]["Scores"]
    )


def test_allocations_of_one_group_spread_by_job_anti_affinity() -> None:
    nodes = [node(name="a"), node(name="b")]
    job, group = make_job(count=2)
    result = place_group(job, group, nodes, [], 2)
    assert sorted(p.node_name for p in result.placed) == ["a", "b"]


def test_dynamic_ports_are_unique_across_all_nodes_and_bindable() -> None:
    nodes = [node(name=f"n{i}") for i in range(4)]
    job, group = make_job(ports=("http", "metrics"), count=20)
    # Ports the caller knows to be in use (e.g. by the stand-in itself) are never handed out.
    result = place_group(job, group, nodes, [], 20, used_ports=set(range(20000, 31000)))
    ports = [m["Value"] for p in result.placed for m in p.allocated_resources["Shared"]["Ports"]]
    assert len(ports) == 40 and len(set(ports)) == 40
    assert all(31000 <= v <= 32000 for v in ports)
    # A later call sees the ports held by live allocations, wherever they run.
    live = [as_alloc(job, p) for p in result.placed]
    more = place_group(*make_job("more", ports=("http",)), nodes, live, 5)
    assert not {m["Value"] for p in more.placed for m in p.allocated_resources["Shared"]["Ports"]} & set(
        ports
    )


def test_static_port_collision_exhausts_every_node_on_network() -> None:
    nodes = [node(name="a", node_class="c"), node(name="b", node_class="c")]
    job, group = make_job(ports=(), reserved_ports=(("admin", 24000),))
    (p,) = place_group(job, group, nodes, [], 1).placed
    assert p.allocated_resources["Shared"]["Ports"] == [
        {"Label": "admin", "Value": 24000, "To": 0, "HostIP": "127.0.0.1"}
    ]
    again = place_group(
        *make_job("again", ports=(), reserved_ports=(("admin", 24000),)), nodes, [as_alloc(job, p)], 1
    )
    assert again.metrics["DimensionExhausted"] == {"network: reserved port collision admin=24000": 2}


def test_placing_200_allocations_on_the_large_fleet_is_fast() -> None:
    nodes = load_nodes(LARGE)
    live: list[dict[str, Any]] = []
    start = time.monotonic()
    for i in range(200):
        job, group = make_job(f"model-{i}", gpus=1, cpu=2000, memory=8192, count=1)
        result = place_group(job, group, nodes, live, 1)
        assert result.placed, result.metrics
        live.extend(as_alloc(job, p) for p in result.placed)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"200 placements took {elapsed:.1f} s"
    used = [
        i for a in live for d in a["AllocatedResources"]["Tasks"]["server"]["Devices"] for i in d["DeviceIDs"]
    ]
    assert len(used) == len(set(used)) == 200
    # Never on a node that is down, draining or ineligible.
    usable = {n["ID"] for n in nodes if n["Status"] == "ready" and n["SchedulingEligibility"] == "eligible"}
    assert {a["NodeID"] for a in live} <= usable


def test_dynamic_port_choice_skips_ports_taken_or_bound_on_loopback() -> None:
    from devstack.nomad.placement import _pick_dynamic, port_is_bindable

    free_in_range = [p for p in range(31990, 32001) if port_is_bindable(p)]
    assert len(free_in_range) >= 2, "test needs two free ports near the top of Nomad's range"
    held, spare = free_in_range[:2]
    holder = socket.socket()
    holder.bind(("127.0.0.1", held))
    holder.listen()
    try:
        assert not port_is_bindable(held)
        # Everything in the range is in use by allocations but two ports, and another process
        # holds one of those: only the other one can be handed out.
        in_use = set(range(20000, 32001)) - {held, spare}
        assert _pick_dynamic(1, in_use) == [spare]
        assert _pick_dynamic(2, in_use) is None
        assert _pick_dynamic(1, in_use | {spare}) is None
    finally:
        holder.close()


def test_node_affinity_outweighs_the_name_tie_break() -> None:
    nodes = [node(name="a", meta={"zone": "x"}), node(name="b", meta={"zone": "y"})]
    job, group = make_job()
    job["Affinities"] = [{"LTarget": "${meta.zone}", "Operand": "=", "RTarget": "y", "Weight": 50}]
    (p,) = place_group(job, group, nodes, [], 1).placed
    assert p.node_name == "b"
    assert p.metrics["ScoreMetaData"][0]["Scores"]["node-affinity"] == 1.0


def test_device_affinity_prefers_the_matching_device_group() -> None:
    two_models = node(
        name="mixed",
        gpus=[
            {"model": "NVIDIA L4", "memory_mib": 24564, "count": 1},
            {"model": H100, "memory_mib": 81559, "count": 1},
        ],
    )
    job, group = make_job(gpus=1)
    group["Tasks"][0]["Resources"]["Devices"][0]["Affinities"] = [
        {"LTarget": "${device.attr.memory}", "Operand": ">=", "RTarget": "40 GiB", "Weight": 75}
    ]
    (p,) = place_group(job, group, [two_models], [], 1).placed
    assert p.allocated_resources["Tasks"]["server"]["Devices"][0]["Name"] == H100
    assert p.metrics["ScoreMetaData"][0]["Scores"]["devices"] == 1.0
