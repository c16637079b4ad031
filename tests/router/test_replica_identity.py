"""A replica is its node and its ServiceID together: Consul lets two nodes each register a
service with the same ID (engines registered by hand, two clusters' agents), and a router that
keyed on the ID alone sent one model's requests to the other's engine, which answered them."""

from __future__ import annotations

import httpx

from tests.router.conftest import StartRouter, StartStub


def register_on_node(consul_url: str, node: str, model: str, port: int, service_id: str) -> None:
    """A catalog registration for an external node, with a passing check, as an engine
    registered by hand is."""
    body = {
        "Node": node,
        "Address": "127.0.0.1",
        "Service": {
            "ID": service_id,
            "Service": "llmgw-engine",
            "Address": "127.0.0.1",
            "Port": port,
            "Tags": [f"model={model}"],
            "Meta": {"model": model, "def_hash": "h0"},
        },
        "Check": {
            "Node": node,
            "CheckID": f"{service_id}-alive",
            "Name": "alive",
            "Status": "passing",
            "ServiceID": service_id,
        },
    }
    httpx.put(f"{consul_url}/v1/catalog/register", json=body, timeout=5).raise_for_status()


def test_two_replicas_with_one_service_id_on_two_nodes_each_get_their_own_models_requests(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    alpha = stub_engine("alpha-engine")
    beta = stub_engine("beta-engine")
    register_on_node(consul_url, "node-a", "alpha", alpha.port, "engine-1")
    register_on_node(consul_url, "node-b", "beta", beta.port, "engine-1")
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    router.wait_ready("beta", 1)
    for model, engine in (("alpha", "alpha-engine"), ("beta", "beta-engine")) * 3:
        resp = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == f"served by {engine}"
    assert alpha.requests_seen() == 3
    assert beta.requests_seen() == 3
