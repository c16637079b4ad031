"""The feasibility chain: every constraint operator, unit-aware device constraints, and each
rejection counted under the string Nomad puts in the evaluation's placement metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from devstack.nomad.attributes import compare, int_attr, parse_attribute, version_matches
from devstack.nomad.feasible import Constraint, meets, view_of
from devstack.nomad.nodes import load_nodes, node_from_spec
from devstack.nomad.placement import place_group

SMALL = Path(__file__).resolve().parents[2] / "devstack" / "nodes" / "small.yaml"
H100 = "NVIDIA H100 80GB HBM3"


def make_job(
    job_id: str = "job",
    *,
    gpus: int = 0,
    device: str = "nvidia/gpu",
    device_constraints: list[tuple[str, str, str]] | None = None,
    constraints: list[tuple[str, str, str]] | None = None,
    group_constraints: list[tuple[str, str, str]] | None = None,
    task_constraints: list[tuple[str, str, str]] | None = None,
    cpu: int = 500,
    memory: int = 256,
    disk: int = 300,
    ports: tuple[str, ...] = ("http",),
    reserved_ports: tuple[tuple[str, int], ...] = (),
    count: int = 1,
    datacenters: tuple[str, ...] = ("dc1",),
    pool: str = "default",
    driver: str = "raw_exec",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A canonical API job with one group and one task, enough for placement."""

    def cons(items: list[tuple[str, str, str]] | None) -> list[dict[str, str]] | None:
        return [{"LTarget": lt, "Operand": op, "RTarget": rt} for lt, op, rt in items] if items else None

    devices = None
    if gpus:
        devices = [
            {"Name": device, "Count": gpus, "Constraints": cons(device_constraints), "Affinities": None}
        ]
    group = {
        "Name": "engine",
        "Count": count,
        "Constraints": cons(group_constraints),
        "Networks": [
            {
                "Mode": "host",
                "DynamicPorts": [{"Label": p, "Value": 0, "To": 0, "HostNetwork": "default"} for p in ports],
                "ReservedPorts": [{"Label": lbl, "Value": v, "To": 0} for lbl, v in reserved_ports] or None,
            }
        ]
        if ports or reserved_ports
        else None,
        "EphemeralDisk": {"SizeMB": disk, "Sticky": False, "Migrate": False},
        "Tasks": [
            {
                "Name": "server",
                "Driver": driver,
                "Constraints": cons(task_constraints),
                "Resources": {"CPU": cpu, "MemoryMB": memory, "Devices": devices},
            }
        ],
    }
    job = {
        "ID": job_id,
        "Namespace": "default",
        "Datacenters": list(datacenters),
        "NodePool": pool,
        "Constraints": cons(constraints),
        "TaskGroups": [group],
    }
    return job, group


def small() -> list[dict[str, Any]]:
    return load_nodes(SMALL)


def node(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": "n1", "attributes": {"driver.raw_exec": "1"}}
    base.update(spec)
    return node_from_spec(base)


# ----- operators -----------------------------------------------------------------------------

NODE = node(
    name="box-7",
    node_class="h100",
    attributes={"driver.raw_exec": "1", "cuda.version": "12.4", "rack.slots": "10", "tags": "a, b ,c"},
    meta={"llmgw_engine_llama_cpp": "b6500,b6400", "zone": "eu-1", "weight": "2.5", "ver": "1.3.0-beta1"},
)


@pytest.mark.parametrize(
    ("ltarget", "operand", "rtarget", "expected"),
    [
        ("${meta.zone}", "=", "eu-1", True),
        ("${meta.zone}", "==", "eu-2", False),
        ("${meta.zone}", "is", "eu-1", True),
        ("${meta.missing}", "=", "", False),  # a missing target never equals
        ("${meta.zone}", "!=", "eu-2", True),
        ("${meta.zone}", "not", "eu-1", False),
        ("${meta.missing}", "!=", "x", True),
        ("${attr.rack.slots}", "<", "9", False),  # integers, not strings: "10" < "9" lexically
        ("${attr.rack.slots}", ">", "9", True),
        ("${attr.rack.slots}", "<=", "10", True),
        ("${meta.weight}", ">=", "2.25", True),  # floats
        ("${meta.zone}", ">", "eu-0", True),  # lexical
        ("${meta.missing}", ">", "0", False),
        ("${attr.cuda.version}", "version", ">= 12.0, < 13", True),
        ("${attr.cuda.version}", "version", "~> 12.2", True),
        ("${attr.cuda.version}", "version", "~> 12.5", False),
        ("${meta.ver}", "version", ">= 1.0", False),  # go-version: prerelease vs release constraint
        ("${meta.ver}", "semver", ">= 1.0", True),  # semver orders prereleases normally
        ("${meta.ver}", "semver", "~> 1.0", False),  # no pessimistic operator for semver
        ("${attr.cuda.version}", "version", "not a version", False),
        ("${node.class}", "regexp", "^h1[0-9]+$", True),
        ("${node.unique.name}", "regexp", "box-[0-6]$", False),
        ("${node.unique.name}", "regexp", "(", False),  # invalid regexp never matches
        ("${meta.llmgw_engine_llama_cpp}", "set_contains", "b6500", True),
        ("${meta.llmgw_engine_llama_cpp}", "set_contains", "b6500,b9999", False),
        ("${attr.tags}", "set_contains_all", "c,a", True),
        ("${attr.tags}", "set_contains_any", "z, b", True),
        ("${attr.tags}", "set_contains_any", "x,y", False),
        ("${meta.zone}", "is_set", "", True),
        ("${meta.nope}", "is_set", "", False),
        ("${meta.nope}", "is_not_set", "", True),
        ("${meta.zone}", "is_not_set", "", False),
        ("${node.datacenter}", "=", "dc1", True),
        ("${node.pool}", "=", "default", True),
        ("${node.unique.id}", "is_set", "", True),
        ("${unknown.target}", "is_set", "", False),
        ("${meta.zone}", "no_such_operator", "eu-1", False),
        ("${meta.zone}", "distinct_hosts", "", True),  # handled by its own iterator
    ],
)
def test_every_constraint_operator(ltarget: str, operand: str, rtarget: str, expected: bool) -> None:
    assert meets(Constraint(ltarget, rtarget, operand), view_of(NODE)) is expected


def test_node_unique_id_resolves_to_the_node_id() -> None:
    view = view_of(NODE)
    assert meets(Constraint("${node.unique.id}", NODE["ID"], "="), view)


def test_constraint_string_is_nomads_constraint_filtered_key() -> None:
    c = Constraint("${meta.llmgw_engine_llama_cpp}", "b6500", "set_contains")
    assert str(c) == "${meta.llmgw_engine_llama_cpp} set_contains b6500"


@pytest.mark.parametrize(
    ("version", "constraint", "strict", "expected"),
    [
        ("1.1.5", ">= 1.0, < 1.2", True, True),
        ("1.0.0", "1.0", True, True),
        ("8", "> 10", True, False),
        ("2.1.0-beta", "> 2.0", True, True),
        ("1.3.0-beta1+ent", "= 1.3.0-beta1+cgo", True, True),
        ("1.3.0-beta1", ">= 1.0beta1", True, False),  # malformed for semver
        ("1.2.3", "~> 1.2", False, True),
        ("1.3.0", "~> 1.2.0", False, False),
        ("1.3.0-beta1", ">= 1.3.0-alpha", False, True),
        ("v1.2", "= 1.2.0", False, True),
    ],
)
def test_version_and_semver_follow_go_version(
    version: str, constraint: str, strict: bool, expected: bool
) -> None:
    assert version_matches(version, constraint, strict) is expected


# ----- units -----------------------------------------------------------------------------------


def test_gib_and_mib_compare_in_bytes() -> None:
    h100 = int_attr(81559, "MiB")
    assert compare(h100, parse_attribute("80 GiB")) == -1  # 80 GiB is 81920 MiB
    assert compare(h100, parse_attribute("79 GiB")) == 1
    assert compare(h100, parse_attribute("81559 MiB")) == 0
    assert compare(h100, parse_attribute("85 GB")) == 1  # decimal units: 85e9 bytes
    assert compare(h100, parse_attribute("86GB")) == -1
    assert compare(h100, parse_attribute("80 W")) is None  # bytes and watts never compare
    assert compare(h100, parse_attribute("80")) is None  # a unitless number neither
    assert compare(int_attr(500, "W"), parse_attribute("0.5 kW")) == 0
    # As in Go, 0.7 is the float64 just below 0.7, so 700 W is more than "0.7 kW".
    assert compare(int_attr(700, "W"), parse_attribute("0.7 kW")) == 1


def test_parse_attribute_reads_nomad_literals() -> None:
    assert parse_attribute("2 GiB").to_json() == {"Int": 2, "Unit": "GiB"}
    assert parse_attribute("1.5").to_json() == {"Float": 1.5}
    assert parse_attribute("true").to_json() == {"Bool": True}
    assert parse_attribute("NVIDIA L4").to_json() == {"String": "NVIDIA L4"}
    assert parse_attribute("15760 MB/s").to_json() == {"Int": 15760, "Unit": "MB/s"}


@pytest.mark.parametrize(
    ("constraint", "placed_on"),
    [
        (("${device.attr.memory}", ">=", "80 GiB"), None),  # 81559 MiB < 80 GiB: fits nowhere
        (("${device.attr.memory}", ">=", "79 GiB"), "gpu-h100-0"),
        (("${device.attr.memory}", "<", "30000 MiB"), "gpu-4090-0"),
        (("${device.model}", "=", "NVIDIA L4"), "gpu-l4-0"),
        (("${device.model}", "regexp", "H100|A100"), "gpu-h100-0"),
        (("${device.vendor}", "!=", "nvidia"), None),
        (("${device.type}", "=", "gpu"), "gpu-4090-0"),
        (("${device.attr.power}", ">", "0.5 kW"), "gpu-h100-0"),
        (("${device.attr.driver_version}", "version", ">= 550.0"), "gpu-4090-0"),
        (("${device.attr.no_such}", "is_not_set", ""), "gpu-4090-0"),
    ],
)
def test_device_constraints_are_unit_aware(constraint: tuple[str, str, str], placed_on: str | None) -> None:
    job, group = make_job(gpus=1, device_constraints=[constraint], ports=())
    result = place_group(job, group, small(), [], 1)
    if placed_on is None:
        assert result.placed == []
        assert result.metrics["ConstraintFiltered"] == {"missing devices": 3}
    else:
        # Several nodes may match; bin-packing picks the fullest, ties by name.
        assert [p.node_name for p in result.placed] == [placed_on]


@pytest.mark.parametrize(
    ("name", "placed"),
    [
        ("gpu", True),
        ("nvidia/gpu", True),
        (f"nvidia/gpu/{H100}", True),
        ("amd/gpu", False),
        ("nvidia/fpga", False),
    ],
)
def test_device_names_match_type_vendor_and_model(name: str, placed: bool) -> None:
    job, group = make_job(gpus=1, device=name, ports=())
    result = place_group(job, group, small(), [], 1)
    assert bool(result.placed) is placed
    if name.endswith(H100):
        assert result.placed[0].node_name == "gpu-h100-0"


def test_device_ids_constraint_picks_instances() -> None:
    nodes = small()
    h100 = next(n for n in nodes if n["Name"] == "gpu-h100-0")
    wanted = [i["ID"] for i in h100["NodeResources"]["Devices"][0]["Instances"]][2:4]
    job, group = make_job(
        gpus=2, device_constraints=[("${device.ids}", "set_contains_any", ",".join(wanted))]
    )
    result = place_group(job, group, nodes, [], 1)
    (placement,) = result.placed
    assert placement.allocated_resources["Tasks"]["server"]["Devices"][0]["DeviceIDs"] == wanted


# ----- filter reasons and counts ---------------------------------------------------------------


def test_unmet_job_constraint_is_counted_under_its_string_then_as_class_ineligible() -> None:
    twins = [
        node(name=f"twin-{i}", node_class="l4", meta={"llmgw_engine_llama_cpp": "b6400"}) for i in range(3)
    ]
    job, group = make_job(constraints=[("${meta.llmgw_engine_llama_cpp}", "set_contains", "b6500")])
    result = place_group(job, group, twins, [], 1)
    m = result.metrics
    assert result.failed == 1
    assert m["NodesEvaluated"] == 3
    assert m["NodesFiltered"] == 3
    # Nomad checks one node per computed class; its twins are skipped as the same class.
    assert m["ConstraintFiltered"] == {
        "${meta.llmgw_engine_llama_cpp} set_contains b6500": 1,
        "computed class ineligible": 2,
    }
    assert m["ClassFiltered"] == {"l4": 3}
    assert m["NodesExhausted"] == 0


def test_constraint_on_a_unique_attribute_is_checked_on_every_node() -> None:
    nodes = [node(name=f"n{i}") for i in range(3)]
    job, group = make_job(constraints=[("${node.unique.name}", "=", "elsewhere")])
    m = place_group(job, group, nodes, [], 1).metrics
    assert m["ConstraintFiltered"] == {"${node.unique.name} = elsewhere": 3}


def test_group_and_task_constraints_are_checked_too() -> None:
    nodes = [node(name="a", meta={"zone": "x"})]
    job, group = make_job(group_constraints=[("${meta.zone}", "=", "y")])
    assert place_group(job, group, nodes, [], 1).metrics["ConstraintFiltered"] == {"${meta.zone} = y": 1}
    job, group = make_job(task_constraints=[("${meta.zone}", "!=", "x")])
    assert place_group(job, group, nodes, [], 1).metrics["ConstraintFiltered"] == {"${meta.zone} != x": 1}


def test_missing_driver_is_filtered_as_missing_drivers() -> None:
    nodes = [
        node(name="a", attributes={"driver.exec": "1"}),
        node(name="b", attributes={"driver.raw_exec": "0"}),
    ]
    job, group = make_job(driver="raw_exec")
    m = place_group(job, group, nodes, [], 1).metrics
    assert m["ConstraintFiltered"] == {"missing drivers": 2}
    assert m["NodesFiltered"] == 2


def test_gpu_job_on_cpu_nodes_is_filtered_as_missing_devices() -> None:
    nodes = [node(name="cpu-a"), node(name="cpu-b", node_class="cpu")]
    job, group = make_job(gpus=1)
    m = place_group(job, group, nodes, [], 1).metrics
    assert m["ConstraintFiltered"] == {"missing devices": 2}
    assert m["DimensionExhausted"] is None


def test_more_gpus_than_healthy_instances_is_missing_devices_not_exhaustion() -> None:
    job, group = make_job(gpus=8, device=f"nvidia/gpu/{H100}")
    result = place_group(job, group, small(), [], 1)
    assert result.placed == []
    assert result.metrics["ConstraintFiltered"]["missing devices"] == 3
    job, group = make_job(gpus=7, device=f"nvidia/gpu/{H100}")
    assert [p.node_name for p in place_group(job, group, small(), [], 1).placed] == ["gpu-h100-0"]


def test_nodes_outside_datacenter_pool_or_not_ready_are_not_evaluated() -> None:
    nodes = [
        node(name="ok"),
        node(name="other-dc", datacenter="dc2"),
        node(name="other-pool", node_pool="batch"),
        node(name="down", status="down"),
        node(name="ineligible", eligibility="ineligible"),
        node(name="draining", drain=True),
        node(name="init", status="initializing"),
    ]
    job, group = make_job(constraints=[("${meta.never}", "is_set", "")])
    m = place_group(job, group, nodes, [], 1).metrics
    assert m["NodesEvaluated"] == 1
    assert m["NodesInPool"] == 1
    assert m["NodesAvailable"] == {"dc1": 1}
    assert m["NodePool"] == "default"
    # A glob reaches the other datacenter; "all" reaches every pool.
    job, group = make_job(datacenters=("dc*",), pool="all", constraints=[("${meta.never}", "is_set", "")])
    m = place_group(job, group, nodes, [], 1).metrics
    assert m["NodesEvaluated"] == 3
    assert m["NodesAvailable"] == {"dc1": 2, "dc2": 1}


def test_no_nodes_at_all_reports_nothing_evaluated() -> None:
    job, group = make_job()
    result = place_group(job, group, [], [], 2)
    assert result.failed == 2
    assert result.metrics["NodesEvaluated"] == 0
    assert result.metrics["CoalescedFailures"] == 1


def test_bridge_networking_is_missing_network_on_simulated_nodes() -> None:
    job, group = make_job()
    group["Networks"][0]["Mode"] = "bridge"
    m = place_group(job, group, [node(name="a")], [], 1).metrics
    assert m["ConstraintFiltered"] == {"missing network": 1}


def test_distinct_hosts_filters_nodes_already_running_the_job() -> None:
    nodes = [node(name="a"), node(name="b")]
    job, group = make_job(count=3, constraints=[("", "distinct_hosts", "")], ports=())
    result = place_group(job, group, nodes, [], 3)
    assert sorted(p.node_name for p in result.placed) == ["a", "b"]
    assert result.failed == 1
    assert result.metrics["ConstraintFiltered"] == {"distinct_hosts": 2}


def test_distinct_property_limits_allocations_per_value() -> None:
    nodes = [node(name=f"n{i}", meta={"rack": "r1" if i < 2 else "r2"}) for i in range(4)]
    job, group = make_job(count=3, ports=())
    group["Constraints"] = [{"LTarget": "${meta.rack}", "Operand": "distinct_property", "RTarget": "1"}]
    result = place_group(job, group, nodes, [], 3)
    racks = sorted(next(n for n in nodes if n["ID"] == p.node_id)["Meta"]["rack"] for p in result.placed)
    assert racks == ["r1", "r2"]
    assert result.failed == 1
    assert result.metrics["ConstraintFiltered"] == {
        "distinct_property: ${meta.rack}=r1 used by 1 allocs": 2,
        "distinct_property: ${meta.rack}=r2 used by 1 allocs": 2,
    }


def test_a_host_volume_the_node_does_not_declare_filters_it_on_every_node_of_its_class() -> None:
    """HostVolumeChecker: the weights cache must be declared on the node; twins of one class
    that differ only in it are each checked, never skipped as class-ineligible."""
    cache = {"llmgw-weights": {"path": "/opt/llmgw/models"}}
    without = [
        node(name="bare-0", node_class="l4"),
        node(name="bare-1", node_class="l4"),
        node(
            name="read-only",
            node_class="l4",
            host_volumes={"llmgw-weights": {"path": "/x", "read_only": True}},
        ),
    ]
    job, group = make_job()
    group["Volumes"] = {
        "weights": {"Name": "weights", "Type": "host", "Source": "llmgw-weights", "ReadOnly": False}
    }
    result = place_group(job, group, without, [], 1)
    assert result.failed == 1
    assert result.metrics["ConstraintFiltered"] == {"missing compatible host volumes": 3}
    with_cache = node(name="with-cache", node_class="l4", host_volumes=cache)
    assert place_group(job, group, [*without, with_cache], [], 1).failed == 0
