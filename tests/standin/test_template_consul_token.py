"""A template's Consul lookups carry a Consul token only when the task has a `consul {}` block.

hashicorp/nomad client/allocrunner/taskrunner/template_hook.go: the template hook sets the token
to "invalid-token" ("we want to enforce that we don't have a Consul token unless intentionally
configured") unless the task has the Consul workload identity, which
nomad/job_endpoint_hook_implicit_identities.go (`handleConsulTask`) gives only a task or group
with a `consul` block. Against a Consul with ACLs on and deny by default, the lookup is refused
(403 "ACL not found") and the template never renders: a multi-node leader never sees its
shards. The stand-in's own Consul token stands in for the identity's derived token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.consul_agent import ConsulAgent
from tests.fixtures.consul import ACL_MASTER_TOKEN, AclConsulAgent
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import tiny_node, wait_for

TEMPLATE = '{{ range service "llmgw-shard" }}{{ .Address }}:{{ .Port }}\n{{ end }}'


@pytest.fixture(scope="module")
def acl_consul(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsulAgent]:
    agent = AclConsulAgent(log_dir=tmp_path_factory.mktemp("consul-acl"), die_with_parent=True).start()
    register = {
        "Node": "shard-node",
        "Address": "10.0.0.7",
        "Service": {"Service": "llmgw-shard", "Port": 50052},
    }
    headers = {"X-Consul-Token": ACL_MASTER_TOKEN}
    httpx.put(
        f"{agent.url}/v1/catalog/register", json=register, headers=headers, timeout=10
    ).raise_for_status()
    try:
        yield agent
    finally:
        agent.stop()


@pytest.fixture
def standin(
    start_standin: Callable[..., StandIn], acl_consul: ConsulAgent, monkeypatch: pytest.MonkeyPatch
) -> StandIn:
    # The client's own Consul token, as a Nomad agent's `consul { token = ... }` holds one.
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", ACL_MASTER_TOKEN)
    return start_standin(nodes=[tiny_node("n0")], consul=acl_consul.url)


def job(job_id: str, consul_block: bool) -> dict[str, Any]:
    task: dict[str, Any] = {
        "Name": "t",
        "Driver": "mock_driver",
        "Config": {"run_for": "1h"},
        "Resources": {"CPU": 100, "MemoryMB": 64},
        "Templates": [{"EmbeddedTmpl": TEMPLATE, "DestPath": "local/shards.txt", "ChangeMode": "noop"}],
    }
    if consul_block:
        task["Consul"] = {}
    return {"Job": {"ID": job_id, "TaskGroups": [{"Name": "g", "Count": 1, "Tasks": [task]}]}}


def task_state(standin: StandIn, job_id: str) -> dict[str, Any]:
    client = standin.client()

    def settled() -> dict[str, Any] | None:
        for stub in client.job.get_allocations(job_id):
            state = (client.allocation.get_allocation(stub["ID"]).get("TaskStates") or {}).get("t")
            if state and state["State"] in ("running", "dead"):
                return dict(state)
        return None

    return wait_for(settled, 15, f"{job_id}'s task")


def test_without_a_consul_block_the_lookup_is_refused(standin: StandIn) -> None:
    standin.client().jobs.register_job(job("no-block", consul_block=False))
    state = task_state(standin, "no-block")
    assert state["State"] == "dead"
    messages = [e.get("DisplayMessage", "") for e in state["Events"]]
    failed = next(m for m in messages if m.startswith("Template failed"))
    assert "403" in failed and "ACL not found" in failed, failed


def test_with_a_consul_block_the_template_renders_the_shards(standin: StandIn) -> None:
    standin.client().jobs.register_job(job("with-block", consul_block=True))
    state = task_state(standin, "with-block")
    assert state["State"] == "running", state["Events"]
    rendered = list(Path(standin.data_dir).rglob("shards.txt"))
    assert [p.read_text() for p in rendered] == ["10.0.0.7:50052\n"]
