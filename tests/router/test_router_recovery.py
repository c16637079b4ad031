"""The router after Consul lost its data (a restarted dev agent, a restored snapshot): it keeps
the models it knew and sees new replicas at once, not after a stale blocking read."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from devstack.consul_agent import ConsulAgent
from tests.router.conftest import StartRouter, StartStub, put_kv, register_replica, wait_until
from tests.router.test_router_api import MODELS_YAML


def test_after_consul_comes_back_empty_models_are_kept_and_new_replicas_seen_at_once(
    make_consul_agent: Callable[[], ConsulAgent], stub_engine: StartStub, start_router: StartRouter
) -> None:
    agent = make_consul_agent()
    put_kv(agent.url, "llmgw/config/models", MODELS_YAML)
    stub = stub_engine("r1")
    register_replica(agent.url, "alpha", stub.port, "alpha-1")
    router = start_router(agent.url)
    router.wait_ready("alpha", 1)
    known = set(router.app.discovery.snapshot.models)
    assert "alpha" in known

    agent.restart()  # same ports, no data: the index starts again from the bottom
    wait_until(lambda: router.app.discovery.consul_up, 30, "the router to read Consul again")
    wait_until(
        lambda: router.app.discovery.snapshot.models_error, 10, "the missing definitions to be noticed"
    )
    assert set(router.app.discovery.snapshot.models) == known
    assert "missing" in httpx.get(f"{router.url}/healthz", timeout=5).json()["models_error"]

    # State written after the restart is seen at once too (the watch did not keep waiting on
    # an index from before the restart).
    written = time.monotonic()
    put_kv(agent.url, "llmgw/state/kev-0.5b", '{"parked": true, "last_error": "unknown model architecture"}')
    wait_until(lambda: "kev-0.5b" in router.app.discovery.snapshot.states, 30, "the new state")
    assert time.monotonic() - written < 5

    registered = time.monotonic()
    register_replica(agent.url, "alpha", stub.port, "alpha-2")
    router.wait_ready("alpha", 1)
    assert time.monotonic() - registered < 10
    resp = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "alpha", "messages": [{"role": "user", "content": "back?"}]},
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
