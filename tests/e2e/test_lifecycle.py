"""Ctrl-C in the middle of `devstack up` stops what was started so far, and nothing survives."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devstack import lifetime, processes
from tests.e2e.conftest import REPO, descendants, wait_until

pytestmark = pytest.mark.slow


def test_ctrl_c_during_start_up_stops_everything_started_so_far(tmp_path: Path) -> None:
    state_file = tmp_path / "state.json"
    with (tmp_path / "up.out").open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "devstack", "up", "--tiny", "--no-tour", "--state-dir", str(tmp_path)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lifetime.die_with_parent,
        )
    try:

        def nomad_started() -> bool:
            try:
                state = json.loads(state_file.read_text())
            except (OSError, ValueError):
                return False
            return any(c["name"] == "nomad" for c in state["children"])

        wait_until("the stand-in started", nomad_started, timeout=120, interval=0.1)
        # Give the services a moment to be registered and start, so there is more to stop.
        time.sleep(3)
        started = descendants(up.pid)
        assert len(started) >= 2, f"expected Consul and Nomad under devstack up, found {sorted(started)}"
        up.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends
        assert up.wait(120) == 0, (tmp_path / "up.out").read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    output = (tmp_path / "up.out").read_text()
    assert "SIGINT: stopping everything" in output
    survivors = [pid for pid in started if processes.alive(pid)]
    assert not survivors, f"still running after Ctrl-C: {survivors}\n{output}"
    assert not state_file.exists()
