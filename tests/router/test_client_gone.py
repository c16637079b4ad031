"""A client that leaves costs nothing: whatever its request was doing, the router cancels the
replica's request at once, and the engine (a real llama-cpp-python server) stops working on it.
What counts is the engine's own view: whether it answers another request promptly, and how
much CPU it burns, not only the router's counters."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.config import Timeouts
from tests.fixtures.engines import MakeGguf, StartLlamaServer
from tests.router.conftest import RunningRouter, StartRouter, register_replica, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "tiny"
# As the rendered jobs run it (render.py): the default interrupts streams under concurrency.
ENGINE_ARGS = ["--interrupt_requests", "False"]
# Long enough that an engine left generating is busy for half a minute on a fast machine (its
# cost grows with the context: about 2 s for 1900 tokens, 25 s for 6000).
LONG = 6000
# Random weights would stop at a random end-of-text token (id 2); a long answer must be long.
# And only ASCII bytes (ids 3-130): llama-cpp-python streams nothing while the text so far is
# not valid UTF-8, and a stream that sends nothing never notices its client left, so random
# bytes would make every stream one event at the very end.
LONG_ASCII_ANSWER = {str(token): -100 for token in (2, *range(3 + 0x80, 3 + 0x100))}


def defined_as_llama_cpp_python(directory: Path, gguf: Path) -> str:
    """A models file defining MODEL on the llama-cpp-python engine, so that the router knows
    which engine it talks to (router/assemble.py); returns its path."""
    path = directory / "models.yaml"
    path.write_text(
        "profiles:\n  cpu:\n    engine: llama-cpp-python\n    engine_version: '0.3.36'\n"
        "    gpus: 0\n    memory_mib: 512\n    context: 8192\n"
        f"models:\n  {MODEL}:\n    source: file://{gguf}\n    profile: cpu\n"
    )
    return str(path)


def chat_body(max_tokens: int = LONG, stream: bool = True, prompt: str = "tell me a long story") -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": stream,
            "logit_bias": LONG_ASCII_ANSWER,
            "temperature": 1.0,
        }
    ).encode()


def raw_request(url: str, body: bytes) -> socket.socket:
    """A POST written by hand on a plain socket, so the test decides when (and whether) it is
    read, and can close it at any moment."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(pid: int, over: float = 2.0) -> float:
    """The share of one core the process used over the next `over` seconds."""
    before = cpu_seconds(pid)
    time.sleep(over)
    return (cpu_seconds(pid) - before) / over


def answers_within(engine_url: str, seconds: float) -> float:
    """Time the engine takes to answer a short chat of its own (not through the router)."""
    started = time.monotonic()
    resp = httpx.post(
        f"{engine_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=seconds,
    )
    assert resp.status_code == 200, resp.text
    return time.monotonic() - started


class Engine:
    def __init__(self, server: Any, router: RunningRouter) -> None:
        self.server = server
        self.router = router

    @property
    def pid(self) -> int:
        return int(self.server.pid)

    def early_ends(self, kind: str) -> float:
        return self.router.metric("llmgw_router_early_ends_total", model=MODEL, kind=kind)

    def settles(self, within: float, what: str) -> None:
        """The engine is idle again: it answers a short request of its own promptly and, after
        that, burns no CPU."""
        deadline = time.monotonic() + within

        def idle() -> bool:
            try:
                took = answers_within(self.server.url, max(1.0, deadline - time.monotonic()))
            except httpx.HTTPError:
                return False
            return took < 3.0 and cpu_share(self.pid, 1.5) < 0.25

        wait_until(idle, within, f"the engine to be idle again after {what}")


@pytest.fixture
def engine(
    consul_url: str,
    make_gguf: MakeGguf,
    llama_server: StartLlamaServer,
    start_router: StartRouter,
    tmp_path: Path,
) -> Callable[..., Engine]:
    def start(n_ctx: int = 8192, **router_overrides: Any) -> Engine:
        gguf = make_gguf()
        server = llama_server(gguf, n_ctx=n_ctx, extra_args=ENGINE_ARGS)
        register_replica(consul_url, MODEL, server.port, f"{MODEL}-engine")
        models = defined_as_llama_cpp_python(tmp_path, gguf)
        router = start_router(consul_url, models_file=models, **router_overrides)
        router.wait_ready(MODEL, 1, timeout=30)
        return Engine(server, router)

    return start


def test_a_stream_closed_mid_way_stops_the_engine(engine: Callable[..., Engine]) -> None:
    e = engine()
    sock = raw_request(e.router.url, chat_body())
    first = sock.recv(4096)
    assert b"200 OK" in first, first
    sock.close()
    wait_until(lambda: e.early_ends("stream") + e.early_ends("first_byte") == 1, 10, "the early end counted")
    e.settles(10, "a stream closed mid-way")


def test_five_streams_closed_right_after_sending_leave_the_engine_answering(
    engine: Callable[..., Engine],
) -> None:
    e = engine()
    for _ in range(5):
        raw_request(e.router.url, chat_body()).close()
        time.sleep(0.5)
    wait_until(lambda: e.router.requests_counted(MODEL) == 5, 20, "five requests ended")
    e.settles(15, "five streams closed before their first byte")


def test_a_non_streamed_request_closed_before_its_answer_stops_the_engine(
    engine: Callable[..., Engine],
) -> None:
    """llama-cpp-python finishes a non-streamed completion whoever listens (it runs in a worker
    thread that never looks at the connection), so the router asks it for a stream and
    assembles the answer: closing that stream is what stops the engine."""
    e = engine()
    sock = raw_request(e.router.url, chat_body(stream=False))
    time.sleep(0.5)
    sock.close()
    wait_until(lambda: e.early_ends("upstream") + e.early_ends("body") == 1, 10, "the early end counted")
    assert e.router.app.balancer.outstanding == {}
    e.router.expect_metric("llmgw_router_requests_total", 1, model=MODEL, code="499")
    # Left generating, the engine would spend the rest of its half minute before it answered
    # anyone else.
    e.settles(8, "a non-streamed request closed before its answer")


def never_reading_stream(router_url: str) -> socket.socket:
    """A streamed chat on a socket that is never read, with a receive window as small as a
    stalled client's."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(router_url.rsplit(":", 1)[1])))
    body = chat_body()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_twenty_streams_that_never_read_leave_the_engine_answering(engine: Callable[..., Engine]) -> None:
    """Each answer (about 1 MiB of events) fits in the 4 MiB send buffer the kernel would grow
    for the router's client socket: before the router bounded that buffer no write ever
    blocked, so the deadline never fired and the one-slot engine generated all twenty answers
    to the end, 25 s each, for nobody (over eight minutes here). Bounded, each stalled client
    holds the engine for the write deadline plus the time to fill its small buffer."""
    e = engine(timeouts=Timeouts(client_send_s=2.0))
    socks = [never_reading_stream(e.router.url) for _ in range(20)]
    try:
        e.router.expect_metric(
            "llmgw_router_early_ends_total", 20, timeout=150, model=MODEL, kind="stopped_reading"
        )
        e.settles(15, "twenty streams that never read")
        assert e.router.app.balancer.outstanding == {}
    finally:
        for sock in socks:
            sock.close()
