"""llmgw's own Nomad policies (docs/policies/*.nomad.hcl) against the stand-in with ACLs on.

tests/acl_table.py lists every Nomad call each part of llmgw makes; here each call is made with a
token holding only that part's policy, and must not be refused. Then the grant the call needs is
taken out of the policy, and Nomad's 403 "Permission denied" must come back: a policy that is
short of a capability fails here, not on an operator's cluster. The node agent and the
watcher's Nomad client run as themselves, with their token, as they do in production.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from nomad_driver.node_agent.agent import NodeAgent, NodeAgentConfig
from nomad_driver.nomad import EventStream, Nomad, NomadError
from tests.acl_table import CALLS, Call, NomadGrant
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import mock_job

POLICIES = Path(__file__).resolve().parents[2] / "docs" / "policies"
BOOTSTRAP = str(uuid.uuid4())
JOB = "llmgw-acl-probe"


def probe_job() -> dict[str, Any]:
    # No deployment (MaxParallel 0): one in progress would block the scale call.
    return mock_job(JOB, Update={"MaxParallel": 0})


NOMAD_PARTS = ("watcher", "node-agent", "operator")
# Namespace.GetNamespace checks AllowNamespace (nomad/namespace_endpoint.go): any capability in
# the namespace will do, so taking out the one the table names does not make Nomad refuse it.
ANY_CAPABILITY = {"/v1/namespace/<namespace>"}


@pytest.fixture
def world(start_standin: Callable[..., StandIn]) -> dict[str, str]:
    """An ACL stand-in with a job, its allocation and evaluation for the calls to name."""
    standin = start_standin(consul=False, extra_args=["--acl-bootstrap-token", BOOTSTRAP])
    admin = Nomad(standin.url, token=BOOTSTRAP)
    eval_id = admin.register_job(probe_job()["Job"])["EvalID"]
    _, allocs = admin.blocking_list("allocations")
    _, nodes = admin.blocking_list("nodes")
    return {
        "url": standin.url,
        "<job>": JOB,
        "<eval>": eval_id,
        "<alloc>": allocs[0]["ID"] if allocs else str(uuid.uuid4()),
        "<node>": nodes[0]["ID"],
        "<namespace>": "default",
    }


def make_token(url: str, rules: str) -> str:
    headers = {"X-Nomad-Token": BOOTSTRAP}
    name = f"p-{uuid.uuid4().hex[:12]}"
    put = httpx.put(f"{url}/v1/acl/policy/{name}", json={"Name": name, "Rules": rules}, headers=headers)
    assert put.status_code == 200, put.text
    body = {"Name": name, "Type": "client", "Policies": [name]}
    made = httpx.put(f"{url}/v1/acl/token", json=body, headers=headers)
    assert made.status_code == 200, made.text
    secret: str = made.json()["SecretID"]
    return secret


def policy(part: str) -> str:
    return (POLICIES / f"llmgw-{part}.nomad.hcl").read_text()


def without(rules: str, grant: NomadGrant) -> str:
    """The policy less the grant (and its alternatives): the capability gone, or the level lower."""
    if grant.scope == "namespace":
        for cap in (grant.capability, *grant.alternatives):
            rules = re.sub(rf'"{re.escape(cap)}",?\s*', "", rules)
        return rules
    lower = {"read": "deny", "write": "read"}[grant.capability]
    block = re.compile(rf'({grant.scope}\s*\{{\s*policy\s*=\s*)"\w+"')
    return block.sub(rf'\1"{lower}"', rules)


def nomad_calls(part: str) -> list[Call]:
    return [c for c in CALLS[part] if c.system == "nomad"]  # type: ignore[index]


def make_call(world: dict[str, str], call: Call, token: str) -> httpx.Response:
    path = call.path
    for name, value in world.items():
        path = path.replace(name, value)
    params: dict[str, Any] = {}
    body: Any = None
    if path.startswith("/v1/event/stream"):
        params["topic"] = ["Job", "Allocation"]  # the watcher's feeds (watcher/feeds.py)
    if path.startswith("/v1/client/metadata"):
        params["node_id"] = world["<node>"]
        body = {"NodeID": world["<node>"], "Meta": {"llmgw_acl_probe": "1"}}
    elif path.endswith("/scale"):
        body = {"Count": 1, "Target": {"Group": "g"}}
    elif path.endswith("/evaluate"):
        body = {"JobID": JOB}
    elif call.method == "POST":
        body = probe_job()
    headers = {"X-Nomad-Token": token}
    url = world["url"] + path
    if path.startswith("/v1/event/stream"):
        with httpx.stream("GET", url, params=params, headers=headers, timeout=10) as stream:
            # An allowed stream stays open; only a refusal has a body to read.
            text = "" if stream.status_code == 200 else stream.read().decode()
            return httpx.Response(stream.status_code, text=text)
    return httpx.request(call.method, url, params=params, json=body, headers=headers, timeout=10)


@pytest.mark.parametrize("part", NOMAD_PARTS)
def test_each_parts_policy_is_enough_for_each_call_it_makes(world: dict[str, str], part: str) -> None:
    token = make_token(world["url"], policy(part))
    refused = []
    for call in nomad_calls(part):
        response = make_call(world, call, token)
        if response.status_code == 403:
            refused.append(f"{call}: {response.text}")
    assert refused == [], f"llmgw-{part}.nomad.hcl is not enough"


@pytest.mark.parametrize("part", NOMAD_PARTS)
def test_a_policy_short_of_one_grant_is_refused_as_nomad_refuses(world: dict[str, str], part: str) -> None:
    allowed = []
    for call in nomad_calls(part):
        if call.path in ANY_CAPABILITY:
            continue
        for grant in call.grants:
            assert isinstance(grant, NomadGrant)
            token = make_token(world["url"], without(policy(part), grant))
            response = make_call(world, call, token)
            if (response.status_code, response.text) != (403, "Permission denied"):
                allowed.append(f"{call} without {grant}: {response.status_code}")
    assert allowed == []


def test_the_watchers_nomad_client_runs_on_its_token(world: dict[str, str]) -> None:
    nomad = Nomad(world["url"], token=make_token(world["url"], policy("watcher")))
    _, jobs = nomad.llmgw_jobs()
    assert JOB in [j["ID"] for j in jobs]
    job = nomad.get_job(JOB)
    assert job is not None
    scaled = nomad.scale(JOB, "g", 1, "acl probe")
    _, evaluation = nomad.evaluation(scaled["EvalID"])
    assert evaluation["JobID"] == JOB
    assert nomad.force_reschedule(JOB)["EvalID"]

    async def first_frame() -> dict[str, Any] | None:
        stream = EventStream(nomad, ["Job"], 1)
        try:
            return await stream.next(5.0)
        finally:
            stream.close()

    assert asyncio.run(first_frame()) is not None

    short = Nomad(
        world["url"],
        token=make_token(world["url"], without(policy("watcher"), NomadGrant("namespace", "submit-job"))),
    )
    with pytest.raises(NomadError) as refused:
        short.scale(JOB, "g", 1, "acl probe")
    assert refused.value.status == 403 and "Permission denied" in str(refused.value)
    with pytest.raises(NomadError) as unknown:
        Nomad(world["url"], token=str(uuid.uuid4())).get_job(JOB)
    assert unknown.value.status == 403 and "ACL token not found" in str(unknown.value)


def agent(tmp_path: Path, world: dict[str, str], token: str) -> NodeAgent:
    config = NodeAgentConfig(
        engines_dir=tmp_path / "engines",
        models_dir=tmp_path / "models",
        node_id=world["<node>"],
        nomad_addr=world["url"],
        nomad_token=token,
    )
    return NodeAgent(config, nvml_loader=_no_nvml)


def _no_nvml() -> Any:
    raise ImportError("libnvidia-ml.so.1: cannot open shared object file")


def test_the_node_agent_publishes_on_its_token_and_not_on_a_read_only_one(
    tmp_path: Path, world: dict[str, str]
) -> None:
    (tmp_path / "engines").mkdir()
    (tmp_path / "models").mkdir()
    node_agent = agent(tmp_path, world, make_token(world["url"], policy("node-agent")))
    node_agent.run_once()
    node_agent.publish({"llmgw_acl_probe": "1"})
    read = httpx.get(
        f"{world['url']}/v1/client/metadata",
        params={"node_id": world["<node>"]},
        headers={"X-Nomad-Token": BOOTSTRAP},
    )
    assert read.json()["Dynamic"]["llmgw_acl_probe"] == "1"
    read_only = agent(
        tmp_path, world, make_token(world["url"], without(policy("node-agent"), NomadGrant("node", "write")))
    )
    with pytest.raises(Exception, match="Permission denied"):
        read_only.publish({"llmgw_acl_probe": "2"})
