"""Shared pieces for the router tests: the router itself served by uvicorn in a thread, a
stub engine process, and replica registration in Consul exactly as Nomad does it for the
engine job (service `llmgw-engine`, tag and meta `model`, an HTTP check on `/v1/models`)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from cryptography.hazmat.primitives import serialization

from devstack import lifetime
from devstack.ports import free_port
from devstack.prometheus import self_signed_certificate
from router.app import RouterApp
from router.config import ConsulSettings, RouterConfig
from router.server import uvicorn_config

ROOT = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@dataclass
class RunningRouter:
    app: RouterApp
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    def expect_metric(self, name: str, expected: float, timeout: float = 5.0, **labels: str) -> None:
        """The router counts a request after its last byte, which the client may read first."""
        deadline = time.monotonic() + timeout
        while self.metric(name, **labels) != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.metric(name, **labels) == expected, (name, labels)

    def requests_counted(self, model: str) -> float:
        """Requests the router answered for `model`, any status."""
        total = 0.0
        for family in self.app.metrics.registry.collect():
            if family.name != "llmgw_router_requests":
                continue
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("model") == model:
                    total += sample.value
        return total

    def wait_ready(self, model: str, count: int, timeout: float = 20.0) -> None:
        wait_until(
            lambda: len(self.app.discovery.snapshot.ready.get(model, ())) == count,
            timeout,
            f"{count} ready replicas of {model} in the router's snapshot",
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


StartRouter = Callable[..., RunningRouter]


@pytest.fixture
def start_router() -> Iterator[StartRouter]:
    """`start_router(consul_url, activation=False, **config_overrides)`; every router is stopped
    at teardown. Activation needs a leading watcher to answer the router's asks."""
    started: list[RunningRouter] = []

    def start(consul_url: str, *, activation: bool = False, **overrides: Any) -> RunningRouter:
        port = free_port()
        config = RouterConfig(
            host="127.0.0.1",
            port=port,
            consul=ConsulSettings(addr=consul_url, wait_s=10.0),
        )
        config = replace(config, **overrides)
        app = RouterApp(config, activation=activation)
        # Served exactly as `llmgw router` serves it, connection guards included.
        server = uvicorn.Server(uvicorn_config(app, config, log_level="warning"))
        thread = threading.Thread(target=server.run, name=f"router-{port}", daemon=True)
        thread.start()
        scheme = "https" if config.tls_cert else "http"
        running = RunningRouter(app=app, url=f"{scheme}://127.0.0.1:{port}", server=server, thread=thread)
        started.append(running)
        wait_until(lambda: server.started, 15, "the router to listen")
        wait_until(lambda: app.discovery.has_snapshot, 15, "the router's first Consul snapshot")
        return running

    try:
        yield start
    finally:
        for running in started:
            running.stop()


@dataclass
class StubProcess:
    proc: subprocess.Popen[bytes]
    port: int
    name: str
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests_seen(self) -> int:
        """Proxied requests that reached the engine (its log has a line for each)."""
        return sum(
            1 for line in self.log.read_text(errors="replace").splitlines() if line.startswith("request ")
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


StartStub = Callable[..., StubProcess]


@pytest.fixture
def stub_engine(tmp_path: Path) -> Iterator[StartStub]:
    """`stub_engine(name, chunks=5, chunk_delay=0.0, delay=0.0, big_event=0, done_linger=0.0,
    status=200) -> StubProcess` (a real process; `requests_seen()` counts what reached it)."""
    started: list[StubProcess] = []

    def start(
        name: str,
        *,
        chunks: int = 5,
        chunk_delay: float = 0.0,
        delay: float = 0.0,
        big_event: int = 0,
        done_linger: float = 0.0,
        status: int = 200,
    ) -> StubProcess:
        port = free_port()
        log = tmp_path / f"stub-{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.router.stub_engine",
                    "--port",
                    str(port),
                    "--name",
                    name,
                    "--chunks",
                    str(chunks),
                    "--chunk-delay",
                    str(chunk_delay),
                    "--delay",
                    str(delay),
                    "--big-event",
                    str(big_event),
                    "--done-linger",
                    str(done_linger),
                    "--status",
                    str(status),
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lifetime.die_with_parent,
            )
        stub = StubProcess(proc, port, name, log)
        started.append(stub)

        def answers() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"stub engine {name} exited: {log.read_text(errors='replace')}")
            try:
                return httpx.get(f"{stub.url}/v1/models", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answers, 20, f"stub engine {name} to answer")
        return stub

    try:
        yield start
    finally:
        for stub in started:
            stub.stop()


def register_replica(
    consul_url: str,
    model: str,
    port: int,
    service_id: str,
    *,
    ttl: bool = False,
    def_hash: str = "h0",
) -> str:
    """Register an engine replica in Consul's agent as Nomad does; returns its check ID. With
    `ttl=True` the check is a TTL check the test passes or fails itself."""
    check: dict[str, Any]
    if ttl:
        check = {"Name": "engine ttl", "TTL": "600s", "Status": "passing"}
    else:
        check = {
            "Name": "engine http",
            "HTTP": f"http://127.0.0.1:{port}/v1/models",
            "Interval": "1s",
            "Timeout": "2s",
        }
    body = {
        "Name": "llmgw-engine",
        "ID": service_id,
        "Address": "127.0.0.1",
        "Port": port,
        "Tags": [f"model={model}"],
        "Meta": {"model": model, "def_hash": def_hash},
        "Check": check,
    }
    resp = httpx.put(f"{consul_url}/v1/agent/service/register", json=body, timeout=5)
    resp.raise_for_status()
    return f"service:{service_id}"


def fail_check(consul_url: str, check_id: str) -> None:
    httpx.put(
        f"{consul_url}/v1/agent/check/fail/{check_id}", params={"note": "test"}, timeout=5
    ).raise_for_status()


def put_kv(consul_url: str, key: str, value: str | bytes) -> None:
    httpx.put(f"{consul_url}/v1/kv/{key}", content=value, timeout=5).raise_for_status()


def put_state(consul_url: str, model: str, **state: Any) -> None:
    """A model's state record in KV, as the watcher writes it (`parked`, `last_error`, ...)."""
    put_kv(consul_url, f"llmgw/state/{model}", json.dumps(state))


def get_kv(consul_url: str, key: str) -> str | None:
    resp = httpx.get(f"{consul_url}/v1/kv/{key}", params={"raw": "true"}, timeout=5)
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    return resp.text


def get_definitions_kv(consul_url: str) -> dict[str, str]:
    """Every key under `llmgw/config/` (the definitions, in whichever layout) and its value."""
    resp = httpx.get(f"{consul_url}/v1/kv/llmgw/config/", params={"recurse": "true"}, timeout=5)
    if resp.status_code == 404:
        return {}
    resp.raise_for_status()
    return {e["Key"]: base64.b64decode(e["Value"] or "").decode() for e in resp.json()}


def write_self_signed(directory: Path, days: int = 1) -> tuple[Path, Path, float]:
    """A self-signed certificate for 127.0.0.1 (usable as its own CA) and its key, written as
    router.crt and router.key: (certificate, key, expiry as a Unix time)."""
    cert, key = self_signed_certificate("127.0.0.1", days, ip="127.0.0.1")
    cert_path, key_path = directory / "router.crt", directory / "router.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path, cert.not_valid_after_utc.timestamp()


# The activation tests' fleet (tests/router/fleet.py), for every test file here.
from tests.router.fleet import fleet, make_fleet, watcher_for  # noqa: E402, F401
