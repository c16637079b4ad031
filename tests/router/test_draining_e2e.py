"""Draining, end to end: the Nomad stand-in running the job that `render` writes, with real
`llama-server` engines of one slot each, the real Consul and a router. A scale-down while
every replica is busy fails no request: Nomad takes a stopped replica's service out of Consul
first, the router drops it from rotation at once, and the engine is killed only after the
group's `shutdown_delay`, once the requests already on it have finished."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.llama_cpp import llama_cpp_node
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from tests.router.conftest import StartRouter, put_kv, wait_until
from tests.router.test_load_scaling_e2e import load, ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODELS = """
profiles:
  one-slot:
    engine: llama.cpp
    engine_version: b6500
    gpus: 0
    cpu_mhz: 500
    memory_mib: 512
    context: 256
    args: ["--parallel", "1"]
models:
  slots:
    source: file://{gguf}
    profile: one-slot
    replicas: {{min: 1, max: 3}}
"""


def running_allocs(standin: Any, job_id: str) -> int:
    allocs = httpx.get(f"{standin.url}/v1/job/{job_id}/allocations", timeout=10).json()
    return sum(1 for a in allocs if a["ClientStatus"] == "running")


def test_a_scale_down_under_load_fails_no_request(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    text = MODELS.format(gguf=make_gguf())
    model = parse_models(text).models["slots"]
    standin = start_standin(nodes=[llama_cpp_node("cpu-0", llama_cpp_engines)])
    put_kv(consul_url, "llmgw/config/models", text)
    router = start_router(consul_url)
    job = render_job(model)
    job["TaskGroups"][0]["Count"] = 3
    httpx.put(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10).raise_for_status()
    wait_until(lambda: ready(router) == 3, 90, "three replicas ready")

    # Three clients on three one-slot replicas: every replica has a request on it at almost
    # any moment, so a replica killed as it leaves Consul cuts one.
    with load([router], clients=3, max_tokens=96) as busy:
        wait_until(lambda: len(busy.statuses) >= 12, 60, "the load to run")
        # An operator's `nomad job scale`, or the watcher's scale-down: Nomad stops two allocations.
        httpx.post(
            f"{standin.url}/v1/job/{model.job_id}/scale",
            json={"Count": 1, "Target": {"Group": job["TaskGroups"][0]["Name"]}},
            timeout=10,
        ).raise_for_status()
        wait_until(lambda: ready(router) == 1, 30, "the stopped replicas out of the router's rotation")
        wait_until(lambda: running_allocs(standin, model.job_id) == 1, 90, "the stopped engines to end")
        served = len(busy.statuses)
        time.sleep(1)
    assert len(busy.statuses) > served, "the remaining replica served"
    assert busy.errors == [] and set(busy.statuses) == {200}, busy.errors[:3]
