"""Task states, task events and the restart tracker, with Nomad's strings.

llmgw reads these to tell a model that never comes up from one that is loading: the event
`Type`s, `DisplayMessage`s and restart reasons are copied from `nomad/structs/structs.go`
(`TaskEvent`, `PopulateEventDisplayMessage`) and
`client/allocrunner/taskrunner/restarts/restarts.go`, so that what llmgw learns to read here is
what a real cluster shows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from devstack.nomad.encode import ZERO_TIME, rfc3339

Json = dict[str, Any]

# TaskState.State
PENDING = "pending"
RUNNING = "running"
DEAD = "dead"

# TaskEvent.Type (nomad/structs/structs.go)
TASK_SETUP_FAILURE = "Setup Failure"
TASK_DRIVER_FAILURE = "Driver Failure"
TASK_RECEIVED = "Received"
TASK_FAILED_VALIDATION = "Failed Validation"
TASK_STARTED = "Started"
TASK_TERMINATED = "Terminated"
TASK_KILLING = "Killing"
TASK_KILLED = "Killed"
TASK_RESTARTING = "Restarting"
TASK_NOT_RESTARTING = "Not Restarting"
TASK_RESTART_SIGNAL = "Restart Signaled"
TASK_DOWNLOADING_ARTIFACTS = "Downloading Artifacts"
TASK_ARTIFACT_DOWNLOAD_FAILED = "Failed Artifact Download"
TASK_BUILDING_TASK_DIR = "Building Task Directory"
TASK_SETUP = "Task Setup"
TASK_SIBLING_FAILED = "Sibling Task Failed"
TASK_HOOK_FAILED = "Task hook failed"

# Restart tracker reasons (restarts.go)
REASON_NO_RESTARTS_ALLOWED = "Policy allows no restarts"
REASON_UNRECOVERABLE_ERROR = "Error was unrecoverable"
REASON_WITHIN_POLICY = "Restart within policy"
REASON_DELAY = "Exceeded allowed attempts, applying a delay"
REASON_SUCCESS = "Restart unnecessary as task terminated successfully"

# The client keeps only the newest ten events per task (taskrunner defaultMaxEvents).
MAX_EVENTS = 10
# The client's max_kill_timeout default; a task's kill_timeout is capped to it.
MAX_KILL_TIMEOUT_NS = 30 * 1_000_000_000

SECOND = 1_000_000_000

# Service and system jobs restart on a clean exit too; batch jobs do not (NewRestartTracker).
_NO_RESTART_ON_SUCCESS = ("batch", "sysbatch")

DEFAULT_RESTART_POLICY = {
    "service": {"Attempts": 2, "Interval": 1800 * SECOND, "Delay": 15 * SECOND, "Mode": "fail"},
    "batch": {"Attempts": 3, "Interval": 86400 * SECOND, "Delay": 15 * SECOND, "Mode": "fail"},
}


def go_duration(ns: int) -> str:
    """Go's `time.Duration.String()`: "15s", "30m0s", "24h0m0s", "1.5s", "250ms", "0s"."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(int(ns))
    if u < SECOND:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000), ("ns", 1)):
            if u >= size:
                return sign + _fraction(u, size) + unit
    hours, rem = divmod(u, 3600 * SECOND)
    minutes, rem = divmod(rem, 60 * SECOND)
    seconds = _fraction(rem, SECOND) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds


def _fraction(value: int, size: int) -> str:
    whole, frac = divmod(value, size)
    if not frac:
        return str(whole)
    digits = len(str(size)) - 1
    return f"{whole}.{frac:0{digits}d}".rstrip("0")


# ----- events ---------------------------------------------------------------------------------


def new_event(type_: str, time_ns: int) -> Json:
    """A TaskEvent as Nomad's JSON has it, every deprecated top-level field included."""
    return {
        "Type": type_,
        "Time": time_ns,
        "Message": "",
        "DisplayMessage": "",
        "Details": {},
        "FailsTask": False,
        "RestartReason": "",
        "SetupError": "",
        "DriverError": "",
        "ExitCode": 0,
        "Signal": 0,
        "KillTimeout": 0,
        "KillError": "",
        "KillReason": "",
        "StartDelay": 0,
        "DownloadError": "",
        "ValidationError": "",
        "DiskLimit": 0,
        "FailedSibling": "",
        "VaultError": "",
        "TaskSignalReason": "",
        "TaskSignal": "",
        "DriverMessage": "",
        "GenericSource": "",
    }


def set_message(event: Json, message: str) -> Json:
    event["Message"] = message
    event["Details"]["message"] = message
    return event


def set_fails_task(event: Json) -> Json:
    event["FailsTask"] = True
    event["Details"]["fails_task"] = "true"
    return event


def set_driver_error(event: Json, error: str) -> Json:
    event["DriverError"] = error
    event["Details"]["driver_error"] = error
    return event


def set_exit(event: Json, exit_code: int, signal: int, message: str, oom_killed: bool = False) -> Json:
    event["ExitCode"] = exit_code
    event["Details"]["exit_code"] = str(exit_code)
    event["Signal"] = signal
    event["Details"]["signal"] = str(signal)
    event["Details"]["oom_killed"] = "true" if oom_killed else "false"
    if message:
        event["Message"] = message
        event["Details"]["exit_message"] = message
    return event


def set_restart(event: Json, delay_ns: int | None, reason: str) -> Json:
    if delay_ns is not None:
        event["StartDelay"] = delay_ns
        event["Details"]["start_delay"] = str(delay_ns)
    event["RestartReason"] = reason
    event["Details"]["restart_reason"] = reason
    return event


def set_kill_timeout(event: Json, timeout_ns: int) -> Json:
    actual = min(timeout_ns, MAX_KILL_TIMEOUT_NS)
    event["KillTimeout"] = actual
    event["Details"]["kill_timeout"] = go_duration(actual)
    return event


def set_download_error(event: Json, error: str) -> Json:
    event["DownloadError"] = error
    event["Details"]["download_error"] = error
    return event


def set_failed_sibling(event: Json, sibling: str) -> Json:
    event["FailedSibling"] = sibling
    event["Details"]["failed_sibling"] = sibling
    return event


def populate_display_message(event: Json) -> Json:
    """`TaskEvent.PopulateEventDisplayMessage`, for the event types this client emits."""
    if event["DisplayMessage"]:
        return event
    t = event["Type"]
    if t == TASK_SETUP:
        desc = event["Message"]
    elif t == TASK_STARTED:
        desc = "Task started by client"
    elif t == TASK_RECEIVED:
        desc = "Task received by client"
    elif t == TASK_SETUP_FAILURE:
        desc = event["SetupError"] or "Task setup failed"
    elif t == TASK_DRIVER_FAILURE:
        desc = event["DriverError"] or "Failed to start task"
    elif t == TASK_DOWNLOADING_ARTIFACTS:
        desc = "Client is downloading artifacts"
    elif t == TASK_ARTIFACT_DOWNLOAD_FAILED:
        desc = event["DownloadError"] or "Failed to download artifacts"
    elif t == TASK_KILLING:
        if event["KillReason"]:
            desc = event["KillReason"]
        elif event["KillTimeout"]:
            desc = f"Sent interrupt. Waiting {go_duration(event['KillTimeout'])} before force killing"
        else:
            desc = "Sent interrupt"
    elif t == TASK_KILLED:
        desc = event["KillError"] or "Task successfully killed"
    elif t == TASK_TERMINATED:
        parts = [f"Exit Code: {event['ExitCode']}"]
        if event["Signal"]:
            parts.append(f"Signal: {event['Signal']}")
        if event["Message"]:
            parts.append(f"Exit Message: {_go_quote(event['Message'])}")
        desc = ", ".join(parts)
    elif t == TASK_RESTARTING:
        in_ = f"Task restarting in {go_duration(event['StartDelay'])}"
        reason = event["RestartReason"]
        desc = f"{reason} - {in_}" if reason and reason != REASON_WITHIN_POLICY else in_
    elif t == TASK_NOT_RESTARTING:
        desc = event["RestartReason"] or "Task exceeded restart policy"
    elif t == TASK_SIBLING_FAILED:
        sibling = event["FailedSibling"]
        desc = f"Task's sibling {_go_quote(sibling)} failed" if sibling else "Task's sibling failed"
    elif t == TASK_RESTART_SIGNAL:
        desc = event["RestartReason"] or "Task signaled to restart"
    else:
        desc = event["Message"]
    event["DisplayMessage"] = desc
    return event


def _go_quote(text: str) -> str:
    # Go's %q for the plain text these messages carry: backslash and double quote escaped.
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


# ----- task state -----------------------------------------------------------------------------


@dataclass
class TaskState:
    """One task's `TaskState`; times are Unix nanoseconds here and RFC3339 in the JSON."""

    state: str = PENDING
    failed: bool = False
    restarts: int = 0
    last_restart_ns: int = 0
    started_at_ns: int = 0
    finished_at_ns: int = 0
    events: list[Json] = field(default_factory=list)

    def append_event(self, event: Json) -> None:
        """taskrunner `appendEvent`: a failing event fails the task, a restart is counted."""
        populate_display_message(event)
        if event["FailsTask"]:
            self.failed = True
        if event["Type"] == TASK_RESTARTING:
            self.restarts += 1
            self.last_restart_ns = event["Time"]
        self.events.append(event)
        if len(self.events) > MAX_EVENTS:
            del self.events[0]

    def set_state(self, state: str, now_ns: int) -> None:
        """taskrunner `updateStateImpl`: StartedAt on each start, FinishedAt once when dead."""
        if state == RUNNING and self.state != RUNNING:
            self.started_at_ns = now_ns
        if state == DEAD and not self.finished_at_ns:
            self.finished_at_ns = now_ns
        self.state = state

    def to_json(self) -> Json:
        return {
            "State": self.state,
            "Failed": self.failed,
            "Restarts": self.restarts,
            "LastRestart": rfc3339(self.last_restart_ns) if self.last_restart_ns else ZERO_TIME,
            "StartedAt": rfc3339(self.started_at_ns) if self.started_at_ns else ZERO_TIME,
            "FinishedAt": rfc3339(self.finished_at_ns) if self.finished_at_ns else ZERO_TIME,
            "Events": [dict(e, Details=dict(e["Details"])) for e in self.events],
            "Paused": "",
        }


def client_status(states: dict[str, TaskState]) -> tuple[str, str]:
    """alloc_runner `getClientStatus`: the alloc's ClientStatus and ClientDescription."""
    values = list(states.values())
    if any(s.state == DEAD and s.failed for s in values):
        return "failed", "Failed tasks"
    if any(s.state == RUNNING for s in values):
        return "running", "Tasks are running"
    if any(s.state == PENDING for s in values):
        return "pending", "No tasks have started"
    if values:
        return "complete", "All tasks have completed"
    return "pending", ""


# ----- restart tracker ------------------------------------------------------------------------


@dataclass
class ExitResult:
    """What a driver reports when a task ends (`plugins/drivers` `ExitResult`)."""

    exit_code: int = 0
    signal: int = 0
    err: str = ""
    oom_killed: bool = False

    def successful(self) -> bool:
        return self.exit_code == 0 and self.signal == 0 and not self.err


class StartError(Exception):
    """A task that could not be started; `recoverable` as `structs.NewRecoverableError`."""

    def __init__(self, message: str, recoverable: bool = False) -> None:
        super().__init__(message)
        self.recoverable = recoverable


@dataclass
class RestartDecision:
    state: str  # TASK_RESTARTING | TASK_NOT_RESTARTING | TASK_TERMINATED | TASK_KILLED | ""
    delay_ns: int
    reason: str


class RestartTracker:
    """restarts.go `RestartTracker`, on the stand-in's clock.

    `jitter` is Nomad's 25%; tests that compare "Task restarting in 15s" exactly set it to 0.
    """

    jitter: float = 0.25

    def __init__(
        self,
        policy: Json,
        job_type: str,
        now_ns: int,
        rng: random.Random | None = None,
        lifecycle: Json | None = None,
    ) -> None:
        self.attempts = int(policy.get("Attempts") or 0)
        self.interval_ns = int(policy.get("Interval") or 0)
        self.delay_ns = int(policy.get("Delay") or 0)
        self.mode = policy.get("Mode") or "fail"
        self.on_success = job_type not in _NO_RESTART_ON_SUCCESS
        # Prestart and poststart tasks restart on success only as sidecars; poststop never
        # (client/allocrunner/taskrunner/restarts/restarts.go NewRestartTracker).
        hook = str((lifecycle or {}).get("Hook") or "")
        if hook in ("prestart", "poststart"):
            self.on_success = bool((lifecycle or {}).get("Sidecar"))
        elif hook == "poststop":
            self.on_success = False
        self.start_ns = now_ns
        self.count = 0
        self.reason = ""
        self._rng = rng or random.Random()
        self._clear()

    def _clear(self) -> None:
        self.exit_result: ExitResult | None = None
        self.start_error: StartError | None = None
        self.killed = False
        self.restart_triggered = False
        self.failure = False

    def set_start_error(self, error: StartError) -> None:
        self.start_error = error
        self.failure = True

    def set_exit_result(self, result: ExitResult) -> None:
        self.exit_result = result
        self.failure = True

    def set_restart_triggered(self, failure: bool) -> None:
        if failure:
            self.failure = True
        else:
            self.restart_triggered = True

    def set_killed(self) -> None:
        self.killed = True

    def get_state(self, now_ns: int) -> RestartDecision:
        try:
            return self._decide(now_ns)
        finally:
            self._clear()

    def _decide(self, now_ns: int) -> RestartDecision:
        if self.killed:
            self.reason = ""
            return RestartDecision(TASK_KILLED, 0, "")
        if self.restart_triggered:
            self.reason = ""
            return RestartDecision(TASK_RESTARTING, 0, "")
        exit_ok = self.exit_result is not None and self.exit_result.successful()
        if self.attempts == 0:
            self.reason = REASON_NO_RESTARTS_ALLOWED
            if not self.on_success and exit_ok:
                return RestartDecision(TASK_TERMINATED, 0, self.reason)
            return RestartDecision(TASK_NOT_RESTARTING, 0, self.reason)
        if now_ns > self.start_ns + self.interval_ns:
            self.count = 0
            self.start_ns = now_ns
        self.count += 1
        if not self.failure:
            return RestartDecision("", 0, self.reason)
        if self.start_error is not None:
            if not self.start_error.recoverable:
                self.reason = REASON_UNRECOVERABLE_ERROR
                return RestartDecision(TASK_NOT_RESTARTING, 0, self.reason)
        elif exit_ok and not self.on_success:
            self.reason = REASON_SUCCESS
            return RestartDecision(TASK_TERMINATED, 0, self.reason)
        if self.count > self.attempts:
            if self.mode == "fail":
                self.reason = (
                    f"Exceeded allowed attempts {self.attempts} in interval "
                    f'{go_duration(self.interval_ns)} and mode is "fail"'
                )
                return RestartDecision(TASK_NOT_RESTARTING, 0, self.reason)
            self.reason = REASON_DELAY
            return RestartDecision(
                TASK_RESTARTING, max(0, self.start_ns + self.interval_ns - now_ns), self.reason
            )
        self.reason = REASON_WITHIN_POLICY
        delay = self.delay_ns or 1
        return RestartDecision(
            TASK_RESTARTING, delay + int(self._rng.randrange(delay) * self.jitter), self.reason
        )
