"""Nomad for the dev stack: a real `nomad agent -dev` when one is on PATH, else the stand-in.

Either way it listens on a free loopback port, registers services in the stack's Consul, runs
raw_exec tasks as local processes and offers the engines dir through client meta. The
stand-in also simulates the GPU fleet; a real dev agent has only the GPUs of this machine, so
with it the demo's GPU models are placed only where Nomad's nvidia plugin finds cards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from devstack.agent_tls import AgentTLS, verify
from devstack.fleet import ENGINE_VERSION
from devstack.ports import free_port, free_ports
from devstack.processes import spawn as _spawn_child

REPO = Path(__file__).resolve().parents[1]
Say = Callable[[str], None]


class NomadStartError(RuntimeError):
    """Nomad (real or the stand-in) did not start; the message names its log."""


def _wait_leader(
    url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float, ca: Path | None = None
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            resp = httpx.get(f"{url}/v1/status/leader", timeout=2, verify=verify(ca))
            if resp.status_code == 200 and resp.json():
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise NomadStartError(f"Nomad at {url} named no leader within {timeout:.0f}s; see {log}")


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_standin(
    *,
    nodes: Path,
    consul_url: str,
    data_dir: Path,
    log: Path,
    clock_speed: float,
    acl_bootstrap_token: str | None = None,
    consul_token: str | None = None,
    tls: AgentTLS | None = None,
    consul_ca: Path | None = None,
    timeout: float = 30.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """The stand-in on a free port; with `acl_bootstrap_token`, Nomad's ACLs on and that secret
    as the management token; with `consul_token`, the token it registers services with (a Nomad
    agent's `consul { token }`); with `tls`, its API over HTTPS with that certificate."""
    https = ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)] if tls else []
    consul_env = {"CONSUL_HTTP_TOKEN": consul_token} if consul_token else {}
    if consul_ca:
        consul_env["CONSUL_CACERT"] = str(consul_ca)
    env = {**os.environ, **consul_env} if consul_env else None
    acl = ["--acl-bootstrap-token", acl_bootstrap_token] if acl_bootstrap_token else []
    for _ in range(3):  # a free port may be taken before the stand-in binds it
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "devstack.nomad",
            "--listen",
            f"127.0.0.1:{port}",
            "--nodes",
            str(nodes),
            "--consul",
            consul_url,
            "--data-dir",
            str(data_dir),
            "--clock-speed",
            str(clock_speed),
            *acl,
            *https,
        ]
        proc = _spawn_child("nomad stand-in", argv, log, cwd=REPO, env=env)
        # `localhost` rather than 127.0.0.1: a name `nomad tls cert create` puts in the certificate.
        url = f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"
        if _wait_leader(url, proc, log, timeout, tls.ca if tls else None):
            return proc, url
        proc.wait()
        if "cannot listen" not in _tail(log):
            break
    raise NomadStartError(f"the Nomad stand-in exited during start-up; its log {log}:\n{_tail(log)}")


def real_nomad_config(*, data_dir: Path, consul_url: str, engines_dir: Path, ports: list[int]) -> str:
    http, rpc, serf = ports
    consul = consul_url.removeprefix("http://")
    return f"""# Written by 'python -m devstack up' for a real 'nomad agent -dev'.
data_dir  = "{data_dir}"
bind_addr = "127.0.0.1"
ports {{
  http = {http}
  rpc  = {rpc}
  serf = {serf}
}}
consul {{
  address = "{consul}"
}}
client {{
  node_pool = "gpu"
  meta {{
    llmgw_engines_dir             = "{engines_dir.resolve()}"
    llmgw_engine_llama_cpp_python = "{ENGINE_VERSION}"
  }}
}}
plugin "raw_exec" {{
  config {{
    enabled = true
  }}
}}
"""


def start_real(
    *, binary: str, consul_url: str, engines_dir: Path, state_dir: Path, log: Path, timeout: float = 60.0
) -> tuple[subprocess.Popen[bytes], str]:
    ports = free_ports(3)
    config = state_dir / "nomad-dev.hcl"
    data_dir = state_dir / "nomad-data"
    data_dir.mkdir(parents=True, exist_ok=True)
    config.write_text(
        real_nomad_config(data_dir=data_dir, consul_url=consul_url, engines_dir=engines_dir, ports=ports)
    )
    proc = _spawn_child("nomad agent -dev", [binary, "agent", "-dev", "-config", str(config)], log)
    url = f"http://127.0.0.1:{ports[0]}"
    if not _wait_leader(url, proc, log, timeout):
        raise NomadStartError(f"nomad agent -dev exited during start-up; its log {log}:\n{_tail(log)}")
    return proc, url


def find_nomad() -> str | None:
    return shutil.which("nomad")
