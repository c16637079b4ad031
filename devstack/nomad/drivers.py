"""The task drivers: `raw_exec` (a real local process) and `mock_driver` (no process at all).

`exec` runs as `raw_exec`: on a real client it adds a chroot, cgroups and namespaces, none of
which a single-machine stand-in can offer, so here an `exec` task sees the host as raw_exec does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal as signal_mod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from devstack.lifetime import die_with_parent
from devstack.nomad import docker
from devstack.nomad.clock import Clock
from devstack.nomad.encode import duration_ns
from devstack.nomad.taskstate import ExitResult, StartError

Json = dict[str, Any]

PROCESS_DRIVERS = ("raw_exec", "exec")
DRIVERS = (*PROCESS_DRIVERS, "mock_driver", "docker")
# A container-less docker task runs until stopped (docker.py); ten years is "until stopped".
_UNTIL_STOPPED_NS = 10 * 365 * 24 * 3600 * 10**9


class TaskHandle(Protocol):
    async def wait(self) -> ExitResult: ...

    async def kill(self, timeout_ns: int, kill_signal: str) -> None: ...

    def force_kill(self) -> None: ...


@dataclass
class StartRequest:
    """What a driver needs to start one task (`drivers.TaskConfig`, trimmed)."""

    name: str
    config: Json  # the task's driver config, already interpolated
    env: dict[str, str]
    task_dir: Path
    stdout: Path
    stderr: Path
    extra: Json = field(default_factory=dict)
    node_attributes: dict[str, str] = field(default_factory=dict)


async def sleep_unless(clock: Clock, event: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` of clock time unless `event` is set first; True if it was."""
    if event.is_set():
        return True
    if seconds <= 0:
        return False
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waiter.cancel()
    return event.is_set()


def _signal_number(name: str) -> signal_mod.Signals:
    # Nomad's default kill_signal is SIGINT ("Sent interrupt"), for raw_exec as for exec.
    if not name:
        return signal_mod.SIGINT
    upper = name.upper()
    if not upper.startswith("SIG"):
        upper = "SIG" + upper
    try:
        return signal_mod.Signals[upper]
    except KeyError:
        raise StartError(f"invalid kill_signal {name!r}") from None


# ----- raw_exec -------------------------------------------------------------------------------


def _lookup_bin(command: str, task_dir: Path, env: dict[str, str]) -> str:
    """raw_exec's `lookupBin`: the task's `local/` and root first, then the PATH."""
    if os.path.isabs(command):
        if os.path.isfile(command):
            return command
    else:
        for candidate in (task_dir / "local" / command, task_dir / command):
            if candidate.is_file():
                return str(candidate)
        found = shutil.which(command, path=env.get("PATH"))
        if found:
            return found
    raise StartError(
        "failed to launch command with executor: rpc error: code = Unknown desc = "
        f"file {command} not found under path {task_dir}"
    )


class ProcessHandle:
    """One raw_exec process, leader of its own process group so that killing the group leaves
    nothing behind, however many children the task forked."""

    def __init__(self, proc: asyncio.subprocess.Process, clock: Clock) -> None:
        self.proc = proc
        self.clock = clock
        self._exited = asyncio.Event()
        self._result: ExitResult | None = None
        self._waiter = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        code = await self.proc.wait()
        # The executor reports a signal death as 128+N with the signal alongside (bash style).
        if code < 0:
            self._result = ExitResult(exit_code=128 - code, signal=-code)
        else:
            self._result = ExitResult(exit_code=code)
        self._killpg(signal_mod.SIGKILL)  # orphans of the leader go with it
        self._exited.set()

    def _killpg(self, sig: signal_mod.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def wait(self) -> ExitResult:
        await self._exited.wait()
        assert self._result is not None
        return self._result

    async def kill(self, timeout_ns: int, kill_signal: str) -> None:
        if self._exited.is_set():
            return
        self._killpg(_signal_number(kill_signal))
        if not await sleep_unless(self.clock, self._exited, timeout_ns / 1e9):
            self._killpg(signal_mod.SIGKILL)
        await self._exited.wait()

    def force_kill(self) -> None:
        if not self._exited.is_set():
            self._killpg(signal_mod.SIGKILL)


async def start_raw_exec(req: StartRequest, clock: Clock) -> ProcessHandle:
    command = req.config.get("command")
    if not isinstance(command, str) or not command:
        raise StartError('failed to parse config: "command" is required')
    args = req.config.get("args") or []
    if not isinstance(args, list):
        raise StartError('failed to parse config: "args" must be a list of strings')
    binary = _lookup_bin(command, req.task_dir, req.env)
    with req.stdout.open("ab") as out, req.stderr.open("ab") as err:
        try:
            proc = await asyncio.create_subprocess_exec(
                binary,
                *[str(a) for a in args],
                cwd=str(req.task_dir),
                env=req.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            raise StartError(
                f"failed to launch command with executor: rpc error: code = Unknown desc = {exc}"
            ) from exc
    return ProcessHandle(proc, clock)


# ----- mock_driver ----------------------------------------------------------------------------


def _duration(config: Json, key: str) -> int:
    value = config.get(key)
    if value in (None, ""):
        return 0
    try:
        return duration_ns(value)
    except ValueError:
        raise StartError(f"{key} {value} not a valid duration") from None


class MockHandle:
    """A mock task: a timer, an exit result and nothing else, so thousands are cheap. Output
    repeats (`stdout_repeat`) cost a coroutine only for tasks that ask for them."""

    def __init__(self, req: StartRequest, clock: Clock, run_for_ns: int, kill_after_ns: int) -> None:
        config = req.config
        self.clock = clock
        self.kill_after_ns = kill_after_ns
        self._killed = asyncio.Event()
        self._result = ExitResult(
            exit_code=int(config.get("exit_code") or 0),
            signal=int(config.get("exit_signal") or 0),
            err=str(config.get("exit_err_msg") or ""),
        )
        self._run_for_ns = run_for_ns
        self._done = asyncio.Event()
        self._outputs: list[tuple[Path, str, int, int]] = []
        for prefix, path in (("stdout", req.stdout), ("stderr", req.stderr)):
            text = config.get(f"{prefix}_string")
            if text:
                repeat = int(config.get(f"{prefix}_repeat") or 0)
                every = _duration(config, f"{prefix}_repeat_duration")
                self._outputs.append((path, str(text), repeat, every))

    async def wait(self) -> ExitResult:
        # run_for elapsed or killed: either way the configured result (drivers/mock command.go).
        writers = [asyncio.ensure_future(self._write(*out)) for out in self._outputs]
        try:
            await sleep_unless(self.clock, self._killed, self._run_for_ns / 1e9)
        finally:
            for writer in writers:
                writer.cancel()
            self._done.set()
        return self._result

    async def _write(self, path: Path, text: str, repeat: int, every_ns: int) -> None:
        with path.open("a") as f:
            f.write(text)
            f.flush()
            for _ in range(repeat):
                if await sleep_unless(self.clock, self._killed, every_ns / 1e9):
                    return
                f.write(text)
                f.flush()

    async def kill(self, timeout_ns: int, kill_signal: str) -> None:
        if self._done.is_set():
            return
        # StopTask waits kill_after, ignoring the kill timeout, as the mock driver does.
        if await sleep_unless(self.clock, self._done, self.kill_after_ns / 1e9):
            return
        self._killed.set()

    def force_kill(self) -> None:
        self._killed.set()


async def start_mock(req: StartRequest, clock: Clock) -> MockHandle:
    config = req.config
    start_block = _duration(config, "start_block_for")
    run_for = _duration(config, "run_for")
    kill_after = _duration(config, "kill_after")
    if start_block:
        await clock.sleep(start_block / 1e9)
    start_error = config.get("start_error")
    if start_error:
        raise StartError(str(start_error), recoverable=bool(config.get("start_error_recoverable")))
    return MockHandle(req, clock, run_for, kill_after)


async def start_task(driver: str, req: StartRequest, clock: Clock) -> TaskHandle:
    if driver in PROCESS_DRIVERS:
        return await start_raw_exec(req, clock)
    if driver == "mock_driver":
        return await start_mock(req, clock)
    if driver == "docker":
        task_dir = req.task_dir
        refused = docker.start_error(req.config, req.node_attributes, str(task_dir.parent), str(task_dir))
        if refused:
            # A plain error from the plugin: not recoverable, so the task is not restarted.
            raise StartError(refused)
        return MockHandle(req, clock, _UNTIL_STOPPED_NS, 0)
    raise StartError(f'failed to start task: driver "{driver}" is not available on this client')
