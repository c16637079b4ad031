"""Issue 13, item 3: clients that hold connections without finishing a request. A head sent a
byte a second, a connection that sends nothing, a chunked body that trickles: each stayed open
for ever, and ~20,000 of them used every file descriptor, health checks included. Then a body
sent a byte every 29 s: it passed every per-read deadline, was never idle, and about
`max_connections` of them made every newcomer, health checks included, a 503."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import httpx
import pytest

from router.config import Limits, Timeouts
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica
from tests.router.conftest import StartStub, wait_until

pytestmark = pytest.mark.timeout(120)

FAST = Timeouts(request_head_s=1.0, body_read_s=1.0)
SLOW_BODY_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    b'Content-Length: 4000\r\n\r\n{"model": "alpha", '
)


def router_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


class Attacker:
    """One raw connection, read without blocking: what the router said to it, and whether the
    router has closed it."""

    def __init__(self, port: int, first: bytes = b"") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if first:
            self.sock.sendall(first)
        self.sock.setblocking(False)
        self.answer = b""
        self.closed = False
        self.refused_send = False

    def poll(self) -> bool:
        """True once the router closed the connection (end of stream or reset); what it wrote
        before that is kept in `answer`."""
        if self.closed:
            return True
        try:
            while chunk := self.sock.recv(65536):
                self.answer += chunk
            self.closed = True
        except BlockingIOError:
            pass
        except OSError:
            self.closed = True
        return self.closed

    def send(self, data: bytes) -> None:
        """Sends while the router lets it; whether it closed is for `poll` to find out, with
        what it said first."""
        if self.closed or self.refused_send:
            return
        try:
            self.sock.send(data)
        except BlockingIOError:
            pass
        except OSError:
            self.refused_send = True

    def close(self) -> None:
        self.sock.close()


@contextmanager
def trickling(attackers: list[Attacker], every_s: float = 0.5) -> Iterator[None]:
    """One more body byte on every open attacker's connection every `every_s`."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            for attacker in list(attackers):
                attacker.send(b" ")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def read_answer(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except OSError:
        pass
    return answer


def closed_oldest_first(attackers: list[Attacker]) -> int:
    """How many attackers were closed, after checking that they are exactly the oldest ones."""
    closed = [a.poll() for a in attackers]
    count = sum(closed)
    assert closed == [True] * count + [False] * (len(closed) - count), (
        "closed connections (1) among the attackers, oldest first: "
        + "".join("1" if c else "0" for c in closed)
    )
    return count


def test_a_head_sent_a_byte_at_a_time_gets_408_and_the_connection_closes(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    router = guarded_router(consul_url, timeouts=FAST)
    router.wait_ready("alpha", 1)
    with (
        Bystander(router.url) as bystander,
        socket.create_connection(("127.0.0.1", router_port(router.url)), timeout=10) as sock,
    ):
        started = time.monotonic()
        for byte in b"GET /healthz HTTP/1.1\r\nHo":
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.2)
        answer = read_answer(sock)
        elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"request_timeout" in answer
    # The deadline runs from the first byte, not from the last one.
    assert elapsed < 6
    bystander.assert_served(minimum=2)  # a health check and a chat in a second or two


def test_a_slow_chunked_body_gets_408_and_the_connection_closes(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    router = guarded_router(consul_url, timeouts=FAST)
    router.wait_ready("alpha", 1)
    with (
        Bystander(router.url) as bystander,
        socket.create_connection(("127.0.0.1", router_port(router.url)), timeout=10) as sock,
    ):
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\n'
        )
        started = time.monotonic()
        answer = read_answer(sock)
        elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"the request body stopped arriving" in answer
    assert b"connection: close" in answer.lower()
    assert elapsed < 6
    bystander.assert_served(minimum=2)  # a health check and a chat in a second or two


def test_a_body_that_keeps_trickling_gets_408_at_the_whole_body_deadline(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    # Each read brings a byte well inside its own deadline; only the whole body's ends it.
    router = guarded_router(consul_url, timeouts=replace(FAST, body_read_s=30.0, request_body_s=2.0))
    router.wait_ready("alpha", 1)
    attackers: list[Attacker] = []
    try:
        with Bystander(router.url) as bystander, trickling(attackers, every_s=0.2):
            started = time.monotonic()
            attackers.append(attacker := Attacker(router_port(router.url), SLOW_BODY_HEAD))
            wait_until(attacker.poll, 10, "the trickling body's connection closed")
            elapsed = time.monotonic() - started
    finally:
        for attacker in attackers:
            attacker.close()
    assert attacker.answer.startswith(b"HTTP/1.1 408"), attacker.answer[:200]
    assert b"the request body did not arrive within 2s" in attacker.answer
    assert b"connection: close" in attacker.answer.lower()
    assert 1.5 < elapsed < 5, elapsed
    bystander.assert_served(minimum=2)  # a health check and a chat in a second or two


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
    attackers: list[Attacker] = []
    try:
        with Bystander(router.url) as bystander:
            # Three times the cap: half say nothing, half start a head and stop.
            for i in range(3 * cap):
                attackers.append(Attacker(port, b"GET /healthz HTTP/1.1\r\nX-Slow: " if i % 2 else b""))
            # The oldest were closed to make room, the newest are still held.
            wait_until(lambda: all(a.poll() for a in attackers[:cap]), 10, "the oldest attackers closed")
            wait_until(lambda: bystander.served_during >= 4, 20, "the bystander served beside them")
        bystander.assert_served()
        closed = closed_oldest_first(attackers)
        assert 2 * cap <= closed < 3 * cap
        assert all(a.answer == b"" for a in attackers), "an idle connection is closed without an answer"
        health = httpx.get(f"{router.url}/healthz", timeout=10)
        assert health.status_code == 200
        assert router.metric("llmgw_router_connections_closed_total", reason="idle_over_cap") >= 2 * cap
    finally:
        for attacker in attackers:
            attacker.close()


def test_bodies_trickling_past_the_cap_are_dropped_oldest_first_and_others_served(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    cap = 24
    # Deadlines far beyond the test, as with a body byte every 29 s under the defaults: only
    # the connection cap can make room.
    router = guarded_router(
        consul_url,
        timeouts=Timeouts(request_head_s=30.0, body_read_s=30.0, request_body_s=300.0),
        limits=replace(Limits(), max_connections=cap),
    )
    router.wait_ready("alpha", 1)
    port = router_port(router.url)
    attackers: list[Attacker] = []
    try:
        with Bystander(router.url) as bystander, trickling(attackers):
            # Twice the cap, each with its head sent and its body begun: never idle again.
            for _ in range(2 * cap):
                attackers.append(Attacker(port, SLOW_BODY_HEAD))
                time.sleep(0.01)
            # Held for a few seconds, long enough for the deadlines of old to have let nobody in.
            time.sleep(4.0)
            closed_during = sum(a.poll() for a in attackers)
        bystander.assert_served(minimum=6)
        closed = closed_oldest_first(attackers)
        assert closed_during >= cap, "newcomers were let in by dropping no slow body"
        # The newest attackers are still held: only what room needed was dropped.
        assert closed < len(attackers)
        # Each was answered 408 before the close, though a connection still sending when it is
        # closed is reset, and its answer may be lost to the reset.
        answered = [a.answer for a in attackers if a.closed and a.answer]
        assert answered
        for answer in answered:
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"arriving too slowly" in answer
        assert router.metric("llmgw_router_connections_closed_total", reason="slow_body_over_cap") >= cap
        assert httpx.get(f"{router.url}/healthz", timeout=10).status_code == 200
    finally:
        for attacker in attackers:
            attacker.close()


def test_a_connection_that_never_sends_a_byte_is_closed(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    router = guarded_router(consul_url, timeouts=FAST)
    router.wait_ready("alpha", 1)
    with (
        Bystander(router.url) as bystander,
        socket.create_connection(("127.0.0.1", router_port(router.url)), timeout=10) as sock,
    ):
        started = time.monotonic()
        answer = read_answer(sock)
        elapsed = time.monotonic() - started
    assert answer == b""
    assert elapsed < 6
    bystander.assert_served(minimum=2)  # a health check and a chat in a second or two
