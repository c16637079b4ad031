"""`shutdown_delay`: the wait between taking a workload's services out of Consul and killing it.

Nomad's client does this in two places. For a group, `client/allocrunner/groupservice_hook.go`
(`preKillLocked`, run by the alloc runner's `killTasks` before any task is told to stop)
deregisters the group's services, then waits the group's `ShutdownDelay`, with no task event.
For a task, `client/allocrunner/taskrunner/task_runner.go` (`handleKill`) deregisters the task's
services in its pre-kill hooks, emits "Waiting for shutdown delay" (state pending), and waits the
task's `ShutdownDelay` unless the task exits first. Either wait is skipped when the allocation's
`DesiredTransition.NoShutdownDelay` is set (`nomad alloc stop -no-shutdown-delay`), which emits
"Skipping shutdown delay" for a task instead.

It is what lets a router drop a stopped replica before its engine dies: the requests already on
the engine finish while no new ones arrive.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from devstack.nomad import taskstate as ts
from devstack.nomad.clock import Clock
from devstack.nomad.drivers import sleep_unless

Json = dict[str, Any]

TASK_WAITING_SHUTDOWN_DELAY = "Waiting for shutdown delay"
TASK_SKIPPING_SHUTDOWN_DELAY = "Skipping shutdown delay"


def delay_ns(block: Json) -> int:
    """A group's or task's `ShutdownDelay`, in nanoseconds (null and absent are 0)."""
    return int(block.get("ShutdownDelay") or 0)


def ignored(alloc: Json) -> bool:
    """`DesiredTransition.ShouldIgnoreShutdownDelay()`."""
    return bool((alloc.get("DesiredTransition") or {}).get("NoShutdownDelay"))


def message(type_: str, delay: int) -> str:
    verb = "Waiting for" if type_ == TASK_WAITING_SHUTDOWN_DELAY else "Skipping"
    return f"{verb} shutdown_delay of {_go_duration(delay)} before killing the task."


async def wait(clock: Clock, delay: int, cut_short: asyncio.Event) -> None:
    """Wait `delay` ns of clock time, or until `cut_short` is set (the stand-in shutting down)."""
    if delay > 0:
        await sleep_unless(clock, cut_short, delay / 1e9)


class _Task(Protocol):
    task: Json
    clock: Clock

    def _event(self, type_: str) -> Json: ...

    def update_state(self, state: str, event: Json | None = None) -> None: ...


async def before_task_kill(runner: _Task, alloc: Json, cut_short: asyncio.Event) -> None:
    """A task's own delay, after its services were deregistered (`handleKill`)."""
    delay = delay_ns(runner.task)
    if not delay:
        return
    skip = ignored(alloc) or cut_short.is_set()
    kind = TASK_SKIPPING_SHUTDOWN_DELAY if skip else TASK_WAITING_SHUTDOWN_DELAY
    event = runner._event(kind)
    event["DisplayMessage"] = message(kind, delay)  # SetDisplayMessage
    runner.update_state(ts.PENDING, event)
    if not skip:
        await wait(runner.clock, delay, cut_short)


def _go_duration(ns: int) -> str:
    # Go's Duration.String(), to whole seconds past a minute (what a jobspec's delay is).
    seconds = ns / 1e9
    if seconds < 60:
        return f"{seconds:g}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"
