"""A replica that answers 5xx (or times out) several times in a row is taken out of rotation
for a back-off that grows with each ejection, as Envoy's outlier detection does: a replica that
fails fast would otherwise always have the fewest requests outstanding and draw more traffic
than a healthy one."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import httpx
from typer.testing import CliRunner, Result

from nomad_driver.cli.app import app
from tests.router.conftest import StartRouter, StartStub, register_replica
from tests.test_ctl import AdminServer, row_of


def test_a_replica_that_only_answers_500_serves_under_a_tenth_of_the_requests(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    broken = stub_engine("broken", status=500)
    healthy = stub_engine("healthy")
    register_replica(consul_url, "alpha", broken.port, "alpha-broken", ttl=True)
    register_replica(consul_url, "alpha", healthy.port, "alpha-healthy", ttl=True)
    router = start_router(consul_url)
    router.wait_ready("alpha", 2)
    served: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    with httpx.Client(timeout=10) as client:
        for i in range(200):
            resp = client.post(
                f"{router.url}/v1/chat/completions",
                # Different prompts: no affinity, load alone decides.
                json={"model": "alpha", "messages": [{"role": "user", "content": f"question {i}"}]},
            )
            served[resp.headers["x-llmgw-replica"]] += 1
            statuses[resp.status_code] += 1
    assert served["alpha-broken"] < 20, served
    assert statuses[500] == served["alpha-broken"]
    assert broken.requests_seen() == served["alpha-broken"]
    assert router.metric("llmgw_router_ejections_total", model="alpha", reason="consecutive_5xx") >= 1
    router.expect_metric("llmgw_router_replicas", 1, model="alpha", state="ejected")
    assert any(key[1] == "alpha-broken" for key in router.app.balancer.ejected(time.monotonic()))


def ctl(admin: str, *args: str, key: str | None = None) -> Result:
    env = {"LLMGW_ADMIN_ADDR": admin, "COLUMNS": "220", "NO_COLOR": "1", "LLMGW_ROUTER_API_KEY": key}
    return CliRunner().invoke(app, ["ctl", *args], env=env)


def admin_row(model: str, alloc: str, port: int) -> dict[str, Any]:
    """A replica as the watcher's admin API lists it."""
    return {
        "model": model,
        "alloc_id": alloc * 36,
        "node": "node-1",
        "node_id": "n1",
        "address": f"127.0.0.1:{port}",
        "state": "ready",
        "ready": True,
        "since": 1_800_000_000.0,
        "fabric": "",
        "shards": [],
    }


def test_ctl_replicas_shows_which_replicas_a_router_ejected_and_for_how_long(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    broken = stub_engine("broken", status=500)
    healthy = stub_engine("healthy")
    register_replica(consul_url, "alpha", broken.port, "alpha-broken", ttl=True)
    register_replica(consul_url, "alpha", healthy.port, "alpha-healthy", ttl=True)
    router = start_router(consul_url, api_keys=("sk-router",))
    router.wait_ready("alpha", 2)
    auth = {"Authorization": "Bearer sk-router"}
    with httpx.Client(timeout=10, headers=auth) as client:
        for i in range(40):
            client.post(
                f"{router.url}/v1/chat/completions",
                json={"model": "alpha", "messages": [{"role": "user", "content": f"question {i}"}]},
            )
        # The router's own view, behind its API key like the model list.
        assert httpx.get(f"{router.url}/v1/router/replicas", timeout=5).status_code == 401
        views = {r["id"]: r for r in client.get(f"{router.url}/v1/router/replicas").json()["replicas"]}
    assert views["alpha-broken"]["ejected"] is True
    assert views["alpha-broken"]["ejection_reason"] == "consecutive_5xx"
    assert 0 < views["alpha-broken"]["ejected_for_s"] <= 30
    assert views["alpha-healthy"]["ejected"] is False

    admin = AdminServer()
    admin.replicas = [admin_row("alpha", "a", broken.port), admin_row("alpha", "b", healthy.port)]
    admin.start()
    try:
        table = ctl(admin.url, "replicas", "--router", router.url, key="sk-router")
        assert table.exit_code == 0, table.output
        assert row_of(table.stdout, "alpha")[-1].startswith("ejected")
        ejected, kept = (line for line in table.stdout.splitlines() if "│ alpha " in line)
        assert f"127.0.0.1:{broken.port}" in ejected and "(consecutive_5xx)" in ejected
        assert f"127.0.0.1:{healthy.port}" in kept and "in rotation" in kept
        data = json.loads(
            ctl(admin.url, "replicas", "--json", "--router", router.url, key="sk-router").stdout
        )
        routing = {r["address"]: r["routing"] for r in data["replicas"]}
        assert routing[f"127.0.0.1:{broken.port}"][0]["ejected"] is True
        assert routing[f"127.0.0.1:{healthy.port}"][0]["ejected"] is False
        assert data["routers"] == [{"router": router.url, "error": None}]
        # Without the key the router refuses, and ctl says so but still lists the replicas.
        refused = ctl(admin.url, "replicas", "--router", router.url)
        assert refused.exit_code == 0
        assert "refused the key" in refused.stderr
    finally:
        admin.stop()
