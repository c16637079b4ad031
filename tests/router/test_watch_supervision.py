"""A discovery watch that raises (a bug in reading an answer, not Consul failing) is logged,
shown in /healthz and the metrics while it is down, and restarted: before, its task ended
silently, the snapshot stopped moving, and /healthz still said "ok"."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.router.conftest import StartRouter, StartStub, register_replica, wait_until


def test_a_discovery_watch_that_raises_once_is_shown_down_and_recovers(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    router = start_router(consul_url)
    fleet = router.app.discovery.fleet
    original = fleet.set_instances
    raised: list[bool] = []

    def fails_once(*args: Any, **kwargs: Any) -> None:
        if not raised:
            raised.append(True)
            raise RuntimeError("injected fault while applying the catalog")
        original(*args, **kwargs)

    # Fault injection into the real router: the next catalog answer cannot be applied.
    fleet.set_instances = fails_once  # type: ignore[method-assign]
    stub = stub_engine("r1")
    register_replica(consul_url, "alpha", stub.port, "alpha-1")

    seen_down: dict[str, Any] = {}

    def health_shows_it_down() -> bool:
        body = httpx.get(f"{router.url}/healthz", timeout=5).json()
        watch = body["consul"]["watches"]["replicas"]
        if not watch["ok"] and "injected fault" in (watch["error"] or ""):
            seen_down.update(body)
            return True
        return False

    wait_until(health_shows_it_down, 10, "/healthz to show the replicas watch down")
    assert seen_down["status"] == "degraded"
    assert router.metric("llmgw_router_consul_up") == 0
    # Restarted, it reads the catalog again and this time applies it.
    router.wait_ready("alpha", 1, timeout=20)
    assert router.metric("llmgw_router_watch_restarts_total", watch="replicas") == 1
    wait_until(lambda: httpx.get(f"{router.url}/healthz", timeout=5).json()["status"] == "ok", 10, "ok")
    resp = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert resp.status_code == 200
    assert any(
        "event=watch_died" in r.getMessage() and "watch=replicas" in r.getMessage() for r in caplog.records
    )
