"""A rendered multi-node replica's wiring on the stand-in with a real Consul, engines aside: the
shards register their own service, the leader's template lists exactly its replica's shards,
and a change in that list restarts the leader (not as a failure) with the new list."""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from nomad_driver.render import SHARD_GROUP, render_replica_job
from nomad_driver.spec import parse_models

MODELS = textwrap.dedent(
    """
    profiles:
      split:
        engine: llama.cpp
        engine_version: b6500
        gpus: 0
        cpu_mhz: 200
        memory_mib: 128
        nodes: 3
    models:
      wide:
        source: file:///nowhere/wide.gguf
        profile: split
        replicas: {min: 1, max: 1}
    """
)


def node(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "datacenter": "dc1",
        "cpu_mhz": 8000,
        "cpu_cores": 4,
        "memory_mib": 8192,
        "disk_mb": 10000,
        "attributes": {"driver.raw_exec": "1"},
        "meta": {"llmgw_engines_dir": "/nowhere", "llmgw_engine_llama_cpp": "b6500"},
        "gpus": [],
    }


def wired_job() -> dict[str, Any]:
    """The rendered replica with its programs swapped for a shell and a listener: the leader
    prints the shard list its template rendered."""
    (model,) = parse_models(MODELS).models.values()
    job = render_replica_job(model, 0)
    leader, shards = job["TaskGroups"]
    task = leader["Tasks"][0]
    task["Config"] = {
        "command": "/bin/sh",
        "args": ["-c", 'echo "shards=$RPC_SERVERS"; exec sleep 1000'],
    }
    shards["Tasks"][0]["Config"] = {
        "command": sys.executable,
        "args": ["-m", "http.server", "--bind", "127.0.0.1", "${NOMAD_PORT_rpc}"],
    }
    return job


def leader_output(url: str, job_id: str) -> tuple[str, dict[str, Any]]:
    allocs = httpx.get(f"{url}/v1/job/{job_id}/allocations", timeout=10).json()
    (leader,) = [a for a in allocs if a["TaskGroup"] == "engine" and a["ClientStatus"] == "running"]
    logs = httpx.get(
        f"{url}/v1/client/fs/logs/{leader['ID']}",
        params={"task": "engine", "type": "stdout", "plain": "true", "origin": "start"},
        timeout=10,
    )
    return logs.text, leader["TaskStates"]["engine"]


def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout:.0f}s; last: {last!r}")


@pytest.mark.timeout(180)
def test_the_leader_sees_its_shards_and_restarts_when_they_change(start_standin: Callable[..., Any]) -> None:
    standin = start_standin(nodes=[node(f"n{i}") for i in range(3)])
    job = wired_job()
    reply = httpx.post(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10)
    assert reply.status_code == 200, reply.text

    def listed(n: int) -> Callable[[], Any]:
        def check() -> Any:
            out, state = leader_output(standin.url, job["ID"])
            lines = [line for line in out.splitlines() if line.startswith("shards=")]
            if lines and len([s for s in lines[-1][len("shards=") :].split(",") if s]) == n:
                return lines, state
            return None

        return check

    # Both shards registered; the leader was restarted into the list of two.
    lines, before = wait_for("the leader to list two shards", listed(2), 90)
    shards = lines[-1][len("shards=") :].split(",")
    assert all(s.startswith("127.0.0.1:") for s in shards)
    allocs = httpx.get(f"{standin.url}/v1/job/{job['ID']}/allocations", timeout=10).json()
    assert len({a["NodeID"] for a in allocs if a["ClientStatus"] == "running"}) == 3  # distinct hosts

    # One shard goes: the leader restarts with the shorter list, and not as a failure.
    scaled = httpx.post(
        f"{standin.url}/v1/job/{job['ID']}/scale",
        json={"Count": 1, "Target": {"Group": SHARD_GROUP}},
        timeout=10,
    )
    assert scaled.status_code == 200, scaled.text
    lines, _ = wait_for("the leader to list one shard", listed(1), 90)

    # The log is the task's own file, read at once; its state reaches the server in the client's
    # next batched update (as Nomad's client sends them), so the restart shows there a moment later.
    def restart_reported() -> Any:
        _, state = leader_output(standin.url, job["ID"])
        # Each start printed one line: the state is caught up once it counts as many restarts.
        caught_up = state["Restarts"] == len(lines) - 1 and state["State"] == "running"
        return state if caught_up else None

    after = wait_for("the leader's restart in its task state", restart_reported, 30)
    signaled = [e for e in after["Events"] if e["Type"] == "Restart Signaled"]
    assert signaled and all("template" in e["DisplayMessage"] for e in signaled)
    # Template restarts do not count against the restart policy (one attempt in it): the leader
    # was restarted once more and still runs, not failed.
    assert after["Restarts"] > before["Restarts"]
    assert after["State"] == "running" and not after["Failed"]
