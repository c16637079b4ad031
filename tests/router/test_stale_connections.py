"""A request reaches an engine at most once. The router re-sends a request only when the
engine provably did not see it: the connection could not be opened. A connection carries more
than one request only to an engine that keeps it open itself (the uvicorn ones); llama-server
closes it after every streamed answer, and an engine the router does not know gets a connection
per request, so an engine closing a kept-alive connection takes none. Once the body went out, a
connection that closes without an answer is the engine's answer: the client is told so, with
`x-should-retry: false`, and no other replica gets the request. A prompt that crashes its engine
would otherwise crash every replica of the model, twice each, and the SDK's retries on top."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from devstack.ports import free_port
from router.upstream import IDLE_REUSE_S
from tests.fixtures.engines import MakeGguf
from tests.fixtures.llama_cpp import StartLlamaCpp
from tests.router.conftest import StartRouter, put_kv, register_replica

ANSWER = json.dumps(
    {"id": "x", "object": "chat.completion", "model": "alpha",
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
).encode()  # fmt: skip
BODY = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}


class RawEngine:
    """An engine on a bare asyncio server, so that a test decides exactly when a connection
    closes. `answer(n)` says whether the n-th request of a connection (from 1) is answered;
    an unanswered one is read whole and its connection closed without a word. `idle_close_s`
    closes a connection that long after its last answer."""

    def __init__(self, answer: Callable[[int], bool], idle_close_s: float | None = None) -> None:
        self.port = free_port()
        self.answer = answer
        self.idle_close_s = idle_close_s
        self.received = 0
        self.closed_unanswered = 0
        self.answered = 0
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        started.set()
        # Ends when stop() stops the loop.
        with contextlib.suppress(RuntimeError):
            self.loop.run_until_complete(server.serve_forever())
        # End the connections' handlers on this loop, and close it: left pending, one was
        # finalized in a later test's garbage collection and warned of a closed loop.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        on_connection = 0
        self.connections += 1
        try:
            while True:
                if self.idle_close_s is not None and on_connection:
                    try:
                        async with asyncio.timeout(self.idle_close_s):
                            head = await reader.readuntil(b"\r\n\r\n")
                    except TimeoutError:
                        break
                else:
                    head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                on_connection += 1
                if head.startswith(b"POST "):
                    self.received += 1
                if not self.answer(on_connection):
                    self.closed_unanswered += 1
                    break
                self.answered += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(ANSWER)}\r\n\r\n".encode()
                    + ANSWER
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def raw_engines() -> Iterator[Callable[..., RawEngine]]:
    started: list[RawEngine] = []

    def start(answer: Callable[[int], bool], idle_close_s: float | None = None) -> RawEngine:
        engine = RawEngine(answer, idle_close_s)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def test_each_request_has_a_connection_of_its_own_so_a_closed_keep_alive_takes_none(
    consul_url: str, raw_engines: Callable[..., RawEngine], start_router: StartRouter
) -> None:
    # Answers the first request of each connection; a second one on the same connection would
    # be read and the connection closed, as llama-server was seen doing to kept-alive
    # connections under load (a lost request, which the router may not send again).
    engine = raw_engines(lambda n: n == 1)
    register_replica(consul_url, "alpha", engine.port, "alpha-closing", ttl=True)
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    for _ in range(5):
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=BODY, timeout=10)
        assert resp.status_code == 200, resp.text
    assert engine.received == 5 and engine.answered == 5
    assert engine.closed_unanswered == 0


def test_an_engine_that_reads_the_body_and_aborts_sees_the_request_once_and_no_other_replica_does(
    consul_url: str, raw_engines: Callable[..., RawEngine], start_router: StartRouter
) -> None:
    engines = [raw_engines(lambda n: False) for _ in range(3)]
    for i, engine in enumerate(engines):
        register_replica(consul_url, "alpha", engine.port, f"alpha-{i}", ttl=True)
    router = start_router(consul_url)
    router.wait_ready("alpha", 3)
    # The SDK as users run it, with its two retries.
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", timeout=20)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "upstream_closed"
    assert sum(e.received for e in engines) == 1
    router.expect_metric("llmgw_router_requests_total", 1, model="alpha", code="502")
    # Logged and counted as what it was: a replica that took the request and closed.
    assert router.metric("llmgw_router_upstream_failures_total", model="alpha", phase="connect") == 0
    assert router.metric("llmgw_router_upstream_failures_total", model="alpha", phase="closed") == 1


def test_a_kept_alive_connection_the_engine_closed_while_idle_costs_no_request(
    consul_url: str, raw_engines: Callable[..., RawEngine], start_router: StartRouter
) -> None:
    # Closes each connection 0.2 s after its answer, well inside the router's own keep-alive.
    engine = raw_engines(lambda n: True, idle_close_s=0.2)
    register_replica(consul_url, "alpha", engine.port, "alpha-idle", ttl=True)
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    for _ in range(3):
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=BODY, timeout=10)
        assert resp.status_code == 200, resp.text
        time.sleep(0.6)
    assert engine.received == 3
    assert engine.answered == 3
    for phase in ("connect", "closed", "stream"):
        assert router.metric("llmgw_router_upstream_failures_total", model="alpha", phase=phase) == 0
    assert router.app.balancer.ejected(time.monotonic()) == set()


def models_on(engine: str, version: str) -> str:
    """Definitions in which model `alpha` runs on `engine`."""
    gpus = 1 if engine == "vllm" else 0
    return (
        f'profiles:\n  p: {{engine: {engine}, engine_version: "{version}", gpus: {gpus}}}\n'
        'models:\n  alpha: {source: "file:///alpha.gguf", profile: p}\n'
    )


@pytest.mark.parametrize(
    ("engine", "version", "connections"),
    [("llama-cpp-python", "0.3.36", 1), ("vllm", "0.11.0", 1), ("llama.cpp", "b6500", 5)],
)
def test_a_connection_is_kept_for_the_next_request_only_to_an_engine_that_keeps_it(
    consul_url: str,
    raw_engines: Callable[..., RawEngine],
    start_router: StartRouter,
    engine: str,
    version: str,
    connections: int,
) -> None:
    # The uvicorn engines keep a connection between requests; a new one per request was most of
    # the router's loss against a bare proxy under wrk (0.52x of it, 0.97x kept).
    backend = raw_engines(lambda n: True)
    put_kv(consul_url, "llmgw/config/models", models_on(engine, version))
    register_replica(consul_url, "alpha", backend.port, "alpha-kept", ttl=True)
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    assert router.app.discovery.snapshot.models["alpha"].profile.engine == engine
    for _ in range(5):
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=BODY, timeout=10)
        assert resp.status_code == 200, resp.text
    assert backend.received == backend.answered == 5
    assert backend.connections == connections


def test_a_pooled_connection_idle_past_the_reuse_limit_is_replaced_before_the_engine_closes_it(
    consul_url: str, raw_engines: Callable[..., RawEngine], start_router: StartRouter
) -> None:
    # An engine that closes at 5 s idle as uvicorn does would, written to at that moment, lose
    # the request; the router lets a connection idle for IDLE_REUSE_S go first.
    backend = raw_engines(lambda n: True)
    put_kv(consul_url, "llmgw/config/models", models_on("llama-cpp-python", "0.3.36"))
    register_replica(consul_url, "alpha", backend.port, "alpha-idle-limit", ttl=True)
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    for pause in (0.0, IDLE_REUSE_S + 0.3):
        time.sleep(pause)
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=BODY, timeout=10)
        assert resp.status_code == 200, resp.text
    assert backend.connections == 2


def streamed_completion(port: int) -> bytes:
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True}).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def test_llama_server_closes_its_connection_after_every_streamed_answer(
    llama_cpp_server: StartLlamaCpp, make_gguf: MakeGguf
) -> None:
    """The fact the connection per request to llama-server rests on (router/upstream.py): its
    streamed answer says `Keep-Alive`, and the connection closes the moment the answer ends.
    When a llama.cpp release keeps it open, this fails, and llama.cpp can join the engines
    whose connections are kept."""
    server = llama_cpp_server(make_gguf())
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(streamed_completion(server.port))
        answer = b""
        while not answer.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert b"transfer-encoding: chunked" in head
        assert b"keep-alive: timeout=5" in head and b"connection: close" not in head
        readable, _, _ = select.select([sock], [], [], 1.0)
        assert readable and sock.recv(1) == b"", "llama-server kept the connection open"
