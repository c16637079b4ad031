"""Activation against the Nomad stand-in (real Nomad HTTP API, real placement rules, engines run
as real llama.cpp processes registered in the real Consul) and the real watcher: a request for a
model with nothing running asks, the leading watcher scales its job up, and the request is
answered once a replica is ready; a model that fits nowhere is refused at once with Nomad's
reason, and asked about afresh on the next request. The router never calls Nomad."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import APIStatusError, APITimeoutError, OpenAI, RateLimitError

from router.config import Timeouts
from tests.router.conftest import StartRouter, get_kv, put_kv, put_state, wait_until
from tests.router.fleet import Fleet, MakeFleet, models_yaml, node


@pytest.mark.slow
def test_concurrent_requests_for_an_idle_model_share_one_activation_and_are_answered(
    fleet: Fleet, consul_url: str
) -> None:
    assert fleet.job_count("llmgw-tiny") == 0
    before = time.time()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: fleet.chat("tiny"), range(4)))
    for resp in answers:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert fleet.job_count("llmgw-tiny") == 1
    # One scale call for the four requests.
    events = [e for e in fleet.scale_events("llmgw-tiny") if e.get("Count") == 1]
    assert len(events) == 1, events
    assert "no ready replica" in events[0]["Message"]
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="tiny", result="placed")
    # Activity is written once placed, so the watcher does not scale it straight down.
    activity = get_kv(consul_url, "llmgw/activity/tiny")
    assert activity is not None and float(activity) >= before - 1
    # With a replica ready, the next request goes straight through without Nomad.
    assert fleet.chat("tiny").status_code == 200
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="tiny", result="placed")


@pytest.mark.slow
def test_a_model_that_fits_nowhere_is_refused_at_once_and_asked_about_afresh_each_time(fleet: Fleet) -> None:
    started = time.monotonic()
    resp = fleet.chat("phi-4")
    assert time.monotonic() - started < 10, "waited for more than the evaluation"
    assert resp.status_code == 503
    assert resp.headers["x-should-retry"] == "false"
    assert "retry-after" not in resp.headers
    error = resp.json()["error"]
    assert error["code"] == "model_unplaceable"
    assert "model 'phi-4' cannot be placed on any node: " in error["message"]
    assert "nvidia/gpu" in error["message"]
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="phi-4", result="unplaceable")

    # The next request does not reuse that answer: it asks Nomad again.
    assert fleet.chat("phi-4").status_code == 503
    fleet.router.expect_metric("llmgw_router_activations_total", 2, model="phi-4", result="unplaceable")


@pytest.mark.slow
def test_a_model_refused_as_unplaceable_is_served_once_room_is_made(fleet: Fleet, consul_url: str) -> None:
    # The watcher's last word says unplaceable; the router must not trust it blindly.
    put_kv(
        consul_url,
        "llmgw/state/phi-4",
        json.dumps({"unplaceable": True, "placement_reason": "no node has 8 x nvidia/gpu"}),
    )
    wait_until(lambda: "phi-4" in fleet.router.app.discovery.snapshot.states, 10, "the stale state")
    assert fleet.chat("phi-4").status_code == 503
    fleet.standin.add_node(node("gpu-h100-0", fleet.engines, 8, 81559, "NVIDIA H100 80GB HBM3"))
    resp = fleet.chat("phi-4")
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-llmgw-replica"]


@pytest.mark.slow
def test_a_placed_model_whose_window_runs_out_gets_model_loading_plain_or_streamed(
    make_fleet: MakeFleet,
) -> None:
    # kev's engine never turns ready (an architecture llama.cpp does not know), so the window
    # runs out however quickly the ask is answered. With a model that loads (a tiny one, 1 s), a
    # quick ask on a quiet machine found the replica ready within the window and, rightly,
    # served it.
    fleet = make_fleet(keepalive_s=0.2, kev_window="1s")
    started = time.monotonic()
    resp = fleet.chat("kev-0.5b")
    waited = time.monotonic() - started
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "model_loading"
    assert int(resp.headers["retry-after"]) > 0
    assert "x-should-retry" not in resp.headers
    assert 0.8 <= waited < 15
    fleet.router.expect_metric("llmgw_router_activations_total", 1, model="kev-0.5b", result="placed")

    # Streamed: the refusal comes as an event after the keepalives.
    with httpx.stream(
        "POST",
        f"{fleet.router.url}/v1/chat/completions",
        json={"model": "kev-0.5b", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[0] == ": waiting for a replica of kev-0.5b"
    error = json.loads(lines[-1][len("data: ") :])["error"]
    assert error["code"] == "model_loading"
    assert "no replica became ready within 1s" in error["message"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_client_waiting_for_a_model_that_cannot_start_hears_model_parked_when_it_is_parked(
    make_fleet: MakeFleet, consul_url: str
) -> None:
    # A window far longer than the five failed starts take: the answer must come from the
    # park, not from the window running out.
    fleet = make_fleet(clock_speed=20.0, kev_window="600s")
    client = OpenAI(base_url=f"{fleet.router.url}/v1", api_key="none", timeout=280)
    started = time.monotonic()
    with pytest.raises(APIStatusError) as raised:
        client.chat.completions.create(
            model="kev-0.5b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    answered = time.time()
    assert raised.value.status_code == 503
    error = raised.value.body
    assert isinstance(error, dict) and error["code"] == "model_parked", error
    assert "unknown model architecture: 'kev'" in error["message"]
    assert "llmgw ctl retry kev-0.5b" in error["message"]
    state = json.loads(get_kv(consul_url, "llmgw/state/kev-0.5b") or "{}")
    assert state["parked"] is True
    # Within seconds of the park, not at the end of the window.
    assert answered - state["updated_at"] < 5, answered - state["updated_at"]
    assert time.monotonic() - started < 280
    # The SDK honoured x-should-retry: false and sent one request.
    assert fleet.router.requests_counted("kev-0.5b") == 1


@pytest.mark.slow
def test_more_waiting_requests_than_the_bound_get_429_and_a_client_that_leaves_frees_its_place(
    make_fleet: MakeFleet,
) -> None:
    fleet = make_fleet(kev_window="600s", max_waiting=3)
    router = fleet.router
    # Clients that give up after 8 s, once (the SDK would retry its own timeout).
    patient = fleet.sdk(timeout=8, max_retries=0)

    def waits() -> Exception | None:
        try:
            fleet.ask(patient, "kev-0.5b")
        except APITimeoutError as exc:
            return exc
        return None

    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(waits) for _ in range(3)]
        wait_until(lambda: router.app.activator.waiting("kev-0.5b") == 3, 10, "three waiting requests")
        # The SDK with its defaults, which retry a 429 twice unless the answer says not to.
        client = fleet.sdk()
        started = time.monotonic()
        for _ in range(2):
            with pytest.raises(RateLimitError) as raised:
                fleet.ask(client, "kev-0.5b")
            error = raised.value.body
            assert isinstance(error, dict) and error["code"] == "model_overloaded", error
            assert "3 requests already wait" in error["message"]
            headers = raised.value.response.headers
            assert int(headers["retry-after"]) > 0
            assert headers["x-should-retry"] == "false"
        # At once, and one request each: a retry would have waited Retry-After (10 s) first.
        assert time.monotonic() - started < 2, "the extra requests waited, or were retried"
        router.expect_metric("llmgw_router_requests_total", 2, model="kev-0.5b", code="429")
        # The three clients give up (their timeout): each is counted as an early end while
        # waiting, and their places are free again.
        assert all(isinstance(f.result(), APITimeoutError) for f in waiting)
    router.expect_metric("llmgw_router_early_ends_total", 3, timeout=10, model="kev-0.5b", kind="waiting")
    router.expect_metric("llmgw_router_refusals_total", 2, model="kev-0.5b", reason="overloaded")
    assert router.app.activator.waiting("kev-0.5b") == 0


@pytest.mark.slow
def test_a_streamed_request_that_waits_gets_keepalive_comments_then_its_tokens(make_fleet: MakeFleet) -> None:
    fleet = make_fleet(keepalive_s=0.3)
    lines: list[str] = []
    with httpx.stream(
        "POST",
        f"{fleet.router.url}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        },
        timeout=120,
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    keepalives = [i for i, line in enumerate(lines) if line == ": waiting for a replica of tiny"]
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert keepalives, lines
    assert data and max(keepalives) < min(data), lines
    assert lines[-1] == "data: [DONE]"
    assert "choices" in json.loads(lines[data[0]][len("data: ") :])

    # The SDK reads the same kind of stream as if the comments were not there.
    fleet.scale("llmgw-tiny", 0)
    wait_until(lambda: not fleet.router.app.discovery.snapshot.ready.get("tiny"), 30, "tiny scaled down")
    client = OpenAI(base_url=f"{fleet.router.url}/v1", api_key="none", timeout=120, max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks and chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.slow
def test_a_model_placed_once_then_left_without_room_is_refused_and_its_count_put_back(
    make_fleet: MakeFleet, consul_url: str
) -> None:
    fleet = make_fleet(activity_interval_s=0.2, idle_timeouts={"tiny": "2s", "filler": "6s"})
    assert fleet.chat("tiny").status_code == 200
    # Scaled down by the watcher when idle; then another model takes the only GPU.
    wait_until(lambda: fleet.job_count("llmgw-tiny") == 0, 30, "the watcher to idle tiny down")
    wait_until(lambda: not fleet.router.app.discovery.snapshot.replicas.get("tiny"), 30, "tiny gone")
    assert fleet.chat("filler").status_code == 200
    time.sleep(0.6)
    activity_before = get_kv(consul_url, "llmgw/activity/tiny")

    client = fleet.sdk()
    with pytest.raises(APIStatusError) as raised:
        fleet.ask(client, "tiny")
    assert raised.value.status_code == 503
    error = raised.value.body
    assert isinstance(error, dict) and error["code"] == "model_unplaceable", error
    assert "nvidia/gpu" in error["message"], error["message"]
    assert raised.value.response.headers["x-should-retry"] == "false"
    # The SDK asked once: the refusal says not to retry.
    fleet.router.expect_metric("llmgw_router_requests_total", 1, model="tiny", code="503")
    # The watcher raised the count to 1 for the ask; refused, it puts it back once the request
    # has ended, and no activity was written for it.
    wait_until(lambda: fleet.job_count("llmgw-tiny") == 0, 15, "the watcher to undo the activation")
    assert any(
        "undo the activation of tiny" in e.get("Message", "") for e in fleet.scale_events("llmgw-tiny")
    )
    assert get_kv(consul_url, "llmgw/activity/tiny") == activity_before

    # Room is made (the idle filler scaled down by the watcher): the next request is served.
    wait_until(lambda: fleet.job_count("llmgw-filler") == 0, 30, "the watcher to idle filler down")
    answer = fleet.ask(client, "tiny")
    assert answer.choices[0].message.role == "assistant"
    assert fleet.job_count("llmgw-tiny") == 1


def test_no_watcher_answering_is_a_retryable_503_naming_it(
    consul_url: str, start_router: StartRouter
) -> None:
    """The router asks and the leading watcher scales; with no watcher (none runs, none leads,
    or it cannot reach Nomad) nobody answers the ask, and the request hears so after the
    window, retryable, not a wait without end."""
    put_kv(
        consul_url,
        "llmgw/config/models",
        models_yaml(Path("/models/tiny.gguf"), Path("/models/kev.gguf")),
    )
    router = start_router(consul_url, activation=True, timeouts=Timeouts(evaluation_s=2.0))
    wait_until(lambda: router.app.discovery.snapshot.models, 10, "the models")
    started = time.monotonic()
    resp = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert 1.5 < time.monotonic() - started < 10
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "activation_failed"
    assert "no watcher answered its activation within 2s" in error["message"]
    assert resp.headers["retry-after"] == "5"
    router.expect_metric("llmgw_router_activations_total", 1, model="tiny", result="error")


def test_an_attempt_answering_another_routers_later_clock_is_not_taken_for_this_requests_answer(
    consul_url: str, start_router: StartRouter
) -> None:
    """An older watcher (its attempt names no asks) compares asks from several routers by time.
    Another router's clock runs an hour ahead of this one's; that watcher answered its ask
    ("unplaceable", before this request arrived). This router's ask time must come after that
    attempt, so the request waits for an attempt of its own (here none comes: no watcher)
    instead of taking the old answer as current."""
    put_kv(
        consul_url,
        "llmgw/config/models",
        models_yaml(Path("/models/tiny.gguf"), Path("/models/kev.gguf")),
    )
    ahead = round(time.time() + 3600, 3)
    old = {"asked": ahead, "at": ahead, "eval": "e-old", "result": "unplaceable", "reason": "no room then"}
    put_state(consul_url, "tiny", attempt=old)
    router = start_router(consul_url, activation=True, timeouts=Timeouts(evaluation_s=2.0))
    wait_until(lambda: "tiny" in router.app.discovery.snapshot.states, 10, "the old attempt")
    key = f"llmgw/inflight/{router.app.activity.router_id}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post,
            f"{router.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )

        def published_ask() -> float:
            value = get_kv(consul_url, key)
            return float(json.loads(value)["models"].get("tiny", {}).get("asked", 0.0)) if value else 0.0

        asked = wait_until(published_ask, 10, "the ask")
        resp = pending.result()
    assert asked > ahead
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "activation_failed", resp.text


def test_a_waiting_request_takes_only_the_attempt_that_answers_its_own_ask_by_number(
    consul_url: str, start_router: StartRouter
) -> None:
    """Another router's clock runs 30 s ahead, and the watcher answered its ask ("no room
    then") after this router asked, so no attempt seen before the ask could move this ask's
    time past it. By time that attempt answers this request too; by number it does not, and
    the request waits for the attempt that names this router's ask."""
    put_kv(
        consul_url,
        "llmgw/config/models",
        models_yaml(Path("/models/tiny.gguf"), Path("/models/kev.gguf")),
    )
    router = start_router(consul_url, activation=True, timeouts=Timeouts(evaluation_s=20.0))
    wait_until(lambda: "tiny" in router.app.discovery.snapshot.models, 10, "the models")
    key = f"llmgw/inflight/{router.app.activity.router_id}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post,
            f"{router.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )

        def published() -> dict[str, Any] | None:
            value = get_kv(consul_url, key)
            record = json.loads(value) if value else {}
            use = record.get("models", {}).get("tiny", {})
            return {**use, "asker": record.get("asker")} if "asked" in use else None

        mine = wait_until(published, 10, "the ask")
        ahead = mine["asked"] + 30
        others = {
            "asked": ahead,
            "at": ahead,
            "eval": "e-then",
            "result": "unplaceable",
            "reason": "no room then",
        }
        put_state(consul_url, "tiny", attempt={**others, "answered": {"other-router/1a2b3c4d": 1}})
        wait_until(
            lambda: (s := router.app.discovery.snapshot.states.get("tiny")) and s.attempt and s.attempt.eval,
            10,
            "the other router's attempt",
        )
        time.sleep(0.5)
        assert not pending.done(), pending.result().text
        answered = {"other-router/1a2b3c4d": 1, mine["asker"]: mine["ask_seq"]}
        now = {**others, "eval": "e-now", "reason": "no room now", "answered": answered}
        put_state(consul_url, "tiny", attempt=now)
        resp = pending.result()
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "model_unplaceable", resp.text
    assert "no room now" in resp.json()["error"]["message"], resp.text


@pytest.mark.slow
def test_a_waiting_request_hears_a_later_unplaceable_evaluation_and_a_removed_definition(
    make_fleet: MakeFleet, consul_url: str
) -> None:
    fleet = make_fleet(kev_window="600s")
    router = fleet.router
    # A stale "unplaceable" from before the request does not end its wait; a newer one does.
    put_state(consul_url, "kev-0.5b", unplaceable=True, placement_reason="old news", placement_eval="e-old")
    wait_until(lambda: "kev-0.5b" in router.app.discovery.snapshot.states, 10, "the stale state")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(fleet.chat, "kev-0.5b", 60)
        wait_until(lambda: router.app.activator.waiting("kev-0.5b") == 1, 20, "a waiting request")
        time.sleep(1)
        assert not waiting.done()
        put_state(
            consul_url,
            "kev-0.5b",
            unplaceable=True,
            placement_reason="no node has 1 x nvidia/gpu free (replacement allocation)",
            placement_eval="e-new",
            updated_at=time.time(),
        )
        resp = waiting.result(timeout=10)
    assert resp.status_code == 503
    error = resp.json()["error"]
    assert error["code"] == "model_unplaceable"
    assert "replacement allocation" in error["message"]

    # The definition goes away while another request waits: it hears so at once.
    put_state(consul_url, "kev-0.5b")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(fleet.chat, "kev-0.5b", 60)
        wait_until(lambda: router.app.activator.waiting("kev-0.5b") == 1, 20, "a waiting request")
        text = get_kv(consul_url, "llmgw/config/models") or ""
        models = yaml.safe_load(text)
        del models["models"]["kev-0.5b"]
        put_kv(consul_url, "llmgw/config/models", yaml.safe_dump(models))
        resp = waiting.result(timeout=10)
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"
    assert "removed" in resp.json()["error"]["message"]
