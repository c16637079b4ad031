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


def chat_body(
    max_tokens: int = LONG, stream: bool = True, prompt: str = "tell me a long story", **extra: Any
) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": stream,
            "logit_bias": LONG_ASCII_ANSWER,
            "temperature": 1.0,
            **extra,
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


def never_reading_stream(router_url: str, body: bytes) -> socket.socket:
    """A streamed chat on a socket that is never read, with a receive window as small as a
    stalled client's."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(router_url.rsplit(":", 1)[1])))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


# What the sockets between the router and a client that reads nothing take before a write
# blocks: the router's send buffer (64 KiB, which the kernel doubles), uvicorn's 64 KiB
# before it waits for the socket, and the client's small window.
STALLED_CLIENT_HOLDS = 200 * 1024
# The answers (1,900 tokens, 445 KB of events) in a second or two of engine time rather
# than ten: each event carries the top 20 logprobs of its token (about 1 KiB, against 235
# bytes without), so 400 tokens are some 430 KB.
WIDE = {"max_tokens": 400, "logprobs": True, "top_logprobs": 20}
# An answer larger than what the kernel holds between the engine and a router that stopped
# reading (measured: about 4 MB, the engine's send buffer grown to tcp_wmem's 4 MiB): 640
# tokens with 250 logprobs each, 5.2 MB in a few seconds of engine time.
HUGE = {"max_tokens": 640, "logprobs": True, "top_logprobs": 250}


def read_stream(url: str, body: bytes) -> int:
    """Read a whole stream as a client that keeps up does; returns its size."""
    headers = {"content-type": "application/json"}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", content=body, headers=headers, timeout=120
    ) as resp:
        assert resp.status_code == 200
        return sum(len(piece) for piece in resp.iter_raw())


def test_twenty_streams_that_never_read_leave_the_engine_answering(engine: Callable[..., Engine]) -> None:
    """The issue's case, on the default settings (a 30 s write deadline). llama-cpp-python
    serves one request at a time, first come first served, so the twenty are generated in turn
    and a request of the engine's own waits behind them, as it would behind twenty readers;
    what matters is that no stalled client holds the engine past its answer's generation. The
    engine then answers at once and is idle while the twenty are still connected, read
    nothing, and wait for the deadline to drop them."""
    e = engine()
    assert e.router.app.config.timeouts == Timeouts() and Timeouts().client_send_s == 30.0
    body = chat_body(**WIDE)
    # What one such answer costs, read by a client that keeps up.
    started = time.monotonic()
    assert read_stream(e.router.url, body) > 2 * STALLED_CLIENT_HOLDS
    one = time.monotonic() - started
    # Busy, the engine answers its health check late: wait for Consul to pass it again.
    e.router.wait_ready(MODEL, 1, timeout=30)

    socks = [never_reading_stream(e.router.url, body) for _ in range(20)]
    try:
        sent = time.monotonic()
        wait_until(
            lambda: sum(e.router.app.balancer.outstanding.values()) == 20, 30, "twenty streams upstream"
        )
        time.sleep(0.5)
        answers_within(e.server.url, 20 * one * 3 + 30)
        waited = time.monotonic() - sent
        assert waited < 20 * one * 1.5 + 5, f"answered {waited:.1f}s after the twenty; one takes {one:.1f}s"
        assert cpu_share(e.pid, 1.5) < 0.25
        # The stalled clients are dropped at the write deadline, their answers with them.
        e.router.expect_metric(
            "llmgw_router_early_ends_total", 20, timeout=60, model=MODEL, kind="stopped_reading"
        )
        assert e.router.app.balancer.outstanding == {}
        assert e.router.metric("llmgw_router_backlog_bytes") == 0
    finally:
        for sock in socks:
            sock.close()


def test_a_client_that_never_reads_a_long_answer_holds_the_engine_no_longer_than_its_generation(
    engine: Callable[..., Engine],
) -> None:
    """An answer larger than the buffers between engine and router: before the router read
    streams ahead of their clients, the engine's writes blocked once those were full and its
    slot stayed taken until the write deadline (30 s) dropped the client. Read ahead, the
    engine finishes at its own pace and answers anyone else while the stalled client is still
    connected; the router holds the answer (at most 4 MiB; the rest waits in the kernel)."""
    e = engine()
    body = chat_body(**HUGE)
    # The engine's own time for the answer, read straight from it.
    started = time.monotonic()
    assert read_stream(e.server.url, body) > 5_000_000
    one = time.monotonic() - started
    e.router.wait_ready(MODEL, 1, timeout=30)

    sock = never_reading_stream(e.router.url, body)
    try:
        sent = time.monotonic()
        wait_until(
            lambda: e.router.metric("llmgw_router_time_to_first_byte_seconds_count", model=MODEL) == 1,
            30,
            "the stream to start",
        )
        answers_within(e.server.url, 60)
        waited = time.monotonic() - sent
        assert waited < one * 2 + 5, f"answered {waited:.1f}s after the stalled stream; one takes {one:.1f}s"
        assert cpu_share(e.pid, 1.5) < 0.25
        # Freed by reading ahead, not by dropping the client: that comes at the deadline.
        assert e.early_ends("stopped_reading") == 0
        assert e.router.metric("llmgw_router_backlog_bytes") > 3 * 1024 * 1024
        e.router.expect_metric(
            "llmgw_router_early_ends_total", 1, timeout=45, model=MODEL, kind="stopped_reading"
        )
        assert e.router.metric("llmgw_router_backlog_bytes") == 0
    finally:
        sock.close()
