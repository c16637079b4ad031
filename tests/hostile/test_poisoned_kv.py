"""Issue 13, items 4 and 7: values written straight into Consul KV, past `llmgw apply`. The
router refused a non-UTF-8 `llmgw/config/models` while the watcher read it with the bad bytes
replaced, so the two could disagree on what is defined; the leader's value was parsed past the
one bounded rule; and `llmgw/activity/<m>` = `1e300` kept an on-demand model up for ever."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, activity_key, inflight_key
from nomad_driver.watcher.leader import LeaderInfo, parse_leader
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica
from tests.router.conftest import StartStub
from tests.watcher_support import CRASH_AND_IDLE_MODELS, mock_job, until, watcher_on_standin

pytestmark = pytest.mark.timeout(180)

# A models file with one byte that is not UTF-8, in a comment: read with the bad byte replaced
# it is a valid file, which is how the two readers came to disagree.
NOT_UTF8 = CRASH_AND_IDLE_MODELS.encode() + b"  # \xff\n"
UTF8_PROBLEM = f"consul:{CONFIG_MODELS_KEY}: not UTF-8 text (invalid byte at offset {len(NOT_UTF8) - 2})"


async def test_a_non_utf8_definitions_value_is_refused_alike_by_the_router_and_the_watcher(
    consul_url: str, start_standin: Callable[..., Any], stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    _standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, CRASH_AND_IDLE_MODELS, ident="w", clock_speed=20.0
    )
    alpha_replica(consul_url, stub_engine)
    await watcher.start()
    try:
        router = guarded_router(consul_url)
        await until(lambda: {"crash", "idle"} <= set(router.app.discovery.snapshot.models), 20, "router defs")
        await until(lambda: {"crash", "idle"} <= set(watcher.decisions), 30, "a first pass")
        # The same models with a changed replica count, and the bad byte: nothing of it is read.
        poisoned = NOT_UTF8.replace(b"max: 1}\n  idle", b"max: 3}\n  idle")
        assert poisoned != NOT_UTF8
        with Bystander(router.url) as bystander:
            await consul.kv_put(CONFIG_MODELS_KEY, poisoned)
            await until(lambda: router.app.discovery.snapshot.models_error, 20, "the router's problem")
            await until(lambda: watcher.definitions_problem, 20, "the watcher's problem")
            passes = watcher.passes
            await until(lambda: watcher.passes > passes + 2, 30, "more passes")
            await until(lambda: bystander.served_during >= 4, 20, "the bystander served meanwhile")
        bystander.assert_served()
        expected = UTF8_PROBLEM.replace(str(len(NOT_UTF8) - 2), str(len(poisoned) - 2))
        assert router.app.discovery.snapshot.models_error == expected
        assert watcher.definitions_problem == expected
        # Both keep the last good definitions, and the watcher keeps reconciling them.
        assert watcher.models["crash"].replicas_max == 1
        assert router.app.discovery.snapshot.models["crash"].replicas_max == 1
        assert {"crash", "idle"} <= set(watcher.decisions)
    finally:
        await watcher.stop()
        await consul.close()


@pytest.mark.parametrize(
    "raw",
    [
        b'{"id": NaN, "address": "127.0.0.1:4700"}',
        b'{"id": ' + b"9" * 400 + b', "address": "127.0.0.1:4700"}',
        b'{"id": "w1", "address": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        b"[" * 5000,
        b'"' + b"x" * 5000 + b'"',
    ],
    ids=["nan", "400-digits", "nested", "too-deep-and-large", "too-large"],
)
def test_a_leader_value_past_the_bounds_reads_as_no_leader_known(raw: bytes) -> None:
    assert parse_leader(raw) is None


def test_a_leader_value_as_a_watcher_writes_it_names_the_leader() -> None:
    assert parse_leader(b'{"id": "w1", "address": "10.0.0.5:4700"}') == LeaderInfo("w1", "10.0.0.5:4700")


async def test_an_activity_time_of_1e300_does_not_keep_an_on_demand_model_up(
    consul_url: str, start_standin: Callable[..., Any]
) -> None:
    text = CRASH_AND_IDLE_MODELS.replace(
        "  idle:\n    source: file:///tmp/idle.gguf\n    profile: cpu\n    replicas: {min: 0, max: 1}\n",
        "  idle:\n    source: file:///tmp/idle.gguf\n    profile: cpu\n    replicas: {min: 0, max: 1}\n"
        "    idle_timeout: 3s\n",
    )
    assert "idle_timeout: 3s" in text
    _standin, consul, nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w", clock_speed=20.0
    )
    model = parse_models(text).models["idle"]
    nomad.register_job(mock_job(model, 0, run_for="2h"))
    await watcher.start()
    try:
        # Asked for, as a router asks: a waiting request and its ask in the router's in-flight
        # key, which the leading watcher answers with a scale to one.
        asked = round(time.time(), 3)
        waiting = {
            "router": "r1",
            "at": asked,
            "interval_s": 5,
            "models": {"idle": {"requests": 1, "asked": asked}},
        }
        await consul.kv_put(inflight_key("r1"), json.dumps(waiting).encode())
        await until(lambda: count(nomad, model.job_id) == 1, 20, "scaled up for the ask")
        # The request ends, and its activity time comes from far beyond the end of time.
        await consul.kv_put(activity_key("idle"), b"1e300")
        done = {"router": "r1", "at": time.time(), "interval_s": 5, "models": {}}
        await consul.kv_put(inflight_key("r1"), json.dumps(done).encode())
        ended = time.monotonic()
        await until(lambda: count(nomad, model.job_id) == 0, 60, "scaled back down when idle")
        # Down after its idle timeout (3 s) from the request the watcher saw, neither kept up
        # nor dropped early by a time it cannot believe.
        assert time.monotonic() - ended >= 2.5
    finally:
        await watcher.stop()
        await consul.close()


def count(nomad: Any, job_id: str) -> int:
    job = nomad.get_job(job_id)
    return int(job["TaskGroups"][0]["Count"]) if job else -1
