"""Nomad ACLs on the stand-in (`--acl-bootstrap-token`): tokens, policies and 403s as Nomad gives them.

Sources in hashicorp/nomad: command/agent/http.go (`parseToken`: `X-Nomad-Token`, else
`Authorization: Bearer`; `errCodeFromHandler`: 403 with the bare error text),
nomad/structs/errors.go ("ACL token not found", "Permission denied"), acl/policy.go
(`expandNamespacePolicy`, the capability names), command/agent/acl_endpoint.go and
nomad/structs/structs.go (`ACLPolicy`, `ACLPolicyListStub`, `ACLToken` JSON).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from devstack.nomad.acl import expand_namespace_policy
from tests.fixtures.nomad import StandIn

BOOTSTRAP = str(uuid.uuid4())


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False, extra_args=["--acl-bootstrap-token", BOOTSTRAP])


def call(standin: StandIn, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
    headers = {"X-Nomad-Token": token} if token else {}
    return httpx.request(method, f"{standin.url}{path}", headers=headers, timeout=10, **kw)


def client_token(standin: StandIn, name: str, rules: str) -> str:
    put = call(standin, "PUT", f"/v1/acl/policy/{name}", BOOTSTRAP, json={"Name": name, "Rules": rules})
    assert put.status_code == 200, put.text
    made = call(
        standin, "PUT", "/v1/acl/token", BOOTSTRAP, json={"Name": name, "Type": "client", "Policies": [name]}
    )
    assert made.status_code == 200, made.text
    secret: str = made.json()["SecretID"]
    return secret


def test_without_the_flag_no_token_is_asked_for(start_standin: Callable[..., StandIn]) -> None:
    plain = start_standin(consul=False)
    assert call(plain, "GET", "/v1/jobs").status_code == 200
    assert call(plain, "GET", "/v1/jobs", str(uuid.uuid4())).status_code == 200


def test_unknown_token_and_missing_capability_answer_nomads_403s(standin: StandIn) -> None:
    unknown = call(standin, "GET", "/v1/jobs", str(uuid.uuid4()))
    assert (unknown.status_code, unknown.text) == (403, "ACL token not found")
    anonymous = call(standin, "GET", "/v1/jobs")
    assert (anonymous.status_code, anonymous.text) == (403, "Permission denied")
    assert call(standin, "GET", "/v1/jobs", BOOTSTRAP).status_code == 200
    # Bearer works as X-Nomad-Token does; a query parameter is not read at all.
    bearer = httpx.get(f"{standin.url}/v1/jobs", headers={"Authorization": f"Bearer {BOOTSTRAP}"}, timeout=10)
    assert bearer.status_code == 200
    assert call(standin, "GET", f"/v1/jobs?token={BOOTSTRAP}").status_code == 403
    assert call(standin, "GET", "/v1/status/leader").status_code == 200  # needs no token


def test_policies_and_tokens_have_nomads_json(standin: StandIn) -> None:
    rules = 'namespace "default" {\n  policy = "read"\n}\n'
    put = call(standin, "PUT", "/v1/acl/policy/readers", BOOTSTRAP, json={"Name": "readers", "Rules": rules})
    assert put.status_code == 200 and int(put.headers["X-Nomad-Index"]) > 1
    policy = call(standin, "GET", "/v1/acl/policy/readers", BOOTSTRAP).json()
    assert list(policy) == [
        "Name",
        "Description",
        "Rules",
        "RulesJSON",
        "JobACL",
        "Hash",
        "CreateIndex",
        "ModifyIndex",
    ]
    assert policy["Rules"] == rules
    stubs = call(standin, "GET", "/v1/acl/policies", BOOTSTRAP).json()
    assert [list(s) for s in stubs] == [
        ["Name", "Description", "JobACL", "Hash", "CreateIndex", "ModifyIndex"]
    ]

    made = call(
        standin,
        "PUT",
        "/v1/acl/token",
        BOOTSTRAP,
        json={"Name": "r", "Type": "client", "Policies": ["readers"]},
    )
    token = made.json()
    assert list(token) == [
        "AccessorID",
        "SecretID",
        "Name",
        "Type",
        "Policies",
        "Roles",
        "Global",
        "Hash",
        "CreateTime",
        "ExpirationTime",
        "ExpirationTTL",
        "CreateIndex",
        "ModifyIndex",
    ]
    nobody = call(standin, "GET", "/v1/acl/token/self")
    assert (nobody.status_code, nobody.text) == (404, "ACL token not found")
    me = call(standin, "GET", "/v1/acl/token/self", token["SecretID"])
    assert me.status_code == 200 and me.json()["AccessorID"] == token["AccessorID"]
    # Only a management token writes policies.
    denied = call(standin, "PUT", "/v1/acl/policy/x", token["SecretID"], json={"Name": "x", "Rules": rules})
    assert (denied.status_code, denied.text) == (403, "Permission denied")

    assert call(standin, "DELETE", "/v1/acl/policy/readers", BOOTSTRAP).status_code == 200
    missing = call(standin, "GET", "/v1/acl/policy/readers", BOOTSTRAP)
    assert (missing.status_code, missing.text) == (404, "ACL policy not found")
    # The token outlives its policy and is then allowed nothing.
    assert call(standin, "GET", "/v1/jobs", token["SecretID"]).status_code == 403


def test_read_and_write_expand_as_nomads_policy_go(standin: StandIn) -> None:
    assert "read-logs" not in expand_namespace_policy("read")
    reader = client_token(standin, "reader", 'namespace "*" { policy = "read" }\nnode { policy = "read" }')
    assert call(standin, "GET", "/v1/jobs", reader).status_code == 200
    assert call(standin, "GET", "/v1/jobs?namespace=other", reader).status_code == 200  # the glob
    assert call(standin, "GET", "/v1/nodes", reader).status_code == 200
    refused = call(standin, "PUT", "/v1/jobs", reader, json={"Job": {"ID": "x"}})
    assert (refused.status_code, refused.text) == (403, "Permission denied")
    default_only = client_token(standin, "default-only", 'namespace "default" { policy = "read" }')
    assert call(standin, "GET", "/v1/jobs?namespace=*", default_only).status_code == 200  # any will do
    assert call(standin, "GET", "/v1/jobs?namespace=other", default_only).status_code == 403
    node_meta = call(standin, "POST", "/v1/client/metadata", reader, json={"Meta": {"a": "b"}})
    assert node_meta.status_code == 403


def test_a_rule_the_stand_in_does_not_understand_is_refused(standin: StandIn) -> None:
    for rules in (
        'namespace "default" { policy = "admin" }',
        'namespace "default" { capabilities = ["launch-rockets"] }',
        'namespace "default" { variables { path "*" { capabilities = ["peek"] } } }',
        'quota { policy = "read" }',
        "this is not hcl {",
    ):
        put = call(standin, "PUT", "/v1/acl/policy/bad", BOOTSTRAP, json={"Name": "bad", "Rules": rules})
        assert put.status_code == 400, (rules, put.text)
        assert put.text.startswith("policy 0 invalid: 1 error occurred:\n\t* "), put.text
    empty = call(standin, "PUT", "/v1/acl/token", BOOTSTRAP, json={"Name": "e", "Type": "client"})
    assert (empty.status_code, empty.text) == (
        400,
        "token 0 invalid: 1 error occurred:\n\t* client token missing policies or roles\n\n",
    )


def test_a_fine_grained_capability_does_what_submit_job_does_for_its_endpoint(standin: StandIn) -> None:
    # Nomad 2.0's job_endpoint.go: Register takes submit-job or register-job; Scale does not.
    registrar = client_token(standin, "registrar", 'namespace "default" { capabilities = ["register-job"] }')
    job = {"Job": {"ID": "fine", "TaskGroups": [{"Name": "g", "Count": 0, "Tasks": []}]}}
    registered = call(standin, "PUT", "/v1/job/fine", registrar, json=job)
    assert registered.status_code != 403, registered.text
    scaled = call(
        standin, "POST", "/v1/job/fine/scale", registrar, json={"Count": 1, "Target": {"Group": "g"}}
    )
    assert (scaled.status_code, scaled.text) == (403, "Permission denied")
    scaler = client_token(standin, "scaler", 'namespace "default" { policy = "scale" }')
    assert call(standin, "GET", "/v1/job/fine", scaler).status_code != 403  # `scale` includes read-job


def test_the_anonymous_policy_is_what_a_request_without_a_token_gets(standin: StandIn) -> None:
    assert call(standin, "GET", "/v1/jobs").status_code == 403
    rules = 'namespace "default" { capabilities = ["list-jobs"] }'
    put = call(
        standin, "PUT", "/v1/acl/policy/anonymous", BOOTSTRAP, json={"Name": "anonymous", "Rules": rules}
    )
    assert put.status_code == 200, put.text
    assert call(standin, "GET", "/v1/jobs").status_code == 200
    assert call(standin, "GET", "/v1/nodes").status_code == 403
