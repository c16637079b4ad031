"""The world fails under the watcher: malformed state in KV is reported and replaced, and a
Consul that restarts empty is rebuilt from what Nomad still knows, without crashing the watcher."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from nomad_driver.config_kv import CONFIG_PREFIX, StoredDefinitions, config_entries
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.nomad import Nomad
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, state_key
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.watcher_support import CRASH_AND_IDLE_MODELS, mock_job, read_state, until

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


async def state_of(consul: Consul, model: str) -> ModelState | None:
    try:
        return await read_state(consul, model)
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
    await consul.kv_put(CONFIG_MODELS_KEY, CRASH_AND_IDLE_MODELS)
    await consul.kv_put(state_key("idle"), b"{not json")
    model = parse_models(CRASH_AND_IDLE_MODELS).models["crash"]
    job = mock_job(model, run_for="1s", exit_code=1)
    nomad = Nomad(standin.url)
    nomad.register_job(job)
    watcher = Watcher(
        Consul(agent.url), nomad, WatcherConfig(wait_s=5, lock_delay_s=0.5, tick_s=0.5), ident="w"
    )
    await watcher.start()
    try:
        replaced = await until(lambda: state_of(consul, "idle"), 30, "idle state replaced", every=0.2)
        assert not replaced.parked
        assert any("event=state_malformed model=idle" in r.getMessage() for r in caplog.records)
        await until(lambda: _parked(consul), 90, "crash parked", every=0.2)

        # Consul restarts empty: no keys, no sessions, no catalog entries.
        agent.restart()
        await until(lambda: watcher.leadership.is_leader, 40, "leading again", every=0.2)
        # Definitions are kept from before (the key is gone), the parked state is rebuilt from
        # Nomad's allocations, and the Consul UI entries come back.
        state = await until(lambda: _parked(consul), 40, "parked state rebuilt", every=0.2)
        assert state.consecutive_failures >= 5

        async def entries() -> list[dict[str, Any]]:
            _, found = await consul.health_service("llmgw-model")
            return found if len(found) == 2 else []

        await until(entries, 30, "both UI entries back", every=0.2)

        # The definitions themselves are written back, so routers do not forget every model: as
        # one key per model, whatever layout they were read from.
        async def definitions() -> dict[str, KVEntry] | None:
            _, entries = await consul.kv_get(CONFIG_PREFIX, recurse=True)
            return config_entries(entries) or None

        restored = StoredDefinitions()
        restored.read(await until(definitions, 30, "definitions written back", every=0.2))
        assert restored.layout == "model keys"
        assert restored.models == parse_models(CRASH_AND_IDLE_MODELS).models
        assert all(not t.done() for t in watcher._tasks)
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


async def _parked(consul: Consul) -> ModelState | None:
    s = await state_of(consul, "crash")
    return s if s is not None and s.parked else None
