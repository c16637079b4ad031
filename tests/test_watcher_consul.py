"""The watcher against a real Consul while Nomad is down: it keeps running, parks nothing on its
own failed calls, serves the admin API and metrics, and only the leader changes state."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, parse_state, state_key
from nomad_driver.watcher.admin import create_app
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.watcher_support import BARE_CPU_PROFILE, until

pytestmark = pytest.mark.timeout(120)

MODELS = (
    BARE_CPU_PROFILE
    + """
models:
  kev:
    source: file:///tmp/kev.gguf
    profile: cpu
    replicas: {min: 1, max: 2}
"""
)
KEV_HASH = parse_models(MODELS, "test").models["kev"].def_hash


def make_watcher(url: str, ident: str, port: int) -> Watcher:
    config = WatcherConfig(address=f"127.0.0.1:{port}", wait_s=5, lock_delay_s=0.5, tick_s=0.5)
    return Watcher(Consul(url), Nomad("http://127.0.0.1:1", timeout=1), config, ident=ident)


@pytest.fixture
async def two_watchers(consul_url: str) -> AsyncIterator[tuple[Watcher, Watcher]]:
    setup = Consul(consul_url)
    await setup.kv_put(CONFIG_MODELS_KEY, MODELS)
    parked = ModelState(parked=True, consecutive_failures=5, last_error="boom", parked_def_hash=KEV_HASH)
    await setup.kv_put(state_key("kev"), parked.to_kv())
    a, b = make_watcher(consul_url, "a", 4701), make_watcher(consul_url, "b", 4702)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.leadership.is_leader or b.leadership.is_leader, 20, "a leader", every=0.05)
        await until(lambda: "kev" in a.decisions and "kev" in b.decisions, 20, "first passes", every=0.05)
        await until(
            lambda: a.leadership.leader is not None and b.leadership.leader is not None,
            20,
            "leader known",
            every=0.05,
        )
        yield (a, b) if a.leadership.is_leader else (b, a)
    finally:
        await a.stop()
        await b.stop()
        for w in (a, b):
            await w.consul.close()
        await setup.close()


def client(w: Watcher) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(w)), base_url="http://admin")


async def test_nomad_down_parks_nothing_and_is_logged_once_per_outage(
    consul_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    consul = Consul(consul_url)
    await consul.kv_put(CONFIG_MODELS_KEY, MODELS)
    before = ModelState(consecutive_failures=4, last_error="Exit Code: 1")
    await consul.kv_put(state_key("kev"), before.to_kv())
    w = make_watcher(consul_url, "solo", 4703)
    await w.start()
    try:
        await until(lambda: w.leadership.is_leader and w.passes > 3, 20, "leading and passing", every=0.05)
        await asyncio.sleep(3)
        _, entries = await consul.kv_get(state_key("kev"))
        after = parse_state("k", entries[0].value)
        assert not after.parked and after.consecutive_failures == 4
        assert not w.ready_to_act()
        failed = [r for r in caplog.records if "event=watch_failed watch=nomad-allocations" in r.getMessage()]
        assert len(failed) == 1
        assert all(t.done() is False for t in w._tasks)
    finally:
        await w.stop()
        await w.consul.close()
        await consul.close()


async def test_followers_answer_reads_and_name_the_leader_for_retry(
    two_watchers: tuple[Watcher, Watcher],
) -> None:
    leader, follower = two_watchers
    async with client(follower) as c:
        listing = (await c.get("/v1/admin/models")).json()
        assert listing["is_leader"] is False
        assert listing["leader"]["address"] == leader.config.address
        kev = (await c.get("/v1/admin/models/kev")).json()
        assert kev["parked"] is True and kev["last_error"] == "boom" and kev["state"] == "parked"
        assert (await c.get("/v1/admin/models/nope")).status_code == 404
        refused = await c.post("/v1/admin/models/kev/retry")
        assert refused.status_code == 409
        assert leader.config.address in refused.json()["error"]
        assert refused.headers["x-llmgw-leader"] == leader.config.address
        metrics = (await c.get("/metrics")).text
        assert 'llmgw_model_parked{model="kev"} 1.0' in metrics
        assert 'llmgw_model_unplaceable{model="kev"} 0.0' in metrics
        assert 'llmgw_model_ready_replicas{model="kev"} 0.0' in metrics
        assert "llmgw_leader 0.0" in metrics
    async with client(leader) as c:
        assert "llmgw_leader 1.0" in (await c.get("/metrics")).text


async def test_retry_on_the_leader_unparks_through_a_fenced_write(
    two_watchers: tuple[Watcher, Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    leader, follower = two_watchers
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "sesame")
    async with client(leader) as c:
        assert (await c.post("/v1/admin/models/kev/retry")).status_code == 401
        ok = await c.post("/v1/admin/models/kev/retry", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200, ok.text
    _, entries = await leader.consul.kv_get(state_key("kev"))
    state = parse_state("k", entries[0].value)
    assert not state.parked and state.consecutive_failures == 0
    await until(lambda: not follower.decisions["kev"].state.parked, 10, "follower sees the retry", every=0.05)


async def test_a_retry_right_after_the_state_changed_in_consul_unparks_instead_of_saying_try_again(
    two_watchers: tuple[Watcher, Watcher],
) -> None:
    # The state changes under the leader (a pass's write, or anyone's) and the operator retries
    # before the leader's KV watch has seen it: the check-and-set against the old index must
    # not become "could not write; try again" for an operator who did nothing wrong.
    leader, _ = two_watchers
    for round_ in range(5):
        again = ModelState(
            parked=True, consecutive_failures=5, last_error=f"boom {round_}", parked_def_hash=KEV_HASH
        )
        await leader.consul.kv_put(state_key("kev"), again.to_kv())
        state = await leader.retry("kev")
        assert not state.parked
        _, entries = await leader.consul.kv_get(state_key("kev"))
        stored = parse_state("k", entries[0].value)
        assert not stored.parked and stored.consecutive_failures == 0, round_
