"""Multi-node replicas in the definition and the rendered job: `nodes: N` is refused where the
engine cannot shard, and a replica renders as one job with a leader group and a shard group that
find each other through Consul, as API JSON and as HCL that say the same."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import hcl2
import pytest

from nomad_driver.engines.llama_cpp import RPC_SERVERS_VAR
from nomad_driver.render import (
    GROUP_NAME,
    SHARD_GROUP,
    SHARD_SERVICE,
    render_job,
    render_replica_job,
    replica_job_ids,
)
from nomad_driver.render_files import render_files, render_hcl
from nomad_driver.spec import SpecError, definition_hash, parse_models

MODELS = textwrap.dedent(
    """
    profiles:
      rpc-2x24g:
        engine: llama.cpp
        engine_version: b6500
        gpus: 1
        gpu_memory_mib: 24000
        nodes: 2
        context: 2048
      rpc-3-cpu:
        engine: llama.cpp
        engine_version: b6500
        gpus: 0
        nodes: 3
      vllm-2x8:
        engine: vllm
        engine_version: v0.10.1
        gpus: 8
        gpu_memory_mib: 80000
        nodes: 2
      one:
        engine: llama.cpp
        engine_version: b6500
        gpus: 1
    models:
      gemma-split:
        source: file:///srv/models/gemma.gguf
        profile: rpc-2x24g
        replicas: {min: 1, max: 1}
      cpu-split:
        source: file:///srv/models/tiny.gguf
        profile: rpc-3-cpu
        replicas: {min: 0, max: 1}
      llama-405b:
        source: hf://meta-llama/Llama-3.1-405B-Instruct
        profile: vllm-2x8
        replicas: {min: 1, max: 1}
      single:
        source: file:///srv/models/one.gguf
        profile: one
    """
)
SET = parse_models(MODELS)


def test_nodes_with_an_engine_that_cannot_shard_is_refused_naming_the_field() -> None:
    text = MODELS.replace(
        "engine: llama.cpp\n    engine_version: b6500\n    gpus: 0",
        "engine: llama-cpp-python\n    engine_version: 0.3.36\n    gpus: 0",
    )
    with pytest.raises(SpecError) as err:
        parse_models(text)
    (problem,) = err.value.problems
    assert problem.startswith("profiles.rpc-3-cpu.nodes: llama-cpp-python cannot split a model across nodes")
    assert "llama.cpp" in problem and "vllm" in problem


@pytest.mark.parametrize("bad", ["0", "-1", "65", '"2"'])
def test_nodes_must_be_a_whole_number_of_nodes(bad: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_models(MODELS.replace("nodes: 3", f"nodes: {bad}"))
    assert err.value.problems[0].startswith("profiles.rpc-3-cpu.nodes:")


def test_one_node_keeps_the_hash_of_a_definition_written_before_nodes_existed() -> None:
    profile = SET.profiles["one"]
    assert profile.nodes == 1
    assert definition_hash("file:///x", profile) == definition_hash(
        "file:///x", profile.model_copy(update={"nodes": 1})
    )
    assert definition_hash("file:///x", profile) != definition_hash(
        "file:///x", profile.model_copy(update={"nodes": 2})
    )


def test_a_single_node_model_renders_as_before() -> None:
    job = render_job(SET.models["single"])
    assert [g["Name"] for g in job["TaskGroups"]] == [GROUP_NAME]
    assert "Constraints" not in job


def test_each_replica_is_a_job_of_its_own_whose_ids_cannot_be_another_models() -> None:
    model = SET.models["gemma-split"]
    assert replica_job_ids(model) == ["llmgw-gemma-split"]
    assert render_job(model) == render_replica_job(model, 0)
    # ':' is not allowed in model names, so no model's own job is called like a replica.
    with pytest.raises(SpecError):
        parse_models(MODELS.replace("gemma-split:", "gemma-split:1:"))
    assert sorted(render_files([model], "json")) == ["llmgw-gemma-split.nomad.json"]
    first = render_replica_job(model, 0)
    second = render_replica_job(model, 1)
    assert first["ID"] == "llmgw-gemma-split" and second["ID"] == "llmgw-gemma-split:1"
    # replicas.min 1: the first replica runs; one beyond the minimum waits at count 0.
    assert [g["Count"] for g in first["TaskGroups"]] == [1, 1]
    assert [g["Count"] for g in second["TaskGroups"]] == [0, 0]
    assert second["Meta"]["llmgw_replica"] == "1" and second["Meta"]["llmgw_nodes"] == "2"
    assert second["Meta"]["llmgw_model"] == "gemma-split"


def test_a_multi_node_model_runs_one_replica_until_the_watcher_manages_more() -> None:
    with pytest.raises(SpecError) as err:
        parse_models(
            MODELS.replace(
                "replicas: {min: 1, max: 1}\n  cpu-split", "replicas: {min: 1, max: 2}\n  cpu-split"
            )
        )
    (problem,) = err.value.problems
    assert problem == (
        "models.gemma-split.replicas.max: a multi-node model (profile 'rpc-2x24g', nodes: 2) "
        "runs at most 1 replica, got 2"
    )


def test_a_llama_cpp_replica_is_a_leader_and_shards_on_distinct_nodes_each_with_all_its_gpus() -> None:
    model = SET.models["cpu-split"]
    job = render_replica_job(model, 0)
    leader, shards = job["TaskGroups"]
    assert (leader["Name"], shards["Name"]) == (GROUP_NAME, SHARD_GROUP)
    # min 0: registered, nothing runs until activation scales it.
    assert (leader["Count"], shards["Count"]) == (0, 0)
    assert (leader["Scaling"]["Max"], shards["Scaling"]["Max"]) == (1, 2)
    assert job["Constraints"] == [{"Operand": "distinct_hosts", "RTarget": "true"}]
    gemma = render_replica_job(SET.models["gemma-split"], 0)
    for group in gemma["TaskGroups"]:
        (device,) = group["Tasks"][0]["Resources"]["Devices"]
        assert device["Count"] == 1
        assert group["Constraints"][0]["LTarget"] == "${meta.llmgw_engine_llama_cpp}"

    (shard_task,) = shards["Tasks"]
    assert shard_task["Config"]["command"] == "${meta.llmgw_engines_dir}/llama.cpp/b6500/ggml-rpc-server"
    assert shard_task["Config"]["args"] == ["--host", "${NOMAD_IP_rpc}", "--port", "${NOMAD_PORT_rpc}"]
    (service,) = shards["Services"]
    assert service["Name"] == SHARD_SERVICE
    assert "job=llmgw-cpu-split" in service["Tags"]
    # No check: ggml-rpc-server answers one client, so a TCP check fails while the leader is
    # connected. The service lives while the shard's process does.
    assert "Checks" not in service

    (leader_task,) = leader["Tasks"]
    (template,) = leader_task["Templates"]
    assert template["ChangeMode"] == "restart" and template["Envvars"] is True
    assert 'service "job=llmgw-cpu-split.llmgw-shard"' in template["EmbeddedTmpl"]
    assert template["EmbeddedTmpl"].startswith(f"{RPC_SERVERS_VAR}=")
    assert leader_task["Config"]["command"] == "/bin/sh"
    script = leader_task["Config"]["args"][1]
    assert "${meta.llmgw_engines_dir}/llama.cpp/b6500/llama-server" in script
    assert f"--rpc ${{{RPC_SERVERS_VAR}}}" in script
    assert "-lt 2 ]" in script  # waits for both shards before it serves
    # The leader loads the file where it lies on its node (raw_exec); the shards load nothing.
    assert "--model /srv/models/tiny.gguf" in script
    assert "Artifacts" not in leader_task and "Artifacts" not in shard_task
    assert leader["Services"][0]["Checks"][0]["Path"] == "/health"


def test_a_vllm_replica_joins_its_shards_to_the_leaders_ray_head_found_in_consul() -> None:
    job = render_replica_job(SET.models["llama-405b"], 0)
    leader, shards = job["TaskGroups"]
    head = leader["Tasks"][0]["Config"]["args"][1]
    assert head.startswith("ray start --head")
    assert "--pipeline-parallel-size 2" in head and "--tensor-parallel-size 8" in head
    assert "--distributed-executor-backend ray" in head
    assert "llmgw-ray-head" in [s["Name"] for s in leader["Services"]]
    (lookup,) = shards["Tasks"][0]["Templates"]
    assert 'service "job=llmgw-llama-405b.llmgw-ray-head"' in lookup["EmbeddedTmpl"]
    assert "ray start --block --address=$RAY_HEAD_ADDRESS" in shards["Tasks"][0]["Config"]["args"][1]
    for group in (leader, shards):
        assert group["Tasks"][0]["Resources"]["Devices"][0]["Count"] == 8


def _unquote(value: Any) -> Any:
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return json.loads(value).replace("%%{", "%{")
    if isinstance(value, dict):
        return {
            _unquote(k): _unquote(v) for k, v in value.items() if k not in ("__is_block__", "__comments__")
        }
    if isinstance(value, list):
        return [_unquote(v) for v in value]
    return value


@pytest.mark.parametrize("name", ["gemma-split", "cpu-split", "llama-405b"])
def test_the_hcl_of_a_replica_says_what_its_json_says(name: str) -> None:
    model = SET.models[name]
    job = render_job(model)
    tree = _unquote(hcl2.loads(render_hcl(model)))
    ((job_id, body),) = [next(iter(b.items())) for b in tree["job"]]
    assert job_id == job["ID"]
    assert [
        {
            **({"LTarget": c["attribute"]} if "attribute" in c else {}),
            "RTarget": c["value"],
            "Operand": c["operator"],
        }
        for c in body["constraint"]
    ] == job["Constraints"]
    groups = [next(iter(g.items())) for g in body["group"]]
    assert [n for n, _ in groups] == [g["Name"] for g in job["TaskGroups"]]
    for (_, hcl_group), group in zip(groups, job["TaskGroups"], strict=True):
        assert hcl_group["count"] == group["Count"]
        assert [(s["name"], s["tags"], s["meta"][0]) for s in hcl_group["service"]] == [
            (s["Name"], s["Tags"], s["Meta"]) for s in group["Services"]
        ]
        ((_, task_body),) = [next(iter(t.items())) for t in hcl_group["task"]]
        task = group["Tasks"][0]
        assert task_body["config"][0] == task["Config"]
        templates = task.get("Templates", [])
        assert [
            {
                "EmbeddedTmpl": t["data"],
                "DestPath": t["destination"],
                "Envvars": t["env"],
                "ChangeMode": t["change_mode"],
            }
            for t in task_body.get("template", [])
        ] == [{k: t[k] for k in ("EmbeddedTmpl", "DestPath", "Envvars", "ChangeMode")} for t in templates]


@pytest.mark.parametrize("name", ["gemma-split", "llama-405b"])
def test_every_group_of_a_replica_opts_out_of_deployments(name: str) -> None:
    """Parking scales the leader and the shards; a deployment on either group would make Nomad
    refuse the scale ("job scaling blocked due to active deployment")."""
    from nomad_driver.watcher.job_facts import job_makes_deployments

    job = render_job(SET.models[name])
    assert [g["Update"] for g in job["TaskGroups"]] == [{"MaxParallel": 0}] * len(job["TaskGroups"])
    assert not job_makes_deployments(job)
    job["TaskGroups"][-1]["Update"] = {"MaxParallel": 1}  # as the shard group was rendered before
    assert job_makes_deployments(job)


def test_each_shard_lands_only_on_a_node_with_exactly_the_gpus_it_takes() -> None:
    # `gpus` is per node and a shard asks for all of them: a node with more would be shared.
    wants = {"LTarget": "${meta.llmgw_gpu_count}", "RTarget": "8", "Operand": "="}
    assert wants in render_job(SET.models["llama-405b"])["Constraints"]
    # Nothing to match for a replica without GPUs.
    cpu = render_job(SET.models["cpu-split"])["Constraints"]
    assert all(c.get("LTarget") != "${meta.llmgw_gpu_count}" for c in cpu)


@pytest.mark.parametrize("name", ["cpu-split", "llama-405b"])
def test_every_task_whose_template_asks_consul_has_a_consul_block(name: str) -> None:
    """Nomad gives a task a Consul workload identity, and so its template a Consul token, only
    when the task or its group has a `consul` block (hashicorp/nomad
    nomad/job_endpoint_hook_implicit_identities.go, `handleConsulTask`). Without one, on a
    Consul with ACLs, the leader's lookup of its shards sees nothing and it waits for ever."""
    job = render_replica_job(SET.models[name], 0)
    asking = [
        task
        for group in job["TaskGroups"]
        for task in group["Tasks"]
        if any("service " in t["EmbeddedTmpl"] for t in task.get("Templates") or [])
    ]
    assert asking
    for task in asking:
        assert task["Consul"] == {}
    tree = _unquote(hcl2.loads(render_hcl(SET.models[name])))
    ((_, body),) = [next(iter(b.items())) for b in tree["job"]]
    tasks = [next(iter(t.items()))[1] for g in body["group"] for t in next(iter(g.items()))[1]["task"]]
    with_consul = [t for t in tasks if "consul" in t]
    assert len(with_consul) == len(asking)
    assert all("template" in t for t in with_consul)
