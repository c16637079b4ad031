"""Issue 13, item 1: credentials in a source. `https://user:SECRET@host/x.gguf` reached end users
(the router's 503 and /v1/models), the admin API, `llmgw ctl`, the Consul UI, job meta, the
artifact and the logs. Now a source with a credential is refused with how to pass it instead,
and anything secret-looking is redacted wherever a source or an engine error is shown."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from nomad_driver.cli.app import app as cli_app
from nomad_driver.logs import LogfmtFormatter
from nomad_driver.spec import SpecError, parse_models, redact
from nomad_driver.state import CONFIG_MODELS_KEY
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica, chat
from tests.router.conftest import StartStub, get_definitions_kv, put_kv, put_state, wait_until

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cr3tVALUE"
SOURCES = [
    f"https://user:{SECRET}@example.com/x.gguf",
    f"https://{SECRET}@example.com/x.gguf",
    f"s3://bucket/x.gguf?aws_access_key_id=AKIAEXAMPLE&aws_access_key_secret={SECRET}",
    f"https://bucket.s3.amazonaws.com/x.gguf?X-Amz-Credential=a%2F{SECRET}&X-Amz-Signature={SECRET}",
    f"https://example.com/x.gguf?token={SECRET}",
    f"https://example.com/x.gguf?SIG={SECRET}",
]


def models_with(source: str) -> str:
    return f"""profiles:
  cpu: {{engine: llama-cpp-python, engine_version: b1, gpus: 0}}
models:
  m: {{source: "{source}", profile: cpu}}
"""


@pytest.mark.parametrize("source", SOURCES)
def test_a_source_with_a_credential_is_refused_with_how_to_pass_it(source: str, tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        parse_models(models_with(source))
    (problem,) = err.value.problems
    assert problem.startswith("models.m.source: ")
    assert "carries a credential" in problem
    assert "Nomad Variable" in problem and "docs/models.md" in problem
    assert SECRET not in problem
    path = tmp_path / "models.yaml"
    path.write_text(models_with(source))
    result = CliRunner().invoke(cli_app, ["render", str(path), "--check"])
    assert result.exit_code == 2
    assert SECRET not in result.output


def test_plain_sources_still_pass() -> None:
    for source in (
        "hf://Org/repo@main/x.gguf",
        "s3://bucket/x.gguf?region=eu-west-1",
        "https://h/x.gguf?v=2",
    ):
        parse_models(models_with(source))


def test_redact_hides_credentials_wherever_they_are_quoted() -> None:
    for source in SOURCES:
        assert SECRET not in redact(f"download {source} failed: 403")
    assert redact("Authorization: Bearer abc.def-ghi") == "Authorization: Bearer ***"
    assert "hf_" + "A" * 30 not in redact("HF_TOKEN=hf_" + "A" * 30)
    assert redact("hf://Org/repo@main/x.gguf") == "hf://Org/repo@main/x.gguf"
    record = logging.LogRecord("llmgw", logging.ERROR, "", 0, "fetch %s failed", (SOURCES[0],), None)
    assert SECRET not in LogfmtFormatter().format(record)


def test_an_engine_error_quoting_a_credential_never_reaches_clients(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    error = f"artifact download failed: GET {SOURCES[0]}: 403 Forbidden"
    defined = (
        "profiles:\n  cpu: {engine: llama-cpp-python, engine_version: b1, gpus: 0}\nmodels:\n"
        '  kev: {source: "file:///m/kev.gguf", profile: cpu, replicas: {min: 0, max: 1}}\n'
        '  far: {source: "file:///m/far.gguf", profile: cpu, replicas: {min: 0, max: 1}}\n'
    )
    put_kv(consul_url, CONFIG_MODELS_KEY, defined)
    put_state(consul_url, "kev", parked=True, consecutive_failures=5, last_error=error)
    put_state(consul_url, "far", unplaceable=True, placement_reason=f"fetching {SOURCES[2]}")
    router = guarded_router(consul_url)
    router.wait_ready("alpha", 1)
    wait_until(lambda: "kev" in router.app.discovery.snapshot.states, 10, "states read")
    wait_until(lambda: "kev" in router.app.discovery.snapshot.models, 10, "definitions read")
    with Bystander(router.url) as bystander:
        parked = httpx.post(f"{router.url}/v1/chat/completions", json=chat("kev"), timeout=10)
        listing = httpx.get(f"{router.url}/v1/models", timeout=10)
        # A definitions key written with a credential (by hand, past `llmgw apply`): refused,
        # and the problem shown without it.
        put_kv(consul_url, CONFIG_MODELS_KEY, models_with(SOURCES[0]))
        wait_until(lambda: router.app.discovery.snapshot.models_error, 10, "the problem reported")
        health = httpx.get(f"{router.url}/healthz", timeout=10)
        bystander.wait_served()
    assert parked.status_code == 503
    assert "artifact download failed" in parked.text
    for answer in (parked.text, listing.text, health.text):
        assert SECRET not in answer
    assert "carries a credential" in health.json()["models_error"]
    assert "far" in listing.text and "***" in listing.text
    bystander.assert_served()


@pytest.mark.parametrize("source", [SOURCES[0], SOURCES[2]])
def test_apply_refuses_a_source_with_a_credential_and_stores_nothing(
    source: str, tmp_path: Path, consul_url: str, start_standin: Any
) -> None:
    standin = start_standin(consul=False)
    env = {"CONSUL_HTTP_ADDR": consul_url, "NOMAD_ADDR": standin.url}
    good = tmp_path / "good.yaml"
    good.write_text(models_with("file:///models/m.gguf"))
    applied = CliRunner().invoke(
        cli_app, ["apply", str(good), "--auto-approve", "--allow-unplaceable"], env=env
    )
    assert applied.exit_code == 0, applied.output
    stored = get_definitions_kv(consul_url)
    jobs_before = httpx.get(f"{standin.url}/v1/jobs", timeout=10).json()
    assert stored and [j["ID"] for j in jobs_before] == ["llmgw-m"]

    bad = tmp_path / "bad.yaml"
    bad.write_text(models_with(source))
    refused = CliRunner().invoke(
        cli_app, ["apply", str(bad), "--auto-approve", "--allow-unplaceable"], env=env
    )
    assert refused.exit_code == 2, refused.output
    assert "carries a credential" in refused.output and "Nomad Variable" in refused.output
    assert SECRET not in refused.output
    # Nothing of it stored: the definitions and the jobs are what the good apply left.
    assert get_definitions_kv(consul_url) == stored
    jobs = httpx.get(f"{standin.url}/v1/jobs", timeout=10).json()
    assert [(j["ID"], j["JobModifyIndex"]) for j in jobs] == [
        (j["ID"], j["JobModifyIndex"]) for j in jobs_before
    ]
    job = httpx.get(f"{standin.url}/v1/job/llmgw-m", timeout=10).json()
    assert SECRET not in json.dumps(job)
