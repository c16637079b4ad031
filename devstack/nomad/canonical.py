"""The defaults Nomad fills into a job on register (`api/jobs.go`, `api/tasks.go`,
`api/services.go` `Canonicalize`), and what makes a re-register a new version.

A job read back from the stand-in must look like one read back from Nomad: a client that renders
a minimal job and compares what it gets back (as llmgw's watcher does with its definition hash in
job meta) would otherwise see differences that a real cluster never shows.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from devstack.nomad.encode import duration_ns
from devstack.nomad.validate import JobError, check_types

Json = dict[str, Any]

SECOND = 1_000_000_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE

# Fields the server sets; a re-register that differs only in these is not a new version.
SERVER_FIELDS = (
    "Status",
    "StatusDescription",
    "Stable",
    "Version",
    "SubmitTime",
    "CreateIndex",
    "ModifyIndex",
    "JobModifyIndex",
    "VersionTag",
)

_RESTART_DEFAULTS = {
    "service": {"Attempts": 2, "Interval": 30 * MINUTE, "Delay": 15 * SECOND, "Mode": "fail"},
    "batch": {"Attempts": 3, "Interval": 24 * HOUR, "Delay": 15 * SECOND, "Mode": "fail"},
}
_RESCHEDULE_DEFAULTS = {
    "service": {
        "Attempts": 0,
        "Interval": 0,
        "Delay": 30 * SECOND,
        "DelayFunction": "exponential",
        "MaxDelay": HOUR,
        "Unlimited": True,
    },
    "batch": {
        "Attempts": 1,
        "Interval": 24 * HOUR,
        "Delay": 5 * SECOND,
        "DelayFunction": "constant",
        "MaxDelay": 0,
        "Unlimited": False,
    },
}
_UPDATE_DEFAULTS = {
    "Stagger": 30 * SECOND,
    "MaxParallel": 1,
    "HealthCheck": "checks",
    "MinHealthyTime": 10 * SECOND,
    "HealthyDeadline": 5 * MINUTE,
    "ProgressDeadline": 10 * MINUTE,
    "AutoRevert": False,
    "AutoPromote": False,
    "Canary": 0,
}
# A job without an update block still carries the zero struct at job level (Go value type).
_UPDATE_ZERO = {
    "Stagger": 0,
    "MaxParallel": 0,
    "HealthCheck": "",
    "MinHealthyTime": 0,
    "HealthyDeadline": 0,
    "ProgressDeadline": 0,
    "AutoRevert": False,
    "AutoPromote": False,
    "Canary": 0,
}
_MIGRATE_DEFAULTS = {
    "MaxParallel": 1,
    "HealthCheck": "checks",
    "MinHealthyTime": 10 * SECOND,
    "HealthyDeadline": 5 * MINUTE,
}
_DURATION_KEYS = {
    "Interval",
    "Delay",
    "MaxDelay",
    "Timeout",
    "Grace",
    "Stagger",
    "MinHealthyTime",
    "HealthyDeadline",
    "ProgressDeadline",
    "KillTimeout",
    "ShutdownDelay",
    "MaxRunDuration",
}


def _merge(defaults: Json, given: Json | None) -> Json:
    out = dict(defaults)
    if given:
        out.update({k: v for k, v in given.items() if v is not None})
    return out


def _durations(obj: Json | None) -> None:
    """Duration fields to integer nanoseconds, in place."""
    if not obj:
        return
    for key in _DURATION_KEYS & obj.keys():
        if obj[key] is not None:
            try:
                obj[key] = duration_ns(obj[key])
            except ValueError as exc:
                raise JobError(f"{key}: {exc}") from exc


def canonicalize_job(raw: Json, now_ns: int) -> Json:
    """A copy of `raw` with Nomad's defaults filled in, status "pending", version 0."""
    job = copy.deepcopy(raw)
    check_types(raw)
    job_id = job.get("ID")
    job.setdefault("Name", job_id)
    if not job.get("Name"):
        job["Name"] = job_id
    for key, default in (
        ("Region", "global"),
        ("Namespace", "default"),
        ("Type", "service"),
        ("NodePool", "default"),
    ):
        if not job.get(key):
            job[key] = default
    if job.get("Priority") in (None, 0):
        job["Priority"] = 50
    if not job.get("Datacenters"):
        job["Datacenters"] = ["*"]
    job_type = job["Type"]
    job_defaults: tuple[tuple[str, Any], ...] = (
        ("AllAtOnce", False),
        ("Constraints", None),
        ("Affinities", None),
        ("Spreads", None),
        ("Multiregion", None),
        ("Periodic", None),
        ("ParameterizedJob", None),
        ("Reschedule", None),
        ("Migrate", None),
        ("Meta", None),
        ("UI", None),
        ("ParentID", ""),
        ("Dispatched", False),
        ("DispatchIdempotencyToken", ""),
        ("Payload", None),
        ("ConsulNamespace", ""),
        ("VaultNamespace", ""),
        ("NomadTokenID", ""),
        ("VersionTag", None),
    )
    for key, default in job_defaults:
        job.setdefault(key, default)
    job_update = job.get("Update")
    _durations(job_update)
    job["Update"] = _merge(_UPDATE_ZERO, job_update)
    _durations(job.get("Reschedule"))
    _durations(job.get("Migrate"))

    groups = job.get("TaskGroups") or []
    job["TaskGroups"] = groups
    for group in groups:
        if isinstance(group, dict):
            _canonicalize_group(job, group, job_update, job_type)

    job["Stop"] = bool(job.get("Stop", False))
    job["Status"] = "pending"
    job["StatusDescription"] = ""
    job["Stable"] = False
    job["Version"] = 0
    job["SubmitTime"] = now_ns
    job["JobModifyIndex"] = 0
    return job


def _canonicalize_group(job: Json, group: Json, job_update: Json | None, job_type: str) -> None:
    scaling = group.get("Scaling")
    if group.get("Count") is None:
        group["Count"] = scaling["Min"] if scaling and scaling.get("Min") is not None else 1
    if scaling:
        scaling.setdefault("ID", str(uuid.uuid4()))
        scaling["Namespace"] = job["Namespace"]
        scaling["Target"] = {"Namespace": job["Namespace"], "Job": job["ID"], "Group": group.get("Name")}
        scaling.setdefault("Type", "horizontal")
        if scaling.get("Enabled") is None:
            scaling["Enabled"] = True
        if scaling.get("Min") is None:
            scaling["Min"] = group["Count"]
        scaling.setdefault("Policy", None)
    for key in (
        "Constraints",
        "Affinities",
        "Spreads",
        "Volumes",
        "Networks",
        "Services",
        "Meta",
        "Disconnect",
        "Consul",
        "StopAfterClientDisconnect",
        "MaxClientDisconnect",
        "MaxRunDuration",
    ):
        group.setdefault(key, None)
    group.setdefault("ShutdownDelay", None)
    group.setdefault("PreventRescheduleOnLost", False)

    restart_defaults = _RESTART_DEFAULTS["batch" if job_type == "batch" else "service"]
    _durations(group.get("RestartPolicy"))
    group["RestartPolicy"] = _merge(
        {**restart_defaults, "RenderTemplates": False}, group.get("RestartPolicy")
    )

    if job_type in ("service", "batch"):
        _durations(group.get("ReschedulePolicy"))
        policy = _merge(_RESCHEDULE_DEFAULTS[job_type], job.get("Reschedule"))
        group["ReschedulePolicy"] = _merge(policy, group.get("ReschedulePolicy"))
    else:
        group["ReschedulePolicy"] = None

    group["EphemeralDisk"] = _merge(
        {"Sticky": False, "Migrate": False, "SizeMB": 300}, group.get("EphemeralDisk")
    )

    _durations(group.get("Update"))
    if job_type == "service":
        group["Update"] = _merge(_merge(_UPDATE_DEFAULTS, job_update), group.get("Update"))
        _durations(group.get("Migrate"))
        group["Migrate"] = _merge(_merge(_MIGRATE_DEFAULTS, job.get("Migrate")), group.get("Migrate"))
    else:
        group.setdefault("Update", None)
        group.setdefault("Migrate", None)

    for service in group.get("Services") or []:
        if isinstance(service, dict):
            _canonicalize_service(service, f"{job['ID']}-{group.get('Name')}")

    for task in group.get("Tasks") or []:
        if isinstance(task, dict):
            _canonicalize_task(job, group, task)


def _canonicalize_task(job: Json, group: Json, task: Json) -> None:
    for key in (
        "Config",
        "Env",
        "Services",
        "Vault",
        "Consul",
        "Templates",
        "Constraints",
        "Affinities",
        "DispatchPayload",
        "Lifecycle",
        "Meta",
        "Artifacts",
        "VolumeMounts",
        "ScalingPolicies",
        "CSIPluginConfig",
        "Identity",
        "Identities",
        "Actions",
        "Schedule",
    ):
        task.setdefault(key, None)
    for key, default in (("User", ""), ("Leader", False), ("KillSignal", ""), ("Kind", "")):
        task.setdefault(key, default)
    if isinstance(task.get("Consul"), dict):
        # api/consul.go `Consul.Canonicalize`: the cluster defaults to "default".
        task["Consul"] = {"Namespace": "", "Partition": "", **task["Consul"]}
        task["Consul"]["Cluster"] = task["Consul"].get("Cluster") or "default"
    _durations(task)
    if task.get("KillTimeout") is None:
        task["KillTimeout"] = 5 * SECOND
    if task.get("ShutdownDelay") is None:
        task["ShutdownDelay"] = 0
    res = task.get("Resources") or {}
    res = _merge(
        {
            "CPU": 100,
            "Cores": 0,
            "MemoryMB": 300,
            "MemoryMaxMB": 0,
            "DiskMB": 0,
            "IOPS": 0,
            "Networks": None,
            "Devices": None,
            "NUMA": None,
        },
        res,
    )
    for device in res.get("Devices") or []:
        if isinstance(device, dict):
            if device.get("Count") is None:
                device["Count"] = 1
            device.setdefault("Constraints", None)
            device.setdefault("Affinities", None)
    task["Resources"] = res
    task["LogConfig"] = _merge(
        {"MaxFiles": 10, "MaxFileSizeMB": 10, "Disabled": False}, task.get("LogConfig")
    )
    # A task without its own restart block follows the group's (api/tasks.go Task.Canonicalize).
    _durations(task.get("RestartPolicy"))
    task["RestartPolicy"] = _merge(group["RestartPolicy"], task.get("RestartPolicy"))
    for service in task.get("Services") or []:
        if isinstance(service, dict):
            _canonicalize_service(service, f"{job['ID']}-{group.get('Name')}-{task.get('Name')}")
            service["TaskName"] = task.get("Name")


def _canonicalize_service(service: Json, default_name: str) -> None:
    if not service.get("Name"):
        service["Name"] = default_name
    for key, default in (
        ("AddressMode", "auto"),
        ("OnUpdate", "require_healthy"),
        ("Provider", "consul"),
        ("Cluster", "default"),
    ):
        if not service.get(key):
            service[key] = default
    service_defaults: tuple[tuple[str, Any], ...] = (
        ("Tags", None),
        ("CanaryTags", None),
        ("EnableTagOverride", False),
        ("PortLabel", ""),
        ("Address", ""),
        ("TaskName", ""),
        ("Meta", None),
        ("CanaryMeta", None),
        ("TaggedAddresses", None),
        ("Connect", None),
        ("Identity", None),
        ("Weights", None),
        ("Kind", ""),
        ("CheckRestart", None),
    )
    for key, default in service_defaults:
        service.setdefault(key, default)
    _durations(service.get("CheckRestart"))
    for check in service.get("Checks") or []:
        if not isinstance(check, dict):
            continue
        _durations(check)
        if not check.get("Name"):
            check["Name"] = f'service: "{service["Name"]}" check'
        if not check.get("OnUpdate"):
            check["OnUpdate"] = service["OnUpdate"]
        check_defaults: tuple[tuple[str, Any], ...] = (
            ("Command", ""),
            ("Args", None),
            ("Path", ""),
            ("Protocol", ""),
            ("PortLabel", ""),
            ("Expose", False),
            ("AddressMode", ""),
            ("Advertise", ""),
            ("InitialStatus", ""),
            ("Notes", ""),
            ("TLSServerName", ""),
            ("TLSSkipVerify", False),
            ("Header", None),
            ("Method", ""),
            ("GRPCService", ""),
            ("GRPCUseTLS", False),
            ("TaskName", ""),
            ("SuccessBeforePassing", 0),
            ("FailuresBeforeCritical", 0),
            ("FailuresBeforeWarning", 0),
            ("Body", ""),
        )
        for key, default in check_defaults:
            check.setdefault(key, default)
        # A service-level check_restart applies to each of its checks unless a check has its own.
        restart = check.get("CheckRestart") or service.get("CheckRestart")
        if restart:
            _durations(restart)
            check["CheckRestart"] = _merge({"Limit": 0, "Grace": SECOND, "IgnoreWarnings": False}, restart)
        else:
            check["CheckRestart"] = None


def spec_changed(old: Json, new: Json) -> bool:
    """Whether a re-register is a new version (`Job.SpecChanged`): server-set fields aside."""
    return any(old.get(k) != new.get(k) for k in (old.keys() | new.keys()) if k not in _IGNORED_FOR_DIFF)


_IGNORED_FOR_DIFF = frozenset(SERVER_FIELDS)


def group_spec(group: Json) -> Json:
    """A group without its count: what decides whether an allocation must be replaced when the
    job changes, rather than updated in place. How to roll out and migrate (`update`, `migrate`)
    is not what runs, so changing it replaces nothing (`tasksUpdated` ignores it too)."""
    return {k: v for k, v in group.items() if k not in ("Count", "Scaling", "Update", "Migrate")}
