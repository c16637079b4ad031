"""Requests in flight: what routers publish under `llmgw/inflight/`, how the watcher sums it,
and the scale-down rule it feeds (never below the replicas with work; the idle clock from the
end of the last request, plus a grace of the routers' interval)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from nomad_driver.consul import Consul
from nomad_driver.spec import parse_models
from nomad_driver.state import INFLIGHT_PREFIX, activity_key, inflight_key, parse_activity, parse_inflight
from nomad_driver.watcher.decisions import ModelView, Scale
from nomad_driver.watcher.desired import desired_replicas
from nomad_driver.watcher.in_flight import requests_in_flight
from nomad_driver.watcher.loop import WatcherConfig
from nomad_driver.watcher.reconcile import reconcile
from router.activity import WAITING, ActivityRecorder
from tests.test_reconcile import job
from tests.watcher_support import BARE_CPU_PROFILE

pytestmark = pytest.mark.timeout(60)

MODELS = (
    BARE_CPU_PROFILE
    + """
models:
  lazy:
    source: file:///tmp/lazy.gguf
    profile: cpu
    # A target above the requests these tests hold, so only the in-flight floor is at work.
    replicas: {min: 0, max: 3, target_in_flight: 4}
    idle_timeout: 60s
"""
)
LAZY = parse_models(MODELS, "test").models["lazy"]
NOW = 1_000_000.0


def view(count: int, **kw: Any) -> ModelView:
    # Scaled long ago, so only activity and in-flight work can hold replicas up.
    return ModelView(model=LAZY, job=job(LAZY, count), scaled_at=NOW - 3600, now=NOW, **kw)


def test_a_request_in_flight_keeps_the_model_however_long_ago_it_started() -> None:
    started_long_ago = NOW - 3600
    assert desired_replicas(view(1, activity=started_long_ago), 1) == 0
    assert desired_replicas(view(1, activity=started_long_ago, in_flight=1, busy_replicas=1), 1) == 1
    d = reconcile(view(2, activity=started_long_ago, in_flight=3, busy_replicas=2))
    assert d.desired == 2 and not [a for a in d.actions if isinstance(a, Scale)]


def test_never_below_the_replicas_with_work_and_never_up_because_of_it() -> None:
    # Three replicas, requests on two of them, the model otherwise idle: down to two at most.
    d = reconcile(view(3, in_flight=2, busy_replicas=2, activity=NOW - 3600))
    assert (d.desired, d.desired_reason) == (2, "busy")  # the two with work, not the idle third
    assert desired_replicas(view(1, busy_replicas=2), 1) == 1


def test_the_idle_clock_runs_from_the_last_end_plus_the_routers_interval() -> None:
    ended = NOW - 62
    assert desired_replicas(view(1, activity=ended), 1) == 0
    assert desired_replicas(view(1, activity=ended, activity_grace_s=5.0), 1) == 1
    assert desired_replicas(view(1, activity=NOW - 66, activity_grace_s=5.0), 1) == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b"not json",
        b'{"at": 1e400, "interval_s": 5, "models": {}}',
        b'{"at": "now", "interval_s": 5, "models": {}}',
        b'{"at": 1, "interval_s": 1e300, "models": {}}',
        b'{"at": 1, "interval_s": NaN, "models": {}}',
        b'{"at": 1, "interval_s": 5, "models": []}',
        b"x" * (2 << 20),
        # Past what the bounded JSON rule reads at all: the whole value is refused.
        b'{"at": 1, "interval_s": 5, "models": {"m": {"requests": 1000000000000000000000000000000}}}',
    ],
)
def test_a_bad_inflight_value_counts_for_nothing(raw: bytes) -> None:
    assert parse_inflight(raw) is None


def test_poisoned_counts_and_times_are_not_work() -> None:
    doc = {
        "at": NOW + 10**9,
        "interval_s": 5,
        "models": {"lazy": {"requests": 10**7, "replicas": ["a"]}, "ok": {"requests": 1, "replicas": ["b"]}},
    }
    parsed = parse_inflight(json.dumps(doc))
    assert parsed is not None
    assert parsed.requests == {"ok": 1}  # an absurd count is dropped, the model next to it kept
    assert not parsed.live(NOW)  # a time far in the future is not a live router


async def test_routers_publish_while_busy_and_the_watcher_sums_live_ones(consul_url: str) -> None:
    consul = Consul(consul_url)
    writes: list[str] = []

    async def write(key: str, value: str) -> None:
        writes.append(key)
        await consul.kv_put(key, value)

    a = ActivityRecorder(write, 5.0, router_id="router-a")
    b = ActivityRecorder(write, 5.0, router_id="router-b")
    a.touch("lazy")
    a.begin("lazy", "replica-1")
    a.begin("lazy", "replica-1")
    b.begin("lazy", "replica-2")
    b.begin("other", "replica-9")
    b.begin("other", WAITING)  # waiting for a replica to start counts, on no replica
    await a.flush()
    await b.flush()
    # A router that crashed long ago still says it is busy; nobody should believe it.
    stale = {
        "at": time.time() - 60,
        "interval_s": 5.0,
        "models": {"lazy": {"requests": 7, "replicas": ["r"]}},
    }
    await consul.kv_put(inflight_key("router-dead"), json.dumps(stale))

    _, entries = await consul.kv_get(INFLIGHT_PREFIX, recurse=True)
    requests, replicas, grace = requests_in_flight(
        {e.key: e for e in entries}, time.time(), WatcherConfig().activity_interval_s
    )
    assert requests == {"lazy": 3, "other": 2}
    assert replicas == {"lazy": {"replica-1", "replica-2"}, "other": {"replica-9"}}
    assert grace == 5.0

    # The requests end: one more write says so, the idle clock restarts at the end, and an
    # idle router then writes nothing.
    before_end = time.time()
    a.end("lazy", "replica-1")
    a.end("lazy", "replica-1")
    await a.flush()
    _, entries = await consul.kv_get(inflight_key("router-a"))
    assert json.loads(entries[0].value)["models"] == {}
    _, entries = await consul.kv_get(activity_key("lazy"))
    ended_at = parse_activity(entries[0].value)
    assert ended_at is not None and ended_at >= before_end - 0.01
    writes.clear()
    await a.flush()
    assert writes == []
    await consul.close()


def test_a_routers_ask_is_published_with_its_waiting_request_and_read_by_the_watcher() -> None:
    recorder = ActivityRecorder(lambda key, value: None, 5.0, router_id="r1")  # type: ignore[arg-type,return-value]
    recorder.begin("lazy", WAITING)
    asked = recorder.ask("lazy")
    value = recorder.in_flight()
    assert value["models"]["lazy"] == {"requests": 1, "replicas": [], "asked": asked.at, "ask_seq": 1}
    parsed = parse_inflight(json.dumps(value))
    assert parsed is not None and parsed.asked == {"lazy": asked.at}
    # Once the request ends, the ask goes with it.
    recorder.end("lazy", WAITING, demand=False)
    assert "lazy" not in recorder.in_flight()["models"]
    # A value that is not a time is no ask.
    bad = parse_inflight(json.dumps({**value, "models": {"lazy": {"requests": 1, "asked": "soon"}}}))
    assert bad is not None and bad.asked == {}


async def test_the_first_request_after_a_quiet_spell_is_published_at_once(consul_url: str) -> None:
    """A request that begins between two of the router's periodic writes would be unknown to
    the watcher until the next one, up to an interval later: long enough for an idle
    scale-down to stop the replica it is on. The first request on an idle model is written at
    once (within the prompt gap), not at the next interval."""
    consul = Consul(consul_url)

    async def write(key: str, value: str) -> None:
        await consul.kv_put(key, value)

    recorder = ActivityRecorder(write, 30.0, router_id="router-quiet")
    recorder.start()
    try:
        await asyncio.sleep(0.3)  # the first write at start is done; now quiet
        recorder.begin("lazy", "replica-1")
        deadline = time.monotonic() + 3.0
        published: dict[str, Any] = {}
        while time.monotonic() < deadline:
            _, entries = await consul.kv_get(inflight_key("router-quiet"))
            published = json.loads(entries[0].value)["models"] if entries else {}
            if published:
                break
            await asyncio.sleep(0.05)
        assert published.get("lazy", {}).get("requests") == 1, "not published within 3 s of a 30 s interval"
    finally:
        recorder.end("lazy", "replica-1")
        await recorder.stop()
        await consul.kv_delete(inflight_key("router-quiet"))
        await consul.close()
