"""`LLMGW_ROUTER_TLS_CERT` and `LLMGW_ROUTER_TLS_KEY` make `llmgw router` serve HTTPS, as the
operating guide says, and the certificate served is the one whose expiry the router publishes."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import httpx

from devstack import lifetime
from devstack.ports import free_port
from tests.router.conftest import wait_until, write_self_signed


def test_the_router_serves_https_with_the_certificate_from_the_environment(
    consul_url: str, tmp_path: Path
) -> None:
    cert, key, _ = write_self_signed(tmp_path)
    port = free_port()
    env = {
        **os.environ,
        "CONSUL_HTTP_ADDR": consul_url,
        "LLMGW_ROUTER_LISTEN": f"127.0.0.1:{port}",
        "LLMGW_ROUTER_TLS_CERT": str(cert),
        "LLMGW_ROUTER_TLS_KEY": str(key),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "nomad_driver.cli", "router"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lifetime.die_with_parent,
    )
    verify = ssl.create_default_context(cafile=str(cert))

    def answers() -> bool:
        try:
            return httpx.get(f"https://127.0.0.1:{port}/healthz", verify=verify, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(answers, 30, "llmgw router to answer /healthz over HTTPS")
        metrics = httpx.get(f"https://127.0.0.1:{port}/metrics", verify=verify, timeout=5).text
        assert f'llmgw_tls_cert_expiry_timestamp_seconds{{path="{cert}"}}' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=15)
