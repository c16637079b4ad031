"""llmgw's own jobs, in their raw_exec variant (jobs/local/), run on the Nomad stand-in with a
real Consul: the watchers, the router and a node agent on every node come up healthy, one
watcher leads, and the node agents publish their nodes' metadata."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from devstack.ports import free_port
from devstack.services import parse_job, passing_instances, register_job
from tests.fixtures.nomad import StandIn

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "jobs" / "local"


def wait_until(what: str, check: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout:.0f}s")


def test_watchers_router_and_node_agents_come_up_healthy(
    start_standin: Callable[..., StandIn], consul_url: str
) -> None:
    standin = start_standin()
    nodes = httpx.get(f"{standin.url}/v1/nodes", timeout=10).json()
    ready = [n for n in nodes if n["Status"] == "ready" and n["SchedulingEligibility"] == "eligible"]
    common = {"venv": sys.prefix, "nomad_addr": standin.url, "consul_addr": consul_url}
    for name, variables in (
        ("llmgw-watcher", {**common}),
        # The router talks to Consul only.
        ("llmgw-router", {"venv": sys.prefix, "consul_addr": consul_url, "port": free_port()}),
        ("llmgw-node-agent", {"venv": sys.prefix, "nomad_addr": standin.url}),
    ):
        job, _ = parse_job(standin.url, LOCAL / f"{name}.nomad.hcl", variables)
        register_job(standin.url, job)

    wait_until("two watchers passing", lambda: len(passing_instances(consul_url, "llmgw-watcher")) == 2)
    wait_until("the router passing", lambda: len(passing_instances(consul_url, "llmgw-router")) == 1)
    wait_until(
        f"a node agent passing on each of the {len(ready)} ready nodes",
        lambda: len(passing_instances(consul_url, "llmgw-node-agent")) == len(ready),
    )

    leader = httpx.get(f"{consul_url}/v1/kv/llmgw/leader", timeout=10)
    assert leader.status_code == 200 and leader.json()[0].get("Session"), "no watcher holds llmgw/leader"

    def every_node_published() -> bool:
        metas = [httpx.get(f"{standin.url}/v1/node/{n['ID']}", timeout=10).json()["Meta"] for n in ready]
        # No NVML on these machines: the agents say so instead of inventing GPUs.
        return all(meta.get("llmgw_nvml") == "unavailable" for meta in metas)

    wait_until("every node agent publishing its node's metadata", every_node_published)
    router = passing_instances(consul_url, "llmgw-router")[0]
    assert httpx.get(f"{router}/healthz", timeout=10).status_code == 200
