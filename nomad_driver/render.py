"""A model definition becomes one Nomad service job.

`render_job` builds the job as Nomad's API JSON (what `llmgw apply` submits); `render_hcl` writes
that same dict out as HCL, so the two can never say different things. Field names are those of
Nomad's `api` package (`api/jobs.go`, `api/tasks.go`, `api/resources.go`, `api/services.go`).
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from nomad_driver.hcl import job_to_hcl
from nomad_driver.spec import Model, Profile

GROUP_NAME = "engine"
TASK_NAME = "engine"
SERVICE_NAME = "llmgw-engine"
PORT_LABEL = "http"
GPU_DEVICE = "nvidia/gpu"

# Where the artifact puts the weights, relative to the allocation's task directory; inside the
# task that directory is ${NOMAD_TASK_DIR} (`local/`), for raw_exec and docker alike.
WEIGHTS_DEST = "local/model"
WEIGHTS_DIR = "${NOMAD_TASK_DIR}/model"

SECOND = 1_000_000_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE

# vLLM shares tensors between its tensor-parallel workers through /dev/shm; Docker's 64 MiB
# default makes a multi-GPU model die at start-up.
VLLM_SHM_BYTES = 16 * 1024**3

READINESS_PATHS = {
    "llama.cpp": "/health",
    "vllm": "/health",
    # llama_cpp.server has no /health (404); it loads the model before it listens, so any
    # answer from /v1/models means ready.
    "llama-cpp-python": "/v1/models",
}


def engine_meta_key(engine: str) -> str:
    """The node meta key listing installed versions of `engine`: `llmgw_engine_llama_cpp`."""
    return "llmgw_engine_" + re.sub(r"[^A-Za-z0-9]", "_", engine)


def readiness_path(engine: str) -> str:
    return READINESS_PATHS[engine]


@dataclass(frozen=True)
class Weights:
    """How the engine gets its weights: an artifact Nomad downloads into the task directory, or,
    for a Hugging Face repository given to vLLM, a name the engine resolves itself."""

    model_arg: str
    artifact: dict[str, Any] | None


def weights_for(source: str) -> Weights:
    parts = urlsplit(source)
    is_dir = source.endswith("/")
    name = posixpath.basename(parts.path.rstrip("/")) or "model"
    if parts.scheme == "hf":
        segments = [s for s in (parts.netloc + parts.path).split("/") if s]
        if len(segments) == 2:
            # vLLM downloads a whole repository itself; go-getter cannot list a Hub repository.
            return Weights(model_arg="/".join(segments), artifact=None)
        org, repo, *path = segments
        revision = "main"
        if "@" in repo:
            repo, revision = repo.split("@", 1)
        getter = f"https://huggingface.co/{org}/{repo}/resolve/{revision}/{'/'.join(path)}"
    elif parts.scheme == "s3":
        query = dict(parse_qsl(parts.query))
        region = query.pop("region", "")
        # go-getter takes the region from a three-part path-style host (s3-REGION.amazonaws.com).
        host = f"s3-{region}.amazonaws.com" if region else "s3.amazonaws.com"
        getter = f"s3::https://{host}/{parts.netloc}{parts.path}"
        if query:
            getter += "?" + urlencode(query)
    else:
        getter = source
    artifact = {
        "GetterSource": getter,
        "GetterMode": "dir" if is_dir else "file",
        "RelativeDest": f"{WEIGHTS_DEST}/{name}",
    }
    return Weights(model_arg=f"{WEIGHTS_DIR}/{name}", artifact=artifact)


def _engine_task_config(model: Model, weights: Weights) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The driver, its config and the task environment for the model's engine."""
    p = model.profile
    engines = "${meta.llmgw_engines_dir}"
    listen = ["--host", "${NOMAD_IP_http}", "--port", "${NOMAD_PORT_http}"]
    env: dict[str, str] = {}
    config: dict[str, Any]
    if p.gpus > 0 and p.engine != "vllm":
        # The nvidia device plugin hands out GPUs as NVIDIA_VISIBLE_DEVICES, which only the
        # NVIDIA container runtime reads; a raw_exec process uses CUDA_VISIBLE_DEVICES, and
        # without it every replica on a node would pile onto GPU 0.
        env["CUDA_VISIBLE_DEVICES"] = "${NVIDIA_VISIBLE_DEVICES}"

    if p.engine == "llama.cpp":
        # raw_exec, not exec: the engine lives under llmgw_engines_dir (/opt/...), which exec's
        # chroot does not carry, and CUDA needs the host's driver libraries as they are.
        args = ["--model", weights.model_arg, *listen, "--ctx-size", str(p.context)]
        args += ["--alias", model.name]
        if p.gpus > 0:
            args += ["-ngl", "999"]
        config = {"command": f"{engines}/llama.cpp/{p.engine_version}/llama-server", "args": args + p.args}
        return "raw_exec", config, env

    if p.engine == "llama-cpp-python":
        args = ["-m", "llama_cpp.server", "--model", weights.model_arg, *listen]
        args += ["--n_ctx", str(p.context), "--model_alias", model.name]
        # Its server otherwise ends a running stream (with [DONE], no error) whenever another
        # request arrives: behind a router that balances several clients, most streams break.
        args += ["--interrupt_requests", "False"]
        if p.gpus > 0:
            args += ["--n_gpu_layers", "-1"]
        if p.chat_format:
            args += ["--chat_format", p.chat_format]
        config = {
            "command": f"{engines}/llama-cpp-python/{p.engine_version}/bin/python",
            "args": args + p.args,
        }
        return "raw_exec", config, env

    # vLLM ships as a container image; the docker driver maps the dynamic port to the same
    # number inside the container, so the engine listens on NOMAD_PORT_http on all interfaces.
    args = ["--model", weights.model_arg, "--served-model-name", model.name]
    args += ["--host", "0.0.0.0", "--port", "${NOMAD_PORT_http}", "--max-model-len", str(p.context)]
    if p.gpus > 1:
        args += ["--tensor-parallel-size", str(p.gpus)]
    config = {
        "image": f"vllm/vllm-openai:{p.engine_version}",
        "ports": [PORT_LABEL],
        "shm_size": VLLM_SHM_BYTES,
        "args": args + p.args,
    }
    return "docker", config, env


def _gpu_devices(p: Profile) -> list[dict[str, Any]]:
    if p.gpus == 0:
        return []
    constraints = []
    if p.gpu_memory_mib > 0:
        # With a unit on the right-hand side Nomad compares unit-aware against the plugin's
        # `memory` attribute (an int in MiB); a bare number would not compare at all.
        constraints.append(
            {"LTarget": "${device.attr.memory}", "RTarget": f"{p.gpu_memory_mib} MiB", "Operand": ">="}
        )
    if p.gpu_models:
        # Exact names as NVML reports them; set_contains_any matches one of several, where a
        # three-part device name could name only one.
        constraints.append(
            {"LTarget": "${device.model}", "RTarget": ",".join(p.gpu_models), "Operand": "set_contains_any"}
        )
    return [{"Name": GPU_DEVICE, "Count": p.gpus, "Constraints": constraints, "Affinities": []}]


# Nomad's own retries are the backstop for when no llmgw watcher runs; with one running, the
# watcher parks a model after 5 start failures long before these run out. One local restart
# (the weights are already on disk, so it is cheap and cures a transient crash), then the
# allocation fails; two reschedules elsewhere, spaced out exponentially, within a day. A broken
# model thus starts at most 6 times a day on its own instead of looping, which is what started
# one model 155 times in eight hours. 6 >= 5, so a running watcher always sees enough failures
# to park the model before Nomad gives up on it.
RESTART_POLICY = {"Attempts": 1, "Interval": 30 * MINUTE, "Delay": 15 * SECOND, "Mode": "fail"}
RESCHEDULE_POLICY = {
    "Attempts": 2,
    "Interval": 24 * HOUR,
    "Delay": 1 * MINUTE,
    "DelayFunction": "exponential",
    "MaxDelay": 10 * MINUTE,
    "Unlimited": False,
}
# `max_parallel = 0` is Nomad's own "no deployments" (`UpdateStrategy.IsEmpty`); see render_job.
UPDATE_STRATEGY = {"MaxParallel": 0}
CHECK_INTERVAL = 5 * SECOND
CHECK_TIMEOUT = 2 * SECOND


def render_job(model: Model, *, namespace: str | None = None) -> dict[str, Any]:
    """The Job object for Nomad's API (without the `{"Job": ...}` wrapper of a register call).

    Node pool and datacenters come from the model's profile, so `render`, `apply` and the
    watcher place a model alike. The namespace is the cluster's, not the model's: left out
    unless given, a job lands in the namespace of the call that registers it (`NOMAD_NAMESPACE`,
    which Nomad also prefers over the job's own field), never silently in `default`."""
    p = model.profile
    weights = weights_for(model.source)
    driver, config, env = _engine_task_config(model, weights)

    resources: dict[str, Any] = {"CPU": p.cpu_mhz, "MemoryMB": p.memory_mib}
    devices = _gpu_devices(p)
    if devices:
        resources["Devices"] = devices

    task: dict[str, Any] = {"Name": TASK_NAME, "Driver": driver, "Config": config}
    if env:
        task["Env"] = env
    if weights.artifact:
        task["Artifacts"] = [weights.artifact]
    task["Resources"] = resources
    # The engine gets time to free GPU memory cleanly before the next replica wants it.
    task["KillTimeout"] = 30 * SECOND

    service = {
        "Name": SERVICE_NAME,
        "PortLabel": PORT_LABEL,
        "Tags": [f"model={model.name}"],
        "Meta": {"model": model.name, "def_hash": model.def_hash},
        # No check_restart: a big model loads for minutes and fails this check all that time;
        # killing it mid-load would turn every slow start into a start failure.
        "Checks": [
            {
                "Name": "engine ready",
                "Type": "http",
                "Path": readiness_path(p.engine),
                "Interval": CHECK_INTERVAL,
                "Timeout": CHECK_TIMEOUT,
            }
        ],
    }

    group: dict[str, Any] = {
        "Name": GROUP_NAME,
        "Count": model.replicas_min,
        # The engine must be installed on the node in this version; a node that lacks it is
        # filtered with this constraint as the reason, which placement summaries show as is.
        "Constraints": [
            {
                "LTarget": f"${{meta.{engine_meta_key(p.engine)}}}",
                "RTarget": p.engine_version,
                "Operand": "set_contains",
            }
        ],
        # Nomad refuses scale calls above Max, so neither activation nor a stray `nomad job
        # scale` runs more replicas than the definition allows. Min stays 0 whatever the
        # definition says: parking scales a failing model to 0, and Nomad would refuse that
        # below a higher Min. Disabled, so an autoscaler leaves the group to llmgw.
        "Scaling": {"Min": 0, "Max": model.replicas_max, "Enabled": False},
        "Networks": [{"DynamicPorts": [{"Label": PORT_LABEL}], "ReservedPorts": []}],
        "Services": [service],
        "RestartPolicy": RESTART_POLICY,
        "ReschedulePolicy": RESCHEDULE_POLICY,
        # No deployments for model jobs. Nomad gives a job without an update block the default
        # strategy (max_parallel 1), so every version (and every scale call makes one) gets a
        # deployment; while it runs Nomad refuses scale calls ("job scaling blocked due to active
        # deployment"), which would hold up parking a crash-looping model, activation and idle
        # scale-down, and a load longer than healthy_deadline would fail it. llmgw judges
        # replicas itself (readiness checks, start failures), so max_parallel = 0 opts out.
        "Update": UPDATE_STRATEGY,
        "Tasks": [task],
    }

    job: dict[str, Any] = {
        "ID": model.job_id,
        "Name": model.job_id,
        "Type": "service",
    }
    if namespace:
        job["Namespace"] = namespace
    job["Datacenters"] = list(p.datacenters) if p.datacenters else ["*"]
    if p.node_pool:
        job["NodePool"] = p.node_pool
    job["Meta"] = {
        "llmgw_model": model.name,
        "llmgw_def_hash": model.def_hash,
        "llmgw_source": model.source,
        "llmgw_profile": model.profile_name,
    }
    job["TaskGroups"] = [group]
    return job


def render_hcl(model: Model, *, namespace: str | None = None) -> str:
    """The same job as `render_job`, as an HCL jobspec for `nomad job run`."""
    job = render_job(model, namespace=namespace)
    header = (
        f"# Rendered by llmgw from model '{model.name}' (definition {model.def_hash}).\n"
        "# Edit the models file and render again rather than this file.\n"
    )
    return header + job_to_hcl(job)


def job_filename(model: Model, fmt: str) -> str:
    return f"{model.job_id}.nomad.{fmt}"


def render_files(models: list[Model], fmt: str, *, namespace: str | None = None) -> dict[str, str]:
    """File name -> content for each model. JSON files carry the `{"Job": ...}` wrapper, so the
    same file works with `nomad job run -json` and as the body of `PUT /v1/jobs`."""
    files: dict[str, str] = {}
    for model in models:
        if fmt == "json":
            text = json.dumps({"Job": render_job(model, namespace=namespace)}, indent=2) + "\n"
        elif fmt == "hcl":
            text = render_hcl(model, namespace=namespace)
        else:
            raise ValueError(f"unknown format {fmt!r}: expected hcl or json")
        files[job_filename(model, fmt)] = text
    return files
