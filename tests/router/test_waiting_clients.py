"""Requests that wait for a model, as the issue's users tried them: with the real `openai` SDK,
the Nomad stand-in, real llama-cpp-python engines and the real watcher, which answers the
routers' asks. What a
waiting client hears comes from its own attempt (never one that finished before it came); a
client that leaves while it waits costs the engine nothing."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from openai import APITimeoutError

from router.activation import Activator, AttemptResult
from router.activity import WAITING, ActivityRecorder
from router.config import ConsulSettings, Timeouts
from router.discovery import Discovery
from router.errors import RouterError
from router.metrics import RouterMetrics
from tests.router.conftest import get_kv, wait_until
from tests.router.fleet import Fleet, MakeFleet

pytestmark = pytest.mark.slow


def test_an_attempt_that_finished_is_not_joined_even_before_the_router_forgets_it(
    fleet: Fleet, consul_url: str
) -> None:
    """An attempt is forgotten by its done-callback, which runs on a later turn of the event
    loop than the attempt's end; a request that arrives in between must ask Nomad afresh, not
    take the finished attempt's answer. Here that answer is an old "placed" for a model that
    fits nowhere now: joined, the request would wait out the model's 90 s window for a replica
    that never comes."""

    async def arrive_between() -> RouterError:
        discovery = Discovery(ConsulSettings(addr=consul_url, wait_s=5.0))
        await discovery.start()
        recorder = ActivityRecorder(discovery.put_kv, 5.0, router_id="between")
        recorder.start()
        try:
            while "phi-4" not in discovery.snapshot.models:
                await asyncio.sleep(0.05)
            activator = Activator(
                recorder.ask, recorder.served, discovery, RouterMetrics(), Timeouts(), retry_after_s=5
            )

            async def placed_a_while_ago() -> AttemptResult:
                return AttemptResult(placed=True, finished=time.monotonic())

            finished = asyncio.create_task(placed_a_while_ago())
            await finished
            # The moment between the attempt's end and its done-callback.
            activator._attempts["phi-4"] = finished
            # In flight while it waits, as the router counts it, so its ask is published.
            recorder.begin("phi-4", WAITING)
            with pytest.raises(RouterError) as refused:
                async with asyncio.timeout(20):
                    await activator.activate(discovery.snapshot.models["phi-4"], time.monotonic())
            recorder.end("phi-4", WAITING, demand=False)
            return refused.value
        finally:
            await recorder.stop()
            await discovery.stop()

    refusal = asyncio.run(arrive_between())
    assert refusal.code == "model_unplaceable", refusal.message
    assert "nvidia/gpu" in refusal.message
    scale_calls = [e for e in fleet.scale_events("llmgw-phi-4") if "no ready replica" in e.get("Message", "")]
    assert len(scale_calls) == 1, scale_calls


def test_a_client_that_leaves_during_a_cold_start_costs_the_engine_nothing(fleet: Fleet) -> None:
    """The SDK as a user who gives up after half a second, while tiny's engine is still being
    started for it. The start goes on (others may be waiting for it), but once the replica is
    ready the engine's own log shows no request for the client that left, and one for the
    client that comes next."""
    impatient = fleet.sdk(timeout=0.5, max_retries=0)
    with pytest.raises(APITimeoutError):
        fleet.ask(impatient, "tiny")
    fleet.router.expect_metric("llmgw_router_early_ends_total", 1, timeout=10, model="tiny", kind="waiting")
    assert fleet.router.app.activator.waiting("tiny") == 0
    fleet.router.wait_ready("tiny", 1, timeout=120)
    # Long enough for anything the router still held for the gone client to reach the engine.
    time.sleep(2)
    assert "POST /v1/chat/completions" not in fleet.engine_log("llmgw-tiny")

    answer = fleet.ask(fleet.sdk(), "tiny")
    assert answer.choices[0].message.role == "assistant"
    wait_until(
        lambda: fleet.engine_log("llmgw-tiny").count("POST /v1/chat/completions") == 1,
        10,
        "the engine to log the request that came next",
    )
    fleet.router.expect_metric("llmgw_router_requests_total", 1, model="tiny", code="499")


def test_a_request_refused_for_want_of_room_is_served_once_the_watcher_makes_room(
    make_fleet: MakeFleet, consul_url: str
) -> None:
    """One GPU, held by `filler`. A request for `tiny` asks; the watcher scales tiny up and
    Nomad's evaluation finds no room, so the request is refused at once with Nomad's reason
    (the watcher's answer to *its* ask, not an older one) and tiny's count goes back down.
    Meanwhile the idle `filler` is scaled down by the watcher: the next request for tiny is
    served, not refused on what Nomad said before the room was made."""
    fleet = make_fleet(idle_timeouts={"filler": "3s"}, activity_interval_s=0.5)
    client = fleet.sdk()
    fleet.ask(client, "filler")
    assert fleet.job_count("llmgw-filler") == 1

    refused = fleet.chat("tiny", 30)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "model_unplaceable"
    state = json.loads(get_kv(consul_url, "llmgw/state/tiny") or "{}")
    assert state["attempt"]["result"] == "unplaceable" and state["attempt"]["eval"]
    # The idle filler is scaled down by the watcher: room is made.
    wait_until(lambda: fleet.job_count("llmgw-filler") == 0, 60, "the watcher to scale filler down")
    answer = fleet.ask(client, "tiny")
    assert answer.choices[0].message.role == "assistant"
    assert fleet.job_count("llmgw-tiny") == 1
    fleet.router.expect_metric("llmgw_router_refusals_total", 1, model="tiny", reason="unplaceable")
