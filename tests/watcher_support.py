"""Setup shared by the watcher tests: model definitions, jobs on Nomad's mock driver, stand-in
nodes, and polling for a condition."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import requests

from devstack.fleet import install_llama_cpp_python
from devstack.ports import free_port
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.render import render_job
from nomad_driver.spec import Model
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, parse_state, state_key
from nomad_driver.watcher.loop import Watcher, WatcherConfig

# The CPU profile with nothing but its engine: enough for reconcile() and for a watcher whose
# Nomad is never asked to place anything.
BARE_CPU_PROFILE = """
profiles:
  cpu:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 0
"""

# One model that keeps crashing (parked after five failures) and one that is never started.
CRASH_AND_IDLE_MODELS = """
profiles:
  cpu:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 0
    cpu_mhz: 500
    memory_mib: 512
models:
  crash:
    source: file:///tmp/crash.gguf
    profile: cpu
    replicas: {min: 1, max: 1}
  idle:
    source: file:///tmp/idle.gguf
    profile: cpu
    replicas: {min: 0, max: 1}
"""

# A small CPU profile that fits the stand-in's nodes, and a two-GPU one that fits none of them.
PROFILES = """
profiles:
  cpu:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 0
    cpu_mhz: 500
    memory_mib: 512
    context: 256
  huge:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 2
    gpu_memory_mib: 81920
    cpu_mhz: 500
    memory_mib: 512
"""


def models_text(**models: tuple[str, str, int]) -> str:
    """PROFILES plus one model per keyword: (source, profile, replicas min), max 2."""
    lines = [PROFILES, "models:"]
    for name, (source, profile, minimum) in models.items():
        lines += [
            f"  {name}:",
            f"    source: {source}",
            f"    profile: {profile}",
            f"    replicas: {{min: {minimum}, max: 2}}",
        ]
    return "\n".join(lines) + "\n"


async def until(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """The first truthy result of cond (awaited when it is a coroutine), polled every `every` s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        result = cond()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return result
        await asyncio.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def mock_job(model: Model, count: int | None = None, **config: Any) -> dict[str, Any]:
    """The rendered job, with its engine swapped for Nomad's mock driver; the rendered count
    unless one is given."""
    job = render_job(model)
    task = job["TaskGroups"][0]["Tasks"][0]
    task["Driver"] = "mock_driver"
    task["Config"] = config
    task.pop("Artifacts", None)
    if count is not None:
        job["TaskGroups"][0]["Count"] = count
    return job


async def read_state(consul: Consul, model: str) -> ModelState | None:
    _, entries = await consul.kv_get(state_key(model))
    return parse_state("k", entries[0].value) if entries else None


def engines_dir(tmp_path: Path) -> Path:
    """`<dir>/llama-cpp-python/0.3.36/bin/python` as a node expects it: this virtualenv's python,
    behind the simulated node's CUDA view, as the dev stack installs it."""
    root = tmp_path / "engines"
    install_llama_cpp_python(root)
    return root


def node(name: str, engines: Path, gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A stand-in node with both drivers and llama-cpp-python 0.3.36 installed under engines."""
    return {
        "name": name,
        "datacenter": "dc1",
        "node_class": "cpu",
        "cpu_mhz": 16000,
        "cpu_cores": 8,
        "memory_mib": 65536,
        "disk_mb": 100000,
        "attributes": {"driver.raw_exec": "1", "driver.mock_driver": "1"},
        "meta": {"llmgw_engines_dir": str(engines), "llmgw_engine_llama_cpp_python": "0.3.36"},
        "gpus": gpus or [],
    }


async def watcher_on_standin(
    consul_url: str,
    start_standin: Callable[..., Any],
    text: str,
    *,
    ident: str,
    clock_speed: float,
    nodes: Any = None,
) -> tuple[Any, Consul, Nomad, Watcher]:
    """A stand-in (default nodes unless given), `text` stored as the definitions in Consul, and a
    watcher on both, not yet started: (stand-in, Consul client for the test, Nomad, watcher)."""
    standin = start_standin(clock_speed=clock_speed, **({"nodes": nodes} if nodes is not None else {}))
    consul = Consul(consul_url)
    await consul.kv_put(CONFIG_MODELS_KEY, text)
    nomad = Nomad(standin.url)
    config = WatcherConfig(wait_s=10, lock_delay_s=0.5, tick_s=0.5)
    watcher = Watcher(Consul(consul_url), nomad, config, ident=ident)
    return standin, consul, nomad, watcher


def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """The first truthy result of cond, polled every 0.1 s; a watcher not yet answering counts
    as not yet."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            result = cond()
        except requests.RequestException:
            result = None
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def leader_of(procs: list[Any]) -> int | None:
    """The index of the live watcher process whose /healthz says it leads, if any."""
    for i, (proc, url) in enumerate(procs):
        if proc.poll() is None and requests.get(f"{url}/healthz", timeout=2).json().get("leader"):
            return i
    return None


@contextmanager
def watcher_processes(
    env_for: Callable[[int], dict[str, str]], listen_host: str, log_dir: Path, count: int = 2
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """`count` real `llmgw watcher` processes on free ports, each listening on listen_host with
    the environment env_for(port) and logging to log_dir/watcher-<i>.log: (process, URL) pairs,
    stopped with SIGTERM (then SIGKILL) on exit."""
    procs: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for i in range(count):
            port = free_port()
            log = (log_dir / f"watcher-{i}.log").open("wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "nomad_driver.cli", "watcher", "--listen", f"{listen_host}:{port}"],
                env=env_for(port),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            procs.append((proc, f"http://127.0.0.1:{port}"))
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def terminated(nomad: Nomad, job_id: str) -> int:
    """How many times a job's tasks have exited, over all its allocations, as Nomad reports it."""
    allocs = nomad._json(nomad._request("job", job_id, "allocations", params={"all": "true"}), "allocs")
    return sum(
        1
        for a in allocs
        for state in (a.get("TaskStates") or {}).values()
        for e in state.get("Events") or []
        if e.get("Type") == "Terminated"
    )


@asynccontextmanager
async def watchers_on_standin(
    consul_url: str, start_standin: Callable[..., Any]
) -> AsyncIterator[Callable[..., Awaitable[tuple[Any, Consul, Nomad, Watcher]]]]:
    """watcher_on_standin as a factory (same arguments but the first two), every watcher it made
    stopped and its Consul clients closed on exit."""
    made: list[tuple[Consul, Watcher]] = []

    async def make(text: str, **kwargs: Any) -> tuple[Any, Consul, Nomad, Watcher]:
        standin, consul, nomad, watcher = await watcher_on_standin(consul_url, start_standin, text, **kwargs)
        made.append((consul, watcher))
        return standin, consul, nomad, watcher

    try:
        yield make
    finally:
        for consul, watcher in made:
            await watcher.stop()
            await watcher.consul.close()
            await consul.close()
