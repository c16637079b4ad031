"""The dev stack's own processes: each in its own session, remembered in a state file.

Every child starts with `start_new_session`, so one `killpg` reaches whatever it started in
turn (an engine's workers, a shell's children), and Ctrl-C in the terminal reaches only
`devstack up`, which then stops them in order: the services that watch first, what they
watch last, so nothing logs a storm of errors about a Consul that went away first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from devstack import lifetime

STATE_FILE = "state.json"


def find_binary(env_var: str, cached: Path, name: str, error: type[Exception], what: str, source: str) -> str:
    """The program `name`: the path in env_var, else `cached` (where `make setup` unpacks it),
    else PATH. Otherwise `error`, saying that 'make setup' fetches `what` (from `source`)."""
    from_env = os.environ.get(env_var)
    if from_env:
        if not os.access(from_env, os.X_OK):
            raise error(f"{env_var}={from_env} is not an executable file; run 'make setup' to fetch {what}")
        return from_env
    if os.access(cached, os.X_OK):
        return str(cached)
    on_path = shutil.which(name)
    if on_path:
        return on_path
    raise error(
        f"no {name} binary: {env_var} is unset, {cached} does not exist and "
        f"'{name}' is not on PATH; run 'make setup' to fetch {source} into the cache"
    )


@dataclass
class Child:
    """A process `devstack up` started: its name, PID (also its process group) and log."""

    name: str
    pid: int
    log: str


@dataclass
class StackState:
    """What `devstack down` and the tests need: PIDs to stop and the addresses to reach."""

    up_pid: int
    children: list[Child] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    ready: bool = False

    def save(self, state_dir: Path) -> None:
        # Written whole and renamed, so a reader never sees half a file.
        path = state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, state_dir: Path) -> StackState | None:
        path = state_dir / STATE_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"{path}: unreadable dev stack state ({exc}); remove it by hand") from exc
        return cls(
            up_pid=int(raw["up_pid"]),
            children=[Child(**c) for c in raw.get("children", [])],
            env=dict(raw.get("env", {})),
            info=dict(raw.get("info", {})),
            ready=bool(raw.get("ready", False)),
        )


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session with stdout and stderr appended to `log_path`.

    Its own session, so Ctrl-C reaches only `devstack up`, which stops it in order; and tied
    to our life, so a `devstack up` killed hard does not leave it running.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"--- devstack: starting {name}: {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            preexec_fn=lifetime.die_with_parent,
        )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is gone for every purpose here.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def group_members(pgid: int) -> list[int]:
    """PIDs whose process group is `pgid` (Linux /proc); empty where /proc is missing."""
    members = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap(pid: int) -> None:
    # Our own children must be waited for, or they linger as zombies until we exit.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop_group(pid: int, timeout: float = 15.0) -> bool:
    """SIGTERM the process group led by `pid`, SIGKILL what is left after `timeout`.

    Returns True when nothing of the group is left. The group is used rather than the PID so
    that a child that forked (the stand-in's engines are in groups of their own and are
    stopped by the stand-in; this catches anything else) goes with its parent.
    """
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not alive(pid) and not group_members(pid):
            return True
        time.sleep(0.1)
    _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        _reap(pid)
        if not alive(pid) and not group_members(pid):
            return True
        time.sleep(0.1)
    return False


def stop_children(state: StackState, say: Callable[[str], None]) -> None:
    """Every recorded process group, newest first; the state file lists what `up` started."""
    for child in reversed(state.children):
        if not alive(child.pid) and not group_members(child.pid):
            continue
        if not stop_group(child.pid):
            say(f"{child.name} (pid {child.pid}) did not stop, even on SIGKILL")
