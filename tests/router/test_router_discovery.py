"""Discovery: what the router reads from Consul, and how it behaves when Consul goes away."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from devstack.consul_agent import ConsulAgent
from nomad_driver.consul import KVEntry
from router.discovery import parse_health, parse_states
from tests.router.conftest import (
    StartRouter,
    StartStub,
    fail_check,
    put_kv,
    register_replica,
    wait_until,
)
from tests.router.test_router_api import MODELS_YAML


def entry(
    service_id: str,
    *,
    model: str | None = "m",
    tags: list[str] | None = None,
    address: str = "10.0.0.5",
    statuses: tuple[str, ...] = ("passing",),
    port: int = 8000,
) -> dict[str, object]:
    return {
        "Node": {"Node": "n1", "Address": "10.0.0.1"},
        "Service": {
            "ID": service_id,
            "Service": "llmgw-engine",
            "Tags": tags if tags is not None else [],
            "Address": address,
            "Port": port,
            "Meta": {"model": model, "def_hash": "abc"} if model else {},
        },
        "Checks": [{"CheckID": f"c{i}", "Status": s} for i, s in enumerate(statuses)],
    }


def test_a_replica_is_ready_only_when_all_its_checks_pass() -> None:
    replicas = parse_health(
        [
            entry("ok", statuses=("passing", "passing")),
            entry("warn", statuses=("passing", "warning")),
            entry("crit", statuses=("critical", "passing")),
            entry("maint", statuses=("passing", "maintenance")),
        ]
    )["m"]
    status = {r.id: (r.status, r.ready) for r in replicas}
    assert status == {
        "ok": ("passing", True),
        "warn": ("warning", False),
        "crit": ("critical", False),
        "maint": ("critical", False),
    }


def test_the_model_comes_from_meta_or_the_model_tag_and_the_address_falls_back_to_the_node() -> None:
    by_model = parse_health(
        [
            entry("a", model="alpha"),
            entry("b", model=None, tags=["gpu", "model=beta"], address=""),
            entry("c", model=None, tags=["gpu"]),
            entry("d", model="alpha", port=0),
            {"garbage": True},
        ]
    )
    assert set(by_model) == {"alpha", "beta"}
    assert [r.id for r in by_model["alpha"]] == ["a"]
    beta = by_model["beta"][0]
    assert (beta.host, beta.port, beta.base_url) == ("10.0.0.1", 8000, "http://10.0.0.1:8000")


def test_a_malformed_state_value_is_ignored_and_the_others_are_read() -> None:
    def kv(key: str, value: bytes) -> KVEntry:
        return KVEntry(key, value, modify_index=1)

    states = parse_states(
        [
            kv("llmgw/state/good", json.dumps({"parked": True, "last_error": "boom"}).encode()),
            kv("llmgw/state/bad", b"{not json"),
            kv("llmgw/state/list", b"[1]"),
            kv("llmgw/state/sub/key", b"{}"),
        ]
    )
    assert set(states) == {"good"}
    assert states["good"].parked and states["good"].last_error == "boom"


def test_the_snapshot_follows_registrations_checks_and_state_in_consul(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    router = start_router(consul_url)
    stub = stub_engine("r1")
    check = register_replica(consul_url, "alpha", stub.port, "alpha-1", ttl=True)
    router.wait_ready("alpha", 1)
    replica = router.app.discovery.snapshot.by_id["alpha-1"]
    assert (replica.model, replica.port, replica.def_hash) == ("alpha", stub.port, "h0")

    fail_check(consul_url, check)
    router.wait_ready("alpha", 0)
    assert [r.status for r in router.app.discovery.snapshot.replicas["alpha"]] == ["critical"]

    put_kv(consul_url, "llmgw/state/alpha", json.dumps({"unplaceable": True, "placement_reason": "no room"}))
    wait_until(lambda: "alpha" in router.app.discovery.snapshot.states, 10, "the state of alpha")
    assert router.app.discovery.snapshot.states["alpha"].placement_reason == "no room"
    # A garbage value must not stop the loop: the next good write still arrives.
    put_kv(consul_url, "llmgw/state/alpha", b"\xff\xfe not json")
    wait_until(
        lambda: "alpha" not in router.app.discovery.snapshot.states, 10, "the garbage state to be dropped"
    )
    put_kv(consul_url, "llmgw/state/alpha", json.dumps({"parked": True}))
    wait_until(lambda: router.app.discovery.snapshot.states.get("alpha"), 10, "the state of alpha again")

    httpx.put(f"{consul_url}/v1/agent/service/deregister/alpha-1", timeout=5).raise_for_status()
    wait_until(lambda: "alpha" not in router.app.discovery.snapshot.replicas, 10, "alpha-1 to go")


def test_model_definitions_come_from_consul_and_a_bad_edit_keeps_the_previous_ones(
    consul_url: str, start_router: StartRouter
) -> None:
    router = start_router(consul_url)
    put_kv(consul_url, "llmgw/config/models", MODELS_YAML)
    wait_until(lambda: len(router.app.discovery.snapshot.models) == 4, 10, "four models from KV")
    alpha = router.app.discovery.snapshot.models["alpha"]
    assert (alpha.job_id, alpha.replicas_max) == ("llmgw-alpha", 2)

    put_kv(
        consul_url,
        "llmgw/config/models",
        MODELS_YAML.replace("profile: tiny\n    replicas", "profile: gpu9\n    replicas"),
    )
    wait_until(lambda: router.app.discovery.snapshot.models_error, 10, "the bad edit to be noticed")
    assert len(router.app.discovery.snapshot.models) == 4
    health = httpx.get(f"{router.url}/healthz", timeout=5).json()
    assert "models.alpha.profile: unknown profile 'gpu9'" in health["models_error"]


def test_models_come_from_the_file_while_consul_has_none(
    consul_url: str, start_router: StartRouter, tmp_path: object
) -> None:

    path = Path(str(tmp_path)) / "models.yaml"
    path.write_text(MODELS_YAML)
    router = start_router(consul_url, models_file=str(path))
    assert set(router.app.discovery.snapshot.models) == {"alpha", "kev-0.5b", "phi-4", "idle-one"}
    assert router.app.discovery.snapshot.models_origin == str(path)


def test_with_consul_gone_the_router_serves_from_its_last_snapshot_and_says_so(
    make_consul_agent: Callable[[], ConsulAgent], stub_engine: StartStub, start_router: StartRouter
) -> None:
    agent = make_consul_agent()
    stub = stub_engine("r1")
    register_replica(agent.url, "alpha", stub.port, "alpha-1")
    router = start_router(agent.url)
    router.wait_ready("alpha", 1)
    health = httpx.get(f"{router.url}/healthz", timeout=5).json()
    assert health["status"] == "ok"

    agent.stop()
    wait_until(lambda: not router.app.discovery.consul_up, 15, "the router to notice Consul is gone")
    health_resp = httpx.get(f"{router.url}/healthz", timeout=5)
    assert health_resp.status_code == 200
    health = health_resp.json()
    assert health["status"] == "degraded"
    assert health["consul"]["up"] is False
    assert any(w["error"] for w in health["consul"]["watches"].values())
    router.expect_metric("llmgw_router_consul_up", 0)

    for i in range(5):
        resp = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": "alpha", "messages": [{"role": "user", "content": f"still there {i}?"}]},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
    time.sleep(1.2)
    age = router.metric("llmgw_router_consul_watch_age_seconds", watch="replicas")
    assert age >= 1.0

    # Consul comes back (empty, as a dev agent does): the watches read again.
    agent.restart()
    wait_until(lambda: router.app.discovery.consul_up, 30, "the router to read Consul again")
    assert httpx.get(f"{router.url}/healthz", timeout=5).json()["status"] == "ok"
