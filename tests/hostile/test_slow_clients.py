"""Issue 13, item 3: clients that hold connections without finishing a request. A head sent a
byte a second, a connection that sends nothing, a chunked body that trickles: each stayed open
for ever, and ~20,000 of them used every file descriptor, health checks included."""

from __future__ import annotations

import socket
import time
from dataclasses import replace

import httpx
import pytest

from router.config import Limits, Timeouts
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica
from tests.router.conftest import StartStub, wait_until

pytestmark = pytest.mark.timeout(120)

FAST = Timeouts(request_head_s=1.0, body_read_s=1.0)


def router_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def is_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b"" or True
    except BlockingIOError:
        return False
    except OSError:
        return True


def read_answer(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except OSError:
        pass
    return answer


def test_a_head_sent_a_byte_at_a_time_gets_408_and_the_connection_closes(
    consul_url: str, guarded_router: GuardedRouter
) -> None:
    router = guarded_router(consul_url, timeouts=FAST)
    with socket.create_connection(("127.0.0.1", router_port(router.url)), timeout=10) as sock:
        started = time.monotonic()
        for byte in b"GET /healthz HTTP/1.1\r\nHo":
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
        answer = read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert b"request_timeout" in answer
        # The deadline runs from the first byte, not from the last one.
        assert time.monotonic() - started < 6


def test_a_slow_chunked_body_gets_408_and_the_connection_closes(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    router = guarded_router(consul_url, timeouts=FAST)
    router.wait_ready("alpha", 1)
    with socket.create_connection(("127.0.0.1", router_port(router.url)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\n'
        )
        started = time.monotonic()
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"the request body stopped arriving" in answer
    assert b"connection: close" in answer.lower()
    assert time.monotonic() - started < 6


def test_idle_and_slow_connections_past_the_cap_are_dropped_oldest_first_and_health_checks_answered(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    cap = 40
    router = guarded_router(
        consul_url,
        timeouts=replace(FAST, request_head_s=30.0),
        limits=replace(Limits(), max_connections=cap),
    )
    router.wait_ready("alpha", 1)
    port = router_port(router.url)
    attackers: list[socket.socket] = []
    try:
        with Bystander(router.url) as bystander:
            # Three times the cap: half say nothing, half start a head and stop.
            for i in range(3 * cap):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                if i % 2:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
                attackers.append(sock)
            for sock in attackers:
                sock.setblocking(False)
            # The oldest were closed to make room, the newest are still held.
            wait_until(lambda: all(is_closed(s) for s in attackers[:cap]), 10, "the oldest attackers closed")
            time.sleep(1.0)
        bystander.assert_served()
        open_now = sum(1 for s in attackers if not is_closed(s))
        assert open_now <= cap
        health = httpx.get(f"{router.url}/healthz", timeout=10)
        assert health.status_code == 200
        assert router.metric("llmgw_router_connections_closed_total", reason="idle_over_cap") >= cap
    finally:
        for sock in attackers:
            sock.close()


def test_a_connection_that_never_sends_a_byte_is_closed(
    consul_url: str, guarded_router: GuardedRouter
) -> None:
    router = guarded_router(consul_url, timeouts=FAST)
    with socket.create_connection(("127.0.0.1", router_port(router.url)), timeout=10) as sock:
        started = time.monotonic()
        assert read_answer(sock) == b""
        assert time.monotonic() - started < 6
