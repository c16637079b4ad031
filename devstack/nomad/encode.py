"""Nomad's JSON: Go field names, durations as integer nanoseconds, `time.Time` as RFC3339, and
the list stubs Nomad answers collection reads with (`nomad/structs` `*ListStub`).

Objects live in the store already in Nomad's shape, so encoding is one `json.dumps`; the stubs
here pick fields, they never rename them.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

Json = dict[str, Any]

# Go's zero time.Time, which Nomad emits for an unset `WaitUntil`.
ZERO_TIME = "0001-01-01T00:00:00Z"

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)


def dumps(obj: Any) -> bytes:
    return _encoder.encode(obj).encode()


def dumps_pretty(obj: Any) -> bytes:
    # Nomad's `?pretty` indents by four.
    return json.dumps(obj, indent=4).encode()


_UNITS_NS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "μs": 1_000,
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(text: str) -> int:
    """A Go `time.ParseDuration` string ("30s", "1h30m", "250ms") in nanoseconds."""
    s = text.strip()
    sign = 1
    if s[:1] in "+-":
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    if s == "0":
        return 0
    if not s:
        raise ValueError(f"invalid duration {text!r}")
    pos = 0
    total = 0.0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if not m:
            raise ValueError(f"invalid duration {text!r}")
        total += float(m.group(1)) * _UNITS_NS[m.group(2)]
        pos = m.end()
    return sign * int(total)


def duration_ns(value: Any) -> int:
    """A duration from a job body: Nomad's JSON carries integer nanoseconds; a Go duration
    string is accepted too, because hand-written JSON jobs often use one."""
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str):
        return parse_go_duration(value)
    raise ValueError(f"invalid duration {value!r}")


def rfc3339(ns: int) -> str:
    if ns <= 0:
        return ZERO_TIME
    dt = datetime.fromtimestamp(ns / 1e9, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ns % 1_000_000_000:09d}Z"


def parse_rfc3339_ns(text: str | None) -> int:
    """Nanoseconds since the epoch; 0 for Go's zero time or nothing."""
    if not text or text.startswith("0001-01-01"):
        return 0
    base, _, frac = text.rstrip("Z").partition(".")
    # fromisoformat, not strptime: the deployment watcher parses every tracked allocation's
    # task times five times a second, and strptime was a tenth of a busy stand-in's CPU.
    dt = datetime.fromisoformat(base).replace(tzinfo=UTC)
    frac_ns = int((frac + "000000000")[:9]) if frac else 0
    return int(dt.timestamp()) * 1_000_000_000 + frac_ns


# ----- list stubs ---------------------------------------------------------------------------

_ALLOC_STUB_FIELDS = (
    "ID",
    "EvalID",
    "Name",
    "Namespace",
    "NodeID",
    "NodeName",
    "JobID",
    "TaskGroup",
    "DesiredStatus",
    "DesiredDescription",
    "ClientStatus",
    "ClientDescription",
    "DesiredTransition",
    "TaskStates",
    "DeploymentStatus",
    "FollowupEvalID",
    "NextAllocation",
    "RescheduleTracker",
    "PreemptedAllocations",
    "PreemptedByAllocation",
    "CreateIndex",
    "ModifyIndex",
    "CreateTime",
    "ModifyTime",
)


def alloc_stub(alloc: Json, resources: bool = False) -> Json:
    """`structs.AllocListStub`: the allocation without its job, with the job's type and version."""
    stub = {k: alloc.get(k) for k in _ALLOC_STUB_FIELDS}
    job = alloc.get("Job") or {}
    stub["JobType"] = job.get("Type", "")
    stub["JobVersion"] = job.get("Version", 0)
    if resources:
        stub["AllocatedResources"] = alloc.get("AllocatedResources")
    return stub


def alloc_without_job(alloc: Json) -> Json:
    return {k: v for k, v in alloc.items() if k != "Job"}


def job_stub(job: Json, summary: Json | None, with_meta: bool = False) -> Json:
    """`structs.JobListStub`."""
    stub: Json = {
        "ID": job["ID"],
        "ParentID": job.get("ParentID", ""),
        "Name": job["Name"],
        "Namespace": job["Namespace"],
        "Datacenters": job["Datacenters"],
        "NodePool": job["NodePool"],
        "Multiregion": job.get("Multiregion"),
        "Type": job["Type"],
        "Priority": job["Priority"],
        "Periodic": job.get("Periodic") is not None,
        "ParameterizedJob": job.get("ParameterizedJob") is not None,
        "Stop": job["Stop"],
        "Status": job["Status"],
        "StatusDescription": job.get("StatusDescription", ""),
        "JobSummary": summary,
        "CreateIndex": job["CreateIndex"],
        "ModifyIndex": job["ModifyIndex"],
        "JobModifyIndex": job["JobModifyIndex"],
        "SubmitTime": job["SubmitTime"],
    }
    if with_meta:
        stub["Meta"] = job.get("Meta")
    return stub
