"""llmgw's three jobs on a cluster with the defaults Nomad and Consul ship with: a Docker plugin
that mounts no host path, a Consul agent that listens on 127.0.0.1 only, and `nomad job run`
refusing variables a job does not declare. And with TLS, the files mounted where nothing of the
image lives, through the one variables file the docs show."""

from __future__ import annotations

import re
from pathlib import Path

import hcl2
import pytest

from devstack.nomad.docker import volumes_refusal
from devstack.nomad.jobspec import JobspecError, parse_jobspec, parse_variables_file

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
PRODUCTION = sorted(JOBS.glob("llmgw-*.nomad.hcl"))
# Where the jobs mount the operator's TLS directory inside the container: a path of llmgw's
# own, so it can never cover the image's CA bundle (/etc/ssl/certs) or anything else in it.
TLS_MOUNT = "/etc/llmgw/tls"


def task_of(path: Path, variables: dict[str, object] | None = None) -> dict:
    return parse_jobspec(path.read_text(), variables or {})["TaskGroups"][0]["Tasks"][0]


def docs_tls_vars() -> str:
    """The variables file docs/operating.md section 9 tells the operator to write."""
    page = (ROOT / "docs" / "operating.md").read_text()
    match = re.search(r"cat > tls\.vars\.hcl <<'VARS'\n(.*?)\nVARS\n", page, re.S)
    assert match, "docs/operating.md no longer shows tls.vars.hcl"
    return match.group(1)


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: p.name)
def test_without_a_tls_dir_no_job_mounts_a_tls_directory(path: Path) -> None:
    config = task_of(path)["Config"]
    volumes = config.get("volumes") or []
    assert not any(TLS_MOUNT in v or "/etc/ssl" in v for v in volumes), volumes
    if "node-agent" not in path.name:
        # The watcher and router need no host path at all: they run on Docker's defaults.
        assert volumes_refusal(config, volumes_enabled=False) is None


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: p.name)
def test_a_tls_dir_is_mounted_read_only_under_llmgws_own_path(path: Path) -> None:
    task = task_of(path, {"tls_dir": "/etc/ssl/certs", "nomad_cacert": "nomad-agent-ca.pem"})
    assert "/etc/ssl/certs:/etc/llmgw/tls:ro" in task["Config"]["volumes"]
    assert not any(v.split(":")[1].startswith("/etc/ssl") for v in task["Config"]["volumes"])
    if "router" not in path.name:
        assert task["Env"]["NOMAD_CACERT"] == f"{TLS_MOUNT}/nomad-agent-ca.pem"


def test_the_node_agent_is_refused_by_a_default_docker_plugin_and_says_why() -> None:
    """It must read the engines and weights on the node: the one job that needs the GPU
    nodes' Docker plugin to allow host volumes, which docs/getting-started.md step 1 says."""
    config = task_of(JOBS / "llmgw-node-agent.nomad.hcl")["Config"]
    refusal = volumes_refusal(config, volumes_enabled=False)
    assert refusal is not None and refusal.startswith("volumes are not enabled; cannot mount host path")
    assert volumes_refusal(config, volumes_enabled=True) is None
    step1 = (ROOT / "docs" / "getting-started.md").read_text().split("## 2.")[0]
    assert "volumes" in step1 and "enabled = true" in step1


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: p.name)
def test_the_docs_tls_variables_file_runs_every_job_strictly(path: Path) -> None:
    """`nomad job run -var-file tls.vars.hcl` is strict: a variable the job does not declare
    is an error (jobspec2 `Strict`), so every job declares every one the file sets."""
    variables = parse_variables_file(docs_tls_vars())
    task = task_of(path, variables)
    assert any(v.endswith(f":{TLS_MOUNT}:ro") for v in task["Config"]["volumes"])
    for name, value in task["Env"].items():
        if name.endswith(("_CACERT", "_CLIENT_CERT", "_CLIENT_KEY")) and value:
            assert value.startswith(f"{TLS_MOUNT}/"), (name, value)


def test_an_undeclared_variable_is_still_refused() -> None:
    with pytest.raises(JobspecError, match='Undefined variable; A "no_such" variable'):
        task_of(JOBS / "llmgw-router.nomad.hcl", {"no_such": "x"})


@pytest.mark.parametrize(
    ("path", "cert_var", "env_var"),
    [
        (JOBS / "llmgw-router.nomad.hcl", "router_tls_cert", "LLMGW_ROUTER_TLS_CERT"),
        (JOBS / "llmgw-watcher.nomad.hcl", "admin_tls_cert", "LLMGW_ADMIN_TLS_CERT"),
    ],
    ids=["router", "watcher"],
)
def test_serving_tls_has_job_variables_and_the_check_speaks_https(
    path: Path, cert_var: str, env_var: str
) -> None:
    key_var, key_env = cert_var.replace("cert", "key"), env_var.replace("CERT", "KEY")
    plain = parse_jobspec(path.read_text())["TaskGroups"][0]
    assert plain["Services"][0]["Checks"][0].get("Protocol", "http") in ("", "http")
    job = parse_jobspec(
        path.read_text(), {"tls_dir": "/etc/llmgw/tls", cert_var: "serving.pem", key_var: "serving-key.pem"}
    )
    group = job["TaskGroups"][0]
    env = group["Tasks"][0]["Env"]
    assert (env[env_var], env[key_env]) == (f"{TLS_MOUNT}/serving.pem", f"{TLS_MOUNT}/serving-key.pem")
    check = group["Services"][0]["Checks"][0]
    assert check["Protocol"] == "https"
    # Consul runs the check against the task's IP, a name no serving certificate carries.
    assert check["TLSSkipVerify"] is True


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: p.name)
def test_default_addresses_reach_agents_that_listen_on_loopback_only(path: Path) -> None:
    """Consul's default `client_addr` is 127.0.0.1 (agent/config/default.go): a task on
    Docker's bridge network cannot reach it at the node's IP, nor at its own 127.0.0.1. On the
    host's network the agents' loopback addresses work, and they are names that certificates
    from `nomad tls cert create` and `consul tls cert create` carry."""
    task = task_of(path)
    assert task["Config"].get("network_mode") == "host"
    env = task["Env"]
    if "CONSUL_HTTP_ADDR" in env:
        assert env["CONSUL_HTTP_ADDR"] == "http://127.0.0.1:8500"
    if "NOMAD_ADDR" in env:
        assert env["NOMAD_ADDR"] == "http://127.0.0.1:4646"
    # On the host's network the task listens on the port Nomad gave it, not a mapped one.
    args = " ".join(task["Config"]["args"])
    port_label = parse_jobspec(path.read_text())["TaskGroups"][0]["Services"][0]["PortLabel"]
    assert f"${{NOMAD_PORT_{port_label}}}" in args


def test_every_jobs_tls_variables_are_declared_alike() -> None:
    """One file of TLS variables serves all three jobs: each declares the same set."""
    names = []
    for path in PRODUCTION:
        declared = {n.strip('"') for block in hcl2.loads(path.read_text()).get("variable", []) for n in block}
        names.append({n for n in declared if "tls" in n or n.endswith(("_cacert", "_cert", "_key", "_addr"))})
    shared = set.intersection(*names)
    assert set(parse_variables_file(docs_tls_vars())) <= shared
