"""`llmgw ctl retry` sent to a follower reaches the leader: two real watcher processes listening
on 0.0.0.0 as the shipped job does, a real Consul and the Nomad stand-in."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import consul as pyconsul
import pytest
import requests

from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, parse_state, state_key
from tests.watcher_support import CRASH_AND_IDLE_MODELS, leader_of, wait_for, watcher_processes

ADMIN_TOKEN = "ctl-leader-test-token"

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture
def wildcard_watchers(
    consul_url: str, tmp_path: Path, start_standin: Callable[..., Any]
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    standin = start_standin(consul=False)
    kv = pyconsul.Consul(host="127.0.0.1", port=int(consul_url.rsplit(":", 1)[1])).kv
    kv.put(CONFIG_MODELS_KEY, CRASH_AND_IDLE_MODELS)
    kv.put(state_key("idle"), ModelState(parked=True, consecutive_failures=5, last_error="boom").to_kv())

    def env_for(port: int) -> dict[str, str]:
        # What Nomad sets for a task's `admin` port: the host's address, not the 0.0.0.0 it binds.
        env = dict(
            os.environ,
            CONSUL_HTTP_ADDR=consul_url,
            NOMAD_ADDR=standin.url,
            NOMAD_ADDR_admin=f"127.0.0.1:{port}",
        )
        # Beyond loopback the admin API wants a token for reads and writes; watchers share one,
        # as the shipped job gives them from one Nomad Variable.
        env["LLMGW_ADMIN_TOKEN"] = ADMIN_TOKEN
        env.pop("LLMGW_ADMIN_ADVERTISE", None)
        return env

    with watcher_processes(env_for, "0.0.0.0", tmp_path) as procs:
        yield procs


def test_ctl_retry_sent_to_a_follower_is_done_by_the_leader_and_says_which(
    wildcard_watchers: list[Any], consul: pyconsul.Consul
) -> None:
    lead = wait_for(lambda: (i := leader_of(wildcard_watchers)) is not None and (i,), 60, "a leader")[0]
    follower_url = wildcard_watchers[1 - lead][1]
    leader_url = wildcard_watchers[lead][1]
    # The follower names a leader it can be reached at, not the 0.0.0.0 it listens on.
    named = wait_for(
        lambda: (
            requests.get(
                f"{follower_url}/v1/admin/models",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=2,
            )
            .json()
            .get("leader")
        ),
        30,
        "a named leader",
    )
    assert named["address"] == leader_url.removeprefix("http://")

    env = {k: v for k, v in os.environ.items() if k != "LLMGW_ADMIN_ADDR"}
    env["LLMGW_ADMIN_TOKEN"] = ADMIN_TOKEN
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
