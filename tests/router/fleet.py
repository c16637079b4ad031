"""The fleet the activation tests run on: the Nomad stand-in with one L4 node whose engine is
llama-cpp-python from this virtualenv, the test models registered as its jobs and stored in
Consul, a router with activation on, and the real watcher, which answers the router's asks (the
one writer of every job's count)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from devstack.fleet import install_llama_cpp_python
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.render import TASK_NAME, render_job
from nomad_driver.spec import parse_models
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.router.conftest import RunningRouter, StartRouter, put_kv, wait_until

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
  filler:
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
    def __init__(
        self, standin: Any, router: RunningRouter, engines: Path, watcher: WatcherThread | None = None
    ) -> None:
        self.standin = standin
        self.router = router
        self.engines = engines
        self.watcher = watcher

    def chat(self, model: str, timeout: float = 120) -> httpx.Response:
        """One plain request (no SDK retries), as a client that gives up after `timeout`."""
        return httpx.post(
            f"{self.router.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=timeout,
        )

    def sdk(self, timeout: float = 120, **options: Any) -> OpenAI:
        """The real openai SDK on the router, as a user runs it: its two retries included
        unless `max_retries` says otherwise."""
        return OpenAI(base_url=f"{self.router.url}/v1", api_key="none", timeout=timeout, **options)

    def ask(self, client: OpenAI, model: str, **options: Any) -> Any:
        """One short chat through `client`."""
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **options
        )

    def engine_log(self, job_id: str) -> str:
        """What the engines of a job wrote, read through Nomad's log API: for llama-cpp-python,
        uvicorn's line per request it served among it."""
        allocs = httpx.get(f"{self.standin.url}/v1/job/{job_id}/allocations", timeout=10).json()
        logs = []
        for alloc in allocs:
            for kind in ("stdout", "stderr"):
                resp = httpx.get(
                    f"{self.standin.url}/v1/client/fs/logs/{alloc['ID']}",
                    params={"task": TASK_NAME, "type": kind, "plain": "true"},
                    timeout=10,
                )
                logs.append(resp.text)
        return "".join(logs)

    def job_count(self, job_id: str) -> int:
        job = httpx.get(f"{self.standin.url}/v1/job/{job_id}", timeout=10).json()
        return int(job["TaskGroups"][0]["Count"])

    def scale(self, job_id: str, count: int) -> None:
        reply = httpx.post(
            f"{self.standin.url}/v1/job/{job_id}/scale",
            json={"Count": count, "Target": {"Group": "engine"}, "Message": "test"},
            timeout=10,
        )
        assert reply.status_code == 200, reply.text

    def scale_events(self, job_id: str) -> list[dict[str, Any]]:
        status = httpx.get(f"{self.standin.url}/v1/job/{job_id}/scale", timeout=10).json()
        return list(status["TaskGroups"]["engine"]["Events"] or [])


MakeFleet = Callable[..., Fleet]


@pytest.fixture
def make_fleet(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    make_gguf: Callable[..., Path],
    watcher_for: Callable[..., WatcherThread],
) -> MakeFleet:
    """`make_fleet(clock_speed=1.0, kev_window="3s", idle_timeouts={}, nomad_front=None,
    watcher=True, **router_overrides)`: one L4 node on the stand-in, the models registered as
    jobs and stored in Consul, a router, and the real watcher on Nomad (through
    `nomad_front(stand-in URL)` if given) that answers the router's asks."""

    def make(
        clock_speed: float = 1.0,
        kev_window: str = "3s",
        idle_timeouts: dict[str, str] | None = None,
        nomad_front: Callable[[str], str] | None = None,
        watcher: bool = True,
        **router_overrides: Any,
    ) -> Fleet:
        # The nodes' engine install: llama-cpp-python from this virtualenv.
        engines = tmp_path / "engines"
        install_llama_cpp_python(engines)
        nodes = tmp_path / "nodes.yaml"
        nodes.write_text(yaml.safe_dump({"nodes": [node("gpu-l4-0", engines, 1, 24564, "NVIDIA L4")]}))
        standin = start_standin(nodes=nodes, clock_speed=clock_speed)

        text = models_yaml(make_gguf(), make_gguf("kev")).replace(
            "activation_timeout: 3s", f"activation_timeout: {kev_window}"
        )
        for name, idle in (idle_timeouts or {}).items():
            text = text.replace(f"\n  {name}:\n", f"\n  {name}:\n    idle_timeout: {idle}\n", 1)
        for model in parse_models(text).models.values():
            reply = httpx.post(f"{standin.url}/v1/jobs", json={"Job": render_job(model)}, timeout=10)
            assert reply.status_code == 200, reply.text
        put_kv(consul_url, "llmgw/config/models", text)
        nomad_url = nomad_front(standin.url) if nomad_front else standin.url
        router = start_router(consul_url, activation=True, **router_overrides)
        router.wait_ready("tiny", 0)
        wait_until(lambda: len(router.app.discovery.snapshot.models) == 4, 10, "the four models")
        running = watcher_for(consul_url, nomad_url) if watcher else None
        if running is not None:
            wait_until(running.leads_and_acts, 30, "the watcher to lead with every watch read")
        return Fleet(standin, router, engines, running)

    return make


@pytest.fixture
def fleet(make_fleet: MakeFleet) -> Fleet:
    return make_fleet()


class WatcherThread:
    """The real watcher, on its own event loop in a thread beside the router's."""

    def __init__(self, consul_url: str, nomad_url: str, **config: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="watcher", daemon=True)
        self.thread.start()
        settings = WatcherConfig(wait_s=10, lock_delay_s=0.5, tick_s=0.5, **config)
        self.watcher = self._run(_make_watcher(consul_url, nomad_url, settings))

    def leads_and_acts(self) -> bool:
        return self.watcher.leadership.is_leader and self.watcher.ready_to_act()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def start(self) -> None:
        self._run(self.watcher.start())

    def stop(self) -> None:
        self._run(self.watcher.stop())
        self._run(self.watcher.consul.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _make_watcher(consul_url: str, nomad_url: str, config: WatcherConfig) -> Watcher:
    return Watcher(Consul(consul_url), Nomad(nomad_url), config, ident="test-watcher")


@pytest.fixture
def watcher_for() -> Iterator[Callable[..., WatcherThread]]:
    """`watcher_for(consul_url, nomad_url, **watcher_config)`: the real watcher in a thread."""
    started: list[WatcherThread] = []

    def start(consul_url: str, nomad_url: str, **config: Any) -> WatcherThread:
        w = WatcherThread(consul_url, nomad_url, **config)
        started.append(w)
        w.start()
        return w

    try:
        yield start
    finally:
        for w in started:
            w.stop()
