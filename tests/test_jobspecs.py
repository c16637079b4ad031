"""llmgw's own Nomad jobs (jobs/*.nomad.hcl): they parse, say what an operator relies on, and
keep secrets out of the jobspec."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest

from devstack.nomad.jobspec import JobspecError, parse_jobspec, parse_variables_file

JOBS = Path(__file__).resolve().parent.parent / "jobs"
PRODUCTION = sorted(JOBS.glob("llmgw-*.nomad.hcl"))
LOCAL = sorted((JOBS / "local").glob("llmgw-*.nomad.hcl"))
LOCAL_VARS = {"venv": "/opt/venv", "nomad_addr": "http://127.0.0.1:4646", "consul_addr": "127.0.0.1:8500"}


def parse(path: Path, **variables: object) -> dict:
    text = path.read_text()
    declared = {name.strip('"') for block in hcl2.loads(text).get("variable", []) for name in block}
    given = {k: v for k, v in {**LOCAL_VARS, **variables}.items() if k in declared}
    return parse_jobspec(text, given)


def test_there_are_three_production_jobs_and_three_local_variants() -> None:
    names = {p.name for p in PRODUCTION}
    assert names == {"llmgw-watcher.nomad.hcl", "llmgw-router.nomad.hcl", "llmgw-node-agent.nomad.hcl"}
    assert {p.name for p in LOCAL} == names


@pytest.mark.skipif(
    shutil.which("terraform") is None, reason="terraform not installed: its formatter is the HCL style check"
)
def test_jobspecs_are_formatted_as_nomad_fmt_would() -> None:
    done = subprocess.run(
        ["terraform", "fmt", "-check", "-recursive", str(JOBS)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_variable_is_typed_and_described() -> None:
    for path in PRODUCTION + LOCAL:
        for block in hcl2.loads(path.read_text()).get("variable", []):
            for name, body in block.items():
                assert "type" in body and "description" in body, f"{path.name}: variable {name}"


def test_watcher_runs_two_instances_on_distinct_hosts() -> None:
    group = parse(JOBS / "llmgw-watcher.nomad.hcl")["TaskGroups"][0]
    assert group["Count"] == 2
    assert {"LTarget": "", "RTarget": "true", "Operand": "distinct_hosts"} in group["Constraints"]
    assert group["Services"][0]["Checks"][0]["Path"] == "/healthz"


def test_router_registers_its_service_with_a_health_check_on_a_fixed_port() -> None:
    job = parse(JOBS / "llmgw-router.nomad.hcl", router_count=4)
    group = job["TaskGroups"][0]
    assert group["Count"] == 4
    assert group["Services"][0]["Name"] == "llmgw-router"
    assert group["Services"][0]["Checks"][0]["Type"] == "http"
    # On the host's network (tests/test_jobs_default_cluster.py): the port is the router's own.
    assert group["Networks"][0]["ReservedPorts"] == [{"Label": "http", "Value": 8080, "To": 0}]


def test_node_agent_is_a_system_job_on_the_gpu_pool() -> None:
    job = parse(JOBS / "llmgw-node-agent.nomad.hcl")
    assert job["Type"] == "system"
    assert job["NodePool"] == "gpu"


def test_addresses_default_to_the_local_agents_and_can_be_overridden() -> None:
    text = (JOBS / "llmgw-watcher.nomad.hcl").read_text()
    task = parse_jobspec(text)["TaskGroups"][0]["Tasks"][0]
    assert task["Env"]["NOMAD_ADDR"] == "http://127.0.0.1:4646"
    task = parse(JOBS / "llmgw-watcher.nomad.hcl", nomad_addr="https://nomad.internal:4646")["TaskGroups"][0][
        "Tasks"
    ][0]
    assert task["Env"]["NOMAD_ADDR"] == "https://nomad.internal:4646"


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: p.name)
def test_tokens_come_from_nomad_variables_never_from_the_jobspec(path: Path) -> None:
    task = parse(path)["TaskGroups"][0]["Tasks"][0]
    assert not any("TOKEN" in key for key in task["Env"])
    template = task["Templates"][0]
    assert template["Envvars"] is True
    assert template["DestPath"].startswith("${NOMAD_SECRETS_DIR}/")
    assert f'nomadVar "nomad/jobs/{parse(path)["ID"]}"' in template["EmbeddedTmpl"]
    # The router calls no Nomad API (the leading watcher scales for it), so it holds no token.
    has_token = "NOMAD_TOKEN={{ .nomad_token }}" in template["EmbeddedTmpl"]
    assert has_token == ("router" not in path.name)


@pytest.mark.parametrize("path", LOCAL, ids=lambda p: p.name)
def test_local_variants_run_llmgw_from_the_virtualenv(path: Path) -> None:
    task = parse(path)["TaskGroups"][0]["Tasks"][0]
    assert task["Driver"] == "raw_exec"
    assert task["Config"]["command"] == "/opt/venv/bin/llmgw"


def test_parser_refuses_what_it_does_not_understand_naming_the_block() -> None:
    text = 'job "x" {\n  group "g" {\n    volume "data" {\n      type = "host"\n    }\n  }\n}\n'
    with pytest.raises(JobspecError, match=r"job\.x\.group\.g: group has volume"):
        parse_jobspec(text)


def test_parser_refuses_undeclared_and_missing_variables() -> None:
    text = 'variable "venv" {\n  type = string\n}\njob "x" {\n  type = "service"\n}\n'
    with pytest.raises(JobspecError, match="variable 'venv' has no default"):
        parse_jobspec(text)
    with pytest.raises(JobspecError, match='Undefined variable; A "other" variable'):
        parse_jobspec(text, {"venv": "/v", "other": 1})


def test_variables_file_is_read_as_nomad_reads_it() -> None:
    assert parse_variables_file('venv = "/opt/venv"\nport = 8081\n') == {"venv": "/opt/venv", "port": 8081}


TLS_VARS = {
    "nomad_addr": "https://nomad.internal:4646",
    "consul_addr": "https://consul.internal:8501",
    "tls_dir": "/srv/pki/llmgw",
    # File names in tls_dir, which the task sees at /etc/llmgw/tls.
    "nomad_cacert": "nomad-ca.pem",
    "nomad_client_cert": "cli.pem",
    "nomad_client_key": "cli-key.pem",
    "consul_cacert": "consul-ca.pem",
    "consul_client_cert": "consul-cli.pem",
    "consul_client_key": "consul-cli-key.pem",
}


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: p.name)
def test_every_job_talks_tls_to_nomad_and_consul_when_told_to(path: Path) -> None:
    """The variables HashiCorp's CLIs read, pointing at files mounted from the node; the node
    agent talks only to Nomad."""
    task = parse(path, **TLS_VARS)["TaskGroups"][0]["Tasks"][0]
    env = task["Env"]
    if "router" in path.name:
        # Consul only: the router never calls Nomad.
        assert not any(key.startswith("NOMAD_") for key in env)
        assert env["CONSUL_HTTP_ADDR"] == "https://consul.internal:8501"
        assert env["CONSUL_CACERT"] == "/etc/llmgw/tls/consul-ca.pem"
        assert "/srv/pki/llmgw:/etc/llmgw/tls:ro" in task["Config"]["volumes"]
        return
    assert env["NOMAD_ADDR"] == "https://nomad.internal:4646"
    assert (env["NOMAD_CACERT"], env["NOMAD_CLIENT_CERT"], env["NOMAD_CLIENT_KEY"]) == (
        "/etc/llmgw/tls/nomad-ca.pem",
        "/etc/llmgw/tls/cli.pem",
        "/etc/llmgw/tls/cli-key.pem",
    )
    if "node-agent" not in path.name:
        assert env["CONSUL_HTTP_ADDR"] == "https://consul.internal:8501"
        assert env["CONSUL_CACERT"] == "/etc/llmgw/tls/consul-ca.pem"
        assert env["CONSUL_CLIENT_KEY"] == "/etc/llmgw/tls/consul-cli-key.pem"
    assert "/srv/pki/llmgw:/etc/llmgw/tls:ro" in task["Config"]["volumes"]
    # Without them nothing TLS is set: the code reads an empty variable as unset.
    plain = parse(path)["TaskGroups"][0]["Tasks"][0]["Env"]
    assert plain["NOMAD_ADDR"].startswith("http://") and not plain["NOMAD_CACERT"]


def test_the_watcher_advertises_the_hosts_address_of_its_admin_port() -> None:
    env = parse(JOBS / "llmgw-watcher.nomad.hcl")["TaskGroups"][0]["Tasks"][0]["Env"]
    assert env["LLMGW_ADMIN_ADVERTISE"] == "${NOMAD_ADDR_admin}"
