"""The world fails under the watcher: malformed state in KV is reported and replaced, and a
Consul that restarts empty is rebuilt from what Nomad still knows, without crashing the watcher."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, parse_state, state_key
from nomad_driver.watcher import Watcher, WatcherConfig

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

MODELS = """
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


async def until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        result = cond()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return result
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def state_of(consul: Consul, model: str) -> ModelState | None:
    try:
        _, entries = await consul.kv_get(state_key(model))
        return parse_state("k", entries[0].value) if entries else None
    except Exception:
        return None


async def test_malformed_state_is_replaced_and_a_restarted_consul_is_rebuilt(
    make_consul_agent: Callable[[], Any],
    start_standin: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    agent = make_consul_agent()
    standin = start_standin(clock_speed=20.0, consul=False)
    consul = Consul(agent.url)
    await consul.kv_put(CONFIG_MODELS_KEY, MODELS)
    await consul.kv_put(state_key("idle"), b"{not json")
    model = parse_models(MODELS).models["crash"]
    job = render_job(model)
    task = job["TaskGroups"][0]["Tasks"][0]
    task.update(Driver="mock_driver", Config={"run_for": "1s", "exit_code": 1})
    task.pop("Artifacts", None)
    nomad = Nomad(standin.url)
    nomad.register_job(job)
    watcher = Watcher(
        Consul(agent.url), nomad, WatcherConfig(wait_s=5, lock_delay_s=0.5, tick_s=0.5), ident="w"
    )
    await watcher.start()
    try:
        replaced = await until(lambda: state_of(consul, "idle"), 30, "idle state replaced")
        assert not replaced.parked
        assert any("event=state_malformed model=idle" in r.getMessage() for r in caplog.records)
        await until(lambda: _parked(consul), 90, "crash parked")

        # Consul restarts empty: no keys, no sessions, no catalog entries.
        agent.restart()
        await until(lambda: watcher.leadership.is_leader, 40, "leading again")
        # Definitions are kept from before (the key is gone), the parked state is rebuilt from
        # Nomad's allocations, and the Consul UI entries come back.
        state = await until(lambda: _parked(consul), 40, "parked state rebuilt")
        assert state.consecutive_failures >= 5

        async def entries() -> list[dict[str, Any]]:
            _, found = await consul.health_service("llmgw-model")
            return found if len(found) == 2 else []

        await until(entries, 30, "both UI entries back")
        assert all(not t.done() for t in watcher._tasks)
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


async def _parked(consul: Consul) -> ModelState | None:
    s = await state_of(consul, "crash")
    return s if s is not None and s.parked else None
