"""The Consul guarantees llmgw's state writes rest on, shown against a real dev agent, and the
fixture's promise that tests do not leak into each other."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import consul as pyconsul
import httpx
import pytest

from devstack.consul_agent import ConsulAgent, ConsulAgentError
from tests.fixtures.consul import consul_isolated


def test_cas_with_current_modify_index_succeeds_once_and_then_is_stale(consul: pyconsul.Consul) -> None:
    key = "llmgw/state/m1"
    assert consul.kv.put(key, json.dumps({"parked": False}))
    _, entry = consul.kv.get(key)
    index = entry["ModifyIndex"]

    assert consul.kv.put(key, json.dumps({"parked": True}), cas=index) is True
    # Another writer that read the same version loses and must re-read.
    assert consul.kv.put(key, json.dumps({"parked": False}), cas=index) is False
    _, entry = consul.kv.get(key)
    assert json.loads(entry["Value"]) == {"parked": True}


def test_cas_zero_creates_only_if_absent(consul: pyconsul.Consul) -> None:
    key = "llmgw/state/m2"
    assert consul.kv.put(key, "first", cas=0) is True
    assert consul.kv.put(key, "second", cas=0) is False
    _, entry = consul.kv.get(key)
    assert entry["Value"] == b"first"


def _txn_guarded_write(url: str, key: str, session: str, value: bytes) -> httpx.Response:
    ops = [
        {"KV": {"Verb": "check-session", "Key": "llmgw/leader", "Session": session}},
        {"KV": {"Verb": "set", "Key": key, "Value": base64.b64encode(value).decode()}},
    ]
    return httpx.put(f"{url}/v1/txn", json=ops, timeout=10.0)


def test_txn_guarded_by_lock_session_is_refused_for_a_non_holder(
    consul: pyconsul.Consul, consul_url: str
) -> None:
    holder = consul.session.create(name="watcher-a", ttl=10, lock_delay=0)
    other = consul.session.create(name="watcher-b", ttl=10, lock_delay=0)
    assert consul.kv.put("llmgw/leader", "watcher-a", acquire=holder) is True
    assert consul.kv.put("llmgw/leader", "watcher-b", acquire=other) is False

    refused = _txn_guarded_write(consul_url, "llmgw/state/m3", other, b"from b")
    assert refused.status_code == 409, refused.text
    assert "failed session check" in refused.text
    _, entry = consul.kv.get("llmgw/state/m3")
    assert entry is None, "a refused transaction must write nothing"

    accepted = _txn_guarded_write(consul_url, "llmgw/state/m3", holder, b"from a")
    assert accepted.status_code == 200, accepted.text
    _, entry = consul.kv.get("llmgw/state/m3")
    assert entry["Value"] == b"from a"


def test_isolation_removes_what_a_test_created_and_keeps_the_rest(consul_agent: ConsulAgent) -> None:
    outside = pyconsul.Consul(host=consul_agent.host, port=consul_agent.http_port)
    outside.kv.put("not-llmgw/keep", "x")
    existing_session = outside.session.create(name="from-before", ttl=30)
    try:
        with consul_isolated(consul_agent) as c:
            sid = c.session.create(name="leaked-lock", ttl=30, lock_delay=0)
            c.kv.put("llmgw/leader", "w", acquire=sid)
            c.kv.put("llmgw/state/a", "{}")
            c.kv.put("llmgw/activity/a", "1")
            c.agent.service.register("llmgw-engine", service_id="engine-1", port=1234, tags=["model=a"])
            c.catalog.register(
                "gpu-node-1",
                "10.0.0.1",
                service={"Service": "llmgw-engine", "ID": "engine-2", "Port": 5678},
                check={"CheckID": "engine-2-ready", "Name": "ready", "Status": "passing"},
            )
            _, before_exit = c.kv.get("llmgw/", recurse=True)
            assert len(before_exit) == 3

        _, keys = outside.kv.get("llmgw/", recurse=True)
        assert keys is None
        _, sessions = outside.session.list()
        assert {s["ID"] for s in sessions} == {existing_session}
        assert "engine-1" not in outside.agent.services()
        _, nodes = outside.catalog.nodes()
        assert [n["Node"] for n in nodes] == [consul_agent.node_name]
        _, kept = outside.kv.get("not-llmgw/keep")
        assert kept is not None and kept["Value"] == b"x"
    finally:
        outside.kv.delete("not-llmgw/keep")
        outside.session.destroy(existing_session)


def test_restart_keeps_the_address_and_loses_the_state(
    make_consul_agent: Callable[[], ConsulAgent],
) -> None:
    agent = make_consul_agent()
    url = agent.url
    c = pyconsul.Consul(host=agent.host, port=agent.http_port)
    c.kv.put("llmgw/state/m1", "{}")
    old_pid = agent.pid

    agent.restart()

    assert agent.url == url
    assert agent.pid != old_pid
    _, entry = c.kv.get("llmgw/state/m1")
    assert entry is None, "a dev agent comes back empty, as the watcher sees after a Consul restart"
    # Ready for sessions straight away, so a watcher can take its lock again.
    sid = c.session.create(ttl=10, lock_delay=0)
    assert c.kv.put("llmgw/leader", "w", acquire=sid) is True


def test_stop_ends_the_agent_process(make_consul_agent: Callable[[], ConsulAgent]) -> None:
    agent = make_consul_agent()
    url = agent.url
    agent.stop()
    assert not agent.running
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/v1/status/leader", timeout=2.0)


def test_missing_consul_binary_names_make_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMGW_CONSUL_BIN", str(tmp_path / "no-such-consul"))
    with pytest.raises(ConsulAgentError, match="make setup"):
        ConsulAgent()
