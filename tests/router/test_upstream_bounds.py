"""Every wait for an upstream connection is bounded: a replica takes at most
`Limits.max_per_replica` requests at once, a request waits at most `Timeouts.pool_wait_s` for
room on one, and then gets a 503 that says why; one busy model never holds up another."""

from __future__ import annotations

import threading
import time

import httpx

from router.config import Limits, Timeouts
from tests.router.conftest import StartRouter, StartStub, register_replica


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def test_a_full_replica_answers_503_within_the_wait_bound_and_other_models_are_served(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    slow = stub_engine("slow", delay=6)
    quick = stub_engine("quick")
    register_replica(consul_url, "alpha", slow.port, "alpha-slow")
    register_replica(consul_url, "beta", quick.port, "beta-quick")
    router = start_router(consul_url, limits=Limits(max_per_replica=2), timeouts=Timeouts(pool_wait_s=1.0))
    router.wait_ready("alpha", 1)
    router.wait_ready("beta", 1)

    answers: list[int] = []

    def occupy() -> None:
        answers.append(
            httpx.post(f"{router.url}/v1/chat/completions", json=chat("alpha"), timeout=30).status_code
        )

    holders = [threading.Thread(target=occupy) for _ in range(2)]
    for t in holders:
        t.start()
    # Both slots of alpha's one replica are taken once the engine has both requests.
    deadline = time.monotonic() + 10
    while slow.requests_seen() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow.requests_seen() == 2

    started = time.monotonic()
    resp = httpx.post(f"{router.url}/v1/chat/completions", json=chat("alpha"), timeout=30)
    waited = time.monotonic() - started
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "replicas_busy"
    assert "alpha" in error["message"] and "2 requests" in error["message"]
    # Retrying later may well succeed: the SDK may retry, after the advertised pause.
    assert resp.headers["x-should-retry"] == "true"
    assert resp.headers["retry-after"] == "1"
    # The bound is 1 s; the engine would have taken 6.
    assert 0.8 <= waited < 4, waited
    assert slow.requests_seen() == 2

    # Another model is not held up by alpha's full replica.
    started = time.monotonic()
    other = httpx.post(f"{router.url}/v1/chat/completions", json=chat("beta"), timeout=30)
    assert other.status_code == 200
    assert time.monotonic() - started < 2

    for t in holders:
        t.join(30)
    assert answers == [200, 200]
    router.expect_metric("llmgw_router_requests_total", 1, model="alpha", code="503")


def test_a_request_waits_for_room_and_is_served_when_a_slot_frees_within_the_bound(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    slow = stub_engine("slow", delay=1.5)
    register_replica(consul_url, "alpha", slow.port, "alpha-slow")
    router = start_router(consul_url, limits=Limits(max_per_replica=1), timeouts=Timeouts(pool_wait_s=10.0))
    router.wait_ready("alpha", 1)
    first = threading.Thread(
        target=lambda: httpx.post(f"{router.url}/v1/chat/completions", json=chat("alpha"), timeout=30)
    )
    first.start()
    deadline = time.monotonic() + 10
    while slow.requests_seen() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    resp = httpx.post(f"{router.url}/v1/chat/completions", json=chat("alpha"), timeout=30)
    first.join(30)
    assert resp.status_code == 200, resp.text
    assert slow.requests_seen() == 2
