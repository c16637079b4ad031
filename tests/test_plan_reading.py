"""Reading a plan without a cluster: Nomad's answers as they come (preemptions included, which
the stand-in never makes), the nodes a model can land on, and what a job's meta tells when the
stored definitions cannot say why it differs."""

from __future__ import annotations

from typing import Any

from nomad_driver.cli.plan import FleetPlan, ModelPlan, classify, planned_count
from nomad_driver.cli.plan_output import render_text
from nomad_driver.cli.plan_reading import candidates, namespace_default_pool, read_plan
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models

TEXT = """
profiles:
  h100:
    engine: llama.cpp
    engine_version: b6500
    gpus: 2
    gpu_memory_mib: 80000
    gpu_models: ["NVIDIA H100 80GB HBM3"]
models:
  big:
    source: hf://org/repo/big.gguf
    profile: h100
    replicas: {min: 0, max: 3}
"""


def model(text: str = TEXT) -> Any:
    return parse_models(text).models["big"]


def gpu_node(name: str, gpu: str, memory_mib: int, healthy: int, **extra: Any) -> dict[str, Any]:
    instances = [{"ID": f"{name}-{i}", "Healthy": i < healthy} for i in range(4)]
    return {
        "ID": name,
        "Name": name,
        "NodeClass": extra.pop("node_class", "gpu"),
        "Status": extra.pop("status", "ready"),
        "SchedulingEligibility": extra.pop("eligibility", "eligible"),
        "Drain": False,
        "NodeResources": {
            "Devices": [
                {
                    "Vendor": "nvidia",
                    "Type": "gpu",
                    "Name": gpu,
                    "Attributes": {"memory": {"Int": memory_mib, "Unit": "MiB"}},
                    "Instances": instances,
                }
            ]
        },
        **extra,
    }


def test_nodes_that_can_take_a_model_need_enough_healthy_gpus_of_the_right_kind() -> None:
    nodes = [
        gpu_node("a", "NVIDIA H100 80GB HBM3", 81559, healthy=4, node_class="h100"),
        gpu_node("b", "NVIDIA H100 80GB HBM3", 81559, healthy=4, node_class="h100"),
        # One healthy card is not two.
        gpu_node("c", "NVIDIA H100 80GB HBM3", 81559, healthy=1, node_class="h100"),
        # Enough memory, the wrong model.
        gpu_node("d", "NVIDIA A100-SXM4-80GB", 81920, healthy=4, node_class="a100"),
        # Not taking work.
        gpu_node("e", "NVIDIA H100 80GB HBM3", 81559, healthy=4, eligibility="ineligible"),
        gpu_node("f", "NVIDIA H100 80GB HBM3", 81559, healthy=4, status="down"),
    ]
    (only,) = candidates(model(), nodes)
    assert (only.node_class, only.gpu_model, only.nodes) == ("h100", "NVIDIA H100 80GB HBM3", 2)
    smaller = model(TEXT.replace("gpu_memory_mib: 80000", "gpu_memory_mib: 90000"))
    assert candidates(smaller, nodes) == []

    # Only the profile's node pool: a matching node elsewhere is not where it can go.
    pooled = [
        *nodes,
        gpu_node("g", "NVIDIA H100 80GB HBM3", 81559, healthy=4, node_class="h100-gpu", NodePool="gpu"),
    ]
    assert {c.node_class for c in candidates(model(), pooled)} == {"h100"}
    in_gpu = model(TEXT.replace("    gpus: 2\n", "    gpus: 2\n    node_pool: gpu\n"))
    assert [(c.node_class, c.nodes) for c in candidates(in_gpu, pooled)] == [("h100-gpu", 1)]
    # A profile that names no pool lands in its namespace's default pool, wherever that is.
    assert [(c.node_class, c.nodes) for c in candidates(model(), pooled, default_pool="gpu")] == [
        ("h100-gpu", 1)
    ]
    assert candidates(in_gpu, pooled, default_pool="default") == candidates(in_gpu, pooled)


def test_the_default_pool_is_the_namespaces_where_nomad_enterprise_sets_one() -> None:
    enterprise = {"Name": "ml", "NodePoolConfiguration": {"Default": "gpu", "Allowed": None, "Denied": None}}
    assert namespace_default_pool(enterprise) == "gpu"
    assert namespace_default_pool({"Name": "default", "NodePoolConfiguration": None}) == "default"
    assert namespace_default_pool({"Name": "ml", "NodePoolConfiguration": {"Default": ""}}) == "default"
    assert namespace_default_pool(None) == "default"  # a Nomad without namespaces


def test_a_multi_node_replica_counts_once_however_many_allocations_it_has() -> None:
    wide = parse_models(
        TEXT.replace("    gpus: 2\n", "    gpus: 2\n    nodes: 3\n").replace("max: 3", "max: 1")
    ).models["big"]
    job = render_job(wide)
    answer = {
        "Annotations": {
            "DesiredTGUpdates": {
                "engine": {"DestructiveUpdate": 1, "Ignore": 0},
                "shard": {"DestructiveUpdate": 2, "Place": 1},
            }
        }
    }
    # One leader and two shards replaced are one replica; one shard placed is that replica's.
    assert read_plan(answer, job, 1).updates == {"DestructiveUpdate": 1, "Place": 1}


def test_nomads_answer_is_read_with_preemptions_and_the_watchers_reason() -> None:
    job = render_job(model())
    answer = {
        "Annotations": {
            "DesiredTGUpdates": {"engine": {"Place": 1, "Preemptions": 1, "Ignore": 0}},
            "PreemptedAllocs": [{"ID": "a1b2", "JobID": "batch-embeddings"}],
        },
        "FailedTGAllocs": None,
    }
    placed = read_plan(answer, job, 1)
    assert placed.fits and placed.preempts == ["batch-embeddings/a1b2"]
    assert placed.updates == {"Place": 1, "Preemptions": 1}

    failed = {
        "engine": {"NodesEvaluated": 3, "NodesFiltered": 3, "ConstraintFiltered": {"missing devices": 3}}
    }
    nowhere = read_plan({"Annotations": None, "FailedTGAllocs": failed}, job, 1)
    assert not nowhere.fits
    assert nowhere.reason == (
        "no node has 2 x nvidia/gpu with memory >= 80000 MiB and model set_contains_any "
        "NVIDIA H100 80GB HBM3: 3 nodes filtered (missing devices)"
    )
    text = render_text(
        FleetPlan([ModelPlan("big", "llmgw-big", "added", on_demand=True, placement=placed)]), "models.yaml"
    )
    assert "would preempt: batch-embeddings/a1b2" in text
    assert "1 replica when first asked for (on demand)" in text


def test_a_job_that_differs_without_stored_definitions_says_what_its_meta_tells() -> None:
    m = model()
    job = render_job(m)
    assert classify(m, None, job).change == "unchanged"
    old = render_job(model(TEXT.replace("big.gguf", "big-v1.gguf")))
    changed = classify(m, None, old)
    assert changed.change == "changed"
    assert [(f.field, f.old, f.new) for f in changed.fields] == [
        ("source", "hf://org/repo/big-v1.gguf", "hf://org/repo/big.gguf")
    ]
    profile_only = render_job(model(TEXT.replace("b6500", "b6600")))
    (field,) = classify(m, None, profile_only).fields
    assert field.field == "definition"
    assert classify(m, None, None).change == "added"


def test_an_on_demand_model_is_planned_at_one_replica_and_a_running_count_is_kept() -> None:
    m = model()
    job = render_job(m)
    assert planned_count(m, job) == (1, True)
    job["TaskGroups"][0]["Count"] = 2
    assert planned_count(m, job) == (2, False)
