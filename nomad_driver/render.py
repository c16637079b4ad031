"""A model definition becomes one Nomad service job.

`render_job` builds the job as Nomad's API JSON (what `llmgw apply` submits) around the engine's
task (`engine_tasks.py`); `render_files.render_hcl` writes that same dict out as HCL, so the two
can never say different things. Field names are those of
Nomad's `api` package (`api/jobs.go`, `api/tasks.go`, `api/resources.go`, `api/services.go`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from nomad_driver import gpu_check
from nomad_driver.draining import SHUTDOWN_DELAY
from nomad_driver.engine_tasks import (
    PORT_LABEL,
    VLLM_SHM_BYTES,
    engine_task_config,
    gpu_devices,
    readiness_path,
)
from nomad_driver.fetch.render import add_fetch, weights_of
from nomad_driver.node_meta import ENGINES_DIR_KEY, engine_meta_key, interpolated
from nomad_driver.placement import fabric_constraint, gpu_count_constraint
from nomad_driver.spec import Model
from nomad_driver.weights import Weights

GROUP_NAME = "engine"
TASK_NAME = "engine"
SERVICE_NAME = "llmgw-engine"

SECOND = 1_000_000_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE


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


def render_job(model: Model, *, namespace: str | None = None, job_id: str | None = None) -> dict[str, Any]:
    """The Job object for Nomad's API (without the `{"Job": ...}` wrapper of a register call).

    Node pool and datacenters come from the model's profile, so `render`, `apply` and the
    watcher place a model alike. The namespace is the cluster's, not the model's: left out
    unless given, a job lands in the namespace of the call that registers it (`NOMAD_NAMESPACE`,
    which Nomad also prefers over the job's own field), never silently in `default`. `job_id`:
    the model's second job ID, for a definition rolled out beside a serving one (a single-node
    model's; watcher/rollout.py)."""
    if model.profile.nodes > 1:
        return render_replica_job(model, 0, namespace=namespace, job_id=job_id)
    p = model.profile
    weights = weights_of(model)
    driver, config = engine_task_config(model, weights)

    resources: dict[str, Any] = {"CPU": p.cpu_mhz, "MemoryMB": p.memory_mib}
    devices = gpu_devices(p)
    if devices:
        resources["Devices"] = devices

    task: dict[str, Any] = {"Name": TASK_NAME, "Driver": driver, "Config": config}
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
                "LTarget": interpolated(engine_meta_key(p.engine)),
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
        # Out of every router's rotation before the engine is signalled (nomad_driver/draining.py).
        "ShutdownDelay": SHUTDOWN_DELAY,
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
    # Weights from a remote source come through llmgw's own fetch (fetch/render.py).
    add_fetch(group, model, task)

    job: dict[str, Any] = {
        "ID": job_id or model.job_id,
        "Name": job_id or model.job_id,
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


# --- multi-node replicas ---------------------------------------------------------------------
#
# A model with `nodes: N` runs each replica as one Nomad job of its own: a leader group (count 1)
# that serves the API, and a shard group (count N-1) whose processes hold the rest of the layers.
# One job per replica, because Nomad has no way to pair the groups of one job: with a count of
# several replicas, the third leader could not say which two workers are its own. A job per
# replica is also what stops and starts as one (scaling both groups, or deregistering it).

LEADER_GROUP = GROUP_NAME  # the leader keeps the name that status and summaries know as the replica
SHARD_GROUP = "shard"
SHARD_SERVICE = "llmgw-shard"
RPC_PORT_LABEL = "rpc"
RAY_PORT_LABEL = "ray"
RPC_SERVERS_VAR = "RPC_SERVERS"
RAY_HEAD_VAR = "RAY_HEAD_ADDRESS"
RAY_HEAD_SERVICE = "llmgw-ray-head"
# Ray's head and workers, and vLLM's own processes, in the same vLLM image.
RAY_HEAD_PORT = 6379


def replica_job_id(model: Model, replica: int) -> str:
    """`llmgw-<model>` for the first replica, so the model's job is where it always was;
    `llmgw-<model>:<k>` for the others (':' is no character of a model name, so no other model's
    job can be called this)."""
    return model.job_id if replica == 0 else f"{model.job_id}:{replica}"


def replica_job_ids(model: Model) -> list[str]:
    return [replica_job_id(model, k) for k in range(model.replicas_max)]


def shard_tag(job_id: str) -> str:
    """The tag the shards of one replica carry; the leader's template looks up exactly these."""
    return f"job={job_id}"


def _shard_lookup(job_id: str) -> str:
    # consul-template's `service "TAG.NAME"`: passing instances only, so a shard that fails its
    # check leaves the list and the leader is restarted without it. A llama.cpp shard has no
    # check: ggml-rpc-server serves one client at a time and its accept queue holds two, so
    # while the leader is connected a TCP check's connections queue up unanswered and the check
    # fails within two intervals, which would restart the leader every minute. Its service is
    # there while its process runs (Nomad registers it at the start and removes it at the exit),
    # which is the set the leader needs.
    return f'service "{shard_tag(job_id)}.{SHARD_SERVICE}"'


def _rpc_servers_template(job_id: str) -> dict[str, Any]:
    """`RPC_SERVERS=host:port,...` of this replica's shards. `restart` on change: the
    leader's llama-server holds its shards' connections for life, so a new set means a new
    start (and a vanished shard kills it anyway)."""
    body = (
        f"{RPC_SERVERS_VAR}={{{{ range $i, $s := {_shard_lookup(job_id)} }}}}"
        "{{ if $i }},{{ end }}{{ $s.Address }}:{{ $s.Port }}{{ end }}\n"
    )
    return {
        "EmbeddedTmpl": body,
        "DestPath": "local/shards.env",
        "Envvars": True,
        "ChangeMode": "restart",
        "Splay": 0,
    }


def _wait_for_shards(workers: int, var: str, command: str) -> list[str]:
    """A shell that starts the leader only once the template lists all `workers` shards, and
    otherwise waits, listening on nothing, so its check fails and no half replica serves: when
    the last shard registers, the template changes and Nomad restarts it into the real start."""
    script = (
        f'n=$(printf %s "${var}" | tr , "\n" | grep -c .); '
        f'if [ "$n" -lt {workers} ]; then '
        f'echo "waiting for {workers} shard(s), $n registered and healthy" >&2; exec sleep 2147483647; fi; '
        f"exec {command}"
    )
    return ["-c", script]


def _replica_engine(model: Model, job_id: str, weights: Weights) -> tuple[dict[str, Any], dict[str, Any]]:
    """(leader task, shard task) for the model's engine."""
    p = model.profile
    engines = interpolated(ENGINES_DIR_KEY)
    workers = p.nodes - 1
    if p.engine == "llama.cpp":
        binary = f"{engines}/llama.cpp/{p.engine_version}"
        # Leader and shards alike get their GPUs at run time and refuse to start without them.
        probe = gpu_check.llama_cpp_probe(f"{binary}/llama-server")
        devices = ["--device", gpu_check.cuda_device_names(p.gpus)] if p.gpus > 0 else []
        leader_args = [
            "--model",
            weights.model_arg,
            "--host",
            "${NOMAD_IP_http}",
            "--port",
            "${NOMAD_PORT_http}",
        ]
        leader_args += [
            "--ctx-size",
            str(p.context),
            "--alias",
            model.name,
            "--rpc",
            f"${{{RPC_SERVERS_VAR}}}",
        ]
        # Every layer goes to a device, local GPUs and the shards' alike; without it llama.cpp
        # keeps the model on the leader's CPU and the shards hold nothing.
        leader_args += ["-ngl", "999", *devices, *p.args]
        command = " ".join(_shell_word(a) for a in [f"{binary}/llama-server", *leader_args])
        wait_args = _wait_for_shards(workers, RPC_SERVERS_VAR, command)
        if p.gpus > 0:
            wait_args = gpu_check.checked_script(p.gpus, probe, wait_args[1])
        leader: dict[str, Any] = {
            "Driver": "raw_exec",
            "Config": {"command": "/bin/sh", "args": wait_args},
            "Templates": [_rpc_servers_template(job_id)],
            # Without it the task has no Consul identity, and on a Consul with ACLs its lookup
            # of the shards is answered empty: the leader would wait for ever.
            "Consul": {},
        }
        shard_command = f"{binary}/ggml-rpc-server"
        shard_args = ["--host", "${NOMAD_IP_rpc}", "--port", "${NOMAD_PORT_rpc}", *devices]
        shard_config: dict[str, Any] = {"command": shard_command, "args": shard_args}
        if p.gpus > 0:
            shard_config = gpu_check.checked_command(p.gpus, probe, shard_command, shard_args)
        shard: dict[str, Any] = {"Driver": "raw_exec", "Config": shard_config}
        return leader, shard

    # vLLM over Ray: the leader starts Ray's head and then vLLM, which waits until the Ray
    # cluster holds the GPUs of all `nodes` (its placement group) before it loads; each shard
    # finds the head through Consul and joins with its node's GPUs. Pipeline parallelism across
    # the nodes, tensor parallelism within each.
    image = f"vllm/vllm-openai:{p.engine_version}"
    serve = ["vllm", "serve", weights.model_arg, "--served-model-name", model.name, "--host", "0.0.0.0"]
    serve += ["--port", "${NOMAD_PORT_http}", "--max-model-len", str(p.context)]
    serve += ["--tensor-parallel-size", str(p.gpus), "--pipeline-parallel-size", str(p.nodes)]
    serve += ["--distributed-executor-backend", "ray", *p.args]
    head = (
        f"ray start --head --node-ip-address=${{NOMAD_IP_{RAY_PORT_LABEL}}} --port=${{NOMAD_PORT_{RAY_PORT_LABEL}}}"
        " && exec " + " ".join(_shell_word(a) for a in serve)
    )
    # Host networking: Ray opens ports of its own between the nodes beyond the one Nomad gives.
    leader = {
        "Driver": "docker",
        "Config": {
            "image": image,
            "entrypoint": ["/bin/sh"],
            "args": ["-c", head],
            "network_mode": "host",
            "shm_size": VLLM_SHM_BYTES,
        },
    }
    join = (
        f'test -n "${RAY_HEAD_VAR}" || {{ echo "waiting for the Ray head in Consul" >&2; exec sleep 2147483647; }}; '
        f"exec ray start --block --address=${RAY_HEAD_VAR} --node-ip-address=${{NOMAD_IP_{RPC_PORT_LABEL}}} "
        f"--node-manager-port=${{NOMAD_PORT_{RPC_PORT_LABEL}}}"
    )
    shard = {
        "Driver": "docker",
        "Config": {
            "image": image,
            "entrypoint": ["/bin/sh"],
            "args": ["-c", join],
            "network_mode": "host",
            "shm_size": VLLM_SHM_BYTES,
        },
        "Templates": [_ray_head_lookup(job_id)],
        "Consul": {},  # the head lookup's Consul identity, as the llama.cpp leader's
    }
    return leader, shard


def _ray_head_lookup(job_id: str) -> dict[str, Any]:
    """`RAY_HEAD_ADDRESS=host:port` of this replica's head; a new head restarts the shard into it."""
    body = (
        f'{RAY_HEAD_VAR}={{{{ range service "{shard_tag(job_id)}.{RAY_HEAD_SERVICE}" }}}}'
        "{{ .Address }}:{{ .Port }}{{ end }}\n"
    )
    return {
        "EmbeddedTmpl": body,
        "DestPath": "local/head.env",
        "Envvars": True,
        "ChangeMode": "restart",
        "Splay": 0,
    }


def _shell_word(word: str) -> str:
    """One argument for /bin/sh; `${VAR}` is left for Nomad to interpolate before the shell runs."""
    if re.fullmatch(r"[A-Za-z0-9_./:=,@%+${}-]+", word):
        return word
    return "'" + word.replace("'", "'\\''") + "'"


def render_replica_job(
    model: Model,
    replica: int,
    *,
    namespace: str | None = None,
    fabric: str | None = None,
    job_id: str | None = None,
) -> dict[str, Any]:
    """Replica `replica` of a multi-node model: the leader group and the shard group, each on a
    node of its own (`distinct_hosts`), every one asking for all of its node's GPUs. The replica
    runs when the model's replica count reaches it: the first `replicas.min` are rendered at
    full count, the others at 0, ready to be scaled up. With `fabric` (the watcher's choice),
    every shard is pinned to that fabric's nodes. `job_id`: the model's second job ID, for a
    definition rolled out beside a serving one (watcher/rollout.py)."""
    p = model.profile
    job_id = job_id or replica_job_id(model, replica)
    # The single-node job is the base: same meta, placement, policies and leader service.
    one = dataclasses.replace(model, profile=p.model_copy(update={"nodes": 1}))
    job = render_job(one, namespace=namespace)
    job["ID"] = job["Name"] = job_id
    job["Meta"] = {**job["Meta"], "llmgw_nodes": str(p.nodes), "llmgw_replica": str(replica)}
    # Nomad places each allocation on its own; only this keeps two shards of one replica off one
    # node. The fabric constraint that keeps them in one fabric is the watcher's to add.
    job["Constraints"] = [{"Operand": "distinct_hosts", "RTarget": "true"}]
    if p.gpus > 0:
        # `gpus` is the node's whole count: a node with more would give the shard a part of it
        # and leave the rest to others, and the replica's nodes would not be entirely its own.
        job["Constraints"].append(gpu_count_constraint(p.gpus))
    if fabric:
        job["Constraints"].append(fabric_constraint(fabric))
    running = replica < model.replicas_min

    leader = job["TaskGroups"][0]
    leader_task, shard_task = _replica_engine(model, job_id, weights_of(model))
    template_task = leader["Tasks"][0]
    # The leader loads the weights; the fetch task stays beside it (fetch/render.py).
    fetch_tasks = leader["Tasks"][1:]
    for task, base in ((leader_task, template_task), (shard_task, template_task)):
        task["Name"] = TASK_NAME
        task["Resources"] = base["Resources"]
        task["KillTimeout"] = base["KillTimeout"]
    if "Artifacts" in template_task:
        leader_task["Artifacts"] = template_task["Artifacts"]
    if "VolumeMounts" in template_task:
        leader_task["VolumeMounts"] = template_task["VolumeMounts"]
    leader["Tasks"] = [_ordered_task(leader_task), *fetch_tasks]
    leader["Count"] = 1 if running else 0
    leader["Scaling"] = {"Min": 0, "Max": 1, "Enabled": False}
    if p.engine == "vllm":
        leader["Networks"] = [
            {"DynamicPorts": [{"Label": PORT_LABEL}, {"Label": RAY_PORT_LABEL}], "ReservedPorts": []}
        ]
        leader["Services"].append(
            {
                "Name": RAY_HEAD_SERVICE,
                "PortLabel": RAY_PORT_LABEL,
                "Tags": [shard_tag(job_id), f"model={model.name}"],
                "Meta": {"model": model.name, "def_hash": model.def_hash, "job": job_id},
                "Checks": [_tcp_check("ray head up", RAY_PORT_LABEL)],
            }
        )

    shard_group: dict[str, Any] = {
        "Name": SHARD_GROUP,
        "Count": p.nodes - 1 if running else 0,
        "Constraints": leader["Constraints"],
        "Scaling": {"Min": 0, "Max": p.nodes - 1, "Enabled": False},
        "Networks": [{"DynamicPorts": [{"Label": RPC_PORT_LABEL}], "ReservedPorts": []}],
        # The shards' own service: what the leader's template looks up, and what an operator sees
        # in Consul as the replica's other nodes.
        "Services": [
            {
                "Name": SHARD_SERVICE,
                "PortLabel": RPC_PORT_LABEL,
                "Tags": [shard_tag(job_id), f"model={model.name}"],
                "Meta": {"model": model.name, "def_hash": model.def_hash, "job": job_id},
                **(
                    {}
                    if p.engine == "llama.cpp"
                    else {"Checks": [_tcp_check("shard listening", RPC_PORT_LABEL)]}
                ),
            }
        ],
        "RestartPolicy": leader["RestartPolicy"],
        "ReschedulePolicy": leader["ReschedulePolicy"],
        # Shards opt out of deployments like the leader: parking scales both groups, and a
        # deployment on either would refuse it.
        "Update": leader["Update"],
        # Shards outlive the leader's drain: its requests in flight need them to finish.
        "ShutdownDelay": leader["ShutdownDelay"],
        "Tasks": [_ordered_task(shard_task)],
    }
    job["TaskGroups"] = [leader, shard_group]
    return job


def _tcp_check(name: str, port: str) -> dict[str, Any]:
    return {
        "Name": name,
        "Type": "tcp",
        "PortLabel": port,
        "Interval": CHECK_INTERVAL,
        "Timeout": CHECK_TIMEOUT,
    }


def _ordered_task(task: dict[str, Any]) -> dict[str, Any]:
    order = (
        "Name",
        "Driver",
        "Config",
        "Env",
        "Artifacts",
        "Templates",
        "Consul",
        "VolumeMounts",
        "Resources",
        "KillTimeout",
    )
    return {k: task[k] for k in order if k in task}
