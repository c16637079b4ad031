"""Rendering: a model definition becomes a Nomad job, as API JSON and as HCL that say the same."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import hcl2
import pytest

from nomad_driver.engines import gpu_check
from nomad_driver.fetch.prefetch import NotFetched, render_prefetch_job
from nomad_driver.hcl import job_to_hcl
from nomad_driver.node_meta import engine_meta_key
from nomad_driver.render import (
    GROUP_NAME,
    RESCHEDULE_POLICY,
    RESTART_POLICY,
    SERVICE_NAME,
    render_job,
    render_replica_job,
)
from nomad_driver.render_files import render_files, render_hcl
from nomad_driver.spec import Model, SpecError, definition_hash, load_models, parse_models
from nomad_driver.weights import weights_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = load_models(ROOT / "examples" / "models.yaml")
SECOND = 1_000_000_000

DEV_MODELS = parse_models(
    textwrap.dedent(
        """
        profiles:
          cpu-dev:
            engine: llama-cpp-python
            engine_version: 0.3.36
            gpus: 0
            cpu_mhz: 500
            memory_mib: 512
            context: 256
            args: ["--n_threads", "1", 'say "hi" \\ ${NOMAD_ALLOC_ID} %{x}']
          llamacpp-any:
            engine: llama.cpp
            engine_version: b6500
            gpus: 2
          vllm-hub:
            engine: vllm
            engine_version: v0.10.1
            gpus: 1
            gpu_memory_mib: 40000
        models:
          tiny:
            source: file:///srv/models/tiny.gguf
            profile: cpu-dev
            replicas: {min: 0, max: 3}
          revised:
            source: hf://org/repo@abc123/sub/dir/w.gguf
            profile: llamacpp-any
          hub:
            source: hf://meta-llama/Llama-3.1-8B-Instruct
            profile: vllm-hub
          plain:
            source: https://example.com/m/w.gguf
            profile: cpu-dev
          bucket:
            source: s3://weights/team/w.gguf?region=eu-west-1
            profile: cpu-dev
        """
    )
)
ALL_MODELS = list(EXAMPLES.models.values()) + list(DEV_MODELS.models.values())


def group_of(job: dict[str, Any]) -> dict[str, Any]:
    (group,) = job["TaskGroups"]
    return group


def task_of(job: dict[str, Any]) -> dict[str, Any]:
    """The engine's task (a fetched source adds the prestart `fetch` task after it)."""
    task, *others = group_of(job)["Tasks"]
    assert [t["Name"] for t in others] in ([], ["fetch"])
    return task


# --- what the jobs ask Nomad for ----------------------------------------------------------------


def test_the_four_gpu_model_asks_for_four_big_nvidia_gpus_in_mib() -> None:
    job = render_job(EXAMPLES.models["llama-3.3-70b"])
    (device,) = task_of(job)["Resources"]["Devices"]
    assert device["Name"] == "nvidia/gpu"
    assert device["Count"] == 4
    memory = next(c for c in device["Constraints"] if c["LTarget"] == "${device.attr.memory}")
    assert memory["Operand"] == ">="
    # A number with a unit Nomad converts: the plugin reports `memory` as an int in MiB.
    number, unit = memory["RTarget"].split()
    assert int(number) == 80000 and unit == "MiB"
    models = next(c for c in device["Constraints"] if c["LTarget"] == "${device.model}")
    assert models["Operand"] == "set_contains_any"
    assert models["RTarget"].split(",") == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]


def test_a_cpu_only_profile_asks_for_no_device_and_sets_no_gpu_env() -> None:
    job = render_job(DEV_MODELS.models["tiny"])
    task = task_of(job)
    assert "Devices" not in task["Resources"]
    assert "Env" not in task
    assert task["Resources"] == {"CPU": 500, "MemoryMB": 512}


def test_a_gpu_profile_without_memory_or_model_asks_for_any_gpus() -> None:
    task = task_of(render_job(DEV_MODELS.models["revised"]))
    assert task["Resources"]["Devices"] == [
        {"Name": "nvidia/gpu", "Count": 2, "Constraints": [], "Affinities": []}
    ]
    # Not through the task's env: Nomad interpolates it before the device variables exist, so
    # the engine would get the literal text. The prologue sets it at run time and checks.
    assert "Env" not in task
    config = task["Config"]
    assert config["command"] == "/bin/sh"
    assert config["args"][2:4] == [gpu_check.SCRIPT_NAME, "2"]
    assert "${NVIDIA_VISIBLE_DEVICES}" not in json.dumps(config)
    assert 'export CUDA_VISIBLE_DEVICES="$NVIDIA_VISIBLE_DEVICES"' in config["args"][1]


def test_llama_cpp_runs_the_nodes_llama_server_of_that_version() -> None:
    job = render_job(EXAMPLES.models["qwen2.5-0.5b"])
    task = task_of(job)
    assert task["Driver"] == "raw_exec"
    command, args = gpu_check.engine_command(task["Config"])
    assert command == "${meta.llmgw_engines_dir}/llama.cpp/b6500/llama-server"
    # An hf:// file comes through llmgw's fetch into the node's cache (fetch/render.py).
    assert args[:2] == ["--model", "${meta.llmgw_models_dir}/qwen2.5-0.5b/qwen2.5-0.5b-instruct-q4_k_m.gguf"]
    assert args[args.index("--port") + 1] == "${NOMAD_PORT_http}"
    assert args[args.index("--host") + 1] == "${NOMAD_IP_http}"
    assert args[args.index("--ctx-size") + 1] == "8192"
    assert args[-2:] == ["--parallel", "4"]  # profile args come last, so they can override
    assert group_of(job)["Constraints"] == [
        {"LTarget": "${meta.llmgw_engine_llama_cpp}", "RTarget": "b6500", "Operand": "set_contains"}
    ]


def test_llama_cpp_python_runs_the_engines_python_and_names_the_chat_format() -> None:
    job = render_job(EXAMPLES.models["gemma-3-4b"])
    task = task_of(job)
    assert task["Driver"] == "raw_exec"
    command, args = gpu_check.engine_command(task["Config"])
    assert command == "${meta.llmgw_engines_dir}/llama-cpp-python/0.3.36/bin/python"
    assert args[:2] == ["-m", "llama_cpp.server"]
    assert args[args.index("--n_ctx") + 1] == "8192"
    assert args[args.index("--chat_format") + 1] == "gemma"
    assert args[args.index("--model_alias") + 1] == "gemma-3-4b"
    (check,) = group_of(job)["Services"][0]["Checks"]
    assert check["Path"] == "/v1/models"  # llama_cpp.server has no /health
    assert group_of(job)["Constraints"][0]["LTarget"] == "${meta.llmgw_engine_llama_cpp_python}"


def test_vllm_runs_its_image_in_docker_across_all_its_gpus() -> None:
    task = task_of(render_job(EXAMPLES.models["llama-3.3-70b"]))
    assert task["Driver"] == "docker"
    config = task["Config"]
    assert config["image"] == "vllm/vllm-openai:v0.10.1"
    assert config["ports"] == ["http"]
    args = config["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[args.index("--port") + 1] == "${NOMAD_PORT_http}"
    assert args[args.index("--served-model-name") + 1] == "llama-3.3-70b"


def test_engine_meta_keys_follow_the_node_convention() -> None:
    assert engine_meta_key("llama.cpp") == "llmgw_engine_llama_cpp"
    assert engine_meta_key("llama-cpp-python") == "llmgw_engine_llama_cpp_python"
    assert engine_meta_key("vllm") == "llmgw_engine_vllm"


@pytest.mark.parametrize(
    ("source", "getter", "mode", "dest", "model_arg"),
    [
        (
            "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf",
            "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/qwen2.5-0.5b-instruct-q4_k_m.gguf",
            "file",
            "local/model/qwen2.5-0.5b-instruct-q4_k_m.gguf",
            "${NOMAD_TASK_DIR}/model/qwen2.5-0.5b-instruct-q4_k_m.gguf",
        ),
        (
            "hf://org/repo@abc123/sub/dir/w.gguf",
            "https://huggingface.co/org/repo/resolve/abc123/sub/dir/w.gguf",
            "file",
            "local/model/w.gguf",
            "${NOMAD_TASK_DIR}/model/w.gguf",
        ),
        (
            "s3://weights/team/w.gguf",
            "s3::https://s3.amazonaws.com/weights/team/w.gguf",
            "file",
            "local/model/w.gguf",
            "${NOMAD_TASK_DIR}/model/w.gguf",
        ),
        (
            "s3://weights/team/w.gguf?region=eu-west-1&version=7",
            "s3::https://s3-eu-west-1.amazonaws.com/weights/team/w.gguf?version=7",
            "file",
            "local/model/w.gguf",
            "${NOMAD_TASK_DIR}/model/w.gguf",
        ),
        (
            "s3://models/meta-llama/Llama-3.3-70B-Instruct/",
            "s3::https://s3.amazonaws.com/models/meta-llama/Llama-3.3-70B-Instruct/",
            "dir",
            "local/model/Llama-3.3-70B-Instruct",
            "${NOMAD_TASK_DIR}/model/Llama-3.3-70B-Instruct",
        ),
        (
            "https://example.com/m/w.gguf",
            "https://example.com/m/w.gguf",
            "file",
            "local/model/w.gguf",
            "${NOMAD_TASK_DIR}/model/w.gguf",
        ),
    ],
)
def test_sources_become_artifacts_nomad_can_fetch(
    source: str, getter: str, mode: str, dest: str, model_arg: str
) -> None:
    weights = weights_for(source)
    assert weights.artifact == {"GetterSource": getter, "GetterMode": mode, "RelativeDest": dest}
    assert weights.model_arg == model_arg


def test_a_file_for_a_raw_exec_engine_is_read_where_it_lies() -> None:
    # A real client has no file getter (getter/params.go), so an artifact could never fetch it;
    # raw_exec sees the node's files as they are (drivers/rawexec/driver.go).
    job = render_job(DEV_MODELS.models["tiny"])
    group, task = group_of(job), task_of(job)
    assert "Artifacts" not in task and "VolumeMounts" not in task
    assert [t["Name"] for t in group["Tasks"]] == ["engine"] and "Volumes" not in group
    args = task["Config"]["args"]
    assert args[args.index("--model") + 1] == "/srv/models/tiny.gguf"


def test_a_file_for_vllm_is_copied_into_the_nodes_cache_by_llmgws_fetch() -> None:
    # A docker task sees only what is mounted: the fetch (raw_exec) copies the file into the
    # cache volume, which the engine's task mounts.
    model = parse_models(
        textwrap.dedent(
            """
            profiles:
              v: {engine: vllm, engine_version: v0.10.1, gpus: 1}
            models:
              local-gguf: {source: "file:///srv/models/w.gguf", profile: v}
            """
        )
    ).models["local-gguf"]
    group = group_of(render_job(model))
    engine, fetch = group["Tasks"]
    assert fetch["Name"] == "fetch" and fetch["Config"]["args"][:2] == ["fetch", "file:///srv/models/w.gguf"]
    assert "Artifacts" not in engine
    args = engine["Config"]["args"]
    assert args[args.index("--model") + 1] == "${meta.llmgw_models_dir}/local-gguf/w.gguf"


def test_prefetch_says_a_file_read_in_place_has_nothing_to_fetch() -> None:
    with pytest.raises(NotFetched, match=r"read where it lies on the node\); nothing to prefetch"):
        render_prefetch_job(DEV_MODELS.models["tiny"])


def test_a_directory_on_the_node_is_refused_for_vllm_with_what_to_do() -> None:
    with pytest.raises(SpecError, match=r"directory on the node.*docker.*s3://"):
        parse_models(
            textwrap.dedent(
                """
                profiles:
                  v: {engine: vllm, engine_version: v0.10.1, gpus: 1}
                models:
                  local-dir: {source: "file:///srv/models/llama/", profile: v}
                """
            )
        )


def test_a_hub_repository_for_vllm_is_fetched_by_vllm_itself() -> None:
    task = task_of(render_job(DEV_MODELS.models["hub"]))
    assert "Artifacts" not in task
    args = task["Config"]["args"]
    assert args[args.index("--model") + 1] == "meta-llama/Llama-3.1-8B-Instruct"


def test_the_group_registers_the_engine_service_with_model_tag_meta_and_check() -> None:
    model = EXAMPLES.models["qwen2.5-0.5b"]
    group = group_of(render_job(model))
    assert group["Name"] == GROUP_NAME
    assert group["Networks"] == [{"DynamicPorts": [{"Label": "http"}], "ReservedPorts": []}]
    (service,) = group["Services"]
    assert service["Name"] == SERVICE_NAME == "llmgw-engine"
    assert service["PortLabel"] == "http"
    assert service["Tags"] == ["model=qwen2.5-0.5b"]
    assert service["Meta"] == {"model": "qwen2.5-0.5b", "def_hash": model.def_hash}
    (check,) = service["Checks"]
    assert check["Type"] == "http" and check["Path"] == "/health"
    assert check["Interval"] == 5 * SECOND and check["Timeout"] == 2 * SECOND


def test_a_stopped_replica_leaves_consul_and_drains_before_its_engine_is_signalled() -> None:
    # Nomad deregisters the group's services, waits shutdown_delay, then kills: the routers
    # drop the replica while the requests already on it finish (docs/router.md, "Faults").
    for model in ALL_MODELS:
        assert group_of(render_job(model))["ShutdownDelay"] == 15 * SECOND, model.name
    assert 'shutdown_delay = "15s"' in render_hcl(EXAMPLES.models["qwen2.5-0.5b"])
    # A multi-node replica's shards serve the leader's requests in flight until it is killed too.
    one = EXAMPLES.models["llama-3.3-70b"]
    split = dataclasses.replace(one, profile=one.profile.model_copy(update={"nodes": 2}))
    leader, shards = render_replica_job(split, 0)["TaskGroups"]
    assert leader["ShutdownDelay"] == shards["ShutdownDelay"] == 15 * SECOND


def test_job_meta_and_ids_carry_the_definition() -> None:
    model = EXAMPLES.models["llama-3.3-70b"]
    job = render_job(model)
    assert job["ID"] == job["Name"] == "llmgw-llama-3.3-70b"
    assert job["Type"] == "service"
    assert job["Meta"] == {
        "llmgw_model": "llama-3.3-70b",
        "llmgw_def_hash": model.def_hash,
        "llmgw_source": "s3://models/meta-llama/Llama-3.3-70B-Instruct/",
        "llmgw_profile": "vllm-4x80g",
    }


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.name)
def test_count_starts_at_the_minimum_and_scaling_caps_it_at_the_maximum(model: Model) -> None:
    group = group_of(render_job(model))
    assert group["Count"] == model.replicas_min
    # Min 0 always: parking scales to 0, which Nomad refuses below a policy minimum.
    assert group["Scaling"] == {"Min": 0, "Max": model.replicas_max, "Enabled": False}


def test_nomad_itself_gives_up_on_a_model_that_keeps_failing() -> None:
    group = group_of(render_job(EXAMPLES.models["qwen2.5-0.5b"]))
    restart, reschedule = group["RestartPolicy"], group["ReschedulePolicy"]
    assert restart["Mode"] == "fail" and restart["Attempts"] <= 1
    assert reschedule["Unlimited"] is False
    assert reschedule["DelayFunction"] == "exponential"
    starts_per_interval = (reschedule["Attempts"] + 1) * (restart["Attempts"] + 1)
    # Few enough that a broken model does not loop (155 starts in 8 hours was the incident), and
    # at least the watcher's 5, so a running watcher parks the model before Nomad gives up.
    assert 5 <= starts_per_interval <= 8
    assert reschedule["Interval"] >= 12 * 3600 * SECOND
    # Explicitly no deployments: Nomad would fill in max_parallel 1, and an active deployment
    # refuses the scale calls that parking and activation make (test_deployments shows it).
    assert group["Update"] == {"MaxParallel": 0}


def test_placement_comes_from_the_profile_and_the_namespace_from_the_caller() -> None:
    job = render_job(EXAMPLES.models["llama-3.3-70b"], namespace="llm")
    assert (job["Datacenters"], job["Namespace"], job["NodePool"]) == (["dc1"], "llm", "gpu")
    # No namespace of its own: what apply and the watcher submit lands in the namespace of their
    # call (NOMAD_NAMESPACE), never silently in `default`.
    default = render_job(DEV_MODELS.models["tiny"])
    assert default["Datacenters"] == ["*"]
    assert "Namespace" not in default and "NodePool" not in default


def test_placement_is_part_of_the_definition_only_when_set() -> None:
    base = EXAMPLES.profiles["llamacpp-1x24g"]
    unset = base.model_copy(update={"node_pool": None, "datacenters": None})
    moved = base.model_copy(update={"node_pool": "gpu-b"})
    source = "file:///m.gguf"
    # A file written before placement existed keeps its hash across an upgrade (no re-register,
    # no unpark); a model moved to another pool is a new definition, registered again.
    legacy = {
        k: v
        for k, v in unset.model_dump(mode="json").items()
        if k not in ("node_pool", "datacenters", "nodes", "update")
    }
    blob = json.dumps({"source": source, "profile": legacy}, sort_keys=True, separators=(",", ":"))
    assert definition_hash(source, unset) == hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert len({definition_hash(source, p) for p in (unset, base, moved)}) == 3


# Field names of Nomad's api package (api/jobs.go, tasks.go, resources.go, services.go,
# constraint.go, scaling.go, UpdateStrategy in jobs.go): a misspelt key is ignored by Nomad's decoder without a word.
API_FIELDS = {
    "Job": {"ID", "Name", "Type", "Namespace", "Region", "Datacenters", "NodePool", "Meta", "TaskGroups"},
    "TaskGroup": {
        "Name", "Count", "Constraints", "Affinities", "Volumes", "Scaling", "Networks", "Services",
        "RestartPolicy", "ReschedulePolicy", "Update", "ShutdownDelay", "Tasks",
    },
    "Task": {
        "Name", "Driver", "Config", "Env", "Artifacts", "Templates", "Lifecycle", "VolumeMounts",
        "Resources", "KillTimeout",
    },
    "Affinity": {"LTarget", "RTarget", "Operand", "Weight"},
    "VolumeRequest": {"Name", "Type", "Source", "ReadOnly"},
    "VolumeMount": {"Volume", "Destination", "ReadOnly"},
    "TaskLifecycle": {"Hook", "Sidecar"},
    "Template": {"EmbeddedTmpl", "DestPath", "Envvars", "ChangeMode", "Splay"},
    "Resources": {"CPU", "MemoryMB", "Devices"},
    "RequestedDevice": {"Name", "Count", "Constraints", "Affinities"},
    "Constraint": {"LTarget", "RTarget", "Operand"},
    "TaskArtifact": {"GetterSource", "GetterMode", "RelativeDest"},
    "Service": {"Name", "PortLabel", "Tags", "Meta", "Checks"},
    "ServiceCheck": {"Name", "Type", "Path", "Interval", "Timeout"},
    "RestartPolicy": {"Attempts", "Interval", "Delay", "Mode"},
    "ReschedulePolicy": {"Attempts", "Interval", "Delay", "DelayFunction", "MaxDelay", "Unlimited"},
    "ScalingPolicy": {"Min", "Max", "Enabled"},
    "UpdateStrategy": {"MaxParallel"},
    "NetworkResource": {"DynamicPorts", "ReservedPorts"},
    "Port": {"Label"},
}  # fmt: skip


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.name)
def test_every_key_is_a_nomad_api_field(model: Model) -> None:
    job = render_job(model)
    group = group_of(job)
    task = task_of(job)
    objects: list[tuple[str, dict[str, Any]]] = [
        ("Job", job),
        ("TaskGroup", group),
        ("Task", task),
        ("Resources", task["Resources"]),
        ("RestartPolicy", group["RestartPolicy"]),
        ("ReschedulePolicy", group["ReschedulePolicy"]),
        ("ScalingPolicy", group["Scaling"]),
        ("UpdateStrategy", group["Update"]),
    ]
    objects += [("Constraint", c) for c in group["Constraints"]]
    objects += [("NetworkResource", n) for n in group["Networks"]]
    objects += [("Port", p) for n in group["Networks"] for p in n["DynamicPorts"]]
    objects += [("Service", s) for s in group["Services"]]
    objects += [("ServiceCheck", c) for s in group["Services"] for c in s["Checks"]]
    objects += [("TaskArtifact", a) for a in task.get("Artifacts", [])]
    objects += [("Affinity", a) for a in group.get("Affinities", [])]
    objects += [("VolumeRequest", v) for v in group.get("Volumes", {}).values()]
    for other in group["Tasks"][1:]:
        objects += [("Task", other), ("Resources", other["Resources"])]
        objects += [("TaskLifecycle", other["Lifecycle"])]
        objects += [("Template", t) for t in other.get("Templates", [])]
    for t in group["Tasks"]:
        objects += [("VolumeMount", m) for m in t.get("VolumeMounts", [])]
    for device in task["Resources"].get("Devices", []):
        objects.append(("RequestedDevice", device))
        objects += [("Constraint", c) for c in device["Constraints"]]
    for kind, obj in objects:
        assert set(obj) <= API_FIELDS[kind], f"{kind}: {set(obj) - API_FIELDS[kind]}"
    for kind, obj in objects:
        if kind == "Constraint":
            # The JSON API does not default an empty operand to "=" as HCL does.
            assert obj["Operand"] and obj["LTarget"] and obj["RTarget"]


# --- the HCL says the same as the JSON ------------------------------------------------------------


def _unquote(value: Any) -> Any:
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return json.loads(value).replace("%%{", "%{")
    return value


def _clean(value: Any) -> Any:
    """python-hcl2's output without its quotes and block markers."""
    if isinstance(value, dict):
        return {_unquote(k): _clean(v) for k, v in value.items() if k not in ("__is_block__", "__comments__")}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return _unquote(value)


_UNITS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}


def _ns(text: str) -> int:
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", text)
    assert match, text
    return int(match.group(1)) * _UNITS[match.group(2)]


def _labeled(blocks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [next(iter(block.items())) for block in blocks]


def _constraints(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"LTarget": b["attribute"], "RTarget": b["value"], "Operand": b["operator"]} for b in blocks]


def job_from_hcl(text: str) -> dict[str, Any]:
    """Read an HCL jobspec back into API JSON, written here independently of nomad_driver.hcl."""
    tree = _clean(hcl2.loads(text))
    ((job_id, body),) = _labeled(tree["job"])
    job: dict[str, Any] = {
        "ID": job_id,
        "Name": body.get("name", job_id),
        "Type": body["type"],
    }
    if "namespace" in body:
        job["Namespace"] = body["namespace"]
    job["Datacenters"] = body["datacenters"]
    if "node_pool" in body:
        job["NodePool"] = body["node_pool"]
    job["Meta"] = body["meta"][0]
    job["TaskGroups"] = []
    for name, g in _labeled(body["group"]):
        (net,) = g["network"]
        (service,) = g["service"]
        (restart,) = g["restart"]
        (resched,) = g["reschedule"]
        (scaling,) = g["scaling"]
        group: dict[str, Any] = {
            "Name": name,
            "Count": g["count"],
            "Constraints": _constraints(g.get("constraint", [])),
            "Scaling": {"Min": scaling["min"], "Max": scaling["max"], "Enabled": scaling["enabled"]},
            "Networks": [
                {
                    "DynamicPorts": [
                        {"Label": label} for label, p in _labeled(net["port"]) if "static" not in p
                    ],
                    "ReservedPorts": [
                        {"Label": label, "Value": p["static"]}
                        for label, p in _labeled(net["port"])
                        if "static" in p
                    ],
                }
            ],
            "Services": [
                {
                    "Name": service["name"],
                    "PortLabel": service["port"],
                    "Tags": service["tags"],
                    "Meta": service["meta"][0],
                    "Checks": [
                        {
                            "Name": c["name"],
                            "Type": c["type"],
                            "Path": c["path"],
                            "Interval": _ns(c["interval"]),
                            "Timeout": _ns(c["timeout"]),
                        }
                        for c in service["check"]
                    ],
                }
            ],
            "RestartPolicy": {
                "Attempts": restart["attempts"],
                "Interval": _ns(restart["interval"]),
                "Delay": _ns(restart["delay"]),
                "Mode": restart["mode"],
            },
            "ReschedulePolicy": {
                "Attempts": resched["attempts"],
                "Interval": _ns(resched["interval"]),
                "Delay": _ns(resched["delay"]),
                "DelayFunction": resched["delay_function"],
                "MaxDelay": _ns(resched["max_delay"]),
                "Unlimited": resched["unlimited"],
            },
            "Update": {"MaxParallel": g["update"][0]["max_parallel"]},
            "ShutdownDelay": _ns(g["shutdown_delay"]),
            "Tasks": [],
        }
        if "affinity" in g:
            group["Affinities"] = [
                {
                    "LTarget": a["attribute"],
                    "RTarget": a["value"],
                    "Operand": a["operator"],
                    "Weight": a["weight"],
                }
                for a in g["affinity"]
            ]
        if "volume" in g:
            group["Volumes"] = {
                alias: {"Name": alias, "Type": v["type"], "Source": v["source"], "ReadOnly": v["read_only"]}
                for alias, v in _labeled(g["volume"])
            }
        for task_name, t in _labeled(g["task"]):
            (res,) = t["resources"]
            resources: dict[str, Any] = {"CPU": res["cpu"], "MemoryMB": res["memory"]}
            if "device" in res:
                resources["Devices"] = [
                    {
                        "Name": dev_name,
                        "Count": d["count"],
                        "Constraints": _constraints(d.get("constraint", [])),
                        "Affinities": [],
                    }
                    for dev_name, d in _labeled(res["device"])
                ]
            task: dict[str, Any] = {
                "Name": task_name,
                "Driver": t["driver"],
                "Config": t["config"][0],
                "Resources": resources,
                "KillTimeout": _ns(t["kill_timeout"]),
            }
            if "env" in t:
                task["Env"] = t["env"][0]
            if "lifecycle" in t:
                (lc,) = t["lifecycle"]
                task["Lifecycle"] = {"Hook": lc["hook"], "Sidecar": lc["sidecar"]}
            if "template" in t:
                task["Templates"] = [
                    {
                        "EmbeddedTmpl": tp["data"],
                        "DestPath": tp["destination"],
                        "Envvars": tp["env"],
                        "ChangeMode": tp["change_mode"],
                        "Splay": _ns(tp["splay"]),
                    }
                    for tp in t["template"]
                ]
            if "volume_mount" in t:
                task["VolumeMounts"] = [
                    {"Volume": m["volume"], "Destination": m["destination"], "ReadOnly": m["read_only"]}
                    for m in t["volume_mount"]
                ]
            if "artifact" in t:
                task["Artifacts"] = [
                    {"GetterSource": a["source"], "GetterMode": a["mode"], "RelativeDest": a["destination"]}
                    for a in t["artifact"]
                ]
            group["Tasks"].append(task)
        job["TaskGroups"].append(group)
    return job


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.name)
def test_the_hcl_says_exactly_what_the_json_says(model: Model) -> None:
    assert job_from_hcl(render_hcl(model, namespace="llm")) == render_job(model, namespace="llm")
    assert job_from_hcl(render_hcl(model)) == render_job(model)


def test_hcl_keeps_quotes_backslashes_and_nomad_variables_in_arguments() -> None:
    model = DEV_MODELS.models["tiny"]
    args = job_from_hcl(render_hcl(model))["TaskGroups"][0]["Tasks"][0]["Config"]["args"]
    assert args[-1] == 'say "hi" \\ ${NOMAD_ALLOC_ID} %{x}'


def test_the_hcl_writer_refuses_a_field_it_cannot_map() -> None:
    job = render_job(EXAMPLES.models["qwen2.5-0.5b"])
    job["TaskGroups"][0]["Tasks"][0]["Vault"] = {"Policies": ["x"]}
    with pytest.raises(ValueError, match=r"Tasks\[0\]: no HCL mapping for Vault"):
        job_to_hcl(job)


def test_policy_durations_are_nanoseconds_in_json_and_readable_in_hcl() -> None:
    assert RESTART_POLICY["Delay"] == 15 * SECOND
    assert RESCHEDULE_POLICY["Interval"] == 24 * 3600 * SECOND
    text = render_hcl(EXAMPLES.models["qwen2.5-0.5b"])
    assert 'interval       = "24h"' in text
    assert 'delay    = "15s"' in text


# --- the shipped rendered examples --------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hcl", "json"])
def test_shipped_example_jobs_equal_a_fresh_render(fmt: str) -> None:
    fresh = render_files(list(EXAMPLES.models.values()), fmt)
    shipped = {p.name: p.read_text() for p in (ROOT / "jobs" / "examples").glob(f"*.nomad.{fmt}")}
    hint = "re-render: llmgw render examples/models.yaml -o jobs/examples --format " + fmt
    assert shipped == fresh, hint


def test_json_files_wrap_the_job_for_the_register_endpoint() -> None:
    model = EXAMPLES.models["llama-3.3-70b"]
    (text,) = render_files([model], "json").values()
    assert json.loads(text) == {"Job": render_job(model)}


# --- the rendered CPU job runs as it is --------------------------------------------------------


def _interpolate(value: str, env: dict[str, str], node_meta: dict[str, str]) -> str:
    """Nomad's runtime interpolation for the variables a rendered job uses; anything else fails."""

    def lookup(match: re.Match[str]) -> str:
        name = match.group(1)
        if name.startswith("meta."):
            return node_meta[name.removeprefix("meta.")]
        return env[name]

    return re.sub(r"\$\{([^}]+)\}", lookup, value)


@pytest.mark.slow
def test_the_rendered_cpu_job_serves_when_run_as_nomad_would(tmp_path: Path, make_gguf: Any) -> None:
    import subprocess
    import sys
    import time
    from urllib.request import Request, urlopen

    from devstack.ports import free_port
    from tests.fixtures.engines import require_llama_cpp

    require_llama_cpp()
    weights = make_gguf()
    # A node whose engines dir holds llama-cpp-python 0.3.36, which is this virtualenv.
    engines = tmp_path / "engines"
    python = engines / "llama-cpp-python" / "0.3.36" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    node_meta = {"llmgw_engines_dir": str(engines), "llmgw_engine_llama_cpp_python": "0.3.20,0.3.36"}

    model = parse_models(
        textwrap.dedent(
            f"""
            profiles:
              cpu-dev: {{engine: llama-cpp-python, engine_version: 0.3.36, gpus: 0, context: 256}}
            models:
              tiny-dev: {{source: "file://{weights}", profile: cpu-dev}}
            """
        )
    ).models["tiny-dev"]
    job = render_job(model)
    group, task = group_of(job), task_of(job)

    (constraint,) = group["Constraints"]
    assert constraint["Operand"] == "set_contains"
    assert constraint["RTarget"] in _interpolate(constraint["LTarget"], {}, node_meta).split(",")

    # raw_exec reads the file where it lies: nothing is copied into the task directory.
    assert "Artifacts" not in task
    task_dir = tmp_path / "alloc" / task["Name"]
    task_dir.mkdir(parents=True)

    port = free_port()
    env = {
        "NOMAD_IP_http": "127.0.0.1",
        "NOMAD_PORT_http": str(port),
        "NOMAD_TASK_DIR": str(task_dir / "local"),
    }
    command = _interpolate(task["Config"]["command"], env, node_meta)
    args = [_interpolate(a, env, node_meta) for a in task["Config"]["args"]]
    check = group["Services"][0]["Checks"][0]
    log = (tmp_path / "engine.log").open("wb")
    proc = subprocess.Popen([command, *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            try:
                with urlopen(f"http://127.0.0.1:{port}{check['Path']}", timeout=2) as answer:
                    if answer.status == 200:
                        models = json.load(answer)
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "engine never became ready"
            time.sleep(0.2)
        # The engine answers to the model's own name, the one clients and the router use.
        assert [m["id"] for m in models["data"]] == ["tiny-dev"]
        body = json.dumps(
            {"model": "tiny-dev", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        )
        request = Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        with urlopen(request, timeout=60) as answer:
            assert answer.status == 200
            assert json.load(answer)["choices"][0]["message"]["role"] == "assistant"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
