"""Scaling by load, end to end: the Nomad stand-in running real `llama-server` engines with one
slot each (`--parallel 1`, so one request in flight is one replica's worth), the real watcher
(short windows through its config, the CLI's `--scale-up-window` and `--scale-step-interval`),
real routers and a pool of clients. A burst scales the model from 1 to its max and, after the
scale-down delay, back to its min without a request failing; two routers each carrying half
the load add up; a scale-up that fits nowhere reads "short" while the minimum keeps serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.llama_cpp import llama_cpp_node
from nomad_driver.watcher.admin import model_status
from tests.router.conftest import RunningRouter, StartRouter, put_kv, wait_until
from tests.router.fleet import WatcherThread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def models(gguf: Path, rmax: int) -> str:
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
    replicas: {{min: 1, max: {rmax}, scale_down_delay: 8s}}
"""


class Load:
    """`clients` threads, each sending one chat after another to its router until stopped;
    every answer's status is kept."""

    def __init__(self, routers: list[RunningRouter], clients: int, max_tokens: int = 24) -> None:
        self.max_tokens = max_tokens
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(clients)
        self._futures = [self._pool.submit(self._run, routers[i % len(routers)].url) for i in range(clients)]

    def _run(self, url: str) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                try:
                    resp = http.post(
                        f"{url}/v1/chat/completions",
                        json={
                            "model": "slots",
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": self.max_tokens,
                        },
                    )
                    self.statuses.append(resp.status_code)
                    if resp.status_code != 200:
                        self.errors.append(resp.text[:300])
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=150)
        self._pool.shutdown()


@contextmanager
def load(routers: list[RunningRouter], clients: int, max_tokens: int = 24) -> Iterator[Load]:
    running = Load(routers, clients, max_tokens)
    try:
        yield running
    finally:
        running.stop()


def job_count(standin: Any) -> int:
    job = httpx.get(f"{standin.url}/v1/job/llmgw-slots", timeout=10).json()
    return int(job["TaskGroups"][0]["Count"])


def ready(router: RunningRouter) -> int:
    return len(router.app.discovery.snapshot.ready.get("slots", ()))


@pytest.fixture
def scaling_world(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    watcher_for: Callable[..., WatcherThread],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> Callable[..., tuple[Any, WatcherThread, list[RunningRouter]]]:
    def make(
        rmax: int, routers: int = 1, node_memory_mib: int = 65536
    ) -> tuple[Any, WatcherThread, list[RunningRouter]]:
        node = llama_cpp_node("cpu-0", llama_cpp_engines)
        node["memory_mib"] = node_memory_mib
        standin = start_standin(nodes=[node])
        put_kv(consul_url, "llmgw/config/models", models(make_gguf(), rmax))
        # Publishing every half second, so the watcher sees load within a second.
        started = [start_router(consul_url, activation=True, activity_interval_s=0.5) for _ in range(routers)]
        watcher = watcher_for(
            consul_url,
            standin.url,
            scale_up_window_s=2.0,
            scale_step_interval_s=1.0,
            activity_interval_s=0.5,
        )
        # The watcher registers the job at its minimum.
        wait_until(lambda: all(ready(r) == 1 for r in started), 90, "the minimum's replica ready")
        return standin, watcher, started

    return make


def test_a_burst_scales_one_to_max_and_back_to_min_after_the_delay_with_no_request_failing(
    scaling_world: Callable[..., tuple[Any, WatcherThread, list[RunningRouter]]],
) -> None:
    standin, watcher, (router,) = scaling_world(rmax=3)
    with load([router], clients=6) as burst:
        # Six in flight on one one-slot replica is a burst: answered at once, not averaged.
        wait_until(lambda: job_count(standin) == 3, 20, "the watcher to scale to max")
        status = model_status(watcher.watcher, "slots")
        # `max` while the load wants more than 3, `load` at a moment it wants exactly 3, `held`
        # at a moment the clients (slowed on a loaded machine) keep fewer in flight: never less.
        assert status["desired_reason"] in ("max", "load", "held"), status
        assert status["desired"] == 3, status
        assert "per replica" in status["desired_detail"] and status["replicas"]["target_in_flight"] == 1
        wait_until(lambda: ready(router) == 3, 90, "three replicas ready")
        time.sleep(2)
    assert burst.errors == [] and burst.statuses and set(burst.statuses) == {200}, burst.errors[:3]
    # Load gone: held for the scale-down delay (8 s), then back to the minimum.
    stopped = time.monotonic()
    time.sleep(4)
    assert job_count(standin) == 3, "scaled down before the delay"
    assert model_status(watcher.watcher, "slots")["desired_reason"] == "held"
    wait_until(lambda: job_count(standin) == 1, 40, "the watcher to scale back to min")
    assert time.monotonic() - stopped >= 7
    assert model_status(watcher.watcher, "slots")["desired_reason"] == "min"
    # The minimum still serves.
    with load([router], clients=1) as after:
        time.sleep(2)
    assert after.statuses and set(after.statuses) == {200}, after.errors[:3]


def test_two_routers_each_carrying_half_the_load_add_up(
    scaling_world: Callable[..., tuple[Any, WatcherThread, list[RunningRouter]]],
) -> None:
    standin, watcher, routers = scaling_world(rmax=4, routers=2)
    with load(routers, clients=4) as both:
        # Two in flight per router: either alone asks for two replicas, together for four.
        wait_until(lambda: job_count(standin) == 4, 30, "the watcher to sum both routers' load")
        peak = max(r.app.activity.in_flight()["models"].get("slots", {}).get("requests", 0) for r in routers)
        assert peak <= 2
        # Summed over both routers: more than either carries (at some moment, since a client
        # between two requests has none in flight).
        wait_until(lambda: watcher.watcher.views["slots"].in_flight >= 3, 10, "both routers' load summed")
    assert both.errors == [], both.errors[:3]


def test_a_scale_up_that_fits_nowhere_reads_short_while_the_minimum_serves(
    scaling_world: Callable[..., tuple[Any, WatcherThread, list[RunningRouter]]],
) -> None:
    # Room for one 512 MiB replica, not two.
    standin, watcher, (router,) = scaling_world(rmax=3, node_memory_mib=900)
    with load([router], clients=4) as burst:
        wait_until(lambda: job_count(standin) == 3, 20, "the watcher to ask for max")
        status = wait_until(
            lambda: (s := model_status(watcher.watcher, "slots"))["short"] and s,
            20,
            "the model to read short",
        )
        assert status["state"] == "short" and not status["unplaceable"]
        assert "memory" in status["short_reason"], status["short_reason"]
        assert status["health"] == "warning" and status["health_output"].startswith("short: ")
        time.sleep(2)
    # Short, not refused: every request was served by the minimum.
    assert burst.errors == [] and set(burst.statuses) == {200}, burst.errors[:3]
    assert ready(router) == 1
