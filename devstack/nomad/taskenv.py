"""A task's environment and `${...}` interpolation, as `client/taskenv/env.go` builds them.

The names matter to llmgw: the jobs it renders start engines with `--port ${NOMAD_PORT_http}`
and find their model under `${NOMAD_TASK_DIR}`, and a job that works here must work unchanged
on a real cluster.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Json = dict[str, Any]

# Nomad's default `env.denylist`: secrets of the agent that raw_exec tasks must not inherit.
HOST_ENV_DENYLIST = frozenset(
    {
        "CONSUL_TOKEN",
        "CONSUL_HTTP_TOKEN",
        "CONSUL_LICENSE",
        "NOMAD_TOKEN",
        "NOMAD_LICENSE",
        "VAULT_TOKEN",
        "VAULT_LICENSE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "GOOGLE_APPLICATION_CREDENTIALS",
    }
)

_ENV_RE = re.compile(r"\$\{([a-zA-Z0-9_\-.]+)\}")
_CLEAN_PREFIXES = ("NOMAD_ADDR_", "NOMAD_IP_", "NOMAD_PORT_", "NOMAD_HOST_PORT_", "NOMAD_META_")
_INDEX_RE = re.compile(r"\[(\d+)\]$")


def clean_env_var(name: str) -> str:
    """helper.CleanEnvVar: anything but letters, digits and '_' (or a leading digit) becomes '_'."""
    return "".join(
        c if (c.isascii() and (c.isalpha() or c == "_" or (c.isdigit() and i > 0))) else "_"
        for i, c in enumerate(name)
    )


def replace_env(text: str, *maps: dict[str, str]) -> str:
    """helper/args.ReplaceEnv: `${name}` found in one of the maps is replaced; anything else is
    left as written, as Nomad leaves it."""

    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        for mapping in maps:
            if key in mapping:
                return mapping[key]
        return m.group(0)

    return _ENV_RE.sub(sub, text)


def interpolate(value: Any, env: TaskEnv) -> Any:
    """Every string in a driver config (nested lists and maps too), as Nomad's HCL evaluation
    of `config` does with the task's variables."""
    if isinstance(value, str):
        return env.replace(value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def alloc_index(alloc_name: str) -> int:
    m = _INDEX_RE.search(alloc_name or "")
    return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class AllocPaths:
    """The alloc dir layout (`client/allocdir`): shared `alloc/{logs,data,tmp}`, and per task
    `<task>/{local,secrets,tmp}`."""

    root: Path

    @property
    def shared(self) -> Path:
        return self.root / "alloc"

    @property
    def logs(self) -> Path:
        return self.shared / "logs"

    def task_dir(self, task: str) -> Path:
        return self.root / task

    def local(self, task: str) -> Path:
        return self.task_dir(task) / "local"

    def secrets(self, task: str) -> Path:
        return self.task_dir(task) / "secrets"

    def log(self, task: str, kind: str) -> Path:
        # logmon's first file; this client never rotates, so it is the only one.
        return self.logs / f"{task}.{kind}.0"

    def build_shared(self) -> None:
        for sub in ("logs", "data", "tmp"):
            (self.shared / sub).mkdir(parents=True, exist_ok=True)

    def build_task(self, task: str) -> None:
        for sub in ("local", "secrets", "tmp"):
            (self.task_dir(task) / sub).mkdir(parents=True, exist_ok=True)


class TaskEnv:
    """`taskenv.TaskEnv`: the environment map and the node attributes it interpolates with."""

    def __init__(self, env: dict[str, str], node_attrs: dict[str, str]) -> None:
        self.env = env
        self.node_attrs = node_attrs

    def replace(self, text: str) -> str:
        return replace_env(text, self.env, self.node_attrs)


def find_group(job: Json, group_name: str) -> Json:
    for group in job.get("TaskGroups") or []:
        if group.get("Name") == group_name:
            return dict(group)
    raise KeyError(f"job {job.get('ID')!r} has no task group {group_name!r}")


def node_attributes(node: Json | None, region: str) -> dict[str, str]:
    """`setNode`: node.unique.id/name, node.class/datacenter/pool/region, attr.*, meta.*."""
    attrs = {"node.region": region}
    if not node:
        return attrs
    attrs.update(
        {
            "node.unique.id": str(node.get("ID") or ""),
            "node.unique.name": str(node.get("Name") or ""),
            "node.class": str(node.get("NodeClass") or ""),
            "node.datacenter": str(node.get("Datacenter") or ""),
            "node.pool": str(node.get("NodePool") or ""),
        }
    )
    for key, value in (node.get("Attributes") or {}).items():
        attrs[f"attr.{key}"] = str(value)
    for key, value in (node.get("Meta") or {}).items():
        attrs[f"meta.{key}"] = str(value)
    return attrs


def build_task_env(
    alloc: Json,
    node: Json | None,
    paths: AllocPaths,
    task: Json | None,
    host_env: bool = True,
) -> TaskEnv:
    """The environment of `task` in `alloc` (or of the group itself when `task` is None, which
    is what group services are interpolated with). raw_exec has no filesystem isolation, so the
    directory variables are host paths."""
    job = alloc.get("Job") or {}
    group_name = alloc.get("TaskGroup") or ""
    group = find_group(job, group_name)
    region = str(job.get("Region") or "global")
    attrs = node_attributes(node, region)
    env: dict[str, str] = {}
    task_name = (task or {}).get("Name") or ""

    env["NOMAD_ALLOC_DIR"] = str(paths.shared)
    if task_name:
        env["NOMAD_TASK_DIR"] = str(paths.local(task_name))
        env["NOMAD_SECRETS_DIR"] = str(paths.secrets(task_name))

    resources = ((alloc.get("AllocatedResources") or {}).get("Tasks") or {}).get(task_name) or {}
    task_res = (task or {}).get("Resources") or {}
    cpu = ((resources.get("Cpu") or {}).get("CpuShares")) or task_res.get("CPU")
    mem = ((resources.get("Memory") or {}).get("MemoryMB")) or task_res.get("MemoryMB")
    mem_max = ((resources.get("Memory") or {}).get("MemoryMaxMB")) or task_res.get("MemoryMaxMB")
    if mem:
        env["NOMAD_MEMORY_LIMIT"] = str(mem)
    if mem_max:
        env["NOMAD_MEMORY_MAX_LIMIT"] = str(mem_max)
    if cpu:
        env["NOMAD_CPU_LIMIT"] = str(cpu)

    alloc_id = str(alloc.get("ID") or "")
    env["NOMAD_ALLOC_ID"] = alloc_id
    env["NOMAD_SHORT_ALLOC_ID"] = alloc_id[:8]
    env["NOMAD_ALLOC_NAME"] = str(alloc.get("Name") or "")
    env["NOMAD_GROUP_NAME"] = group_name
    env["NOMAD_ALLOC_INDEX"] = str(alloc_index(str(alloc.get("Name") or "")))
    if task_name:
        env["NOMAD_TASK_NAME"] = task_name
    env["NOMAD_JOB_ID"] = str(job.get("ID") or "")
    env["NOMAD_JOB_NAME"] = str(job.get("Name") or job.get("ID") or "")
    if job.get("ParentID"):
        env["NOMAD_JOB_PARENT_ID"] = str(job["ParentID"])
    if node and node.get("Datacenter"):
        env["NOMAD_DC"] = str(node["Datacenter"])
    env["NOMAD_NAMESPACE"] = str(alloc.get("Namespace") or job.get("Namespace") or "default")
    env["NOMAD_REGION"] = region

    # Ports the scheduler assigned (addPorts): host mode, so NOMAD_PORT is the host port unless
    # the job maps it with `to`.
    shared = (alloc.get("AllocatedResources") or {}).get("Shared") or {}
    for port in shared.get("Ports") or []:
        label = str(port.get("Label") or "")
        value = str(port.get("Value") or 0)
        host_ip = str(port.get("HostIP") or "127.0.0.1")
        to = int(port.get("To") or 0)
        mapped = str(to) if to > 0 else value
        env[f"NOMAD_ADDR_{label}"] = f"{host_ip}:{value}"
        env[f"NOMAD_HOST_ADDR_{label}"] = f"{host_ip}:{value}"
        env[f"NOMAD_IP_{label}"] = host_ip
        env[f"NOMAD_HOST_IP_{label}"] = host_ip
        env[f"NOMAD_PORT_{label}"] = mapped
        env[f"NOMAD_ALLOC_PORT_{label}"] = mapped
        env[f"NOMAD_HOST_PORT_{label}"] = value

    # Meta: job, then group, then task (CombinedTaskMeta), each key as given and upper-cased.
    meta: dict[str, str] = {}
    for source in (job.get("Meta"), group.get("Meta"), (task or {}).get("Meta")):
        for key, value in (source or {}).items():
            meta[key] = str(value)
    for key, value in meta.items():
        env[f"NOMAD_META_{key.upper()}"] = replace_env(value, attrs, env)
        env[f"NOMAD_META_{key}"] = replace_env(value, attrs, env)

    if host_env:
        for key, value in os.environ.items():
            if key not in env and key not in HOST_ENV_DENYLIST:
                env[key] = value

    for key, value in ((task or {}).get("Env") or {}).items():
        env[key] = replace_env(str(value), attrs, env)

    # The nvidia device hook's variable: the instance IDs the scheduler assigned to this task.
    device_ids: list[str] = []
    for device in resources.get("Devices") or []:
        if (device.get("Vendor") or "nvidia") == "nvidia":
            device_ids.extend(str(d) for d in device.get("DeviceIDs") or [])
    if device_ids:
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(device_ids)

    cleaned = {(clean_env_var(k) if k.startswith(_CLEAN_PREFIXES) else k): v for k, v in env.items()}
    return TaskEnv(cleaned, attrs)
