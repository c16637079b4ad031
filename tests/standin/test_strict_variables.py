"""Undefined variables: `nomad job run` is strict, `/v1/jobs/parse` is not.

jobspec2 reports a value for a variable that no `variable` block declares as a diagnostic whose
severity is an error only with `ParseConfig.Strict` (hashicorp/nomad jobspec2/types.variables.go,
`collectInputVariableValues`: "Undefined variable"). `nomad job run` sets it from `-hcl2-strict`,
true by default (command/job_run.go, command/helpers.go `JobGetter.Get`); the HTTP endpoint
builds its ParseConfig without it (command/agent/job_endpoint.go `JobsParseRequest`), so there
the value is dropped with a warning nobody sees. The dev stack runs jobs/*.hcl as an operator's
`nomad job run` does, so it is strict whichever Nomad parses.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from devstack.services import LOCAL_JOBS, ServiceError, parse_job
from tests.fixtures.nomad import StandIn

ROUTER = LOCAL_JOBS / "llmgw-router.nomad.hcl"
ROUTER_VARS = {"venv": "/opt/venv", "consul_addr": "http://127.0.0.1:8500", "port": 8080}


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def test_the_parse_endpoint_drops_an_undeclared_variable_as_nomads_does(standin: StandIn) -> None:
    body = {
        "JobHCL": ROUTER.read_text(),
        "Variables": 'venv = "/opt/venv"\nconsul_addr = "http://c:8500"\nno_such = "x"\n',
    }
    resp = httpx.post(f"{standin.url}/v1/jobs/parse", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json()["ID"] == "llmgw-router"


def test_the_dev_stack_refuses_an_undeclared_variable_as_job_run_does(standin: StandIn) -> None:
    with pytest.raises(ServiceError) as refused:
        parse_job(standin.url, ROUTER, {**ROUTER_VARS, "no_such": "x"})
    message = str(refused.value)
    assert str(ROUTER) in message
    assert 'Undefined variable; A "no_such" variable was set but was not found in known variables' in message


def test_the_dev_stack_runs_its_jobs_with_only_declared_variables(standin: StandIn) -> None:
    job, _ = parse_job(standin.url, ROUTER, ROUTER_VARS)
    assert job["ID"] == "llmgw-router"
