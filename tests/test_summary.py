"""The fleet summary from hand-built fleets: Nomad node and allocation JSON as Nomad returns it,
replicas and model states as the watcher holds them."""

from __future__ import annotations

import json
from typing import Any

from nomad_driver.summary import IDLE_AFTER_S, fleet_summary

NOW = 1_800_000_000.0


def node(
    node_id: str,
    gpus: list[tuple[str, bool]],
    *,
    status: str = "ready",
    eligibility: str = "eligible",
    drain: dict[str, Any] | None = None,
    gpu_name: str = "NVIDIA H100 80GB HBM3",
    meta: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "ID": node_id,
        "Name": node_id,
        "Status": status,
        "SchedulingEligibility": eligibility,
        "Drain": drain is not None,
        "DrainStrategy": drain,
        "Meta": meta or {},
        "NodeResources": {
            "Devices": [
                {
                    "Vendor": "nvidia",
                    "Type": "gpu",
                    "Name": gpu_name,
                    "Instances": [{"ID": gid, "Healthy": ok, "HealthDescription": ""} for gid, ok in gpus],
                    "Attributes": {"memory": {"Int": 81559, "Unit": "MiB"}},
                }
            ]
        },
    }


def alloc(
    alloc_id: str,
    node_id: str,
    device_ids: list[str],
    *,
    model: str,
    status: str = "running",
    created: float = NOW,
) -> dict[str, Any]:
    return {
        "ID": alloc_id,
        "NodeID": node_id,
        "JobID": f"llmgw-{model}",
        "ClientStatus": status,
        "DesiredStatus": "run",
        "CreateTime": int(created * 1e9),
        "AllocatedResources": {
            "Tasks": {
                "engine": {
                    "Devices": [{"Vendor": "nvidia", "Type": "gpu", "Name": "x", "DeviceIDs": device_ids}]
                }
            }
        },
        "Job": {"Meta": {"llmgw_model": model}},
    }


def gpus(prefix: str, n: int, unhealthy: tuple[int, ...] = ()) -> list[tuple[str, bool]]:
    return [(f"{prefix}-{i}", i not in unhealthy) for i in range(n)]


DRAIN = {"Deadline": 3_600_000_000_000, "IgnoreSystemJobs": False, "ForceDeadline": "0001-01-01T00:00:00Z"}

NODES = [
    # ib-a: one busy node with a broken card, one empty node, one being drained.
    node("n1", gpus("g1", 4, unhealthy=(3,)), meta={"llmgw_fabric": "ib-a", "llmgw_gpu_class": "h100",
                                                     "llmgw_models_cached": "qwen2.5-0.5b, llama-3-8b"}),
    node("n2", gpus("g2", 4), meta={"llmgw_fabric": "ib-a", "llmgw_gpu_class": "h100"}),
    node("n3", gpus("g3", 4), eligibility="ineligible", drain=DRAIN,
         meta={"llmgw_fabric": "ib-a", "llmgw_gpu_class": "h100"}),
    # ib-b: a down node holding weights, an ineligible node, one free node; class from the device.
    node("n4", gpus("g4", 2), status="down", gpu_name="NVIDIA A10",
         meta={"llmgw_fabric": "ib-b", "llmgw_models_cached": "phi-4"}),
    node("n5", gpus("g5", 2), eligibility="ineligible", gpu_name="NVIDIA A10", meta={"llmgw_fabric": "ib-b"}),
    node("n6", gpus("g6", 2), gpu_name="NVIDIA A10",
         meta={"llmgw_fabric": "ib-b", "llmgw_models_cached": "qwen2.5-0.5b"}),
]  # fmt: skip

ALLOCS = [
    alloc("a1", "n1", ["g1-0"], model="qwen2.5-0.5b"),
    alloc("a2", "n1", ["g1-1"], model="llama-3-8b"),
    alloc("a3", "n3", ["g3-0"], model="qwen2.5-0.5b", created=NOW - 3600),
    alloc("a4", "n2", [], model="llama-3-8b", status="pending"),
    # Finished allocations hold nothing.
    alloc("a8", "n6", ["g6-0"], model="kev-0.5b", status="failed"),
    alloc("a9", "n6", ["g6-1"], model="qwen2.5-0.5b", status="complete"),
]

REPLICAS = [
    {"model": "qwen2.5-0.5b", "node": "n1", "alloc_id": "a1", "ready": True, "last_request_at": NOW - 30},
    {"model": "llama-3-8b", "node": "n1", "alloc_id": "a2", "ready": True, "last_request_at": NOW - 900},
    # Never asked for: idle since its allocation was created.
    {"model": "qwen2.5-0.5b", "node": "n3", "alloc_id": "a3", "ready": True, "last_request_at": None},
    {"model": "llama-3-8b", "node": "n2", "alloc_id": "a4", "ready": False, "last_request_at": None},
]

MODELS = {
    "qwen2.5-0.5b": {"desired": 2, "ready": 2, "parked": False, "consecutive_failures": 0, "last_error": "",
                     "unplaceable": False, "placement_reason": ""},
    "llama-3-8b": {"desired": 2, "ready": 1, "parked": False, "consecutive_failures": 0, "last_error": "",
                   "unplaceable": False, "placement_reason": ""},
    "kev-0.5b": {"desired": 0, "ready": 0, "parked": True, "consecutive_failures": 5,
                 "last_error": "unknown model architecture: 'kev'",
                 "unplaceable": False, "placement_reason": ""},
    "phi-4": {"desired": 1, "ready": 0, "parked": False, "consecutive_failures": 0, "last_error": "",
              "unplaceable": True, "placement_reason": "no node has 2 x nvidia/gpu with >= 80000 MiB"},
    "on-demand": {"desired": 0, "ready": 0, "parked": False, "consecutive_failures": 0, "last_error": "",
                  "unplaceable": False, "placement_reason": ""},
}  # fmt: skip


def summary() -> dict[str, Any]:
    return fleet_summary(NODES, ALLOCS, REPLICAS, MODELS, NOW)


def test_nodes_are_counted_by_state() -> None:
    assert summary()["nodes"] == {"total": 6, "ready": 3, "ineligible": 1, "draining": 1, "down": 1}


def test_unhealthy_gpus_are_neither_used_nor_free() -> None:
    h100 = next(c for c in summary()["gpus"] if c["class"] == "h100")
    # n1: 2 used, 1 unhealthy, 1 free; n2: 4 free; n3 (draining): 1 used, 3 unavailable.
    assert h100 == {"class": "h100", "total": 12, "used": 3, "free": 5, "unhealthy": 1, "unavailable": 3}


def test_gpus_on_down_and_ineligible_nodes_are_not_free_and_finished_allocations_hold_none() -> None:
    a10 = next(c for c in summary()["gpus"] if c["class"] == "NVIDIA A10")
    assert a10 == {"class": "NVIDIA A10", "total": 6, "used": 0, "free": 2, "unhealthy": 0, "unavailable": 4}


def test_fabrics_count_weights_on_live_nodes_and_entirely_free_nodes() -> None:
    assert summary()["fabrics"] == [
        {"fabric": "ib-a", "nodes": 3, "nodes_with_weights": 1, "models_present": 2, "largest_free_block": 1},
        # The down node's phi-4 weights are not present for anyone.
        {"fabric": "ib-b", "nodes": 3, "nodes_with_weights": 1, "models_present": 1, "largest_free_block": 1},
    ]


def test_replicas_by_state_and_idle_replicas_longest_first() -> None:
    s = summary()
    assert s["replicas"] == {"total": 4, "ready": 3, "starting": 1}
    assert s["idle_replicas"] == [
        {"model": "qwen2.5-0.5b", "node": "n3", "alloc_id": "a3", "idle_seconds": 3600, "gpus": 1},
        {"model": "llama-3-8b", "node": "n1", "alloc_id": "a2", "idle_seconds": 900, "gpus": 1},
    ]


def test_a_replica_asked_for_just_under_ten_minutes_ago_is_not_idle() -> None:
    replicas = [
        {
            "model": "m",
            "node": "n2",
            "alloc_id": "x",
            "ready": True,
            "last_request_at": NOW - IDLE_AFTER_S + 1,
        },
        {"model": "m", "node": "n2", "alloc_id": "y", "ready": True, "last_request_at": NOW - IDLE_AFTER_S},
    ]
    idle = fleet_summary([], [], replicas, {}, NOW)["idle_replicas"]
    assert [r["alloc_id"] for r in idle] == ["y"]


def test_models_satisfied_only_when_ready_meets_desired_and_not_parked() -> None:
    s = summary()
    assert s["models"] == {
        "total": 5,
        "satisfied": 2,  # qwen2.5-0.5b, on-demand (not asked for)
        "short": 3,
        "short_models": [
            {"model": "kev-0.5b", "desired": 0, "ready": 0},
            {"model": "llama-3-8b", "desired": 2, "ready": 1},
            {"model": "phi-4", "desired": 1, "ready": 0},
        ],
    }


def test_on_demand_model_asked_for_that_fits_nowhere_is_short_and_unplaceable() -> None:
    s = summary()
    assert "phi-4" in [m["model"] for m in s["models"]["short_models"]]
    assert s["unplaceable"] == [{"model": "phi-4", "reason": "no node has 2 x nvidia/gpu with >= 80000 MiB"}]


def test_parked_models_carry_failures_and_last_error() -> None:
    assert summary()["parked"] == [
        {"model": "kev-0.5b", "consecutive_failures": 5, "last_error": "unknown model architecture: 'kev'"}
    ]


def test_summary_is_json_and_stamped() -> None:
    s = summary()
    assert json.loads(json.dumps(s)) == s
    assert s["generated_at"] == NOW


def test_odd_input_counts_as_absent_rather_than_failing() -> None:
    nodes: list[dict[str, Any]] = [
        {"ID": "bare", "Status": "ready"},
        {"ID": "nulls", "Status": "ready", "NodeResources": {"Devices": None}, "Meta": None},
        {"ID": "cpu", "Status": "ready", "NodeResources": {"Devices": [{"Type": "fpga", "Instances": [{}]}]}},
        node("half", [("h-0", True)], meta={"llmgw_fabric": "f"}) | {"DrainStrategy": None},
    ]
    allocs: list[dict[str, Any]] = [
        {"ID": "z", "NodeID": "half", "ClientStatus": "running", "AllocatedResources": None}
    ]
    replicas: list[Any] = [{"ready": True}, {"ready": "yes"}, {}]
    models: dict[str, Any] = {"junk": "not a dict", "half": {"desired": "two", "ready": None}}
    s = fleet_summary(nodes, allocs, replicas, models, NOW)
    assert s["nodes"]["ready"] == 4
    assert s["gpus"] == [
        {"class": "NVIDIA H100 80GB HBM3", "total": 1, "used": 0, "free": 1, "unhealthy": 0, "unavailable": 0}
    ]
    assert s["replicas"] == {"total": 3, "ready": 1, "starting": 2}
    assert s["models"]["satisfied"] == 2
    assert s["idle_replicas"] == []
