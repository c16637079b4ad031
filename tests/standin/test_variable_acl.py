"""With ACLs on, a template reads a Nomad Variable through its task's workload identity, as
Nomad's does: its own `nomad/jobs/<job>[/<group>[/<task>]]` paths, and whatever policies
attached to its job (`nomad acl policy apply -job`) grant. llmgw's source Variables live
outside `nomad/jobs/`, so a model's job reads one only with such a policy; without it the fetch
task's template fails with Nomad's 403, which names the Variable."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from devstack.nomad.acl import ACL, AclState, Claim, PolicyError, parse_rules
from devstack.nomad.client import ClientRunner
from devstack.nomad.state import StateStore
from devstack.nomad.taskstate import RestartTracker
from nomad_driver.fetch.render import credentials_template
from nomad_driver.spec import parse_models
from nomad_driver.variables import source_variable_path
from tests.standin.client_helpers import (
    events_of,
    make_job,
    new_store,
    raw_exec_task,
    restart_policy,
    running_client,
    start_alloc,
    wait_alloc,
)

MODEL = "tiny"
PATH = source_variable_path(MODEL)
POLICY = f'namespace "default" {{\n  variables {{\n    path "{PATH}" {{\n      capabilities = ["read"]\n    }}\n  }}\n}}\n'
PRINT_KEY = "import os; print(os.environ.get('AWS_ACCESS_KEY_ID', 'none'))"


def test_a_workload_reads_its_own_paths_and_what_its_policies_grant() -> None:
    claim = Claim("default", "llmgw-tiny", "engine", "fetch")
    nobody = ACL([])
    for own in (
        "nomad/jobs",
        "nomad/jobs/llmgw-tiny",
        "nomad/jobs/llmgw-tiny/engine",
        "nomad/jobs/llmgw-tiny/engine/fetch",
    ):
        assert nobody.allow_variable("default", own, "read", claim)
        assert not nobody.allow_variable("default", own, "write", claim)
    assert not nobody.allow_variable("default", "nomad/jobs/llmgw-other", "read", claim)
    assert not nobody.allow_variable("other-ns", "nomad/jobs/llmgw-tiny", "read", claim)
    assert not nobody.allow_variable("default", PATH, "read", claim)

    granted = ACL([parse_rules(POLICY)])
    assert granted.allow_variable("default", PATH, "read", claim)
    assert granted.allow_variable("default", PATH, "list", claim)  # read brings list
    assert not granted.allow_variable("default", PATH, "write", claim)
    globbed = ACL([parse_rules(POLICY.replace(PATH, "llmgw/sources/*"))])
    assert globbed.allow_variable("default", "llmgw/sources/other", "read", claim)
    denied = ACL([parse_rules(POLICY.replace('["read"]', '["read", "deny"]'))])
    assert not denied.allow_variable("default", PATH, "read", claim)
    with pytest.raises(PolicyError, match="Invalid variable capabilities"):
        parse_rules(POLICY.replace('"read"', '"peek"'))


@pytest.fixture
async def acl_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[StateStore, ClientRunner]]:
    monkeypatch.setattr(RestartTracker, "jitter", 0.0)
    store = new_store()
    store.variables[("default", PATH)] = {"Path": PATH, "Items": {"AWS_ACCESS_KEY_ID": "AKIA-TINY"}}
    async with running_client(store, tmp_path / "data", clock_speed=50) as client:
        client.acl = AclState(store, "bootstrap-secret")
        yield store, client


def attach(client: ClientRunner, name: str, job: str) -> None:
    """`nomad acl policy apply -namespace default -job JOB NAME` with the source policy."""
    assert client.acl is not None
    client.acl.upsert_policy(
        {"Name": name, "Rules": POLICY, "JobACL": {"Namespace": "default", "JobID": job}}
    )


def fetch_job() -> dict[str, Any]:
    text = (
        "profiles:\n  cpu: {engine: llama-cpp-python, engine_version: 0.3.36, gpus: 0}\n"
        f"models:\n  {MODEL}: {{source: 's3://weights/tiny.gguf', profile: cpu}}\n"
    )
    model = parse_models(text).models[MODEL]
    task = raw_exec_task(
        "fetch",
        sys.executable,
        ["-c", PRINT_KEY],
        Templates=[credentials_template(model)],
        RestartPolicy=restart_policy(attempts=0),
    )
    return make_job([task], job_id="llmgw-tiny", job_type="batch")


async def test_a_job_without_a_policy_for_its_source_variable_fails_with_nomads_403(
    acl_client: tuple[StateStore, ClientRunner],
) -> None:
    store, client = acl_client
    # A policy for another model's job grants this one nothing.
    attach(client, "src-other", "llmgw-other")
    alloc_id = start_alloc(store, client, fetch_job())
    alloc = await wait_alloc(store, alloc_id, lambda a: a["ClientStatus"] == "failed")
    killing = events_of(alloc, "Killing", task="fetch")
    assert killing and killing[0]["DisplayMessage"] == (
        f"Template failed: nomad.var.get({PATH}@default.global): Unexpected response code: 403 (Permission denied)"
    )


async def test_a_policy_attached_to_the_job_lets_its_template_read_the_variable(
    acl_client: tuple[StateStore, ClientRunner],
) -> None:
    store, client = acl_client
    attach(client, "src-tiny", "llmgw-tiny")
    alloc_id = start_alloc(store, client, fetch_job())
    alloc = await wait_alloc(store, alloc_id, lambda a: a["ClientStatus"] in ("complete", "failed"))
    assert alloc["ClientStatus"] == "complete", events_of(alloc, "Killing", task="fetch")
    assert client.log_path(alloc_id, "fetch", "stdout").read_text() == "AKIA-TINY\n"
