"""A model definition becomes one Nomad service job.

`render_job` builds the job as Nomad's API JSON (what `llmgw apply` submits) around the engine's
task, which the engine's own module writes (`engines/`); `render_files.render_hcl` writes that
same dict out as HCL, so the two can never say different things. Field names are those of
Nomad's `api` package (`api/jobs.go`, `api/tasks.go`, `api/resources.go`, `api/services.go`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nomad_driver import engines
from nomad_driver.draining import SHUTDOWN_DELAY
from nomad_driver.engines.job_parts import (
    CHECK_INTERVAL,
    CHECK_TIMEOUT,
    PORT_LABEL,
    RPC_PORT_LABEL,
    SECOND,
    SHARD_SERVICE,
    shard_tag,
)
from nomad_driver.fetch.render import add_fetch, weights_of
from nomad_driver.node_meta import engine_meta_key, interpolated
from nomad_driver.placement import fabric_constraint, gpu_count_constraint
from nomad_driver.spec import Model, Profile

GROUP_NAME = "engine"
TASK_NAME = "engine"
SERVICE_NAME = "llmgw-engine"

GPU_DEVICE = "nvidia/gpu"

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
    engine = engines.get(p.engine)
    weights = weights_of(model)
    driver, config = engine.task(model, weights)

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
                "Path": engine.readiness_path,
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


def gpu_devices(p: Profile) -> list[dict[str, Any]]:
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


# --- multi-node replicas ---------------------------------------------------------------------
#
# A model with `nodes: N` runs each replica as one Nomad job of its own: a leader group (count 1)
# that serves the API, and a shard group (count N-1) whose processes hold the rest of the layers.
# One job per replica, because Nomad has no way to pair the groups of one job: with a count of
# several replicas, the third leader could not say which two workers are its own. A job per
# replica is also what stops and starts as one (scaling both groups, or deregistering it).

LEADER_GROUP = GROUP_NAME  # the leader keeps the name that status and summaries know as the replica
SHARD_GROUP = "shard"


def replica_job_id(model: Model, replica: int) -> str:
    """`llmgw-<model>` for the first replica, so the model's job is where it always was;
    `llmgw-<model>:<k>` for the others (':' is no character of a model name, so no other model's
    job can be called this)."""
    return model.job_id if replica == 0 else f"{model.job_id}:{replica}"


def replica_job_ids(model: Model) -> list[str]:
    return [replica_job_id(model, k) for k in range(model.replicas_max)]


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
    parts = engines.get(p.engine).replica_tasks(model, job_id, weights_of(model))
    leader_task, shard_task = parts.leader, parts.shard
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
    if parts.leader_ports:
        ports = [{"Label": label} for label in (PORT_LABEL, *parts.leader_ports)]
        leader["Networks"] = [{"DynamicPorts": ports, "ReservedPorts": []}]
    leader["Services"].extend(parts.leader_services)

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
                **({"Checks": list(parts.shard_checks)} if parts.shard_checks else {}),
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
