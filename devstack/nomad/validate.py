"""What Nomad refuses in a job: the types Go's JSON decoder insists on (400 before anything
else), and `Job.Validate`'s messages in Nomad's wording (`nomad/structs`), joined the way
hashicorp/go-multierror joins them, because Nomad's error bodies carry that text verbatim.
"""

from __future__ import annotations

from typing import Any

from devstack.nomad.encode import duration_ns
from devstack.nomad.taskstate import go_duration

Json = dict[str, Any]

JOB_MIN_PRIORITY = 1
JOB_MAX_PRIORITY = 100


class JobError(ValueError):
    """A job Nomad would refuse; `code` is the HTTP status Nomad answers with."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


# ----- decoding: the types Go's encoding/json would insist on ----------------------------------

# A schema maps a field to its type: str, int, bool, DURATION, a nested schema (dict), a list of
# one element type ([T]), or ANY. Unknown keys are ignored, as encoding/json ignores them.
DURATION = "duration"
ANY = "any"
STR_MAP = {"*": str}
_CONSTRAINT = {"LTarget": str, "RTarget": str, "Operand": str}
_AFFINITY = {**_CONSTRAINT, "Weight": int}
_PORT = {"Label": str, "Value": int, "To": int, "HostNetwork": str, "IgnoreCollision": bool}
_NETWORK = {"Mode": str, "Device": str, "CIDR": str, "IP": str, "MBits": int, "Hostname": str,
            "DynamicPorts": [_PORT], "ReservedPorts": [_PORT]}  # fmt: skip
_CHECK_RESTART = {"Limit": int, "Grace": DURATION, "IgnoreWarnings": bool}
_CHECK = {"Name": str, "Type": str, "Command": str, "Args": [str], "Path": str, "Protocol": str,
          "PortLabel": str, "AddressMode": str, "Interval": DURATION, "Timeout": DURATION,
          "InitialStatus": str, "Method": str, "Header": ANY, "CheckRestart": _CHECK_RESTART,
          "TLSSkipVerify": bool, "SuccessBeforePassing": int, "FailuresBeforeCritical": int,
          "FailuresBeforeWarning": int, "Body": str, "OnUpdate": str, "TaskName": str}  # fmt: skip
_SERVICE = {"Name": str, "Tags": [str], "CanaryTags": [str], "PortLabel": str, "AddressMode": str,
            "Address": str, "Checks": [_CHECK], "CheckRestart": _CHECK_RESTART, "Meta": STR_MAP,
            "CanaryMeta": STR_MAP, "TaskName": str, "OnUpdate": str, "Provider": str,
            "EnableTagOverride": bool, "Cluster": str, "Kind": str}  # fmt: skip
_RESTART = {"Attempts": int, "Interval": DURATION, "Delay": DURATION, "Mode": str, "RenderTemplates": bool}
_RESCHEDULE = {"Attempts": int, "Interval": DURATION, "Delay": DURATION, "DelayFunction": str,
               "MaxDelay": DURATION, "Unlimited": bool}  # fmt: skip
_UPDATE = {"Stagger": DURATION, "MaxParallel": int, "HealthCheck": str, "MinHealthyTime": DURATION,
           "HealthyDeadline": DURATION, "ProgressDeadline": DURATION, "AutoRevert": bool,
           "AutoPromote": bool, "Canary": int}  # fmt: skip
_MIGRATE = {"MaxParallel": int, "HealthCheck": str, "MinHealthyTime": DURATION, "HealthyDeadline": DURATION}
_DEVICE = {"Name": str, "Count": int, "Constraints": [_CONSTRAINT], "Affinities": [_AFFINITY]}
_RESOURCES = {"CPU": int, "Cores": int, "MemoryMB": int, "MemoryMaxMB": int, "DiskMB": int, "IOPS": int,
              "Networks": [_NETWORK], "Devices": [_DEVICE]}  # fmt: skip
_TASK = {"Name": str, "Driver": str, "User": str, "Config": {"*": ANY}, "Env": STR_MAP,
         "Services": [_SERVICE], "Resources": _RESOURCES, "RestartPolicy": _RESTART, "Meta": STR_MAP,
         "KillTimeout": DURATION, "ShutdownDelay": DURATION, "Constraints": [_CONSTRAINT],
         "Affinities": [_AFFINITY], "Leader": bool, "KillSignal": str, "Artifacts": [ANY],
         "Templates": [ANY], "LogConfig": {"MaxFiles": int, "MaxFileSizeMB": int, "Disabled": bool}}  # fmt: skip
_SCALING = {"Min": int, "Max": int, "Enabled": bool, "Type": str, "Policy": {"*": ANY}}
_GROUP = {"Name": str, "Count": int, "Tasks": [_TASK], "Constraints": [_CONSTRAINT],
          "Affinities": [_AFFINITY], "RestartPolicy": _RESTART, "ReschedulePolicy": _RESCHEDULE,
          "EphemeralDisk": {"Sticky": bool, "Migrate": bool, "SizeMB": int}, "Update": _UPDATE,
          "Migrate": _MIGRATE, "Networks": [_NETWORK], "Services": [_SERVICE], "Meta": STR_MAP,
          "Scaling": _SCALING, "ShutdownDelay": DURATION}  # fmt: skip
JOB_SCHEMA = {"ID": str, "Name": str, "Region": str, "Namespace": str, "Type": str, "Priority": int,
              "AllAtOnce": bool, "Datacenters": [str], "NodePool": str, "Constraints": [_CONSTRAINT],
              "Affinities": [_AFFINITY], "TaskGroups": [_GROUP], "Update": _UPDATE, "Meta": STR_MAP,
              "Reschedule": _RESCHEDULE, "Migrate": _MIGRATE, "Stop": bool}  # fmt: skip

_GO_TYPES = {str: "string", int: "int", bool: "bool"}


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return f"number {value}" if isinstance(value, float) else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _go_type(schema: Any) -> str:
    if isinstance(schema, list):
        return "[]" + _go_type(schema[0])
    if isinstance(schema, dict):
        return "map[string]" + _go_type(schema["*"]) if "*" in schema else "struct"
    if schema == DURATION:
        return "time.Duration"
    return _GO_TYPES.get(schema, "interface {}")


def _check(value: Any, schema: Any, path: str) -> None:
    if value is None or schema == ANY:
        return
    ok = True
    if schema is str:
        ok = isinstance(value, str)
    elif schema is bool:
        ok = isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif schema == DURATION:
        ok = (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)
        if ok and isinstance(value, str):
            try:
                duration_ns(value)
            except ValueError:
                raise JobError(f"time: invalid duration {value!r} in {path}") from None
    elif isinstance(schema, list):
        ok = isinstance(value, list)
        if ok:
            for item in value:
                _check(item, schema[0], path)
    elif isinstance(schema, dict):
        ok = isinstance(value, dict)
        if ok:
            for key, item in value.items():
                sub = schema.get("*", schema.get(key))
                if sub is not None:
                    _check(item, sub, f"{path}.{key}" if "*" not in schema else path)
    if not ok:
        raise JobError(
            f"json: cannot unmarshal {_json_kind(value)} into Go struct field {path} of type {_go_type(schema)}"
        )


def check_types(job: Any) -> None:
    """Refuse what Go's JSON decoder would refuse, with its message, before any default is
    filled in (a string where Nomad has an int, an object where it has a list)."""
    _check(job, JOB_SCHEMA, "Job")


# ----- validation -----------------------------------------------------------------------------


def validate_job(job: Json) -> list[str]:
    """Nomad's `Job.Validate` messages for a canonicalised job, in Nomad's order and wording."""
    errors: list[str] = []
    if not job.get("Region"):
        errors.append("Missing job region")
    job_id = job.get("ID") or ""
    if not job_id:
        errors.append("Missing job ID")
    elif " " in job_id:
        errors.append("Job ID contains a space")
    elif "\x00" in job_id:
        errors.append("Job ID contains a null character")
    if not job.get("Name"):
        errors.append("Missing job name")
    elif "\x00" in job["Name"]:
        errors.append("Job Name contains a null character")
    if not job.get("Namespace"):
        errors.append("Job must be in a namespace")
    job_type = job.get("Type")
    if job_type not in ("service", "batch", "system", "sysbatch"):
        errors.append(f"Invalid job type: {job_type!r}")
    priority = job.get("Priority")
    if not isinstance(priority, int) or not JOB_MIN_PRIORITY <= priority <= JOB_MAX_PRIORITY:
        errors.append(f"Job priority must be between [{JOB_MIN_PRIORITY}, {JOB_MAX_PRIORITY}]")
    groups = job.get("TaskGroups") or []
    if not groups:
        errors.append("Missing job task groups")
    seen: dict[str, int] = {}
    for i, group in enumerate(groups, start=1):
        if not isinstance(group, dict):
            errors.append(f"Task group {i} is not an object")
            continue
        name = group.get("Name") or ""
        if not name:
            errors.append(f"Job task group {i} missing name")
        elif name in seen:
            errors.append(f"Job task group {i} redefines '{name}' from group {seen[name]}")
        else:
            seen[name] = i
        count = group.get("Count")
        if job_type == "system" and isinstance(count, int) and count > 1:
            errors.append(
                f"Job task group {name} has count {count}. Count cannot exceed 1 with system scheduler"
            )
        for err in _validate_group(job, group):
            errors.append(f"Task group {name} validation failed: {err}")
    return errors


def _validate_group(job: Json, group: Json) -> list[str]:
    errors: list[str] = []
    count = group.get("Count")
    if not isinstance(count, int) or isinstance(count, bool):
        errors.append("Task group count must be an integer")
    elif count < 0:
        errors.append("Task group count can't be negative")
    scaling = group.get("Scaling")
    if scaling:
        if job.get("Type") == "system":
            errors.append("Task groups with job type system do not support scaling blocks")
        smax, smin = scaling.get("Max"), scaling.get("Min")
        if smax is None or smax < 0:
            errors.append("maximum count must be specified and non-negative")
        elif smin is not None and smax < smin:
            errors.append("maximum count must not be less than minimum count")
        if smin is None or smin < 0:
            errors.append("minimum count must be specified and non-negative")
        if isinstance(count, int) and smin is not None and smax is not None and not smin <= count <= smax:
            errors.append(
                "task group count must not be less than minimum count in scaling policy"
                if count < smin
                else "task group count must not be greater than maximum count in scaling policy"
            )
    tasks = group.get("Tasks") or []
    if not tasks:
        errors.append("Missing tasks for task group")
    seen: dict[str, int] = {}
    for i, task in enumerate(tasks, start=1):
        if not isinstance(task, dict):
            errors.append(f"Task {i} is not an object")
            continue
        name = task.get("Name") or ""
        if not name:
            errors.append(f"Task {i} missing name")
        elif name in seen:
            errors.append(f"Task {i} redefines '{name}' from task {seen[name]}")
        else:
            seen[name] = i
        for err in _validate_task(task):
            errors.append(f"Task {name} validation failed: {err}")
    policy = group.get("ReschedulePolicy")
    if policy and (policy.get("Attempts") or 0) > 0 and policy.get("Unlimited"):
        errors.append(
            f"Reschedule Policy with Attempts = {policy['Attempts']}, "
            f"Interval = {go_duration(policy.get('Interval') or 0)}, and Unlimited = true is ambiguous"
        )
    if policy and policy.get("DelayFunction") not in ("constant", "exponential", "fibonacci"):
        errors.append(
            f"Invalid delay function {policy.get('DelayFunction')!r}, "
            "must be one of [constant exponential fibonacci]"
        )
    restart = group.get("RestartPolicy") or {}
    if restart.get("Mode") not in ("fail", "delay"):
        errors.append(f"Unsupported restart mode: {restart.get('Mode')!r}")
    return errors


def _validate_task(task: Json) -> list[str]:
    errors: list[str] = []
    if not task.get("Driver"):
        errors.append("Missing task driver")
    res = task.get("Resources") or {}
    cpu, mem = res.get("CPU", 0), res.get("MemoryMB", 0)
    if isinstance(cpu, int) and cpu < 1 and not res.get("Cores"):
        errors.append(f"minimum CPU value is 1; got {cpu}")
    if isinstance(mem, int) and mem < 10:
        errors.append(f"minimum MemoryMB value is 10; got {mem}")
    for device in res.get("Devices") or []:
        if not isinstance(device, dict) or not device.get("Name"):
            errors.append(
                "device name must be given as one of the following: type, vendor/type, or vendor/type/name"
            )
    for constraint in (task.get("Constraints") or []) + _device_constraints(res):
        if isinstance(constraint, dict) and not constraint.get("Operand"):
            errors.append("Missing constraint operand")
    return errors


def _device_constraints(res: Json) -> list[Json]:
    out: list[Json] = []
    for device in res.get("Devices") or []:
        if isinstance(device, dict):
            out.extend(device.get("Constraints") or [])
    return out


def multierror_text(errors: list[str]) -> str:
    """hashicorp/go-multierror's format, which Nomad's error bodies carry verbatim."""
    head = "1 error occurred:" if len(errors) == 1 else f"{len(errors)} errors occurred:"
    return head + "\n" + "".join(f"\t* {e}\n" for e in errors) + "\n"
