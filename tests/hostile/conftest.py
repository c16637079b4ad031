"""The attack corpus: one file per family of attack, each against the real parts the suite
already starts (the router as `llmgw router` serves it, a real Consul, stub engines, the
watcher on the Nomad stand-in). A new attack is one more file here.

Every attack runs while a bystander keeps using the router, and the tests assert that the
bystander was served throughout, with its latency, and that the attack got a clear answer."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.router.conftest import (
    RunningRouter,
    StartRouter,
    StartStub,
    register_replica,
    start_router,
    stub_engine,
)

__all__ = ["start_router", "stub_engine"]  # fixtures, re-exported for the tests here

GuardedRouter = Callable[..., RunningRouter]


@pytest.fixture
def guarded_router(start_router: StartRouter) -> GuardedRouter:
    """`guarded_router(consul_url, **config_overrides)`: the router served exactly as `llmgw
    router` serves it (router/server.py), which is how tests/router's `start_router` serves it."""
    return start_router


def chat(model: str = "alpha") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Bystander:
    """A well-behaved client of another model, and a load balancer's health check, both on
    fresh connections, in a thread for as long as an attack lasts."""

    url: str
    model: str = "alpha"
    results: list[tuple[str, int, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Bystander:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # A short attack still gets a few requests beside it.
        deadline = time.monotonic() + 30
        while len(self.results) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            for what in ("chat", "healthz"):
                started = time.monotonic()
                try:
                    with httpx.Client(timeout=20) as client:
                        if what == "chat":
                            status = client.post(
                                f"{self.url}/v1/chat/completions", json=chat(self.model)
                            ).status_code
                        else:
                            status = client.get(f"{self.url}/healthz").status_code
                except httpx.HTTPError:
                    status = 0
                self.results.append((what, status, time.monotonic() - started))
            self._stop.wait(0.05)

    def assert_served(self, *, minimum: int = 3, max_latency_s: float = 2.0) -> None:
        """Every request answered 200, the slowest within `max_latency_s`: in the tens of
        milliseconds normally, so the bound is wide for a loaded machine but far below the
        seconds an attack used to cost."""
        assert len(self.results) >= minimum, f"the bystander made only {len(self.results)} requests"
        failed = [r for r in self.results if r[1] != 200]
        assert not failed, f"bystander requests failed during the attack: {failed[:5]}"
        latencies = [r[2] for r in self.results]
        assert max(latencies) < max_latency_s, (
            f"bystander latency: max {max(latencies):.3f}s, median {statistics.median(latencies):.3f}s"
        )


def alpha_replica(consul_url: str, stub_engine: StartStub) -> None:
    stub = stub_engine("alpha-1")
    register_replica(consul_url, "alpha", stub.port, "alpha-1")
