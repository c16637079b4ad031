"""Discovery: what the router reads from Consul, and how it behaves when Consul goes away."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from devstack.consul_agent import ConsulAgent
from nomad_driver.blocking import Reading
from nomad_driver.consul import KVEntry
from router.catalog import Fleet, parse_instances, parse_not_passing
from router.config import ConsulSettings
from router.discovery import ChecksReading, Discovery, InstancesReading, ParsedStates, parse_states
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
    port: int = 8000,
    node: str = "n1",
) -> dict[str, object]:
    """One instance as `/v1/catalog/service/llmgw-engine` answers it."""
    return {
        "Node": node,
        "Address": "10.0.0.1",
        "ServiceID": service_id,
        "ServiceName": "llmgw-engine",
        "ServiceTags": tags if tags is not None else [],
        "ServiceAddress": address,
        "ServicePort": port,
        "ServiceMeta": {"model": model, "def_hash": "abc"} if model else {},
    }


def check(node: str, service_id: str, status: str) -> dict[str, str]:
    return {
        "Node": node,
        "CheckID": f"{service_id or 'node'}-{status}",
        "ServiceID": service_id,
        "Status": status,
    }


def test_a_replica_is_ready_only_when_its_checks_and_its_nodes_pass() -> None:
    fleet = Fleet()
    instances = parse_instances(
        [entry(i) for i in ("ok", "warn", "crit", "maint")] + [entry("drained", node="n2")]
    )
    not_passing = [
        check("n1", "warn", "warning"),
        check("n1", "crit", "warning"),
        check("n1", "crit", "critical"),
        check("n1", "maint", "maintenance"),
        check("n2", "", "critical"),  # the node's own check: serfHealth
        check("n1", "other-service", "critical"),
    ]
    fleet.set_instances(instances, parse_not_passing(not_passing))
    status = {r.id: (r.status, r.ready) for r in fleet.replicas["m"]}
    assert status == {
        "ok": ("passing", True),
        "warn": ("warning", False),
        "crit": ("critical", False),
        "maint": ("critical", False),
        "drained": ("critical", False),
    }
    assert [r.id for r in fleet.ready["m"]] == ["ok"]


def test_a_change_of_checks_rebuilds_only_the_models_it_touches_and_keeps_old_snapshots_whole() -> None:
    fleet = Fleet()
    fleet.set_instances(parse_instances([entry("a1", model="a"), entry("b1", model="b", node="n2")]), {})
    before_replicas, before_ready = fleet.replicas, fleet.ready
    assert fleet.set_not_passing(parse_not_passing([check("n1", "a1", "critical")]))
    assert "a" not in fleet.ready and [r.id for r in fleet.ready["b"]] == ["b1"]
    assert fleet.replicas["b"] is before_replicas["b"]  # untouched, not rebuilt
    assert [r.id for r in before_ready["a"]] == ["a1"]  # a published snapshot never changes
    # A check of something that is no replica changes nothing, and says so.
    assert not fleet.set_not_passing(
        parse_not_passing([check("n1", "a1", "critical"), check("n9", "x", "critical")])
    )
    # The node going away takes out all of its replicas, and its return brings them back.
    a1_down = [check("n1", "a1", "critical")]
    assert fleet.set_not_passing(parse_not_passing([*a1_down, check("n2", "", "critical")]))
    assert not fleet.ready
    a1_down_only = parse_not_passing(a1_down)
    assert fleet.improving(a1_down_only) == {("n2", "b1")}
    assert fleet.set_not_passing(a1_down_only, {("n2", "b1")}, {("n2", "b1"): "passing"})
    assert set(fleet.ready) == {"b"}


def test_a_check_that_clears_puts_an_instance_back_only_once_its_own_health_confirms_it() -> None:
    # A task that stops is deregistered with its checks: its critical check leaves the list a
    # moment before the catalog drops it. Read alone, that looks like a recovery.
    fleet = Fleet()
    fleet.set_instances(
        parse_instances([entry("dying"), entry("back", port=8001), entry("still", port=8002)]),
        parse_not_passing([check("n1", i, "critical") for i in ("dying", "back", "still")]),
    )
    assert "m" not in fleet.ready
    cleared: dict[tuple[str, str], str] = {}
    assert fleet.improving(cleared) == {("n1", "dying"), ("n1", "back"), ("n1", "still")}
    # Unconfirmed, nothing comes back.
    assert not fleet.set_not_passing(cleared)
    assert "m" not in fleet.ready
    # Confirmed: one is gone from Consul, one passes, one turned critical again meanwhile.
    checked = fleet.improving(cleared)
    assert fleet.set_not_passing(cleared, checked, {("n1", "back"): "passing", ("n1", "still"): "critical"})
    assert [r.id for r in fleet.ready["m"]] == ["back"]
    assert {r.id for r in fleet.replicas["m"]} == {"back", "still"}
    assert ("n1", "dying") not in fleet.by_key


def test_the_model_comes_from_meta_or_the_model_tag_and_the_address_falls_back_to_the_node() -> None:
    instances = parse_instances(
        [
            entry("a", model="alpha"),
            entry("b", model=None, tags=["gpu", "model=beta"], address=""),
            entry("c", model=None, tags=["gpu"]),
            entry("d", model="alpha", port=0),
            {"garbage": True},
            {"ServiceMeta": "not a mapping", "ServiceID": "e"},
        ]
    )
    fleet = Fleet()
    fleet.set_instances(instances, {})
    assert set(fleet.replicas) == {"alpha", "beta"}
    assert [r.id for r in fleet.replicas["alpha"]] == ["a"]
    beta = fleet.replicas["beta"][0]
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


def test_a_read_of_the_states_parses_only_the_keys_that_changed_and_warns_of_garbage_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def kv(key: str, state: dict[str, object] | bytes, index: int) -> KVEntry:
        value = state if isinstance(state, bytes) else json.dumps(state).encode()
        return KVEntry(f"llmgw/state/{key}", value, modify_index=index)

    parsed: ParsedStates = {}
    first = parse_states([kv("a", {"parked": True}, 5), kv("b", {}, 6), kv("bad", b"{", 7)], parsed)
    # The leader writes b; a and the garbage are as they were.
    second = parse_states(
        [kv("a", {"parked": True}, 5), kv("b", {"parked": True}, 9), kv("bad", b"{", 7)], parsed
    )
    assert second["a"] is first["a"]
    assert not first["b"].parked and second["b"].parked
    assert "bad" not in second
    assert len([r for r in caplog.records if "treating model bad as having no state" in r.getMessage()]) == 1
    # A key that went away is forgotten, and comes back parsed afresh.
    third = parse_states([kv("b", {"parked": True}, 9)], parsed)
    assert set(third) == {"b"} and set(parsed) == {"llmgw/state/b"}


def test_the_snapshot_follows_registrations_checks_and_state_in_consul(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    router = start_router(consul_url)
    stub = stub_engine("r1")
    check = register_replica(consul_url, "alpha", stub.port, "alpha-1", ttl=True)
    router.wait_ready("alpha", 1)
    (replica,) = router.app.discovery.snapshot.replicas["alpha"]
    assert replica.id == "alpha-1" and replica.key in router.app.discovery.snapshot.by_key
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


def test_an_older_catalog_reading_does_not_undo_a_newer_reading_of_the_checks() -> None:
    # No Consul needed: the two watches' readings are applied in the order they may land.
    discovery = Discovery(ConsulSettings())
    discovery.replica_watch.snapshot = Reading(5, InstancesReading((entry("r1"),), 10, ()), 0.0)
    discovery._apply_instances()
    assert [r.id for r in discovery.snapshot.ready["m"]] == ["r1"]
    # The checks watch then reads r1 critical, at a later index.
    discovery.checks_watch.snapshot = Reading(20, ChecksReading((check("n1", "r1", "critical"),)), 0.0)
    discovery._apply_checks()
    assert "m" not in discovery.snapshot.ready
    # A catalog reading whose checks were read before that (index 10) lands afterwards.
    discovery.replica_watch.snapshot = Reading(6, InstancesReading((entry("r1"),), 10, ()), 0.0)
    discovery._apply_instances()
    assert "m" not in discovery.snapshot.ready
    assert [r.status for r in discovery.snapshot.replicas["m"]] == ["critical"]
