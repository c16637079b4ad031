"""One dev stack for the end-to-end tests: `python -m devstack up --tiny`, exactly as a user
starts it (a tiny generated GGUF instead of Gemma, so nothing is downloaded).

It is shared by the module that asks for it, because one start on two cores costs a minute or
two (Consul, the Nomad stand-in, two watchers and a router as Nomad jobs, the engines, and
kev-0.5b's five failed starts). Whatever happens, it is stopped afterwards with
`python -m devstack down`, and its own process is killed if that did not end it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack import lifetime

REPO = Path(__file__).resolve().parents[2]
UP_TIMEOUT_S = 420.0
OUTPUT_TAIL_LINES = 60


@dataclass
class DevStack:
    process: subprocess.Popen[bytes]
    state_dir: Path
    output: Path
    env: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def router(self) -> str:
        return self.env["LLMGW_ROUTER_URL"]

    @property
    def admin(self) -> str:
        return self.env["LLMGW_ADMIN_ADDR"]

    @property
    def nomad(self) -> str:
        return self.env["NOMAD_ADDR"]

    @property
    def consul(self) -> str:
        return self.env["CONSUL_HTTP_ADDR"]

    def state(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads((self.state_dir / "state.json").read_text())
            return data
        except (OSError, ValueError):
            return {}

    def output_tail(self, lines: int = OUTPUT_TAIL_LINES) -> str:
        try:
            return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no output: {exc})"

    def llmgw(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`llmgw ARGS` from the venv, with the stack's environment, as a user runs it."""
        env = {**os.environ, **self.env, "COLUMNS": "160"}
        return subprocess.run(
            [str(Path(sys.prefix) / "bin" / "llmgw"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    def down(self) -> None:
        if self.process.poll() is None:
            subprocess.run(
                [sys.executable, "-m", "devstack", "down", "--state-dir", str(self.state_dir)],
                cwd=REPO,
                capture_output=True,
                timeout=180,
            )
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def start_devstack(state_dir: Path, *extra: str) -> DevStack:
    state_dir.mkdir(parents=True, exist_ok=True)
    output = state_dir / "up.out"
    with output.open("ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "devstack",
                "up",
                "--tiny",
                "--no-tour",
                "--state-dir",
                str(state_dir),
                *extra,
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            # A test run killed hard takes the stack with it (devstack up ties its children to
            # itself the same way).
            preexec_fn=lifetime.die_with_parent,
        )
    stack = DevStack(process, state_dir, output)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"devstack up exited with {process.returncode}:\n{stack.output_tail()}")
        state = stack.state()
        if state.get("ready"):
            stack.env = dict(state["env"])
            stack.info = dict(state["info"])
            return stack
        time.sleep(0.5)
    stack.down()
    raise AssertionError(f"devstack up not ready within {UP_TIMEOUT_S:.0f}s:\n{stack.output_tail()}")


@pytest.fixture(scope="module")
def devstack_tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    stack = start_devstack(tmp_path_factory.mktemp("devstack"))
    try:
        yield stack
    finally:
        stack.down()


def wait_until(what: str, check: Any, timeout: float = 60.0, interval: float = 0.5) -> Any:
    """Poll `check()` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f}s; last seen: {last!r}")


def descendants(root: int) -> set[int]:
    """Every process below `root`, read from /proc: what a stack started, to check none survives."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
