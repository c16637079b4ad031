"""The failure rules: what counts as a start failure, and how the count survives what Nomad
forgets.

A start is one `Started` of the engine task, or one attempt that never got that far (a driver
failure, a failed download of the weights). It failed if the engine exited before its Consul
check ever passed. Starts are counted across allocations and across restarts inside one
allocation, because Nomad restarting a broken engine in place is the same failure repeated,
and that repetition (155 starts in eight hours) is what parking exists to stop.

A start is named by its allocation and the time of its `Started` event, never by its position
in the task's events: Nomad keeps only the newest ten events per task, so positions shift. It
also forgets whole allocations (garbage collection), and nothing in Nomad says which start was
ever healthy. So the count is kept as a `Ledger` in the model's state: the failures already
counted up to a named start, the failures counted after a start still loading (named one by
one, since that start's outcome is not known yet), and the baseline before which nothing
counts (the newest healthy start, the last retry, the moment the definition changed).
`count_start_failures` is a pure function of Nomad's allocations now, the starts whose check
passes now and that ledger, so any watcher, started at any moment, reaches the same count.
Start times are only ever compared with each other, all from Nomad's clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from nomad_driver import engines
from nomad_driver.fetch.errors import FAILED_PREFIX as FETCH_FAILED_PREFIX
from nomad_driver.fetch.render import FETCH_TASK
from nomad_driver.fields import as_int
from nomad_driver.redaction import redact

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
# A restart asked for: a template re-rendered with change_mode restart (a multi-node leader on
# every change of its shard set, every bring-up included) or an operator's `nomad alloc
# restart`. Nomad gives check_restart's restarts the same type; their reason says so, and those
# are failures.
_RESTART_SIGNALED = "Restart Signaled"
_FAILED_CHECK_RESTART = "healthcheck:"
# Allocations whose open start may still turn healthy or fail; in any other status it is over.
_LIVE_CLIENT = {"pending", "running"}

StartId = tuple[int, str]  # (time of its Started event in UnixNano, allocation ID)


@dataclass(frozen=True)
class Start:
    """One attempt to run the engine, in Nomad's clock (UnixNano)."""

    alloc_id: str
    task: str
    time_ns: int
    job_version: int  # the version of the job the allocation runs
    ended: bool  # over: exited, never started, or its allocation is no longer live
    failed: bool  # ended without being asked to and was never healthy
    error: str  # what Nomad's events said, e.g. "Exit Code: 1"
    ended_ns: int = 0  # when it ended, as far as Nomad's events say; 0 while it runs
    created_index: int = 0  # its allocation's CreateIndex (Nomad's Raft index)

    @property
    def ident(self) -> StartId:
        return (self.time_ns, self.alloc_id)


@dataclass(frozen=True)
class Ledger:
    """What the count keeps in the model's state, because Nomad forgets it.

    `after_ns`: starts at or before this time never count (the newest healthy start, the last
    retry, when the current definition reached Nomad). `through`: the newest start whose outcome
    is already in `counted`; starts at or before it are not counted again, and still count when
    Nomad no longer lists them. `later`: the failures after `through` that were counted while
    an earlier start was still loading, so `through` could not move past them; each still counts
    when Nomad forgets it, unless that loading start turns out healthy before it. `job_version`:
    the first job version that ran the current definition; allocations of older versions ran an
    older one and never count (-1: the definition has not reached Nomad yet, so nothing counts).
    `job_created`: the CreateIndex of the job `job_version` belongs to; allocations created
    before it belong to a job since purged, whose starts the ledger has counted already.
    `decided`: the newest starts at or before `through` whose outcome is counted, so that a
    start Nomad reports late (older than `through`, never seen) still counts; `decided_floor`:
    starts at or before it are taken as decided (those the bounded list let go of, or all up
    to `through` in a ledger stored before the list existed). `def_index`, `def_after_ns`: an allocation created at
    or before Nomad's index `def_index` (the job version that brought the current definition)
    was updated in place into it, and its starts count only after `def_after_ns`, the newest
    start Nomad showed when the watcher first saw the definition there; allocations created for
    the definition count from their first start.
    """

    after_ns: int = 0
    through: StartId | None = None
    counted: int = 0
    job_version: int = 0
    later: tuple[StartId, ...] = ()
    decided: tuple[StartId, ...] = ()
    decided_floor: StartId | None = None
    job_created: int = 0
    def_index: int = 0
    def_after_ns: int = 0


@dataclass(frozen=True)
class FailureCount:
    consecutive: int
    last_failed: Start | None  # the newest failure Nomad still lists, for its error
    ledger: Ledger  # what to store so the next count, by any watcher, starts from here
    newest_start_ns: int  # where a retry puts its baseline
    serving: bool = False  # a start of the current definition passes its check now


def starts_of(alloc: Mapping[str, Any]) -> list[Start]:
    """Every attempt in one allocation that its task events still show."""
    alloc_id = str(alloc.get("ID", ""))
    states = alloc.get("TaskStates")
    if not isinstance(states, dict):
        return []
    version = as_int(alloc.get("JobVersion"))
    created = as_int(alloc.get("CreateIndex"))
    live = alloc.get("ClientStatus") in _LIVE_CLIENT
    alloc_failed = alloc.get("ClientStatus") == "failed"
    out: list[Start] = []
    for task, state in sorted(states.items(), key=lambda kv: str(kv[0])):
        if not isinstance(state, dict):
            continue
        events = [e for e in state.get("Events") or [] if isinstance(e, dict)]
        current: dict[str, Any] | None = None  # the open attempt: time, stop asked
        for ev in events:
            kind = str(ev.get("Type", ""))
            t = as_int(ev.get("Time"))
            if kind == "Started":
                current = {"time": t, "stopping": False}
            elif current is not None and _asked_to_stop(ev):
                current["stopping"] = True
            elif kind == "Terminated" and current is not None:
                failed = not current["stopping"]
                if task == FETCH_TASK and (not failed or as_int(ev.get("ExitCode")) == 0):
                    # The fetch of the weights is a step of a start, not one: only its
                    # failure counts (and names the fetch's cause, fetch/errors.py).
                    current = None
                    continue
                out.append(
                    Start(
                        alloc_id,
                        str(task),
                        current["time"],
                        version,
                        True,
                        failed,
                        event_text(ev),
                        t,
                        created,
                    )
                )
                current = None
            elif current is None and (kind in _FAILED_BEFORE_START or _fails_before_start(ev)):
                out.append(Start(alloc_id, str(task), t, version, True, True, event_text(ev), t, created))
        if current is not None and task == FETCH_TASK:
            continue  # a fetch under way: the start it belongs to has not begun
        if current is not None:
            if live:
                out.append(Start(alloc_id, str(task), current["time"], version, False, False, "", 0, created))
            else:
                # Its allocation is over but the exit fell off the event list (or never came,
                # a lost node): a failed allocation is a failed start, anything else was stopped.
                failed = alloc_failed and not current["stopping"]
                error = redact(str(alloc.get("ClientDescription") or "allocation failed")) if failed else ""
                ended = max(as_int(alloc.get("ModifyTime")), current["time"])
                out.append(
                    Start(alloc_id, str(task), current["time"], version, True, failed, error, ended, created)
                )
    return out


def _fails_before_start(ev: Mapping[str, Any]) -> bool:
    """A kill that fails the task (here, before it ever ran): Nomad's template hook giving up on a
    template it cannot render ("Template failed: ...", client/allocrunner/taskrunner/template/
    template.go), such as a Variable the job's identity may not read. Nothing restarts it in
    place; the allocation fails and is rescheduled, so uncounted it would loop for ever."""
    return ev.get("Type") == "Killing" and bool(ev.get("FailsTask"))


def _asked_to_stop(ev: Mapping[str, Any]) -> bool:
    kind = ev.get("Type")
    if kind == _RESTART_SIGNALED:
        return not str(ev.get("RestartReason") or "").startswith(_FAILED_CHECK_RESTART)
    # A kill that fails the task (a template that cannot render any more) was asked for by nobody.
    return kind in _STOP_REQUESTED and not ev.get("FailsTask")


# Failures remembered one by one behind a start still loading, by default; the watcher passes
# twice its parking threshold. More are never needed: that many failures park the model now.
DEFAULT_REMEMBERED = 10


def count_start_failures(
    allocs: Iterable[Mapping[str, Any]],
    healthy: frozenset[StartId],
    ledger: Ledger = Ledger(),
    *,
    remember: int = DEFAULT_REMEMBERED,
) -> FailureCount:
    """Consecutive failed starts: the ledger's count, plus the failures Nomad shows after it.

    `healthy` are the starts whose check passes now. Starts are taken in order of their
    `Started` time. While one of them serves, the count is 0 and every start shown so far
    becomes the baseline: a model with a serving replica is never parked. A start
    still loading decides nothing yet: failures after it are counted, and the ledger names them
    in `later` (up to `remember` of them), because `through` moves only over starts whose
    outcome is known, so that start is still counted when it ends."""
    starts: list[Start] = []
    for alloc in allocs:
        starts.extend(starts_of(alloc))
    return count_starts(starts, healthy, ledger, remember=remember)


def count_starts(
    starts: Iterable[Start],
    healthy: frozenset[StartId],
    ledger: Ledger = Ledger(),
    *,
    remember: int = DEFAULT_REMEMBERED,
) -> FailureCount:
    """`count_start_failures` over starts already read: a multi-node replica's starts are its
    leader's, each failed too when one of its shards failed during it (`watcher.replica_starts`)."""
    starts = list(starts)
    shown = {s.ident for s in starts}
    newest = max((s.time_ns for s in starts), default=0)
    if ledger.job_version < 0:
        return FailureCount(ledger.counted, None, ledger, max([newest, *(t for t, _ in ledger.later)]))
    mine = [s for s in starts if _of_definition(s, ledger)]
    counted_behind = {s.ident for s in mine}
    # Failures counted behind a loading start that Nomad no longer lists (or lists under a job
    # since purged) still count; with no events left, their error is unknown, and the newest
    # error Nomad still shows is kept.
    remembered = [
        Start(alloc_id, "", time_ns, ledger.job_version, True, True, "", 0, ledger.def_index + 1)
        for time_ns, alloc_id in ledger.later
        if (time_ns, alloc_id) not in counted_behind
    ]
    newest = max([newest, *(s.time_ns for s in remembered)])
    ours = sorted([*mine, *remembered], key=lambda s: (s.time_ns, s.alloc_id, s.task))
    if any(s.ident in healthy and not s.ended for s in ours):
        # A replica serves: the model is not down, so nothing counts towards parking it, and
        # every start Nomad has shown so far is moot. A slot failing beside it is a partial
        # failure, shown as such (`failing_slots`), and Nomad's own budgets bound it.
        # Those the ledger names too: Nomad may have forgotten them since.
        named_times = [ledger.through[0] if ledger.through else 0, *(t for t, _ in ledger.later)]
        baseline = max(ledger.after_ns, ours[-1].time_ns, *named_times)
        kept = Ledger(
            after_ns=baseline,
            job_version=ledger.job_version,
            job_created=ledger.job_created,
            def_index=ledger.def_index,
            def_after_ns=ledger.def_after_ns,
        )
        return FailureCount(0, None, kept, newest, serving=True)
    count = ledger.counted
    last: Start | None = None
    kept = replace(ledger, later=())
    later: list[StartId] = []
    decided = set(ledger.decided)
    floor = ledger.decided_floor
    undecided = False
    skip_through = ledger.through
    for s in (s for s in ours if s.time_ns > ledger.after_ns):
        if s.ident in healthy:
            # Healthy and over since (a view built after the fact): everything before it is
            # moot, loading or not, counted or not; what came after it is counted afresh.
            count, last, undecided, skip_through, later, decided = 0, None, False, None, [], {s.ident}
            kept = replace(kept, after_ns=s.time_ns, through=s.ident, counted=0, decided_floor=None)
            continue
        # Counted already, unless Nomad reported it only now: a start behind `through` that the
        # ledger does not name as decided.
        if (
            skip_through is not None
            and s.ident <= skip_through
            and (s.ident in decided or (floor is not None and s.ident <= floor))
        ):
            continue
        if not s.ended:
            undecided = True
        elif s.failed:
            count += 1
            if s.ident in shown:
                last = s
            if not undecided:
                kept = replace(kept, through=_newer(kept.through, s.ident), counted=count)
                decided.add(s.ident)
            elif len(later) < remember:
                later.append(s.ident)
        elif not undecided:
            kept = replace(kept, through=_newer(kept.through, s.ident))
            decided.add(s.ident)
    through = kept.through
    named = sorted(d for d in decided if through is not None and d <= through)
    if len(named) > remember:
        # Bounded: the ones let go of, and everything before them, are taken as decided.
        kept = replace(kept, decided_floor=_newer(kept.decided_floor, named[-remember - 1]))
        named = named[-remember:]
    return FailureCount(count, last, replace(kept, later=tuple(later), decided=tuple(named)), newest)


def _of_definition(s: Start, ledger: Ledger) -> bool:
    """A start of the current definition (`Ledger`), before the baseline or after it."""
    if s.job_version < ledger.job_version:
        return False
    if 0 < s.created_index < ledger.job_created:
        # An allocation of a job since purged: its versions are not comparable with this
        # job's, and what it counted is in the ledger.
        return False
    return s.created_index > ledger.def_index or s.time_ns > ledger.def_after_ns


def _newer(a: StartId | None, b: StartId) -> StartId:
    return b if a is None or b > a else a


def event_text(ev: Mapping[str, Any]) -> str:
    """The event as Nomad's CLI shows it: its display message, else the detail that says most;
    redacted, since a download error quotes the source and this becomes the stored last error."""
    return redact(_event_text(ev))


def _event_text(ev: Mapping[str, Any]) -> str:
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


# llmgw's fetch of the weights says which of its causes failed it (fetch/errors.py): never an
# engine crash, and ahead of every engine's patterns.
_FETCH_FAILED = re.compile("^" + re.escape(FETCH_FAILED_PREFIX))
# From most to least telling, after llmgw's own GPU check and each engine's own words
# (`engines.startup_error_patterns`): an engine's stderr ends in a traceback whose last line is
# often generic ("Failed to load model from file"); the loader's own line a few lines up says why.
_ANY_ENGINE = [
    re.compile(r"out of memory|CUDA error|cudaMalloc|no CUDA-capable|OOM", re.I),
    re.compile(r"no such file|not found|permission denied", re.I),
    re.compile(r"\berror\b", re.I),
    re.compile(r"\bfatal\b|\bpanic\b|exception|failed", re.I),
]
# A clock time and a level: `2024-05-01T10:00:00Z [ERROR]`, or llama.cpp's `0.00.005.341 E `.
_LOG_PREFIX = re.compile(
    r"^(?:\S*\d{2}:\d{2}:\d{2}\S*\s+|\d+\.\d{2}\.\d{3}\.\d{3}\s+[DIWEF]\s+)?(?:\[[^\]]*\]\s*)?"
)
_MAX_ERROR_CHARS = 300


def telling_line(stderr_tail: str) -> str:
    """The line of an engine's stderr that says why it died, or '' when none does; redacted
    before it is cut short, so that no copy of the last error (KV, the Consul UI's check, the
    scaling event in Nomad) holds a credential the engine quoted, nor the start of one."""
    lines = [ln.strip() for ln in stderr_tail.splitlines() if ln.strip()]
    for pattern in [_FETCH_FAILED, *engines.startup_error_patterns(), *_ANY_ENGINE]:
        # The last matching line: the most recent attempt's words, not an earlier warning's.
        for line in reversed(lines):
            if pattern.search(line):
                text = _LOG_PREFIX.sub("", line)
                # `llama_model_load: error loading model: ...` -> drop the C function's name.
                text = re.sub(r"^[a-z][a-z0-9]*_[a-z0-9_]*:\s+", "", text)
                return redact(text)[:_MAX_ERROR_CHARS]
    return ""


def last_error(failed: Start | None, stderr_tail: str | None) -> str:
    """The engine's own words when its stderr has them, else what Nomad's events said."""
    line = telling_line(stderr_tail or "")
    if line:
        return line
    if failed is None:
        return ""
    return failed.error


def current_start(alloc: Mapping[str, Any]) -> StartId | None:
    """The attempt running now: what a passing check vouches for."""
    if alloc.get("ClientStatus") not in _LIVE_CLIENT:
        return None
    open_starts = [s for s in starts_of(alloc) if not s.ended]
    if not open_starts:
        return None
    return open_starts[-1].ident
