"""Issue 13, item 4: deeply nested JSON anywhere. A 2 KB body of nested arrays was a plain-text
500 with a traceback (which the SDKs retry); `[` x 100,000 in one `llmgw/state/<m>` failed every
watcher pass and made the router call itself degraded; `[` x 5000 in `llmgw/config/models`
left the router degraded with a stale problem."""

from __future__ import annotations

import json

import httpx
import pytest

from nomad_driver.consul import Consul
from nomad_driver.state import CONFIG_MODELS_KEY, state_key
from router.assemble import Assembler, AssemblyFailed
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica, chat
from tests.router.conftest import StartStub, put_kv, put_state, wait_until
from tests.watcher_support import CRASH_AND_IDLE_MODELS, until, watcher_on_standin

pytestmark = pytest.mark.timeout(180)

MODELS = """
profiles:
  cpu:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 0
models:
  alpha: {source: "file:///models/alpha.gguf", profile: cpu, replicas: {min: 1, max: 2}}
  beta: {source: "file:///models/beta.gguf", profile: cpu, replicas: {min: 0, max: 2}}
"""


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_a_deeply_nested_body_is_a_400_not_a_500(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter, depth: int
) -> None:
    alpha_replica(consul_url, stub_engine)
    router = guarded_router(consul_url)
    router.wait_ready("alpha", 1)
    body = b'{"model": "alpha", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    answers: list[httpx.Response] = []
    with Bystander(router.url) as bystander:
        bystander.keep_attacking(
            lambda: answers.append(httpx.post(f"{router.url}/v1/chat/completions", content=body, timeout=20))
        )
    for resp in answers:
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["code"] == "invalid_json"
        assert "nested deeper than 64 levels" in error["message"]
    bystander.assert_served(minimum=4)


def test_a_poisoned_state_key_harms_only_its_model_on_the_router(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    put_kv(consul_url, CONFIG_MODELS_KEY, MODELS)
    put_state(consul_url, "gamma", parked=True, consecutive_failures=5, last_error="boom")
    router = guarded_router(consul_url)
    router.wait_ready("alpha", 1)
    with Bystander(router.url) as bystander:
        put_kv(consul_url, state_key("beta"), "[" * 100_000)
        # The state watch keeps reading: gamma's parked state is still known and refused.
        wait_until(lambda: "beta" not in router.app.discovery.snapshot.states, 10, "beta read as no state")
        refused = httpx.post(f"{router.url}/v1/chat/completions", json=chat("gamma"), timeout=10)
        assert refused.status_code in (404, 503)
        health = httpx.get(f"{router.url}/healthz", timeout=10).json()
        bystander.wait_served()
    assert health["status"] == "ok", health
    assert router.app.discovery.snapshot.states["gamma"].parked
    bystander.assert_served()


def test_nested_brackets_in_the_definitions_keep_the_last_good_ones_and_report_the_problem(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    put_kv(consul_url, CONFIG_MODELS_KEY, MODELS)
    router = guarded_router(consul_url)
    router.wait_ready("alpha", 1)
    wait_until(lambda: "beta" in router.app.discovery.snapshot.models, 10, "definitions read")
    with Bystander(router.url) as bystander:
        put_kv(consul_url, CONFIG_MODELS_KEY, "[" * 5000)
        wait_until(lambda: router.app.discovery.snapshot.models_error, 10, "the problem reported")
        health = httpx.get(f"{router.url}/healthz", timeout=10).json()
        assert health["status"] == "ok", health
        assert "nested deeper than 64 levels" in health["models_error"]
        assert set(router.app.discovery.snapshot.models) == {"alpha", "beta"}
        bystander.wait_served()
        # Fixed: the problem goes away with it.
        put_kv(consul_url, CONFIG_MODELS_KEY, MODELS)
        wait_until(lambda: not router.app.discovery.snapshot.models_error, 10, "the problem cleared")
    assert httpx.get(f"{router.url}/healthz", timeout=10).json()["models_error"] is None
    bystander.assert_served()


async def test_a_poisoned_state_key_is_replaced_by_the_leader_and_other_models_reconciled(
    consul_url: str, start_standin: object
) -> None:
    _standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url,
        start_standin,
        CRASH_AND_IDLE_MODELS,
        ident="w",
        clock_speed=20.0,  # type: ignore[arg-type]
    )
    await consul.kv_put(state_key("idle"), b"[" * 100_000)
    await watcher.start()
    try:

        async def replaced() -> bool:
            _, entries = await Consul(consul_url).kv_get(state_key("idle"))
            try:
                return bool(entries) and isinstance(json.loads(entries[0].value), dict)
            except (ValueError, RecursionError):
                return False

        await until(replaced, 60, "the poisoned state replaced", every=0.2)
        # Every model is still reconciled: the passes go on, and both have decisions.
        passes = watcher.passes
        await until(lambda: watcher.passes > passes + 2, 30, "more passes")
        assert {"idle", "crash"} <= set(watcher.decisions)

        # Nested brackets as the definitions: the last good ones stay, the problem is reported,
        # and cleared once the key is fixed.
        await consul.kv_put(CONFIG_MODELS_KEY, b"[" * 5000)
        await until(lambda: "nested deeper" in watcher.definitions_problem, 30, "the problem reported")
        assert {"idle", "crash"} <= set(watcher.models)
        await consul.kv_put(CONFIG_MODELS_KEY, CRASH_AND_IDLE_MODELS)
        await until(lambda: not watcher.definitions_problem, 30, "the problem cleared")
    finally:
        await watcher.stop()
        await consul.close()


def test_a_deeply_nested_event_from_an_engine_is_a_stream_the_router_cannot_read() -> None:
    # What a non-streamed answer is assembled from (router/assemble.py): a RecursionError
    # here was a 500 with a traceback for the client.
    with pytest.raises(AssemblyFailed, match="nested deeper than 64 levels"):
        Assembler(chat=True).feed_event(b"data: " + b"[" * 100_000 + b"]" * 100_000)
