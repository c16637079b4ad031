"""The connection guard follows HTTP/1.1: it times a request head and counts a connection as
idle only while no response is in flight. A stray CRLF after a body (RFC 9112 2.2 says to
ignore it), a pipelined request whose head is still arriving, and a pipelined stream at the
connection cap each used to cut a healthy stream: a raw 408 written into the middle of its
chunks, or the connection closed as idle."""

from __future__ import annotations

import json
import socket
import time

from router.config import Limits, Timeouts
from tests.router.conftest import RunningRouter, StartRouter, StartStub, register_replica


def stream_request(model: str = "alpha") -> bytes:
    body = json.dumps(
        {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def connect(router: RunningRouter) -> socket.socket:
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=15)
    return sock


def read_until(sock: socket.socket, have: bytes, done: bytes, count: int = 1, timeout: float = 20) -> bytes:
    """Read until `done` appears `count` times or the connection closes."""
    deadline = time.monotonic() + timeout
    while have.count(done) < count and time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        have += data
    return have


def complete_streams(data: bytes) -> int:
    return data.count(b"data: [DONE]")


def slow_streaming_router(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter, **overrides: object
) -> RunningRouter:
    # Six events half a second apart: a stream of 3 s, three times the head timeout.
    stub = stub_engine("slow-stream", chunks=6, chunk_delay=0.5)
    register_replica(consul_url, "alpha", stub.port, "alpha-1")
    router = start_router(consul_url, timeouts=Timeouts(request_head_s=1.0), **overrides)
    router.wait_ready("alpha", 1)
    return router


def test_a_stray_crlf_after_the_body_does_not_cut_the_stream(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    router = slow_streaming_router(consul_url, stub_engine, start_router)
    with connect(router) as sock:
        sock.sendall(stream_request())
        # In a packet of its own, as a client that ends each body with a line end sends it.
        time.sleep(0.2)
        sock.sendall(b"\r\n")
        data = read_until(sock, b"", b"data: [DONE]")
    assert b"request_timeout" not in data and b"408" not in data.split(b"\r\n", 1)[1]
    assert complete_streams(data) == 1
    assert data.count(b"slow-stream-") == 6


def test_a_pipelined_head_still_arriving_is_timed_only_once_the_stream_before_it_ended(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    router = slow_streaming_router(consul_url, stub_engine, start_router)
    with connect(router) as sock:
        sock.sendall(stream_request())
        time.sleep(0.3)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n")
        data = read_until(sock, b"", b"data: [DONE]")
        assert b"request_timeout" not in data
        assert complete_streams(data) == 1 and data.count(b"slow-stream-") == 6
        # The unfinished head is then timed like any other: answered 408 a second later.
        started = time.monotonic()
        rest = read_until(sock, b"", b"request_timeout")
        assert b"408 Request Timeout" in rest
        assert time.monotonic() - started < 5


def test_a_pipelined_stream_is_not_closed_as_idle_at_the_connection_cap(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    router = slow_streaming_router(consul_url, stub_engine, start_router, limits=Limits(max_connections=2))
    with connect(router) as busy:
        busy.sendall(stream_request() + stream_request())
        data = read_until(busy, b"", b"data: [DONE]")
        assert complete_streams(data) == 1
        # The second stream now flows on `busy`; two newcomers take the router past its cap.
        idle = connect(router)
        time.sleep(0.2)
        newcomer = connect(router)
        try:
            data = read_until(busy, data, b"data: [DONE]", count=2)
            assert complete_streams(data) == 2, data[-300:]
            assert data.count(b"slow-stream-") == 12
            # The connection closed to make room was the one with nothing in flight.
            idle.settimeout(5)
            assert idle.recv(100) == b""
        finally:
            idle.close()
            newcomer.close()
