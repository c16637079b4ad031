"""Limits and timeouts on every phase, TLS, and the `llmgw router` command's own checks."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from devstack import lifetime
from devstack.ports import free_port
from nomad_driver.cli.app import app as cli_app
from router.config import ConfigError, Timeouts, from_env, load_api_keys, normalise_addr, parse_listen
from router.proxy import BACKLOG_BYTES
from tests.router.conftest import StartRouter, StartStub, register_replica, wait_until, write_self_signed


def chat(model: str = "alpha", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_a_replica_silent_past_the_first_byte_timeout_is_a_504(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    slow = stub_engine("slow", delay=5)
    register_replica(consul_url, "alpha", slow.port, "alpha-slow")
    router = start_router(consul_url, timeouts=Timeouts(first_byte_s=1.0))
    router.wait_ready("alpha", 1)
    started = time.monotonic()
    resp = httpx.post(f"{router.url}/v1/chat/completions", json=chat(), timeout=20)
    assert time.monotonic() - started < 4
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "upstream_timeout"
    assert "no answer within 1s" in resp.json()["error"]["message"]


def test_a_stream_that_stalls_between_chunks_ends_with_an_error_event(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    stalling = stub_engine("stall", chunks=3, chunk_delay=3)
    register_replica(consul_url, "alpha", stalling.port, "alpha-stall")
    router = start_router(consul_url, timeouts=Timeouts(between_chunks_s=1.0))
    router.wait_ready("alpha", 1)
    started = time.monotonic()
    resp = httpx.post(f"{router.url}/v1/chat/completions", json=chat(stream=True), timeout=20)
    assert time.monotonic() - started < 2.9
    events = [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert "choices" in json.loads(events[0])
    assert json.loads(events[-1])["error"]["code"] == "upstream_failed"
    assert "sent nothing for 1s" in json.loads(events[-1])["error"]["message"]


def test_too_many_headers_is_431(consul_url: str, start_router: StartRouter) -> None:
    router = start_router(consul_url)
    headers = {f"x-filler-{i}": "v" for i in range(150)}
    resp = httpx.post(f"{router.url}/v1/chat/completions", json=chat(), headers=headers, timeout=10)
    assert resp.status_code == 431
    assert resp.json()["error"]["code"] == "headers_too_large"


def test_the_router_serves_https_when_given_a_certificate(
    tmp_path: Path, consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    cert, key, _ = write_self_signed(tmp_path)
    stub = stub_engine("r1")
    register_replica(consul_url, "alpha", stub.port, "alpha-1")
    router = start_router(consul_url, tls_cert=str(cert), tls_key=str(key))
    router.wait_ready("alpha", 1)
    assert router.url.startswith("https://")
    resp = httpx.post(
        f"{router.url}/v1/chat/completions",
        json=chat(),
        verify=ssl.create_default_context(cafile=str(cert)),
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    with pytest.raises(httpx.HTTPError):
        httpx.post(router.url.replace("https", "http") + "/v1/chat/completions", json=chat(), timeout=5)


def test_api_keys_come_from_a_file_and_the_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-a\n\n  sk-b  \nsk-a\n")
    assert load_api_keys(str(keys), "sk-c, sk-b") == ("sk-a", "sk-b", "sk-c")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="no keys in it"):
        load_api_keys(str(empty))
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"))


def test_addresses_are_read_the_way_hashicorp_tools_write_them() -> None:
    assert parse_listen("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    for bad in ("8080", "host:port", "h:70000"):
        with pytest.raises(ConfigError, match="listen address"):
            parse_listen(bad)
    assert normalise_addr("127.0.0.1:8500") == "http://127.0.0.1:8500"
    assert normalise_addr("127.0.0.1:8501", "true") == "https://127.0.0.1:8501"
    assert normalise_addr("https://consul.example:8501/") == "https://consul.example:8501"


def test_the_router_command_refuses_bad_settings_with_one_clear_line(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli_app, ["router", "--listen", "nonsense"])
    assert result.exit_code == 2
    assert "llmgw router: listen address 'nonsense'" in result.output
    result = runner.invoke(cli_app, ["router", "--tls-cert", str(tmp_path / "c.pem")])
    assert result.exit_code == 2
    assert "--tls-cert and --tls-key go together" in result.output
    result = runner.invoke(cli_app, ["router", "--help"])
    assert result.exit_code == 0
    assert "--api-keys-file" in result.output


def test_llmgw_router_serves_until_sigterm(consul_url: str, tmp_path: Path) -> None:
    port = free_port()
    keys = tmp_path / "keys"
    keys.write_text("sk-cli\n")
    env = {
        **os.environ,
        "CONSUL_HTTP_ADDR": consul_url.removeprefix("http://"),
        "LLMGW_ROUTER_LISTEN": f"127.0.0.1:{port}",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from nomad_driver.cli.app import main; main()",
            "router",
            "--api-keys-file",
            str(keys),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lifetime.die_with_parent,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{url}/healthz"), 30, "llmgw router to answer /healthz")
        assert httpx.get(f"{url}/healthz", timeout=5).json()["consul"]["addr"] == consul_url
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        listing = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer sk-cli"}, timeout=5)
        assert listing.status_code == 200 and listing.json()["object"] == "list"
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=15)[0].decode(errors="replace")
    # Uvicorn shuts down cleanly, then re-raises the signal it caught, as a process should.
    assert proc.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_event_larger_than_the_buffer_is_passed_on_as_it_comes(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    big = stub_engine("big", chunks=1, big_event=3 * 1024 * 1024)
    register_replica(consul_url, "alpha", big.port, "alpha-big")
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    received = 0
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{router.url}/v1/chat/completions", json=chat(stream=True), timeout=20
    ) as resp:
        for piece in resp.iter_bytes():
            received += len(piece)
            if received > 2 * 1024 * 1024:
                break
    # Held whole, it would arrive only after the stub's 3 s pause.
    assert time.monotonic() - started < 2.5
    assert received > 2 * 1024 * 1024


def test_a_client_that_hangs_up_before_the_answer_cancels_the_replicas_request(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    slow = stub_engine("slow", delay=30)
    register_replica(consul_url, "alpha", slow.port, "alpha-slow")
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{router.url}/v1/chat/completions", json=chat(), timeout=0.5)
    router.expect_metric("llmgw_router_early_ends_total", 1, model="alpha", kind="upstream")
    router.expect_metric("llmgw_router_requests_total", 1, model="alpha", code="499")
    # The replica's connection is closed, not left open for 30 s.
    assert router.app.balancer.outstanding == {}


def never_reading_stream(router_url: str) -> socket.socket:
    """A streamed request on a plain socket that is never read. Its receive buffer is small, as
    a slow client's window is; with the kernel's default a client can take megabytes unread."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(router_url.rsplit(":", 1)[1])))
    body = json.dumps(chat(stream=True)).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_clients_that_stop_reading_are_dropped_at_the_send_deadline(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    # Streams far larger than any socket buffer, sent as fast as the stub can.
    endless = stub_engine("endless", chunks=1_000_000)
    register_replica(consul_url, "alpha", endless.port, "alpha-endless")
    router = start_router(consul_url, timeouts=Timeouts(client_send_s=1.0))
    router.wait_ready("alpha", 1)
    socks = [never_reading_stream(router.url) for _ in range(20)]
    try:
        started = time.monotonic()
        router.expect_metric(
            "llmgw_router_early_ends_total", 20, timeout=60, model="alpha", kind="stopped_reading"
        )
        assert time.monotonic() - started < 60
        # Their replica's requests went with them: nothing is left open on the stub.
        assert router.app.balancer.outstanding == {}
        assert httpx.post(f"{router.url}/v1/chat/completions", json=chat(), timeout=10).status_code == 200
    finally:
        for sock in socks:
            sock.close()


def test_a_stream_is_read_ahead_of_a_client_that_does_not_read_up_to_its_bound_and_no_further(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    """The router keeps reading a replica's stream while its client is slow, so the engine is not
    held by it, but only up to the backlog bound: past that the engine waits for the client, and
    at the write deadline both go."""
    endless = stub_engine("endless", chunks=1_000_000)
    register_replica(consul_url, "alpha", endless.port, "alpha-endless")
    router = start_router(consul_url, timeouts=Timeouts(client_send_s=8.0))
    router.wait_ready("alpha", 1)

    def held() -> float:
        return router.metric("llmgw_router_backlog_bytes")

    socks = [never_reading_stream(router.url) for _ in range(2)]
    try:
        # Each stream is read ahead of its client to the bound: the engine was not held back...
        wait_until(lambda: held() >= 2 * BACKLOG_BYTES, 8, "two full backlogs")
        # ...and not past it (one chunk over at most): the engine waits now.
        for _ in range(10):
            assert held() <= 2 * (BACKLOG_BYTES + 256 * 1024), held()
            time.sleep(0.1)
        router.expect_metric(
            "llmgw_router_early_ends_total", 2, timeout=15, model="alpha", kind="stopped_reading"
        )
        assert held() == 0

        # The engine's own view: both streams were cut off, having sent little past the bound.
        def ended() -> list[str]:
            return [line for line in endless.log.read_text().splitlines() if "client gone" in line]

        wait_until(lambda: len(ended()) == 2, 10, "the stub to see both streams end")
        for line in ended():
            # Measured: 8.2 MB, the 4 MiB backlog and about as much in the kernel's buffers.
            assert int(line.split()[-2]) < BACKLOG_BYTES + 12 * 1024 * 1024, line
    finally:
        for sock in socks:
            sock.close()


def test_the_wait_bound_comes_from_the_environment_and_bad_values_are_refused() -> None:
    assert from_env({}).max_waiting == 128
    assert from_env({"LLMGW_ROUTER_MAX_WAITING": "7"}).max_waiting == 7
    for bad in ("0", "-3", "many"):
        with pytest.raises(ConfigError, match="LLMGW_ROUTER_MAX_WAITING="):
            from_env({"LLMGW_ROUTER_MAX_WAITING": bad})


def test_the_write_deadline_comes_from_the_environment_and_bad_values_are_refused() -> None:
    assert from_env({}).timeouts.client_send_s == 30.0
    config = from_env({"LLMGW_ROUTER_CLIENT_SEND_S": "2.5"})
    assert config.timeouts.client_send_s == 2.5
    # The other timeouts keep their defaults.
    assert config.timeouts.first_byte_s == Timeouts().first_byte_s
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ConfigError, match="LLMGW_ROUTER_CLIENT_SEND_S="):
            from_env({"LLMGW_ROUTER_CLIENT_SEND_S": bad})


def test_the_routing_policy_comes_from_the_environment_and_an_unknown_one_is_refused() -> None:
    assert from_env({}).policy == "affinity"
    assert from_env({"LLMGW_ROUTER_POLICY": "round-robin"}).policy == "round-robin"
    with pytest.raises(ConfigError, match="LLMGW_ROUTER_POLICY='random': expected one of affinity"):
        from_env({"LLMGW_ROUTER_POLICY": "random"})
