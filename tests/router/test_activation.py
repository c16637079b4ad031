"""Activation against the Nomad stand-in (real Nomad HTTP API, real placement rules, engines run
as real llama.cpp processes registered in the real Consul): a request for a model with nothing
running scales its job up and is answered once a replica is ready; a model that fits nowhere is
refused at once with Nomad's reason, and asked about afresh on the next request."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from tests.router.conftest import RunningRouter, StartRouter, get_kv, put_kv, wait_until

ENGINE_VERSION = "0.3.36"


def node(name: str, engines: Path, gpus: int, gpu_memory_mib: int, model: str) -> dict[str, Any]:
    return {
        "name": name,
        "datacenter": "dc1",
        "cpu_mhz": 32000,
        "cpu_cores": 16,
        "memory_mib": 65536,
        "disk_mb": 100000,
        "attributes": {"driver.raw_exec": "1"},
        "meta": {"llmgw_engines_dir": str(engines), "llmgw_engine_llama_cpp_python": ENGINE_VERSION},
        "gpus": [{"model": model, "memory_mib": gpu_memory_mib, "count": gpus}],
    }


def models_yaml(tiny: Path, kev: Path) -> str:
    return f"""
profiles:
  small:
    engine: llama-cpp-python
    engine_version: "{ENGINE_VERSION}"
    gpus: 1
    gpu_memory_mib: 8000
    memory_mib: 1024
    context: 256
  huge:
    engine: llama-cpp-python
    engine_version: "{ENGINE_VERSION}"
    gpus: 8
    gpu_memory_mib: 80000
    memory_mib: 1024
    context: 256
models:
  tiny:
    source: file://{tiny}
    profile: small
    replicas: {{min: 0, max: 1}}
    activation_timeout: 90s
  phi-4:
    source: file://{tiny}
    profile: huge
    replicas: {{min: 0, max: 1}}
    activation_timeout: 90s
  kev-0.5b:
    source: file://{kev}
    profile: small
    replicas: {{min: 0, max: 1}}
    activation_timeout: 3s
"""


class Fleet:
    def __init__(self, standin: Any, router: RunningRouter, engines: Path) -> None:
        self.standin = standin
        self.router = router
        self.engines = engines

    def chat(self, model: str, timeout: float = 120) -> httpx.Response:
        return httpx.post(
            f"{self.router.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=timeout,
        )

    def job_count(self, job_id: str) -> int:
        job = httpx.get(f"{self.standin.url}/v1/job/{job_id}", timeout=10).json()
        return int(job["TaskGroups"][0]["Count"])

    def scale_events(self, job_id: str) -> list[dict[str, Any]]:
        status = httpx.get(f"{self.standin.url}/v1/job/{job_id}/scale", timeout=10).json()
        return list(status["TaskGroups"]["engine"]["Events"] or [])


@pytest.fixture
def fleet(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    make_gguf: Callable[..., Path],
) -> Fleet:
    # The nodes' engine install: llama-cpp-python from this virtualenv.
    engines = tmp_path / "engines"
    python = engines / "llama-cpp-python" / ENGINE_VERSION / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [node("gpu-l4-0", engines, 1, 24564, "NVIDIA L4")]}))
    standin = start_standin(nodes=nodes)

    text = models_yaml(make_gguf(), make_gguf("kev"))
    for model in parse_models(text).models.values():
        reply = httpx.post(f"{standin.url}/v1/jobs", json={"Job": render_job(model)}, timeout=10)
        assert reply.status_code == 200, reply.text
    put_kv(consul_url, "llmgw/config/models", text)
    router = start_router(consul_url, activation=True, nomad_url=standin.url)
    router.wait_ready("tiny", 0)
    wait_until(lambda: len(router.app.discovery.snapshot.models) == 3, 10, "the three models")
    return Fleet(standin, router, engines)


@pytest.mark.slow
def test_concurrent_requests_for_an_idle_model_share_one_activation_and_are_answered(
    fleet: Fleet, consul_url: str
) -> None:
    assert fleet.job_count("llmgw-tiny") == 0
    before = time.time()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: fleet.chat("tiny"), range(4)))
    for resp in answers:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert fleet.job_count("llmgw-tiny") == 1
    # One scale call for the four requests.
    events = [e for e in fleet.scale_events("llmgw-tiny") if e.get("Count") == 1]
    assert len(events) == 1, events
    assert "no ready replica" in events[0]["Message"]
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="tiny", result="placed")
    # Activity is written before the scale call, so the watcher does not scale it straight down.
    activity = get_kv(consul_url, "llmgw/activity/tiny")
    assert activity is not None and float(activity) >= before - 1
    # With a replica ready, the next request goes straight through without Nomad.
    assert fleet.chat("tiny").status_code == 200
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="tiny", result="placed")


@pytest.mark.slow
def test_a_model_that_fits_nowhere_is_refused_at_once_and_asked_about_afresh_each_time(fleet: Fleet) -> None:
    started = time.monotonic()
    resp = fleet.chat("phi-4")
    assert time.monotonic() - started < 10, "waited for more than the evaluation"
    assert resp.status_code == 503
    assert resp.headers["x-should-retry"] == "false"
    assert "retry-after" not in resp.headers
    error = resp.json()["error"]
    assert error["code"] == "model_unplaceable"
    assert "model 'phi-4' cannot be placed on any node: " in error["message"]
    assert "nvidia/gpu" in error["message"]
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="phi-4", result="unplaceable")

    # The next request does not reuse that answer: it asks Nomad again.
    assert fleet.chat("phi-4").status_code == 503
    fleet.router.expect_metric("llmgw_router_activations_total", 2, model="phi-4", result="unplaceable")


@pytest.mark.slow
def test_a_model_refused_as_unplaceable_is_served_once_room_is_made(fleet: Fleet, consul_url: str) -> None:
    # The watcher's last word says unplaceable; the router must not trust it blindly.
    put_kv(
        consul_url,
        "llmgw/state/phi-4",
        json.dumps({"unplaceable": True, "placement_reason": "no node has 8 x nvidia/gpu"}),
    )
    wait_until(lambda: "phi-4" in fleet.router.app.discovery.snapshot.states, 10, "the stale state")
    assert fleet.chat("phi-4").status_code == 503
    fleet.standin.add_node(node("gpu-h100-0", fleet.engines, 8, 81559, "NVIDIA H100 80GB HBM3"))
    resp = fleet.chat("phi-4")
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-llmgw-replica"]


@pytest.mark.slow
def test_a_placed_model_that_never_becomes_ready_gets_model_loading_with_retry_after(fleet: Fleet) -> None:
    started = time.monotonic()
    resp = fleet.chat("kev-0.5b")
    waited = time.monotonic() - started
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "model_loading"
    assert int(resp.headers["retry-after"]) > 0
    assert "x-should-retry" not in resp.headers
    # Its activation window is 3 s.
    assert 2.5 <= waited < 20
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="kev-0.5b", result="placed")


def test_an_unreachable_nomad_is_a_retryable_503_naming_it(
    consul_url: str, start_router: StartRouter
) -> None:
    put_kv(
        consul_url,
        "llmgw/config/models",
        models_yaml(Path("/models/tiny.gguf"), Path("/models/kev.gguf")),
    )
    router = start_router(consul_url, activation=True, nomad_url="http://127.0.0.1:9")
    wait_until(lambda: router.app.discovery.snapshot.models, 10, "the models")
    resp = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "activation_failed"
    assert "cannot reach Nomad at http://127.0.0.1:9" in error["message"]
    assert resp.headers["retry-after"] == "5"
    router.expect_metric("llmgw_router_activations_total", 1, model="tiny", result="error")
