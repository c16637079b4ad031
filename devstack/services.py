"""llmgw's own services in the dev stack: two watchers and a router.

By default they run as Nomad jobs from `jobs/local/*.nomad.hcl`, the way an operator runs
them: the HCL goes through Nomad's `/v1/jobs/parse` (the stand-in's parser for llmgw's own
jobspecs, Nomad's own with a real agent) and is registered with `PUT /v1/jobs`. The watchers'
admin ports are Nomad's dynamic ports, so they are found where everything else is found: in
Consul, as the passing instances of `llmgw-watcher`. `--services process` runs the same three
commands as plain child processes instead, for when the Nomad in use cannot run raw_exec; the
stack then puts their services in Consul itself, as the jobs declare them (same names, tags and
checks), so that Prometheus finds them there either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devstack import processes
from devstack.agent_tls import verify
from devstack.nomad.jobspec import declared_variables, parse_jobspec, undefined_variable
from devstack.nomad_acls import StackTokens
from devstack.ports import free_port

REPO = Path(__file__).resolve().parents[1]
LOCAL_JOBS = REPO / "jobs" / "local"
WATCHER_JOB = "llmgw-watcher"
ROUTER_JOB = "llmgw-router"
NODE_AGENT_JOB = "llmgw-node-agent"

Say = Callable[[str], None]


class ServiceError(RuntimeError):
    """A service of the dev stack could not be registered or did not become healthy."""


@dataclass
class Services:
    """Where the router and the watchers answer, once they are up."""

    router_url: str = ""
    watcher_urls: list[str] = field(default_factory=list)
    children: list[processes.Child] = field(default_factory=list)


def hcl_variables(values: Mapping[str, object]) -> str:
    """An HCL variables file (`name = value` lines), the `Variables` of `/v1/jobs/parse`."""
    return "".join(f"{name} = {json.dumps(value)}\n" for name, value in values.items())


def nomad_headers(token: str | None) -> dict[str, str]:
    """The token header the `nomad` CLI sends (NOMAD_TOKEN); none where ACLs are off."""
    return {"X-Nomad-Token": token} if token else {}


def parse_job(
    nomad_url: str,
    hcl_path: Path,
    variables: Mapping[str, object],
    token: str | None = None,
    ca: Path | None = None,
) -> tuple[dict[str, Any], str]:
    """The job's API JSON, and who parsed the HCL. Strict about undeclared variables on this
    side, as `nomad job run` is (`-hcl2-strict`), since Nomad's `/v1/jobs/parse` only warns."""
    text = hcl_path.read_text()
    undeclared = sorted(set(variables) - declared_variables(text))
    if undeclared:
        raise ServiceError(f"Error parsing job file from {hcl_path}:\n{undefined_variable(undeclared[0])}")
    body = {"JobHCL": text, "Variables": hcl_variables(variables), "Canonicalize": True}
    resp = httpx.post(
        f"{nomad_url}/v1/jobs/parse", json=body, headers=nomad_headers(token), timeout=30, verify=verify(ca)
    )
    if resp.status_code != 200:
        raise ServiceError(f"{hcl_path}: Nomad refused to parse it: {resp.status_code} {resp.text.strip()}")
    job: dict[str, Any] = resp.json()
    return job, "Nomad's /v1/jobs/parse"


def register_job(
    nomad_url: str, job: Mapping[str, Any], token: str | None = None, ca: Path | None = None
) -> None:
    resp = httpx.put(
        f"{nomad_url}/v1/jobs", json={"Job": job}, headers=nomad_headers(token), timeout=30, verify=verify(ca)
    )
    if resp.status_code != 200:
        raise ServiceError(f"registering job {job.get('ID')!r}: {resp.status_code} {resp.text.strip()}")


def stop_job(nomad_url: str, job_id: str, token: str | None = None, ca: Path | None = None) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.delete(
            f"{nomad_url}/v1/job/{job_id}",
            params={"purge": "true"},
            headers=nomad_headers(token),
            timeout=10,
            verify=verify(ca),
        )


def job_ids(nomad_url: str, token: str | None = None, ca: Path | None = None) -> list[str]:
    try:
        resp = httpx.get(f"{nomad_url}/v1/jobs", headers=nomad_headers(token), timeout=10, verify=verify(ca))
        return [str(j["ID"]) for j in resp.json()] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


def running_allocs(
    nomad_url: str, job_id: str | None = None, token: str | None = None, ca: Path | None = None
) -> int:
    """Allocations of the job (or of every job) that still have processes."""
    path = f"/v1/job/{job_id}/allocations" if job_id else "/v1/allocations"
    try:
        resp = httpx.get(f"{nomad_url}{path}", headers=nomad_headers(token), timeout=10, verify=verify(ca))
        allocs = resp.json() if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(1 for a in allocs if a.get("ClientStatus") in ("pending", "running"))


def wait_allocs_gone(
    nomad_url: str, job_id: str | None, timeout: float, token: str | None = None, ca: Path | None = None
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running_allocs(nomad_url, job_id, token, ca) == 0:
            return True
        time.sleep(0.25)
    return False


def consul_headers(token: str | None) -> dict[str, str]:
    """The token header the `consul` CLI sends (CONSUL_HTTP_TOKEN); none where ACLs are off."""
    return {"X-Consul-Token": token} if token else {}


def passing_instances(
    consul_url: str, service: str, token: str | None = None, ca: Path | None = None
) -> list[str]:
    """`http://ADDRESS:PORT` of each passing instance of `service` in Consul."""
    try:
        resp = httpx.get(
            f"{consul_url}/v1/health/service/{service}",
            params={"passing": "1"},
            headers=consul_headers(token),
            timeout=10,
            verify=verify(ca),
        )
        entries = resp.json() if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return []
    urls = []
    for entry in entries:
        svc = entry.get("Service") or {}
        address = svc.get("Address") or (entry.get("Node") or {}).get("Address") or "127.0.0.1"
        urls.append(f"http://{address}:{svc.get('Port')}")
    return sorted(urls)


def _wait_for(what: str, check: Callable[[], bool], timeout: float, hint: Callable[..., str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise ServiceError(f"{what} not ready within {timeout:.0f}s; {hint()}")


def start_as_jobs(
    *,
    nomad_url: str,
    consul_url: str,
    venv: Path,
    watchers: int,
    max_start_failures: int,
    router_port: int,
    say: Say,
    logs_hint: str,
    timeout: float = 120.0,
    node_pool: str = "default",
    tokens: StackTokens | None = None,
    gpu_node_pool: str = "gpu",
    nomad_ca: Path | None = None,
    consul_ca: Path | None = None,
) -> Services:
    """With `tokens` (ACLs on) the jobs are registered with the management tokens, as an
    installer does, and each runs on the tokens of llmgw's own policies for it."""
    secrets = (
        {"nomad_token": tokens.watcher, "consul_token": tokens.consul.watcher, "admin_token": tokens.admin}
        if tokens
        else {}
    )
    installer = tokens.management if tokens else None
    consul_installer = tokens.consul.management if tokens else None
    watcher_vars = {
        "venv": str(venv),
        "nomad_addr": nomad_url,
        "consul_addr": consul_url,
        "watcher_count": watchers,
        "max_start_failures": max_start_failures,
        "node_pool": node_pool,
        **secrets,
        **({"nomad_cacert": str(nomad_ca)} if nomad_ca else {}),
        **({"consul_cacert": str(consul_ca)} if consul_ca else {}),
    }
    router_vars = {
        "venv": str(venv),
        "consul_addr": consul_url,
        "port": router_port,
        "node_pool": node_pool,
        **({"consul_token": tokens.consul.router, "api_keys": tokens.api_key} if tokens else {}),
        **({"consul_cacert": str(consul_ca)} if consul_ca else {}),
    }
    for job_id, variables in ((WATCHER_JOB, watcher_vars), (ROUTER_JOB, router_vars)):
        hcl = LOCAL_JOBS / f"{job_id}.nomad.hcl"
        job, parser = parse_job(nomad_url, hcl, variables, installer, nomad_ca)
        register_job(nomad_url, job, installer, nomad_ca)
        say(f"registered {job_id} from {hcl.relative_to(REPO)} (HCL parsed by {parser})")
    if tokens:
        # As an installer does (docs/operating.md, section 5): the node agent on the GPU pool,
        # on its own token, so that its policy is exercised too. Without ACLs the fleet file's
        # node meta stands in for it, and the stack spares two cores one process per node.
        node_agent_vars = {"venv": str(venv), "nomad_addr": nomad_url, "node_pool": gpu_node_pool}
        node_agent_vars["nomad_token"] = tokens.node_agent
        if nomad_ca:
            node_agent_vars["nomad_cacert"] = str(nomad_ca)
        hcl = LOCAL_JOBS / f"{NODE_AGENT_JOB}.nomad.hcl"
        job, _ = parse_job(nomad_url, hcl, node_agent_vars, installer, nomad_ca)
        register_job(nomad_url, job, installer, nomad_ca)
        say(f"registered {NODE_AGENT_JOB} from {hcl.relative_to(REPO)} on the pool {gpu_node_pool}")
    services = Services(router_url=f"http://127.0.0.1:{router_port}")
    _wait_for(
        f"{watchers} passing llmgw-watcher instances in Consul",
        lambda: len(passing_instances(consul_url, WATCHER_JOB, consul_installer, consul_ca)) >= watchers,
        timeout,
        lambda: f"see the job's allocations ({logs_hint})",
    )
    services.watcher_urls = passing_instances(consul_url, WATCHER_JOB, consul_installer, consul_ca)
    _wait_for(
        "the router",
        lambda: bool(passing_instances(consul_url, ROUTER_JOB, consul_installer, consul_ca)),
        timeout,
        lambda: f"see the job's allocations ({logs_hint})",
    )
    return services


def job_service(job_id: str, variables: Mapping[str, object]) -> dict[str, Any]:
    """The one service the local job declares (API JSON: Name, Tags, Checks), read from its HCL
    by the stand-in's parser, so that a process registers exactly what the job would."""
    hcl = LOCAL_JOBS / f"{job_id}.nomad.hcl"
    job = parse_jobspec(hcl.read_text(), dict(variables))
    (group,) = job["TaskGroups"]
    (service,) = group["Services"]
    return dict(service)


def register_service(
    consul_url: str,
    service: Mapping[str, Any],
    instance: str,
    port: int,
    token: str | None = None,
    ca: Path | None = None,
) -> None:
    """`service` (from job_service) in the local Consul agent for a process on 127.0.0.1:`port`,
    with its HTTP checks, as Nomad registers it for an allocation."""
    checks = [
        {
            "Name": f"{service['Name']} {check.get('Type', 'http')} check",
            "HTTP": f"http://127.0.0.1:{port}{check['Path']}",
            "Interval": f"{int(check['Interval']) // 1_000_000}ms",
            "Timeout": f"{int(check['Timeout']) // 1_000_000}ms",
        }
        for check in service.get("Checks") or []
    ]
    body = {
        "ID": f"{service['Name']}-{instance}",
        "Name": service["Name"],
        "Tags": list(service.get("Tags") or []),
        "Address": "127.0.0.1",
        "Port": port,
        "Checks": checks,
    }
    resp = httpx.put(
        f"{consul_url}/v1/agent/service/register",
        json=body,
        headers=consul_headers(token),
        timeout=10,
        verify=verify(ca),
    )
    if resp.status_code != 200:
        raise ServiceError(f"registering {body['ID']} in Consul: {resp.status_code} {resp.text.strip()}")


def start_as_processes(
    *,
    nomad_url: str,
    consul_url: str,
    venv: Path,
    watchers: int,
    max_start_failures: int,
    router_port: int,
    logs_dir: Path,
    say: Say,
    timeout: float = 120.0,
    tokens: StackTokens | None = None,
    nomad_ca: Path | None = None,
    consul_ca: Path | None = None,
) -> Services:
    llmgw = str(venv / "bin" / "llmgw")
    env = {**os.environ, "NOMAD_ADDR": nomad_url, "CONSUL_HTTP_ADDR": consul_url}
    if nomad_ca:
        env["NOMAD_CACERT"] = str(nomad_ca)
    if consul_ca:
        env["CONSUL_CACERT"] = str(consul_ca)
    # The router holds no Nomad token; the watchers get theirs, as their job would give them.
    watcher_env = env
    router_env = env
    if tokens:
        watcher_env = {
            **env,
            "NOMAD_TOKEN": tokens.watcher,
            "CONSUL_HTTP_TOKEN": tokens.consul.watcher,
            "LLMGW_ADMIN_TOKEN": tokens.admin,
        }
        router_env = {**env, "CONSUL_HTTP_TOKEN": tokens.consul.router, "LLMGW_API_KEYS": tokens.api_key}
    # The stack registers the processes' services as a Nomad agent would, with its token.
    agent_token = tokens.consul.management if tokens else None
    job_vars = {"venv": str(venv), "nomad_addr": nomad_url, "consul_addr": consul_url}
    watcher_service = job_service(WATCHER_JOB, job_vars)
    # The router never calls Nomad: the leading watcher scales for it.
    router_vars = {k: v for k, v in job_vars.items() if k != "nomad_addr"}
    router_service = job_service(ROUTER_JOB, {**router_vars, "port": router_port})
    services = Services(router_url=f"http://127.0.0.1:{router_port}")
    started: list[tuple[processes.Child, str]] = []
    for n in range(watchers):
        port = free_port()
        name = f"watcher-{n}"
        argv = [
            llmgw,
            "watcher",
            "--listen",
            f"127.0.0.1:{port}",
            "--max-start-failures",
            str(max_start_failures),
        ]
        proc = processes.spawn(name, argv, logs_dir / f"{name}.log", env=watcher_env)
        child = processes.Child(name, proc.pid, str(logs_dir / f"{name}.log"))
        services.children.append(child)
        started.append((child, f"http://127.0.0.1:{port}/healthz"))
        services.watcher_urls.append(f"http://127.0.0.1:{port}")
        register_service(consul_url, watcher_service, name, port, agent_token, consul_ca)
    proc = processes.spawn(
        "router",
        [llmgw, "router", "--listen", f"127.0.0.1:{router_port}"],
        logs_dir / "router.log",
        env=router_env,
    )
    router = processes.Child("router", proc.pid, str(logs_dir / "router.log"))
    services.children.append(router)
    started.append((router, f"{services.router_url}/healthz"))
    register_service(consul_url, router_service, "router", router_port, agent_token, consul_ca)
    say(
        f"started {watchers} watchers and a router as child processes (logs in {logs_dir}), "
        f"registered in Consul as {WATCHER_JOB} and {ROUTER_JOB} with their jobs' tags and checks"
    )
    for child, health in started:

        def healthy(url: str = health, pid: int = child.pid, name: str = child.name) -> bool:
            if not processes.alive(pid):
                raise ServiceError(f"{name} exited during start-up; see {logs_dir / (name + '.log')}")
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_for(child.name, healthy, timeout, lambda log=child.log: f"see {log}")
    return services


def venv_root() -> Path:
    """The virtualenv this process runs in (its `bin/llmgw` is what the jobs run)."""
    return Path(sys.prefix)
