"""`llmgw plan` and `llmgw apply` on a stand-in with Nomad ACLs on, with the token an operator
would hold: one with docs/policies/llmgw-operator.nomad.hcl is enough for both, and one without
`submit-job` is refused as Nomad refuses it, before anything is registered."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from devstack.demo_models import TEMPLATE, effective_models_text
from nomad_driver.cli.app import app
from nomad_driver.nomad import Nomad
from tests.fixtures.nomad import StandIn
from tests.standin.test_acl_llmgw_policies import BOOTSTRAP, make_token, policy
from tests.test_plan import demo_fleet, single_node_demo

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster(
    consul_url: str, start_standin: Callable[..., StandIn], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> StandIn:
    standin = start_standin(
        nodes=demo_fleet(tmp_path), consul=False, extra_args=["--acl-bootstrap-token", BOOTSTRAP]
    )
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    return standin


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(single_node_demo(effective_models_text(TEMPLATE.read_text(), tmp_path)))
    return path


def test_the_operators_policy_plans_and_applies(
    cluster: StandIn, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOMAD_TOKEN", make_token(cluster.url, policy("operator")))
    planned = CliRunner().invoke(app, ["plan", str(demo), "--json"])
    assert planned.exit_code == 7, planned.output  # phi-4 fits nowhere on purpose, as in test_plan
    assert json.loads(planned.stdout)["summary"]["added"] == 4
    applied = CliRunner().invoke(app, ["apply", "--auto-approve", "--allow-unplaceable", str(demo)])
    assert applied.exit_code == 0, applied.output
    assert "applied 4 models: 4 registered" in applied.stdout
    assert Nomad(cluster.url, token=BOOTSTRAP).get_job("llmgw-gemma-3-270m") is not None


def test_an_operator_token_without_submit_job_is_refused(
    cluster: StandIn, demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = re.sub(r'"submit-job",?\s*', "", policy("operator"))
    monkeypatch.setenv("NOMAD_TOKEN", make_token(cluster.url, short))
    planned = CliRunner().invoke(app, ["plan", str(demo)])
    assert planned.exit_code != 0 and "Permission denied" in planned.output, planned.output
    monkeypatch.setenv("NOMAD_TOKEN", str(uuid.uuid4()))
    unknown = CliRunner().invoke(app, ["plan", str(demo)])
    assert unknown.exit_code != 0 and "ACL token not found" in unknown.output, unknown.output
    assert Nomad(cluster.url, token=BOOTSTRAP).get_job("llmgw-gemma-3-270m") is None
