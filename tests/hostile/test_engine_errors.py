"""Issue 13, item 1, engine errors: an engine's error quotes what it was given (a source with a
password, a token, a header), and the router handed it to clients as it came: the body of a
refused request, the message of a plain-text error, the engine's own error object inside a
stream or an assembled answer. The engine here is a real process (tests/hostile/error_engine.py)
that answers every completion with such an error; no client of the router may see the secret."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack import lifetime
from devstack.ports import free_port
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica
from tests.hostile.error_engine import HF_TOKEN, SECRET
from tests.router.conftest import ROOT, StartStub, put_kv, register_replica, wait_until

pytestmark = pytest.mark.timeout(180)

ASSEMBLED = """profiles:
  cpu: {engine: llama-cpp-python, engine_version: "0.3.36", gpus: 0, memory_mib: 512, context: 256}
models:
  assembled: {source: "file:///models/a.gguf", profile: cpu}
  cold:
    source: file:///models/cold.gguf
    profile: cpu
    replicas: {min: 0, max: 1}
    activation_timeout: 90s
"""


@pytest.fixture
def error_engine(tmp_path: Path) -> Iterator[Callable[[], int]]:
    """Starts the error engine as a process; returns its port."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> int:
        port = free_port()
        log = (tmp_path / f"error-engine-{port}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hostile.error_engine", "--port", str(port)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=lifetime.die_with_parent,
        )
        procs.append(proc)
        wait_until(lambda: answers(port), 20, "the error engine to answer")
        return port

    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def ask(url: str, model: str, kind: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": kind}], "stream": stream}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def assert_no_secret(text: str) -> None:
    assert SECRET not in text, text
    assert HF_TOKEN not in text, text
    assert "***" in text, text


def test_engine_errors_reach_clients_redacted(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter, error_engine: Callable[[], int]
) -> None:
    alpha_replica(consul_url, stub_engine)
    port = error_engine()
    # A replica without a definition (its answers pass through) and one of a llama-cpp-python
    # model (non-streamed requests go upstream as a stream and are assembled).
    register_replica(consul_url, "passthrough", port, "passthrough-1")
    register_replica(consul_url, "assembled", port, "assembled-1")
    put_kv(consul_url, CONFIG_MODELS_KEY, ASSEMBLED)
    router = guarded_router(consul_url)
    for model in ("alpha", "passthrough", "assembled"):
        router.wait_ready(model, 1)
    wait_until(lambda: "assembled" in router.app.discovery.snapshot.models, 10, "the definitions")
    with Bystander(router.url) as bystander:
        refused = ask(router.url, "passthrough", "json")
        crashed = ask(router.url, "passthrough", "plain")
        assembled_refused = ask(router.url, "assembled", "json")
        assembled_error = ask(router.url, "assembled", "in-stream")
        bystander.wait_served(2)
    # The status and shape the engine gave, only the secret masked.
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("could not load the model: GET https://")
    assert crashed.status_code == 500
    assert crashed.text.startswith("engine crashed: GET https://")
    assert assembled_refused.status_code == 400
    assert assembled_error.status_code == 500
    assert assembled_error.json()["error"]["code"] == 500
    for answer in (refused, crashed, assembled_refused, assembled_error):
        assert_no_secret(answer.text)
        assert int(answer.headers["content-length"]) == len(answer.content)
    bystander.assert_served(minimum=2)


def engine_node(engines: Path) -> dict[str, Any]:
    return {
        "name": "cpu-0",
        "datacenter": "dc1",
        "cpu_mhz": 16000,
        "cpu_cores": 8,
        "memory_mib": 65536,
        "disk_mb": 100000,
        "attributes": {"driver.raw_exec": "1"},
        "meta": {"llmgw_engines_dir": str(engines), "llmgw_engine_llama_cpp_python": "0.3.36"},
        "gpus": [],
    }


@pytest.mark.slow
def test_an_engine_error_after_keepalives_reaches_the_stream_redacted(
    consul_url: str,
    tmp_path: Path,
    start_standin: Callable[..., Any],
    guarded_router: GuardedRouter,
    watcher_for: Callable[..., Any],
) -> None:
    # The node's llama-cpp-python install is the error engine, so a scaled-up `cold` runs it.
    engines = tmp_path / "engines"
    python = engines / "llama-cpp-python" / "0.3.36" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\ncd {ROOT} && exec {sys.executable} -m tests.hostile.error_engine "$@"\n')
    python.chmod(0o755)
    standin = start_standin(nodes=[engine_node(engines)])
    # A file for the artifact to fetch; the error engine never reads it.
    weights = tmp_path / "cold.gguf"
    weights.write_bytes(b"GGUF")
    text = ASSEMBLED.replace("file:///models/cold.gguf", f"file://{weights}")
    cold = parse_models(text).models["cold"]
    registered = httpx.post(f"{standin.url}/v1/jobs", json={"Job": render_job(cold)}, timeout=10)
    assert registered.status_code == 200, registered.text
    put_kv(consul_url, CONFIG_MODELS_KEY, text)
    router = guarded_router(consul_url, activation=True, keepalive_s=0.2)
    wait_until(lambda: "cold" in router.app.discovery.snapshot.models, 10, "the definitions")
    # The leading watcher answers the router's ask for `cold` (the router never calls Nomad).
    watcher = watcher_for(consul_url, standin.url)
    wait_until(watcher.leads_and_acts, 30, "the watcher to lead with every watch read")
    # Streamed, with nothing ready: each stream starts with keepalives while `cold` starts, and
    # the engine's refusal (its error object, or its plain text in the router's own error)
    # comes as the stream's last event.
    with ThreadPoolExecutor(2) as pool:
        json_error, plain_error = pool.map(lambda kind: streamed_lines(router.url, kind), ["json", "plain"])
    for lines in (json_error, plain_error):
        assert lines[0] == ": waiting for a replica of cold", lines
        assert_no_secret(lines[-1])
    error = json.loads(json_error[-1].removeprefix("data: "))["error"]
    assert error["message"].startswith("could not load the model: GET https://")
    error = json.loads(plain_error[-1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_error"
    assert "answered 500: engine crashed: GET https://" in error["message"]


def streamed_lines(url: str, kind: str) -> list[str]:
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"model": "cold", "messages": [{"role": "user", "content": kind}], "stream": True},
        timeout=120,
    ) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line]
