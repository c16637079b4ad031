"""The simulated fleet: node JSON with Nomad's field names, stable IDs, GPUs as the NVIDIA
plugin reports them, and clear errors for a bad fleet file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from devstack.nomad.nodes import NodeSpecError, load_nodes, node_from_spec, node_stub

NODES_DIR = Path(__file__).resolve().parents[2] / "devstack" / "nodes"
SMALL = NODES_DIR / "small.yaml"
LARGE = NODES_DIR / "large-200.yaml"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def by_name(nodes: list[dict]) -> dict[str, dict]:
    return {n["Name"]: n for n in nodes}


def test_small_fleet_has_the_described_nodes_with_stable_ids() -> None:
    first = by_name(load_nodes(SMALL))
    second = by_name(load_nodes(SMALL))
    assert set(first) == {"gpu-4090-0", "gpu-l4-0", "gpu-h100-0"}
    for name, node in first.items():
        assert UUID.match(node["ID"]), node["ID"]
        assert node["ID"] == second[name]["ID"]
        assert node["Datacenter"] == "dc1"
        assert node["NodePool"] == "default"
        assert node["Status"] == "ready"
        assert node["SchedulingEligibility"] == "eligible"
        assert node["DrainStrategy"] is None
        assert node["Meta"]["llmgw_engine_llama_cpp"] == "b6500"
        assert node["Meta"]["llmgw_engine_llama_cpp_python"] == "0.3.36"
    assert len({n["ID"] for n in first.values()}) == 3


def test_gpus_look_like_the_nvidia_plugin_reports_them() -> None:
    h100 = by_name(load_nodes(SMALL))["gpu-h100-0"]
    (group,) = h100["NodeResources"]["Devices"]
    assert (group["Vendor"], group["Type"], group["Name"]) == ("nvidia", "gpu", "NVIDIA H100 80GB HBM3")
    assert group["Attributes"]["memory"] == {"Int": 81559, "Unit": "MiB"}
    assert set(group["Attributes"]) == {
        "memory", "power", "bar1", "driver_version", "cores_clock", "memory_clock",
        "pci_bandwidth", "display_state", "persistence_mode",
    }  # fmt: skip
    assert group["Attributes"]["pci_bandwidth"]["Unit"] == "MB/s"
    assert "String" in group["Attributes"]["driver_version"]
    ids = [i["ID"] for i in group["Instances"]]
    assert len(ids) == 8 and len(set(ids)) == 8
    assert all(re.match(r"^GPU-[0-9a-f-]{36}$", i) for i in ids)
    unhealthy = [i for i in group["Instances"] if not i["Healthy"]]
    assert len(unhealthy) == 1 and unhealthy[0]["HealthDescription"]
    # Same fleet file, same GPU IDs: a failing test can be replayed.
    again = by_name(load_nodes(SMALL))["gpu-h100-0"]["NodeResources"]["Devices"][0]
    assert [i["ID"] for i in again["Instances"]] == ids


def test_node_reports_the_attributes_every_nomad_client_does() -> None:
    node = by_name(load_nodes(SMALL))["gpu-l4-0"]
    attrs = node["Attributes"]
    for key in ("kernel.name", "cpu.arch", "os.name", "nomad.version", "unique.hostname", "cpu.totalcompute"):
        assert attrs[key], key
    assert attrs["unique.network.ip-address"] == "127.0.0.1"
    assert attrs["unique.hostname"] == "gpu-l4-0"
    assert node["NodeResources"]["Cpu"]["CpuShares"] == 32000
    assert node["NodeResources"]["Memory"]["MemoryMB"] == 131072
    assert node["NodeResources"]["MinDynamicPort"] == 20000
    assert node["NodeResources"]["MaxDynamicPort"] == 32000
    assert set(node["Drivers"]) == {"raw_exec", "exec", "mock_driver"}
    assert node["Drivers"]["raw_exec"]["Detected"] is True
    assert node["Drivers"]["raw_exec"]["Healthy"] is True


def test_a_disabled_driver_is_reported_undetected() -> None:
    node = node_from_spec(
        {"name": "n", "attributes": {"driver.raw_exec": "0", "driver.docker.version": "27"}}
    )
    assert set(node["Drivers"]) == {"raw_exec"}
    assert node["Drivers"]["raw_exec"]["Detected"] is False


def test_a_draining_node_has_a_drain_strategy_and_is_ineligible() -> None:
    node = node_from_spec({"name": "n", "drain": True})
    assert node["DrainStrategy"] is not None
    assert node["DrainStrategy"]["Deadline"] > 0
    assert node["SchedulingEligibility"] == "ineligible"
    assert node_stub(node)["Drain"] is True


def test_node_stub_has_nomads_list_fields_and_resources_only_when_asked() -> None:
    node = by_name(load_nodes(SMALL))["gpu-4090-0"]
    stub = node_stub(node)
    assert set(stub) == {
        "Address", "ID", "Datacenter", "Name", "NodePool", "NodeClass", "Version", "Drain",
        "SchedulingEligibility", "Status", "StatusDescription", "Drivers", "HostVolumes",
        "LastDrain", "CreateIndex", "ModifyIndex",
    }  # fmt: skip
    assert stub["Address"] == "127.0.0.1"
    assert stub["Version"] == node["Attributes"]["nomad.version"]
    assert stub["Drain"] is False
    with_resources = node_stub(node, resources=True)
    assert with_resources["NodeResources"]["Devices"][0]["Name"] == "NVIDIA GeForce RTX 4090"
    assert "ReservedResources" in with_resources
    assert node_stub(node, os=True)["Attributes"] == {"os.name": "ubuntu"}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"name": "bad", "gpus": [{"model": "NVIDIA L4", "memory_mib": 1, "count": 1, "colour": "x"}]},
            "colour",
        ),
        ({"name": "bad", "status": "sleeping"}, "status"),
        (
            {"name": "bad", "gpus": [{"model": "NVIDIA L4", "memory_mib": 1, "count": 1, "unhealthy": 2}]},
            "unhealthy",
        ),
        ({"name": "bad", "memory_mib": "lots"}, "memory_mib"),
        ({"name": "bad", "cpus": 4}, "cpus"),
    ],
)
def test_bad_fleet_entries_fail_naming_file_node_and_field(tmp_path: Path, entry: dict, message: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"nodes": [{"name": "ok"}, entry]}))
    with pytest.raises(NodeSpecError) as err:
        load_nodes(path)
    text = str(err.value)
    assert str(path) in text and "'bad'" in text and message in text


def test_duplicate_node_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump([{"name": "a"}, {"name": "a"}]))
    with pytest.raises(NodeSpecError, match="appears twice"):
        load_nodes(path)


def test_large_fleet_is_a_realistic_mix_and_matches_its_generator() -> None:
    from devstack.nodes import generate

    committed = yaml.safe_load(LARGE.read_text())["nodes"]
    assert committed == generate.fleet(), "large-200.yaml is stale: run python devstack/nodes/generate.py"
    nodes = load_nodes(LARGE)
    assert len(nodes) == 200
    models = {n["NodeResources"]["Devices"][0]["Name"] for n in nodes}
    assert models == {"NVIDIA L4", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"}
    counts = {len(n["NodeResources"]["Devices"][0]["Instances"]) for n in nodes}
    assert counts == {1, 4, 8}
    assert {n["Meta"]["llmgw_fabric"] for n in nodes} == {"ethernet", "infiniband"}
    assert any(not i["Healthy"] for n in nodes for i in n["NodeResources"]["Devices"][0]["Instances"])
    assert any(n["Status"] == "down" for n in nodes)
    assert any(n["SchedulingEligibility"] == "ineligible" for n in nodes)
