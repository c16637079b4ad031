"""Issue 13, item 8: the admin API and the router's keys by default. With no token anyone who
reached the admin API could `retry` (five failed starts a time) and read every source and
error, FastAPI's /docs were open, the shipped job listened on all interfaces without TLS,
`Bearer` was case-sensitive there, and `LLMGW_API_KEYS=" , "` served everyone with only a
warning."""

from __future__ import annotations

import os
import signal
import ssl
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from devstack.ports import free_port
from nomad_driver.cli.app import app as cli_app
from nomad_driver.cli.watcher import admin_token
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.admin import create_app
from tests.hostile.conftest import GuardedRouter, alpha_replica, chat
from tests.router.conftest import StartStub, write_self_signed
from tests.watcher_support import CRASH_AND_IDLE_MODELS, until, wait_for, watcher_on_standin

pytestmark = pytest.mark.timeout(120)

WATCHER = [sys.executable, "-m", "nomad_driver.cli", "watcher"]


async def test_beyond_loopback_reads_and_writes_need_the_token_and_docs_are_off(
    consul_url: str, start_standin: Any
) -> None:
    _standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, CRASH_AND_IDLE_MODELS, ident="w", clock_speed=20.0
    )
    await watcher.start()
    try:
        await until(lambda: "idle" in watcher.decisions, 30, "a first pass")
        app = create_app(watcher, token="sesame", guard_reads=True)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as c:
            for path in ("/v1/admin/models", "/v1/admin/summary", "/v1/admin/nodes", "/v1/admin/models/idle"):
                refused = await c.get(path)
                assert refused.status_code == 401, path
                assert "LLMGW_ADMIN_TOKEN" in refused.json()["error"]
            assert (await c.post("/v1/admin/models/idle/retry")).status_code == 401
            wrong = await c.get("/v1/admin/models", headers={"Authorization": "Bearer guess"})
            assert wrong.status_code == 401
            # The scheme in any case, as RFC 9110 has it and as the router reads it.
            for scheme in ("Bearer", "bearer", "BEARER"):
                ok = await c.get("/v1/admin/models", headers={"Authorization": f"{scheme} sesame"})
                assert ok.status_code == 200, scheme
            # Probes and Prometheus need no token.
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200
            for path in ("/docs", "/redoc", "/openapi.json"):
                docs = await c.get(path, headers={"Authorization": "Bearer sesame"})
                assert docs.status_code == 404, path
        with_docs = create_app(watcher, docs=True)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_docs), base_url="http://a") as c:
            assert (await c.get("/openapi.json")).status_code == 200
    finally:
        await watcher.stop()
        await consul.close()


def test_a_token_is_generated_when_the_api_listens_beyond_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLMGW_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("NOMAD_SECRETS_DIR", str(tmp_path))
    assert admin_token("127.0.0.1") == ("", "")
    assert admin_token("::1") == ("", "")
    token, note = admin_token("0.0.0.0")
    path = tmp_path / "llmgw-admin-token"
    assert len(token) >= 32
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert str(path) in note
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "mine")
    assert admin_token("0.0.0.0") == ("mine", "")


def test_api_keys_that_parse_to_no_key_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_API_KEYS", " , ")
    result = CliRunner().invoke(cli_app, ["router", "--listen", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "LLMGW_API_KEYS is set but holds no key" in result.output


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--tls-cert", "/etc/hostname"], "--tls-cert and --tls-key go together"),
        (
            ["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"],
            "--tls-cert /nonexistent.pem: no such file",
        ),
    ],
)
def test_the_watcher_refuses_half_a_tls_setting(args: list[str], problem: str) -> None:
    result = CliRunner().invoke(cli_app, ["watcher", "--listen", "127.0.0.1:1", *args])
    assert result.exit_code == 2, result.output
    assert problem in result.output


@pytest.mark.slow
def test_a_watcher_on_all_interfaces_generates_a_token_refuses_strangers_and_serves_https(
    tmp_path: Path, consul_url: str, start_standin: Any
) -> None:
    standin = start_standin(consul=False)
    httpx.put(f"{consul_url}/v1/kv/{CONFIG_MODELS_KEY}", content=CRASH_AND_IDLE_MODELS, timeout=5)
    cert, key, _expiry = write_self_signed(tmp_path)
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    port = free_port()
    env = dict(
        os.environ, CONSUL_HTTP_ADDR=consul_url, NOMAD_ADDR=standin.url, NOMAD_SECRETS_DIR=str(secrets_dir)
    )
    env.pop("LLMGW_ADMIN_TOKEN", None)
    log = tmp_path / "watcher.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*WATCHER, "--listen", f"0.0.0.0:{port}", "--tls-cert", str(cert), "--tls-key", str(key)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"https://127.0.0.1:{port}"
        tls = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=url, verify=tls, timeout=5) as client:

            def healthy() -> bool:
                try:
                    return client.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    return proc.poll() is not None  # gone: say so below rather than wait

            wait_for(healthy, 60, "the watcher's admin API over HTTPS")
            assert proc.poll() is None, log.read_text()
            # The token it generated, and where it says it put it.
            token_file = secrets_dir / "llmgw-admin-token"
            token = token_file.read_text().strip()
            assert len(token) >= 32
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
            said = log.read_text()
            assert f"generated a token into {token_file}" in said
            assert token not in said
            # Strangers can neither read nor write; the token holder can.
            for path in ("/v1/admin/models", "/v1/admin/summary", "/v1/admin/models/idle"):
                assert client.get(path).status_code == 401, path
            assert client.post("/v1/admin/models/idle/retry").status_code == 401
            auth = {"Authorization": f"bearer {token}"}
            wait_for(
                lambda: client.get("/v1/admin/models/idle", headers=auth).status_code == 200, 30, "a read"
            )
            assert client.post("/v1/admin/models/idle/retry", headers=auth).status_code != 401
            assert client.get("/docs", headers=auth).status_code == 404
        # It speaks only TLS there.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_the_router_reads_the_bearer_scheme_in_any_case(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    router = guarded_router(consul_url, api_keys=("sesame",))
    router.wait_ready("alpha", 1)
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        served = httpx.post(
            f"{router.url}/v1/chat/completions",
            json=chat(),
            headers={"Authorization": f"{scheme} sesame"},
            timeout=10,
        )
        assert served.status_code == 200, (scheme, served.text)
    for header in ("Bearer guess", "Basic sesame", "sesame"):
        refused = httpx.post(
            f"{router.url}/v1/chat/completions", json=chat(), headers={"Authorization": header}, timeout=10
        )
        assert refused.status_code == 401, header
        assert refused.json()["error"]["code"] == "invalid_api_key"
