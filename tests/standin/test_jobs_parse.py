"""`/v1/jobs/parse`: llmgw's own jobspecs (jobs/local/*.nomad.hcl) turned into API jobs by the
stand-in, then registered and placed, as `nomad job run` does on the client side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nomad
import pytest

from devstack.ports import free_port
from tests.fixtures.nomad import REPO, StandIn
from tests.standin.api_helpers import eval_done, live_allocs, wait_for

LOCAL_JOBS = sorted((REPO / "jobs" / "local").glob("*.nomad.hcl"))


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def fake_venv(tmp_path: Path) -> Path:
    """A venv whose `bin/llmgw` only sleeps: the jobs' raw_exec tasks start, and nothing else
    runs (the real router, watcher and agent have their own tests)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    llmgw = venv / "bin" / "llmgw"
    llmgw.write_text("#!/bin/sh\nexec sleep 3600\n")
    llmgw.chmod(0o755)
    return venv


def variables_for(path: Path, venv: Path, standin: StandIn) -> str:
    text = path.read_text()
    values = {"venv": str(venv), "nomad_addr": standin.url, "consul_addr": "http://127.0.0.1:1"}
    if 'variable "port"' in text:
        values["port"] = str(free_port())
    if 'variable "admin_port"' in text:
        values["admin_port"] = str(free_port())
    lines = []
    for name, value in values.items():
        if f'variable "{name}"' in text:
            lines.append(f"{name} = {value}" if value.isdigit() else f'{name} = "{value}"')
    return "\n".join(lines) + "\n"


def parse(standin: StandIn, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{standin.url}/v1/jobs/parse", json=body, timeout=10)


def test_llmgw_jobspecs_exist() -> None:
    names = {p.name for p in LOCAL_JOBS}
    assert {"llmgw-node-agent.nomad.hcl", "llmgw-router.nomad.hcl", "llmgw-watcher.nomad.hcl"} <= names


@pytest.mark.parametrize("path", LOCAL_JOBS, ids=lambda p: p.name)
def test_local_jobspec_parses_and_registers(standin: StandIn, tmp_path: Path, path: Path) -> None:
    venv = fake_venv(tmp_path)
    response = parse(
        standin,
        {"JobHCL": path.read_text(), "Variables": variables_for(path, venv, standin), "Canonicalize": True},
    )
    assert response.status_code == 200, response.text
    job = response.json()
    assert "Job" not in job, "the answer is the bare Job"
    assert job["ID"] == path.name.removesuffix(".nomad.hcl")
    assert job["Region"] == "global" and job["Namespace"] == "default"  # canonicalised
    task = job["TaskGroups"][0]["Tasks"][0]
    assert task["Config"]["command"] == f"{venv}/bin/llmgw"

    client = standin.client()
    result = client.jobs.register_job({"Job": job})
    evaluation = eval_done(client, result["EvalID"])
    assert evaluation["Status"] == "complete" and evaluation["FailedTGAllocs"] is None, evaluation
    want = (
        len(client.nodes.get_nodes())
        if job["Type"] == "system"
        else sum(g["Count"] for g in job["TaskGroups"])
    )
    allocs = wait_for(
        lambda: live_allocs(client, job["ID"]) if len(live_allocs(client, job["ID"])) == want else None,
        what=f"{want} allocations of {job['ID']}",
    )
    if job["Type"] == "system":
        assert len({a["NodeID"] for a in allocs}) == want
    wait_for(
        lambda: all(a["ClientStatus"] == "running" for a in live_allocs(client, job["ID"])),
        what=f"{job['ID']} running",
    )


def test_parse_without_canonicalize_leaves_defaults_unset(standin: StandIn, tmp_path: Path) -> None:
    path = REPO / "jobs" / "local" / "llmgw-node-agent.nomad.hcl"
    venv = fake_venv(tmp_path)
    job = parse(standin, {"JobHCL": path.read_text(), "Variables": variables_for(path, venv, standin)}).json()
    assert job["Type"] == "system"
    assert "Region" not in job or job["Region"] in (None, "")
    # python-nomad's own call reaches the same endpoint (no variables, so it must fail cleanly).
    with pytest.raises(nomad.api.exceptions.BadRequestNomadException) as err:
        standin.client().jobs.parse(path.read_text())
    assert "Failed to parse job" in err.value.nomad_resp.text


def test_parse_errors(standin: StandIn) -> None:
    empty = parse(standin, {"JobHCL": "  "})
    assert (empty.status_code, empty.text) == (400, "Job spec is empty")
    broken = parse(standin, {"JobHCL": 'job "x" { group "g" {'})
    assert broken.status_code == 400 and broken.text.startswith("Failed to parse job: ")
    undeclared = parse(standin, {"JobHCL": 'job "x" {\n}\n', "Variables": 'nope = "1"\n'})
    assert undeclared.status_code == 400 and "nope" in undeclared.text
    assert httpx.get(f"{standin.url}/v1/jobs/parse").status_code == 405
