"""An engine that closes a kept-alive connection while it sits in the router's pool (llama-server
does, after its keep-alive and when its HTTP threads are all taken) is not a failed replica: the
request goes again on a new connection and the replica stays in rotation. Found with the real
llama-server in bench/affinity_bench.py, where each such close ejected a healthy replica."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from devstack.ports import free_port
from tests.router.conftest import StartRouter, register_replica

ANSWER = json.dumps(
    {"id": "x", "object": "chat.completion", "model": "alpha",
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}
).encode()  # fmt: skip


class ClosingEngine:
    """Answers the first request of each connection and keeps it open; the next request on
    that connection is read and the connection closed without a word."""

    def __init__(self) -> None:
        self.port = free_port()
        self.closed_unanswered = 0
        self.answered = 0
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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if not first:
                    self.closed_unanswered += 1
                    break
                first = False
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
def closing_engine() -> Iterator[ClosingEngine]:
    engine = ClosingEngine()
    yield engine
    engine.stop()


def test_a_kept_alive_connection_the_engine_closed_is_retried_not_counted_against_the_replica(
    consul_url: str, closing_engine: ClosingEngine, start_router: StartRouter
) -> None:
    register_replica(consul_url, "alpha", closing_engine.port, "alpha-closing", ttl=True)
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    body = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(5):
        resp = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10)
        assert resp.status_code == 200, resp.text
    # Every other request met a pooled connection the engine then closed (the one after it
    # found the pool empty and opened a new one).
    assert closing_engine.closed_unanswered == 2
    assert closing_engine.answered == 5
    assert router.metric("llmgw_router_upstream_failures_total", model="alpha", phase="connect") == 0
    assert router.app.balancer.ejected(time.monotonic()) == set()
