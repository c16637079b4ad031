"""A definition change, end to end: the Nomad stand-in running real `llama-server` engines, the
real watcher and a router under steady load. The new definition starts beside the serving one
(the model's second job ID), requests move to it once it is ready, and the old replicas are
drained and stopped only then; a broken new definition is parked after its five starts while
the old one serves every request, and applying the old definition again clears it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from devstack.llama_cpp import llama_cpp_node
from nomad_driver.placement import job_fabric
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.admin import WatcherCollector, model_status
from tests.fixtures.llama_cpp import llama_cpp_models
from tests.router.conftest import RunningRouter, StartRouter, put_kv, wait_until
from tests.router.fleet import WatcherThread
from tests.router.test_load_scaling_e2e import load, ready
from tests.router.test_multinode_replica import allocs_of, ask, fabric_node
from tests.watcher_support import until, watcher_on_standin

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FIRST, SECOND = "llmgw-slots", "llmgw-slots~b"


def models(gguf: Path, replicas: int) -> str:
    return f"""
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
    replicas: {{min: {replicas}, max: {replicas}}}
"""


def job(standin: Any, job_id: str) -> dict[str, Any] | None:
    resp = httpx.get(f"{standin.url}/v1/job/{job_id}", timeout=10)
    return resp.json() if resp.status_code == 200 else None


def count(standin: Any, job_id: str) -> int:
    j = job(standin, job_id)
    return int(j["TaskGroups"][0]["Count"]) if j is not None and not j.get("Stop") else 0


def serving_hashes(router: RunningRouter) -> set[str]:
    return {r.def_hash for r in router.app.discovery.snapshot.ready.get("slots", ())}


def gauges(watcher: WatcherThread) -> set[str]:
    """The model's parked and update-failed series, as Prometheus scrapes them."""
    registry = CollectorRegistry()
    registry.register(WatcherCollector(watcher.watcher))
    lines = generate_latest(registry).decode().splitlines()
    return {
        line
        for line in lines
        if line.startswith(("llmgw_model_parked{", "llmgw_model_update_failed{")) and 'model="slots"' in line
    }


def world(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    watcher_for: Callable[..., WatcherThread],
    engines: Path,
    text: str,
    replicas: int,
    node_memory_mib: int | None = None,
) -> tuple[Any, WatcherThread, RunningRouter]:
    # Nomad's clock five times as fast: restart delays and the drain's shutdown_delay shrink,
    # llama-server's load does not.
    node = llama_cpp_node("cpu-0", engines)
    if node_memory_mib is not None:
        node["memory_mib"] = node_memory_mib
    standin = start_standin(nodes=[node], clock_speed=5.0)
    put_kv(consul_url, "llmgw/config/models", text)
    router = start_router(consul_url, activation=True, activity_interval_s=0.5)
    watcher = watcher_for(consul_url, standin.url, activity_interval_s=0.5)
    wait_until(lambda: ready(router) == replicas, 120, f"{replicas} replicas ready")
    return standin, watcher, router


def test_a_new_definition_serves_before_the_old_one_stops_with_no_failed_request(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    watcher_for: Callable[..., WatcherThread],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    first = models(make_gguf(name="first.gguf", seed=1), 2)
    second = models(make_gguf(name="second.gguf", seed=2), 2)
    new_hash = parse_models(second).models["slots"].def_hash
    standin, watcher, router = world(
        consul_url, start_standin, start_router, watcher_for, llama_cpp_engines, first, 2
    )
    assert job(standin, SECOND) is None

    # Sampled all along: how many of the new definition's replicas served when the old job
    # was first asked to go.
    new_ready_when_old_left: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        # From Consul, as the watcher decides: a router's own reading of it may lag a moment.
        while not stop.is_set():
            old_count = count(standin, FIRST)
            entries = httpx.get(
                f"{consul_url}/v1/health/service/llmgw-engine",
                params={"passing": "1", "tag": "model=slots"},
                timeout=10,
            ).json()
            new_ready = sum(1 for e in entries if e["Service"]["Meta"].get("def_hash") == new_hash)
            if old_count == 0 and not new_ready_when_old_left:
                new_ready_when_old_left.append(new_ready)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    with load([router], clients=2) as steady:
        wait_until(lambda: len(steady.statuses) >= 6, 60, "the load to run")
        sampler.start()
        put_kv(consul_url, "llmgw/config/models", second)
        wait_until(lambda: count(standin, SECOND) == 2, 30, "the new definition's job beside the old")
        assert count(standin, FIRST) == 2, "the old replicas keep serving while the new ones load"
        wait_until(lambda: serving_hashes(router) == {new_hash}, 120, "only the new definition serving")
        old = job(standin, FIRST)
        wait_until(lambda: (job(standin, FIRST) or {}).get("Stop") is True, 60, "the old job stopped")
        wait_until(
            lambda: model_status(watcher.watcher, "slots")["previous_job_id"] == "",
            30,
            "no previous job left",
        )
        served = len(steady.statuses)
        time.sleep(1)
    stop.set()
    sampler.join(5)
    assert old is not None
    assert steady.errors == [] and set(steady.statuses) == {200}, steady.errors[:3]
    assert len(steady.statuses) > served, "the new definition served"
    assert new_ready_when_old_left and new_ready_when_old_left[0] == 2, new_ready_when_old_left
    status = model_status(watcher.watcher, "slots")
    assert status["job_id"] == SECOND and status["previous_job_id"] == "", status


def test_a_broken_new_definition_is_parked_while_the_old_one_serves_and_applying_the_old_clears_it(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    watcher_for: Callable[..., WatcherThread],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    good = models(make_gguf(), 1)
    broken = models(make_gguf("kev"), 1)
    standin, watcher, router = world(
        consul_url, start_standin, start_router, watcher_for, llama_cpp_engines, good, 1
    )
    with load([router], clients=1) as steady:
        wait_until(lambda: len(steady.statuses) >= 3, 60, "the load to run")
        put_kv(consul_url, "llmgw/config/models", broken)

        def update_failed() -> dict[str, Any] | None:
            status = model_status(watcher.watcher, "slots")
            return status if status["state"] == "update-failed" else None

        wait_until(update_failed, 180, "the broken definition parked")
        served = len(steady.statuses)
        time.sleep(2)
    assert steady.errors == [] and set(steady.statuses) == {200}, steady.errors[:3]
    assert len(steady.statuses) > served, "the old definition kept serving after the park"
    status = model_status(watcher.watcher, "slots")
    assert "unknown model architecture: 'kev'" in status["reason"], status
    assert "serving the previous definition (llmgw-slots)" in status["reason"], status
    assert status["previous_job_id"] == FIRST and status["job_id"] == SECOND
    assert count(standin, SECOND) == 0 and count(standin, FIRST) == 1
    # What the alert reads: an update that failed, not a parked (down) model.
    assert gauges(watcher) == {
        'llmgw_model_parked{model="slots"} 0.0',
        'llmgw_model_update_failed{model="slots"} 1.0',
    }

    # The previous definition applied again: it is current (and serves), the failed job goes.
    put_kv(consul_url, "llmgw/config/models", good)
    wait_until(
        lambda: model_status(watcher.watcher, "slots")["state"] == "satisfied", 60, "the model satisfied"
    )
    wait_until(lambda: (job(standin, SECOND) or {}).get("Stop") is True, 60, "the failed job stopped")
    wait_until(
        lambda: model_status(watcher.watcher, "slots")["previous_job_id"] == "", 30, "no previous job left"
    )
    assert model_status(watcher.watcher, "slots")["job_id"] == FIRST
    assert 'llmgw_model_update_failed{model="slots"} 0.0' in gauges(watcher)


def test_with_no_room_beside_a_rolling_update_replaces_one_replica_at_a_time_and_keeps_serving(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    watcher_for: Callable[..., WatcherThread],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    def rolling(gguf: Path) -> str:
        return models(gguf, 2).replace(
            'args: ["--parallel", "1"]', 'args: ["--parallel", "1"]\n    update: rolling'
        )

    first = rolling(make_gguf(name="first.gguf", seed=1))
    second = rolling(make_gguf(name="second.gguf", seed=2))
    new_hash = parse_models(second).models["slots"].def_hash
    # Room for two of the 512 MiB replicas, not four: the new ones cannot start beside the old.
    standin, watcher, router = world(
        consul_url,
        start_standin,
        start_router,
        watcher_for,
        llama_cpp_engines,
        first,
        2,
        node_memory_mib=1100,
    )
    old_counts: list[int] = []
    fewest_ready = [2]
    stop = threading.Event()

    def sample() -> None:
        # Replicas ready as Consul says, which the watcher decides by (a router's reading of it
        # may lag a moment, and a request then waits for it rather than fails).
        while not stop.is_set():
            n = count(standin, FIRST)
            if not old_counts or old_counts[-1] != n:
                old_counts.append(n)
            entries = httpx.get(
                f"{consul_url}/v1/health/service/llmgw-engine",
                params={"passing": "1", "tag": "model=slots"},
                timeout=10,
            ).json()
            fewest_ready[0] = min(fewest_ready[0], len(entries))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    with load([router], clients=1) as steady:
        wait_until(lambda: len(steady.statuses) >= 3, 60, "the load to run")
        sampler.start()
        put_kv(consul_url, "llmgw/config/models", second)
        wait_until(
            lambda: serving_hashes(router) == {new_hash} and ready(router) == 2,
            180,
            "both replicas on the new definition",
        )
        wait_until(lambda: (job(standin, FIRST) or {}).get("Stop") is True, 60, "the old job stopped")
        time.sleep(1)
    stop.set()
    sampler.join(5)
    assert steady.errors == [] and set(steady.statuses) == {200}, steady.errors[:3]
    # One old replica at a time made room, and one always served.
    assert old_counts[:3] == [2, 1, 0], old_counts
    assert fewest_ready[0] >= 1, fewest_ready
    wait_until(
        lambda: model_status(watcher.watcher, "slots")["previous_job_id"] == "", 30, "no previous job left"
    )
    assert model_status(watcher.watcher, "slots")["job_id"] == SECOND


@pytest.mark.timeout(420)
async def test_a_multi_node_models_new_definition_starts_in_another_fabric_beside_the_serving_replica(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    # Two fabrics of two nodes: the new replica cannot share the serving one's nodes, and finds
    # room in the other fabric.
    nodes = [fabric_node(f"{f}-{i}", f, llama_cpp_engines) for f in ("ib-a", "ib-b") for i in range(2)]
    first = llama_cpp_models("tiny-split", make_gguf(name="first.gguf", seed=1), nodes=2)
    second = llama_cpp_models("tiny-split", make_gguf(name="second.gguf", seed=2), nodes=2)
    new_hash = parse_models(second).models["tiny-split"].def_hash
    standin, consul, nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, first, ident="w1", clock_speed=5.0, nodes=nodes
    )
    await watcher.start()
    answers: list[str] = []
    stop = threading.Event()

    def steady() -> None:
        while not stop.is_set():
            try:
                answers.append(ask(router.url))
            except Exception as exc:  # what failed is the assertion's message
                answers.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.2)

    try:
        router = start_router(consul_url)
        await asyncio.to_thread(router.wait_ready, "tiny-split", 1, 180)
        old_fabric = job_fabric(nomad.get_job("llmgw-tiny-split"))
        client = threading.Thread(target=steady, daemon=True)
        client.start()
        await consul.kv_put(CONFIG_MODELS_KEY, second)

        def beside() -> dict[str, Any] | None:
            job = nomad.get_job("llmgw-tiny-split~b")
            return job if job is not None and job_fabric(job) else None

        new_job = await until(beside, 60, "the new definition's replica job, pinned")
        assert job_fabric(new_job) != old_fabric, (job_fabric(new_job), old_fabric)
        await until(
            lambda: (
                {r.def_hash for r in router.app.discovery.snapshot.ready.get("tiny-split", ())} == {new_hash}
            ),
            240,
            "the new replica serving alone",
        )
        await until(
            lambda: (nomad.get_job("llmgw-tiny-split") or {}).get("Stop") is True, 120, "the old job stopped"
        )
        served = len(answers)
        await asyncio.sleep(1)
        stop.set()
        client.join(70)
        assert len(answers) > served
        assert set(answers) == {"assistant"}, [a for a in answers if a != "assistant"][:3]
        # The old replica's leader and shard both end, once drained.
        await until(
            lambda: (
                not [a for a in allocs_of(standin.url, "llmgw-tiny-split") if a["ClientStatus"] == "running"]
            ),
            60,
            "the old leader and shard ended",
        )
        status = model_status(watcher, "tiny-split")
        assert status["job_id"] == "llmgw-tiny-split~b" and status["fabric"] == job_fabric(new_job)
    finally:
        stop.set()
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()
