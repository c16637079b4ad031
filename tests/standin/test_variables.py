"""Nomad Variables on the stand-in (`/v1/vars`, `/v1/var/<path>`), with Nomad's path rule.

Sources in hashicorp/nomad: command/agent/variable_endpoint.go (methods, "missing variable
path", "variable missing required Items object", "variable not found", `cas`, 204 on delete,
409 with the conflicting variable), nomad/structs/variables.go (`validVariablePath`
`^[a-zA-Z0-9-_~/]{1,128}$`, `ValidatePath`'s rules under `nomad/`, `VariableMetadata` and
`VariableDecrypted` field names) and nomad/variables_endpoint.go (`canonicalizeAndValidate`
wraps the validation error in an RPC coded error that `Apply` wraps once more, so the body keeps
one "RPC Error:: 400," prefix), nomad/state/state_store_variables.go (`varSetCASTxn`).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.fixtures.nomad import StandIn


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def put(standin: StandIn, path: str, items: dict[str, str] | None, **params: str) -> httpx.Response:
    body = {"Path": path, "Items": items} if items is not None else {"Path": path}
    return httpx.put(f"{standin.url}/v1/var/{path}", json=body, params=params, timeout=10)


def test_a_variable_is_written_read_listed_and_deleted_with_nomads_json(standin: StandIn) -> None:
    written = put(standin, "nomad/jobs/llmgw-watcher", {"admin_token": "a", "nomad_token": "n"})
    assert written.status_code == 200, written.text
    body = written.json()
    assert list(body) == [
        "Namespace",
        "Path",
        "CreateIndex",
        "CreateTime",
        "ModifyIndex",
        "ModifyTime",
        "Items",
    ]
    assert body["Namespace"] == "default" and body["Items"] == {"admin_token": "a", "nomad_token": "n"}
    assert written.headers["X-Nomad-Index"] == str(body["ModifyIndex"])

    read = httpx.get(f"{standin.url}/v1/var/nomad/jobs/llmgw-watcher", timeout=10)
    assert read.status_code == 200 and read.json() == body

    put(standin, "llmgw/sources/qwen2~5-7b", {"HF_TOKEN": "hf_x"})
    listed = httpx.get(f"{standin.url}/v1/vars", params={"prefix": "llmgw/"}, timeout=10).json()
    assert [v["Path"] for v in listed] == ["llmgw/sources/qwen2~5-7b"]
    assert "Items" not in listed[0]

    gone = httpx.delete(f"{standin.url}/v1/var/nomad/jobs/llmgw-watcher", timeout=10)
    assert gone.status_code == 204
    missing = httpx.get(f"{standin.url}/v1/var/nomad/jobs/llmgw-watcher", timeout=10)
    assert (missing.status_code, missing.text) == (404, "variable not found")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nomad/jobs/llmgw-qwen2.5-7b", 'invalid path "nomad/jobs/llmgw-qwen2.5-7b"'),
        ("x" * 129, f'invalid path "{"x" * 129}"'),
        (
            "nomad",
            '"nomad" is a reserved top-level directory path, but you may write variables to '
            '"nomad/jobs", "nomad/job-templates", "nomad/sentinel", or below',
        ),
        (
            "nomad/other",
            'only paths at "nomad/jobs" or "nomad/job-templates" and below are valid paths '
            'under the top-level "nomad" directory',
        ),
    ],
    ids=["dot", "too-long", "nomad", "nomad-other"],
)
def test_a_path_outside_nomads_rule_is_refused_with_its_text(
    standin: StandIn, path: str, message: str
) -> None:
    refused = put(standin, path, {"k": "v"})
    assert (refused.status_code, refused.text) == (400, f"RPC Error:: 400,{message}")
    assert httpx.get(f"{standin.url}/v1/vars", timeout=10).json() == []


def test_check_and_set_and_empty_items(standin: StandIn) -> None:
    assert put(standin, "a/b", None).text == "variable missing required Items object"
    first = put(standin, "a/b", {"k": "1"}, cas="0")
    assert first.status_code == 200
    again = put(standin, "a/b", {"k": "2"}, cas="0")
    assert again.status_code == 409 and again.json()["ModifyIndex"] == first.json()["ModifyIndex"]
    assert "Items" not in again.json()
    assert put(standin, "a/b", {"k": "2"}, cas=str(first.json()["ModifyIndex"])).status_code == 200
    assert httpx.get(f"{standin.url}/v1/var/", timeout=10).text == "missing variable path"
