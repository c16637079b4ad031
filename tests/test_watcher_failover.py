"""Two watcher processes: SIGKILL the leader and the other takes over within the session's TTL
(Consul reaps up to twice it) plus the lock delay, without losing or rewriting state and without
duplicate entries in the Consul UI."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import consul as pyconsul
import pytest
import requests

from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, parse_state, state_key
from tests.watcher_support import CRASH_AND_IDLE_MODELS, leader_of, mock_job, wait_for, watcher_processes

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TTL_S = 10


@pytest.fixture
def watchers(consul_url: str, tmp_path: Path, start_standin: Callable[..., Any]) -> Iterator[list[Any]]:
    standin = start_standin(clock_speed=20.0)
    env = dict(os.environ, CONSUL_HTTP_ADDR=consul_url, NOMAD_ADDR=standin.url)
    env.pop("LLMGW_ADMIN_TOKEN", None)
    model = parse_models(CRASH_AND_IDLE_MODELS).models["crash"]
    job = mock_job(model, run_for="1s", exit_code=1)
    pyconsul.Consul(host="127.0.0.1", port=int(consul_url.rsplit(":", 1)[1])).kv.put(
        CONFIG_MODELS_KEY, CRASH_AND_IDLE_MODELS
    )
    requests.post(f"{standin.url}/v1/job/{job['ID']}", json={"Job": job}, timeout=10).raise_for_status()
    with watcher_processes(lambda _port: env, "127.0.0.1", tmp_path) as procs:
        yield procs


def test_killing_the_leader_hands_over_without_losing_or_rewriting_state(
    watchers: list[Any], consul: pyconsul.Consul
) -> None:
    wait_for(lambda: leader_of(watchers) is not None, 30, "a leader")
    first = leader_of(watchers)
    assert first is not None

    def parked() -> Any:
        _, entry = consul.kv.get(state_key("crash"))
        return entry if entry and parse_state("k", entry["Value"]).parked else None

    entry = wait_for(parked, 120, "crash parked")
    time.sleep(2)  # let the leader finish its pass (health entries)
    _, entry = consul.kv.get(state_key("crash"))
    index_before = entry["ModifyIndex"]

    proc, _ = watchers[first]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(5)
    killed_at = time.monotonic()
    other = 1 - first
    wait_for(lambda: leader_of(watchers) == other, 2 * TTL_S + 15, "the other watcher to lead")
    took = time.monotonic() - killed_at
    assert took <= 2 * TTL_S + 5, f"handover took {took:.1f}s"

    # The new leader agrees with what is stored: nothing rewritten, nothing lost.
    url = watchers[other][1]
    wait_for(lambda: requests.get(f"{url}/v1/admin/models/crash", timeout=2).json()["parked"], 10, "new view")
    time.sleep(3)
    _, entry = consul.kv.get(state_key("crash"))
    assert entry["ModifyIndex"] == index_before
    assert parse_state("k", entry["Value"]).parked

    # One entry per model in the Consul UI, none duplicated, the parked one critical.
    _, services = consul.health.service("llmgw-model")
    ids = sorted(s["Service"]["ID"] for s in services)
    assert ids == ["llmgw-model-crash", "llmgw-model-idle"]
    status = {s["Service"]["ID"]: s["Checks"][0]["Status"] for s in services}
    assert status == {"llmgw-model-crash": "critical", "llmgw-model-idle": "passing"}
    metrics = requests.get(f"{url}/metrics", timeout=2).text
    assert "llmgw_leader 1.0" in metrics
    assert 'llmgw_model_parked{model="crash"} 1.0' in metrics
    # And `llmgw watcher` ran those passes with what they left alive frozen out of the
    # collector's full walks (watcher/heap.py): a program's modules alone are 100,000 objects.
    health = requests.get(f"{url}/healthz", timeout=2).json()
    assert health["gc_frozen_objects"] > 10_000, health


def test_a_stopped_leader_hands_over_at_once(watchers: list[Any]) -> None:
    """A rolling update stops watchers with SIGTERM: the lock must be released on the way out,
    not left for Consul to expire."""
    wait_for(lambda: leader_of(watchers) is not None, 30, "a leader")
    first = leader_of(watchers)
    assert first is not None
    proc, _ = watchers[first]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    stopped_at = time.monotonic()
    wait_for(lambda: leader_of(watchers) == 1 - first, TTL_S, "the other watcher to lead")
    took = time.monotonic() - stopped_at
    # Well under the session TTL: the lock was released, not expired.
    assert took < TTL_S / 2, f"handover took {took:.1f}s"
