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
from tests.router.fleet import watcher_for

__all__ = ["start_router", "stub_engine", "watcher_for"]  # fixtures, re-exported for the tests here

GuardedRouter = Callable[..., RunningRouter]


@pytest.fixture
def guarded_router(start_router: StartRouter) -> GuardedRouter:
    """`guarded_router(consul_url, **config_overrides)`: the router served exactly as `llmgw
    router` serves it (router/server.py), which is how tests/router's `start_router` serves it."""
    return start_router


def chat(model: str = "alpha") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


@dataclass(frozen=True)
class Served:
    what: str  # "chat" or "healthz"
    status: int  # 0: no answer at all
    started: float  # time.monotonic()
    latency_s: float

    @property
    def ended(self) -> float:
        return self.started + self.latency_s


@dataclass
class Bystander:
    """A well-behaved client of another model, and a load balancer's health check, both on
    fresh connections, in a thread for as long as an attack lasts.

    It is running before the attack starts (entering waits for its first answers), and the
    attack is the body of the `with`: what it measures is what the attack cost others while it
    ran, not after. An attack that is over in a few milliseconds keeps attacking until the
    bystander has been served a few times beside it (`served_during`)."""

    url: str
    model: str = "alpha"
    results: list[Served] = field(default_factory=list)
    attack_started: float = 0.0
    attack_ended: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Bystander:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        # Served before the attack, not merely answered: its replica's check may still be on
        # its way to passing, and a refusal then is no cost of the attack.
        deadline = time.monotonic() + 30
        while not self._served_before() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self._served_before(), f"the bystander was not served before the attack: {self.results[-5:]}"
        self.attack_started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.attack_ended = time.monotonic()
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _served_before(self) -> bool:
        return all(
            any(r.what == what and r.status == 200 for r in list(self.results))
            for what in ("chat", "healthz")
        )

    @property
    def served_during(self) -> int:
        """Requests sent and answered since the attack started."""
        return sum(1 for r in list(self.results) if r.started >= self.attack_started and r.status)

    def keep_attacking(self, attack: Callable[[], object], *, served: int = 4, timeout_s: float = 30) -> int:
        """Repeat `attack` until the bystander was served `served` times beside it; returns how
        many attacks that took."""
        deadline = time.monotonic() + timeout_s
        count = 0
        while count == 0 or (self.served_during < served and time.monotonic() < deadline):
            attack()
            count += 1
        return count

    def wait_served(self, served: int = 4, timeout_s: float = 30) -> None:
        """For an attack that stays in place by itself (a poisoned value in Consul): wait until
        the bystander was served `served` times beside it."""
        deadline = time.monotonic() + timeout_s
        while self.served_during < served and time.monotonic() < deadline:
            time.sleep(0.02)

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
                self.results.append(Served(what, status, started, time.monotonic() - started))
            self._stop.wait(0.05)

    def assert_served(self, *, minimum: int = 3, max_latency_s: float = 2.0) -> None:
        """At least `minimum` requests (health checks and the other model's both among them)
        sent and answered while the attack ran; every request sent from the start of the attack
        answered 200, the slowest within `max_latency_s`: tens of milliseconds normally, so the
        bound is wide for a loaded machine but far below the seconds an attack used to cost."""
        assert self.attack_ended, "assert_served belongs after the attack's `with` block"
        sent = [r for r in self.results if r.started >= self.attack_started]
        during = [r for r in sent if r.ended <= self.attack_ended]
        length = self.attack_ended - self.attack_started
        assert len(during) >= minimum, (
            f"the bystander was answered only {len(during)} times during the {length:.2f}s attack"
        )
        for what in ("chat", "healthz"):
            assert any(r.what == what for r in during), f"no {what} request answered during the attack"
        failed = [r for r in sent if r.status != 200]
        assert not failed, f"bystander requests failed during the attack: {failed[:5]}"
        latencies = [r.latency_s for r in sent]
        assert max(latencies) < max_latency_s, (
            f"bystander latency during the attack: max {max(latencies):.3f}s, "
            f"median {statistics.median(latencies):.3f}s over {len(latencies)} requests"
        )


def alpha_replica(consul_url: str, stub_engine: StartStub) -> None:
    stub = stub_engine("alpha-1")
    register_replica(consul_url, "alpha", stub.port, "alpha-1")
