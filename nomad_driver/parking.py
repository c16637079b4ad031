"""The failure rules: what counts as a start failure, and what the last error really was.

A start is one `Started` of the engine task, or one attempt that never got that far (a driver
failure, a failed download of the weights). It failed if the engine exited before its Consul
check ever passed. Starts are counted across allocations and across restarts inside one
allocation, because Nomad restarting a broken engine in place is the same failure repeated,
and that repetition (155 starts in eight hours) is what parking exists to stop.

Which starts were ever healthy is not in Nomad's task events; the watcher learns it from
Consul's health of `llmgw-engine` and passes it in as `(alloc_id, start_number)` pairs, so the
rules here stay pure and clock-free: start times are only ever compared with each other, all
from Nomad's clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Attempts that fail before the engine ever runs; each is one failed start.
_FAILED_BEFORE_START = {
    "Driver Failure",
    "Setup Failure",
    "Failed Artifact Download",
    "Failed Validation",
    "Task hook failed",
}
# After one of these, the exit that follows was asked for (scale-down, stop), not a failure.
_STOP_REQUESTED = {"Killing", "Killed"}


@dataclass(frozen=True)
class Start:
    """One attempt to run the engine, in Nomad's clock (UnixNano)."""

    alloc_id: str
    task: str
    number: int  # 1-based count of attempts inside the allocation's task
    time_ns: int
    ended: bool
    failed: bool  # ended without being asked to and was never healthy
    error: str  # what Nomad's events said, e.g. "Exit Code: 1"


@dataclass(frozen=True)
class FailureCount:
    consecutive: int
    last_failed: Start | None
    newest_start_ns: int  # where a reset puts its baseline


def starts_of(alloc: Mapping[str, Any], healthy: frozenset[tuple[str, int]]) -> list[Start]:
    """Every attempt in one allocation, from its task states' events."""
    alloc_id = str(alloc.get("ID", ""))
    states = alloc.get("TaskStates")
    if not isinstance(states, dict):
        return []
    out: list[Start] = []
    for task, state in sorted(states.items(), key=lambda kv: str(kv[0])):
        if not isinstance(state, dict):
            continue
        events = [e for e in state.get("Events") or [] if isinstance(e, dict)]
        number = 0
        current: dict[str, Any] | None = None  # the open attempt: time, stop asked
        for ev in events:
            kind = str(ev.get("Type", ""))
            t = _int(ev.get("Time"))
            if kind == "Started":
                number += 1
                current = {"time": t, "stopping": False}
            elif kind in _STOP_REQUESTED and current is not None:
                current["stopping"] = True
            elif kind == "Terminated" and current is not None:
                was_healthy = (alloc_id, number) in healthy
                failed = not current["stopping"] and not was_healthy
                out.append(Start(alloc_id, str(task), number, current["time"], True, failed, event_text(ev)))
                current = None
            elif kind in _FAILED_BEFORE_START and current is None:
                number += 1
                out.append(Start(alloc_id, str(task), number, t, True, True, event_text(ev)))
        if current is not None:
            out.append(Start(alloc_id, str(task), number, current["time"], False, False, ""))
    return out


def count_start_failures(
    allocs: Iterable[Mapping[str, Any]],
    healthy: frozenset[tuple[str, int]],
    after_ns: int = 0,
) -> FailureCount:
    """Failed starts since the last healthy one, ignoring everything at or before `after_ns`
    (the baseline a retry or a new definition sets, so old failures are forgiven)."""
    starts: list[Start] = []
    for alloc in allocs:
        starts.extend(starts_of(alloc, healthy))
    starts.sort(key=lambda s: (s.time_ns, s.alloc_id, s.number))
    newest = max((s.time_ns for s in starts), default=0)
    count = 0
    last: Start | None = None
    for s in starts:
        if s.time_ns <= after_ns:
            continue
        if (s.alloc_id, s.number) in healthy:
            count, last = 0, None
        elif s.failed:
            count += 1
            last = s
    return FailureCount(count, last, newest)


def event_text(ev: Mapping[str, Any]) -> str:
    """The event as Nomad's CLI shows it: its display message, else the detail that says most."""
    raw = ev.get("Details")
    details: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    kind = str(ev.get("Type", "unknown event"))
    for key in ("driver_error", "setup_error", "download_error", "validation_error"):
        if details.get(key):
            return f"{kind}: {details[key]}"
    for key in ("DriverError", "SetupError", "DownloadError", "ValidationError"):
        if ev.get(key):
            return f"{kind}: {ev[key]}"
    if ev.get("DisplayMessage"):
        return str(ev["DisplayMessage"])
    code = details.get("exit_code", ev.get("ExitCode"))
    if code not in (None, ""):
        return f"Exit Code: {code}"
    return str(ev.get("Message") or kind)


# From most to least telling. An engine's stderr ends in a traceback whose last line is often
# generic ("Failed to load model from file"); the loader's own line a few lines up says why.
_TELLING = [
    re.compile(r"unknown model architecture", re.I),
    re.compile(r"error loading model", re.I),
    re.compile(r"out of memory|CUDA error|cudaMalloc|no CUDA-capable|OOM", re.I),
    re.compile(r"no such file|not found|permission denied", re.I),
    re.compile(r"\berror\b", re.I),
    re.compile(r"\bfatal\b|\bpanic\b|exception|failed", re.I),
]
_LOG_PREFIX = re.compile(r"^(?:\S*\d{2}:\d{2}:\d{2}\S*\s+)?(?:\[[^\]]*\]\s*)?")
_MAX_ERROR_CHARS = 300


def telling_line(stderr_tail: str) -> str:
    """The line of an engine's stderr that says why it died, or '' when none does."""
    lines = [ln.strip() for ln in stderr_tail.splitlines() if ln.strip()]
    for pattern in _TELLING:
        # The last matching line: the most recent attempt's words, not an earlier warning's.
        for line in reversed(lines):
            if pattern.search(line):
                text = _LOG_PREFIX.sub("", line)
                # `llama_model_load: error loading model: ...` -> drop the C function's name.
                text = re.sub(r"^[a-z_][a-z0-9_]*:\s+(?=error)", "", text)
                return text[:_MAX_ERROR_CHARS]
    return ""


def last_error(failed: Start | None, stderr_tail: str | None) -> str:
    """The engine's own words when its stderr has them, else what Nomad's events said."""
    line = telling_line(stderr_tail or "")
    if line:
        return line
    if failed is None:
        return ""
    return failed.error


def _int(v: Any) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


def current_start(alloc: Mapping[str, Any]) -> tuple[str, int] | None:
    """The attempt running now, as `(alloc_id, number)`: what a passing check vouches for."""
    open_starts = [s for s in starts_of(alloc, frozenset()) if not s.ended]
    if not open_starts:
        return None
    return open_starts[-1].alloc_id, open_starts[-1].number
