"""Namespaces in the stand-in, as Nomad CE has them: `default` from the start, others created
with `POST /v1/namespace/<name>`, jobs and everything they make scoped by `?namespace=`, and a
job in a namespace that does not exist (or that forbids its driver) refused with Nomad's text."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from typing import Any

import pytest
import requests

from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import NO_DEPLOYMENTS, eval_done, mock_job, wait_for

# structs.Namespace as the API returns it.
NAMESPACE_FIELDS = {
    "Name", "Description", "Quota", "Capabilities", "NodePoolConfiguration", "VaultConfiguration",
    "ConsulConfiguration", "Meta", "Hash", "CreateIndex", "ModifyIndex", "RequiredExtraClaims",
    "OptionalExtraClaims",
}  # fmt: skip


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def call(standin: StandIn, method: str, path: str, **kw: Any) -> requests.Response:
    return requests.request(method, f"{standin.url}{path}", timeout=10, **kw)


def test_default_exists_as_nomad_creates_it(standin: StandIn) -> None:
    listed = call(standin, "GET", "/v1/namespaces")
    assert listed.status_code == 200 and int(listed.headers["X-Nomad-Index"]) >= 1
    assert [ns["Name"] for ns in listed.json()] == ["default"]
    default = call(standin, "GET", "/v1/namespace/default").json()
    assert set(default) == NAMESPACE_FIELDS
    assert (default["Description"], default["CreateIndex"], default["ModifyIndex"]) == (
        "Default shared namespace",
        1,
        1,
    )
    # Namespace.SetHash: BLAKE2b-256 over name, description and quota.
    digest = hashlib.blake2b(b"defaultDefault shared namespace", digest_size=32).digest()
    assert default["Hash"] == base64.b64encode(digest).decode()
    missing = call(standin, "GET", "/v1/namespace/ml")
    assert (missing.status_code, missing.text) == (404, "Namespace not found")


def test_a_created_namespace_is_listed_read_and_replaced(standin: StandIn) -> None:
    created = call(standin, "POST", "/v1/namespace/ml", json={"Name": "ml", "Description": "models"})
    # Nomad's handler writes no object: an empty body, the index in the header.
    assert (created.status_code, created.text) == (200, "")
    index = int(created.headers["X-Nomad-Index"])
    got = call(standin, "GET", "/v1/namespace/ml").json()
    assert (got["Name"], got["Description"], got["CreateIndex"], got["ModifyIndex"]) == (
        "ml",
        "models",
        index,
        index,
    )
    again = call(standin, "POST", "/v1/namespace", json={"Name": "ml", "Meta": {"team": "ai"}})
    assert again.status_code == 200
    got = call(standin, "GET", "/v1/namespace/ml").json()
    assert (got["Description"], got["Meta"], got["CreateIndex"]) == ("", {"team": "ai"}, index)
    assert got["ModifyIndex"] > index
    assert [ns["Name"] for ns in call(standin, "GET", "/v1/namespaces").json()] == ["default", "ml"]
    assert [ns["Name"] for ns in call(standin, "GET", "/v1/namespaces", params={"prefix": "m"}).json()] == [
        "ml"
    ]


def test_bad_namespaces_are_refused_with_nomads_text(standin: StandIn) -> None:
    def refused(path: str, body: Any) -> tuple[int, str]:
        resp = call(standin, "POST", path, json=body)
        return resp.status_code, resp.text

    assert refused("/v1/namespace/ml", {"Name": "other"}) == (
        400,
        "Namespace name does not match request path",
    )
    assert refused("/v1/namespace", {"Name": "no_underscores"}) == (
        500,
        'Invalid namespace "no_underscores": 1 error occurred:\n'
        '\t* invalid name "no_underscores". Must match regex ^[a-zA-Z0-9-]{1,128}$\n\n',
    )
    # Node pool governance is Enterprise; a CE server refuses the block outright.
    assert refused("/v1/namespace/gpu", {"Name": "gpu", "NodePoolConfiguration": {"Default": "gpu"}}) == (
        500,
        'Invalid namespace "gpu": 1 error occurred:\n'
        "\t* invalid node pool configuration: Node Pools Governance is unlicensed.\n\n",
    )
    assert [ns["Name"] for ns in call(standin, "GET", "/v1/namespaces").json()] == ["default"]


def test_jobs_live_in_their_namespace_and_nowhere_else(standin: StandIn) -> None:
    client = standin.client()
    assert call(standin, "POST", "/v1/namespace/ml", json={"Name": "ml"}).status_code == 200
    body = mock_job("svc", count=1, **NO_DEPLOYMENTS)
    registered = call(standin, "POST", "/v1/jobs", params={"namespace": "ml"}, json=body)
    assert registered.status_code == 200, registered.text
    eval_done(client, registered.json()["EvalID"])

    def ids(path: str, namespace: str | None) -> list[str]:
        params = {"namespace": namespace} if namespace else {}
        return [o.get("JobID", o.get("ID")) for o in call(standin, "GET", path, params=params).json()]

    assert ids("/v1/jobs", "ml") == ["svc"]
    assert ids("/v1/jobs", None) == [] and ids("/v1/jobs", "default") == []
    assert ids("/v1/jobs", "*") == ["svc"]
    wait_for(lambda: ids("/v1/allocations", "ml") == ["svc"], what="the allocation in ml")
    assert ids("/v1/allocations", None) == [] and ids("/v1/evaluations", None) == []
    job = call(standin, "GET", "/v1/job/svc", params={"namespace": "ml"}).json()
    assert job["Namespace"] == "ml"
    assert call(standin, "GET", "/v1/job/svc").status_code == 404

    # A namespace that still runs something cannot go; `default` never can.
    deleted = call(standin, "DELETE", "/v1/namespace/ml")
    assert (deleted.status_code, deleted.text) == (
        500,
        "2 errors occurred:\n"
        '\t* namespace "ml" has non-terminal jobs in regions: [global]\n'
        '\t* namespace "ml" has non-terminal allocations in regions: [global]\n\n',
    )
    no_default = call(standin, "DELETE", "/v1/namespace/default")
    assert (no_default.status_code, no_default.text) == (500, "can not delete default namespace")
    gone = call(standin, "DELETE", "/v1/namespace/nope")
    assert (gone.status_code, gone.text) == (500, "namespace not found")


def test_a_job_in_a_namespace_that_does_not_exist_is_refused_and_lands_nowhere(standin: StandIn) -> None:
    # The job's own Namespace wins over the query's, as Nomad's namespaceForJob has it.
    body = mock_job("svc")
    body["Job"]["Namespace"] = "ml"
    refused = call(standin, "POST", "/v1/jobs", json=body)
    # An admission validator's refusal: a multierror with no status code, so 500.
    assert (refused.status_code, refused.text) == (
        500,
        '1 error occurred:\n\t* job "svc" is in nonexistent namespace "ml"\n\n',
    )
    planned = call(standin, "POST", "/v1/job/svc/plan", json=body)
    assert (planned.status_code, planned.text) == (refused.status_code, refused.text)
    assert call(standin, "GET", "/v1/jobs", params={"namespace": "*"}).json() == []


def test_a_namespace_that_forbids_a_driver_refuses_jobs_using_it(standin: StandIn) -> None:
    caps = {"Name": "locked", "Capabilities": {"DisabledTaskDrivers": ["mock_driver"]}}
    assert call(standin, "POST", "/v1/namespace/locked", json=caps).status_code == 200
    refused = call(standin, "POST", "/v1/jobs", params={"namespace": "locked"}, json=mock_job("svc"))
    assert (refused.status_code, refused.text) == (
        500,
        '1 error occurred:\n\t* used task driver "mock_driver" is not allowed in namespace "locked"\n\n',
    )
