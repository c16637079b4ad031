"""A replica that answers 5xx (or times out) several times in a row is taken out of rotation
for a back-off that grows with each ejection, as Envoy's outlier detection does: a replica that
fails fast would otherwise always have the fewest requests outstanding and draw more traffic
than a healthy one."""

from __future__ import annotations

import time
from collections import Counter

import httpx

from tests.router.conftest import StartRouter, StartStub, register_replica


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
