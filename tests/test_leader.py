"""Leadership, fenced state writes and the Consul UI entries, against a real Consul."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from nomad_driver.consul import Consul, ConsulUnavailable
from nomad_driver.nomad import Nomad
from nomad_driver.state import LEADER_KEY, ModelState, parse_state, state_key
from nomad_driver.watcher.health import NODE, Entry, HealthEntries
from nomad_driver.watcher.leader import Leadership
from nomad_driver.watcher.loop import Watcher, WatcherConfig

pytestmark = pytest.mark.timeout(120)


async def until(cond: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        result = cond()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
async def client(consul_url: str) -> AsyncIterator[Consul]:
    c = Consul(consul_url)
    yield c
    await c.close()


async def test_two_watchers_elect_exactly_one_leader_and_hand_over_on_resign(consul_url: str) -> None:
    a_client, b_client = Consul(consul_url), Consul(consul_url)
    a = Leadership(a_client, address="127.0.0.1:1", ident="a", ttl_s=10, lock_delay_s=0.5)
    b = Leadership(b_client, address="127.0.0.1:2", ident="b", ttl_s=10, lock_delay_s=0.5)
    tasks = [asyncio.create_task(a.run()), asyncio.create_task(b.run())]
    try:
        await until(lambda: a.is_leader or b.is_leader, 15, "a leader")
        await asyncio.sleep(1.0)
        assert a.is_leader != b.is_leader
        leader, follower = (a, b) if a.is_leader else (b, a)
        await until(
            lambda: follower.leader is not None and follower.leader.id == leader.me.id,
            5,
            "follower sees leader",
        )
        assert follower.leader is not None and follower.leader.address == leader.me.address
        await leader.resign()
        took = await until(lambda: follower.is_leader, 15, "handover")
        assert took < 10, f"handover after a clean resign took {took:.1f}s"
        assert not leader.is_leader
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a_client.close()
        await b_client.close()


async def test_a_destroyed_session_means_stepping_down_at_once(client: Consul) -> None:
    changes: list[bool] = []
    lead = Leadership(client, address="x", ident="solo", ttl_s=10, lock_delay_s=0.1, on_change=changes.append)
    task = asyncio.create_task(lead.run())
    try:
        await until(lambda: lead.is_leader, 15, "leader")
        # An operator (or Consul losing the session) invalidates it under the leader's feet.
        await client.session_destroy(lead.session)
        await until(lambda: not lead.is_leader, 6, "step down")
        assert changes[:2] == [True, False]
        await until(lambda: lead.is_leader, 15, "leading again with a new session")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_fenced_write_refuses_a_deposed_leader_and_a_stale_index(client: Consul) -> None:
    old = await client.session_create("old", ttl_s=10, lock_delay_s=0)
    new = await client.session_create("new", ttl_s=10, lock_delay_s=0)
    # An earlier test's lock delay may still hold the key for a moment.
    await until(lambda: client.kv_put(LEADER_KEY, b"{}", acquire=old), 20, "lock")
    key = state_key("m1")
    first = ModelState(consecutive_failures=1).to_kv()
    written = await client.fenced_put(key, first, cas=0, session=old, lock_key=LEADER_KEY)
    assert written.ok
    _, entries = await client.kv_get(key)
    index = entries[0].modify_index
    assert written.indexes[key] == index

    # The lock moves to the new leader.
    assert await client.kv_put(LEADER_KEY, b"", release=old)
    await until(lambda: client.kv_put(LEADER_KEY, b"{}", acquire=new), 5, "lock for new")
    deposed = await client.fenced_put(
        key, ModelState(parked=True).to_kv(), cas=index, session=old, lock_key=LEADER_KEY
    )
    assert not deposed.ok and deposed.failed_session_check()

    good = await client.fenced_put(
        key, ModelState(consecutive_failures=2).to_kv(), cas=index, session=new, lock_key=LEADER_KEY
    )
    assert good.ok
    stale = await client.fenced_put(
        key, ModelState(consecutive_failures=9).to_kv(), cas=index, session=new, lock_key=LEADER_KEY
    )
    assert not stale.ok and not stale.failed_session_check()
    _, entries = await client.kv_get(key)
    assert parse_state(key, entries[0].value).consecutive_failures == 2


async def test_blocking_kv_read_wakes_on_change_and_times_out_with_same_index(client: Consul) -> None:
    await client.kv_put("llmgw/state/x", b"1")
    index, _ = await client.kv_get("llmgw/", recurse=True)
    started = time.monotonic()
    same, _ = await client.kv_get("llmgw/", recurse=True, index=index, wait_s=1)
    assert same == index and time.monotonic() - started >= 0.9

    async def write_later() -> None:
        await asyncio.sleep(0.3)
        await client.kv_put("llmgw/state/x", b"2")

    writer = asyncio.create_task(write_later())
    newer, entries = await client.kv_get("llmgw/", recurse=True, index=index, wait_s=10)
    await writer
    assert newer > index and entries[0].value == b"2"


async def test_unreachable_consul_raises_consul_unavailable() -> None:
    c = Consul("http://127.0.0.1:1", timeout=1)
    with pytest.raises(ConsulUnavailable):
        await c.kv_get("llmgw/leader")
    await c.close()


async def test_health_entries_show_status_and_output_and_survive_a_new_leader(client: Consul) -> None:
    first = HealthEntries(client)
    await first.sync({"m1": Entry("critical", "parked: boom"), "m2": Entry("passing", "1 of 1 ready")})
    _, m1 = await client.health_service("llmgw-model")
    by_model = {e["Service"]["Meta"]["model"]: e for e in m1}
    assert set(by_model) == {"m1", "m2"}
    check = next(c for c in by_model["m1"]["Checks"] if c["ServiceID"] == "llmgw-model-m1")
    assert (check["Status"], check["Output"]) == ("critical", "parked: boom")

    # A new leader starts with no memory: it corrects, removes what is no longer defined, and
    # writes nothing that is already right.
    second = HealthEntries(client)
    writes = await second.sync(
        {"m1": Entry("passing", "1 of 1 ready"), "m2": Entry("passing", "1 of 1 ready")}
    )
    assert writes == 1
    await second.sync({"m1": Entry("passing", "1 of 1 ready")})
    _, entries = await client.health_service("llmgw-model")
    assert [e["Service"]["ID"] for e in entries] == ["llmgw-model-m1"]
    assert all(e["Node"]["Node"] == NODE for e in entries)
    assert [c["Status"] for c in entries[0]["Checks"]] == ["passing"]


async def _leading_watcher(consul_url: str, ident: str) -> tuple[Watcher, Consul]:
    """A watcher that leads through a lock taken by hand (no election loop racing the test):
    what a running leader looks like between two passes."""
    consul = Consul(consul_url)
    watcher = Watcher(consul, Nomad("http://127.0.0.1:9"), WatcherConfig(), ident=ident)
    lead = watcher.leadership
    lead.session = await consul.session_create(f"llmgw-watcher {ident}", ttl_s=10, lock_delay_s=0)
    lead._lease_from(time.monotonic())
    # An earlier test's lock delay may still hold the key for a moment.
    await until(
        lambda: consul.kv_put(LEADER_KEY, b'{"id": "%s"}' % ident.encode(), acquire=lead.session), 20, "lock"
    )
    lead._set_leader(True, "acquired")
    return watcher, consul


async def _sessions(consul: Consul) -> set[str]:
    resp = await consul._call("GET", "/v1/session/list")
    return {s["ID"] for s in resp.json()}


async def test_a_cas_conflict_on_a_model_named_session_leaves_the_leader_leading(consul_url: str) -> None:
    """Consul's CAS error names the key, and the key names the model: a model called
    `session-chat` must not read as a lost lock."""
    watcher, consul = await _leading_watcher(consul_url, "cas")
    try:
        session = watcher.leadership.session
        key = state_key("session-chat")
        await consul.kv_put(key, ModelState().to_kv())
        _, entries = await consul.kv_get(key)
        stale = entries[0].modify_index - 1

        result = await consul.fenced_put(
            key, ModelState(consecutive_failures=1).to_kv(), cas=stale, session=session, lock_key=LEADER_KEY
        )
        assert not result.ok and "session" in " ".join(result.errors)
        assert not result.failed_session_check()

        assert not await watcher.states.write("session-chat", ModelState(consecutive_failures=1), stale)
        assert watcher.leadership.is_leader
        assert watcher.leadership.session == session
        assert watcher.leader_changes == 1  # the acquisition only
        assert session in await _sessions(consul)
    finally:
        await watcher.leadership.resign()
        await consul.close()


async def test_a_lost_lock_is_told_by_the_session_check_and_the_old_session_is_destroyed(
    consul_url: str,
) -> None:
    watcher, consul = await _leading_watcher(consul_url, "deposed")
    other = await consul.session_create("other", ttl_s=10, lock_delay_s=0)
    try:
        old = watcher.leadership.session
        # Another watcher holds the lock now (an operator released it, say).
        assert await consul.kv_put(LEADER_KEY, b"", release=old)
        await until(lambda: consul.kv_put(LEADER_KEY, b'{"id": "other"}', acquire=other), 5, "lock for other")

        assert not await watcher.states.write("m1", ModelState(parked=True), 0)
        assert not watcher.leadership.is_leader
        assert watcher.leadership.session == ""
        await until(lambda: _gone(consul, old), 5, "the abandoned session destroyed")
        _, entries = await consul.kv_get(state_key("m1"))
        assert entries == []
    finally:
        await consul.session_destroy(other)
        await consul.close()


async def _gone(consul: Consul, session: str) -> bool:
    return session not in await _sessions(consul)


@pytest.mark.parametrize("garbage", [b"[" * 100_000, b"\xff\xfenot json", b"{" * 3000 + b"}"])
async def test_a_malformed_leader_value_is_no_leader_and_the_lock_can_still_be_taken(
    consul_url: str, garbage: bytes
) -> None:
    consul = Consul(consul_url)
    await consul.kv_put(LEADER_KEY, garbage)
    lead = Leadership(consul, address="127.0.0.1:1", ident="heals", ttl_s=10, lock_delay_s=0.1)
    task = asyncio.create_task(lead.run())
    try:
        await until(lambda: lead.is_leader, 20, "the lock taken over the malformed value")
        _, entries = await consul.kv_get(LEADER_KEY)
        assert entries[0].session == lead.session
        # And garbage written over a held lock (a plain PUT keeps the lock's session) is shown
        # as no leader known to others, while the holder keeps leading.
        await consul.kv_put(LEADER_KEY, garbage)
        follower = Leadership(consul, address="127.0.0.1:2", ident="f", ttl_s=10, lock_delay_s=0.1)
        ftask = asyncio.create_task(follower.run())
        try:
            await asyncio.sleep(2.0)
            assert lead.is_leader and not follower.is_leader
            assert follower.leader is None
        finally:
            ftask.cancel()
            await asyncio.gather(ftask, return_exceptions=True)
            await follower.resign()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lead.resign()
        await consul.close()


async def test_a_follower_whose_session_consul_forgot_makes_a_new_one_and_takes_the_free_lock(
    consul_url: str,
) -> None:
    """Consul forgets a session (its agent restarted, an operator destroyed it) while a watcher
    waits for the lock. When the lock frees, the acquire with the dead session fails; the
    follower finds out from Consul that the session is gone and takes the lock with a new one
    at once, not after its next renewal (a third of a long TTL here: 10 s)."""
    a_client, b_client = Consul(consul_url), Consul(consul_url)
    a = Leadership(a_client, address="127.0.0.1:1", ident="holder", ttl_s=10, lock_delay_s=0.1)
    b = Leadership(b_client, address="127.0.0.1:2", ident="waiter", ttl_s=30, lock_delay_s=0.1)
    a_task = asyncio.create_task(a.run())
    await until(lambda: a.is_leader, 15, "the holder leading")
    b_task = asyncio.create_task(b.run())
    try:
        await until(lambda: bool(b.session) and b.leader is not None, 15, "the waiter waiting")
        forgotten = b.session
        await b_client.session_destroy(forgotten)
        await a.resign()
        took = await until(lambda: b.is_leader, 15, "the waiter leading")
        assert took < 4, f"the waiter took {took:.1f}s to notice its session was gone"
        assert b.session and b.session != forgotten
        _, entries = await b_client.kv_get(LEADER_KEY)
        assert entries[0].session == b.session
    finally:
        for t in (a_task, b_task):
            t.cancel()
        await asyncio.gather(a_task, b_task, return_exceptions=True)
        await b.resign()
        await a_client.close()
        await b_client.close()
