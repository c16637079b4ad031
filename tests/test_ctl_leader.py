"""`llmgw ctl retry` sent to a follower reaches the leader: two real watcher processes listening
on 0.0.0.0 as the shipped job does, a real Consul and the Nomad stand-in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import consul as pyconsul
import pytest
import requests

from devstack.ports import free_port
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, parse_state, state_key
from tests.test_watcher_failover import leader_of, wait_for
from tests.watcher_support import CRASH_AND_IDLE_MODELS

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture
def wildcard_watchers(
    consul_url: str, tmp_path: Path, start_standin: Callable[..., Any]
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    standin = start_standin(consul=False)
    kv = pyconsul.Consul(host="127.0.0.1", port=int(consul_url.rsplit(":", 1)[1])).kv
    kv.put(CONFIG_MODELS_KEY, CRASH_AND_IDLE_MODELS)
    kv.put(state_key("idle"), ModelState(parked=True, consecutive_failures=5, last_error="boom").to_kv())
    procs: list[tuple[subprocess.Popen[bytes], str]] = []
    for i in range(2):
        port = free_port()
        # What Nomad sets for a task's `admin` port: the host's address, not the 0.0.0.0 it binds.
        env = dict(
            os.environ,
            CONSUL_HTTP_ADDR=consul_url,
            NOMAD_ADDR=standin.url,
            NOMAD_ADDR_admin=f"127.0.0.1:{port}",
        )
        env.pop("LLMGW_ADMIN_TOKEN", None)
        env.pop("LLMGW_ADMIN_ADVERTISE", None)
        log = (tmp_path / f"watcher-{i}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "nomad_driver.cli", "watcher", "--listen", f"0.0.0.0:{port}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append((proc, f"http://127.0.0.1:{port}"))
    try:
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def test_ctl_retry_sent_to_a_follower_is_done_by_the_leader_and_says_which(
    wildcard_watchers: list[Any], consul: pyconsul.Consul
) -> None:
    lead = wait_for(lambda: (i := leader_of(wildcard_watchers)) is not None and (i,), 60, "a leader")[0]
    follower_url = wildcard_watchers[1 - lead][1]
    leader_url = wildcard_watchers[lead][1]
    # The follower names a leader it can be reached at, not the 0.0.0.0 it listens on.
    named = wait_for(
        lambda: requests.get(f"{follower_url}/v1/admin/models", timeout=2).json().get("leader"),
        30,
        "a named leader",
    )
    assert named["address"] == leader_url.removeprefix("http://")

    env = {k: v for k, v in os.environ.items() if k not in ("LLMGW_ADMIN_TOKEN", "LLMGW_ADMIN_ADDR")}
    result = subprocess.run(
        [sys.executable, "-m", "nomad_driver.cli", "ctl", "--addr", follower_url, "retry", "idle"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"retried by watcher {named['id']} at {leader_url}" in result.stdout
    assert f"{follower_url} does not lead" in result.stdout
    _, entry = consul.kv.get(state_key("idle"))
    state = parse_state("k", entry["Value"])
    assert not state.parked and state.consecutive_failures == 0
