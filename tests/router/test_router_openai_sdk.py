"""The official openai SDK against the router, with real llama.cpp replicas behind it: what a
client sees for answers, streams, refusals and failures, and how often it asks."""

from __future__ import annotations

import openai
import pytest

from tests.router.conftest import (
    RunningRouter,
    StartRouter,
    StartStub,
    put_kv,
    put_state,
    register_replica,
    wait_until,
)
from tests.router.test_router_api import KEV_ERROR, MODELS_YAML


def client(router: RunningRouter, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-test", **kw)  # type: ignore[arg-type]


@pytest.fixture
def llama_router(
    consul_url: str,
    make_gguf,
    llama_server,
    start_router: StartRouter,  # type: ignore[no-untyped-def]
) -> RunningRouter:
    model = make_gguf()
    engine = llama_server(model)
    register_replica(consul_url, "tiny", engine.port, "tiny-1")
    router = start_router(consul_url)
    router.wait_ready("tiny", 1)
    return router


@pytest.mark.slow
def test_chat_and_completions_through_the_sdk_streamed_and_not(llama_router: RunningRouter) -> None:
    sdk = client(llama_router)
    chat = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8, seed=1
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens > 0

    stream = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    completion = sdk.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8)
    assert completion.choices[0].text is not None
    assert completion.usage is not None and completion.usage.completion_tokens > 0

    streamed = list(
        sdk.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, stream=True)
    )
    assert len(streamed) >= 2
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert isinstance(text, str)

    models = {m.id: m for m in sdk.models.list()}
    assert "tiny" in models
    llama_router.expect_metric("llmgw_router_requests_total", 4, model="tiny", code="200")


@pytest.mark.slow
def test_an_unknown_model_is_a_404_the_sdk_does_not_retry(llama_router: RunningRouter) -> None:
    sdk = client(llama_router)
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"
    assert "known models: tiny" in caught.value.message


def _refused(router: RunningRouter, model: str) -> openai.APIStatusError:
    sdk = client(router, max_retries=2)
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    return caught.value


def test_a_parked_model_is_refused_once_and_the_sdk_does_not_retry(
    consul_url: str, start_router: StartRouter
) -> None:
    put_kv(consul_url, "llmgw/config/models", MODELS_YAML)
    put_state(consul_url, "kev-0.5b", parked=True, consecutive_failures=5, last_error=KEV_ERROR)
    router = start_router(consul_url)
    router.wait_ready("kev-0.5b", 0)
    wait_until(lambda: "kev-0.5b" in router.app.discovery.snapshot.states, 10, "the parked state")
    error = _refused(router, "kev-0.5b")
    assert error.status_code == 503
    assert error.code == "model_parked"
    assert "unknown model architecture: 'kev'" in error.message
    assert "llmgw ctl retry kev-0.5b" in error.message
    assert isinstance(error.body, dict) and error.body["code"] == "model_parked"
    # One request reached the router, not three.
    router.expect_metric("llmgw_router_requests_total", 1, model="kev-0.5b", code="503")


def test_an_unplaceable_model_is_refused_once_with_nomads_reason(
    consul_url: str, start_router: StartRouter
) -> None:
    put_kv(consul_url, "llmgw/config/models", MODELS_YAML)
    reason = "no node has 1 x nvidia/gpu with >= 80000 MiB; 4 nodes evaluated, 4 exhausted on devices"
    put_state(consul_url, "phi-4", unplaceable=True, placement_reason=reason)
    # Without Nomad to ask again, the watcher's last answer is the one given.
    router = start_router(consul_url, activation=False)
    wait_until(lambda: "phi-4" in router.app.discovery.snapshot.states, 10, "the unplaceable state")
    error = _refused(router, "phi-4")
    assert error.status_code == 503
    assert error.code == "model_unplaceable"
    assert reason in error.message
    assert error.response.headers.get("x-should-retry") == "false"
    assert "retry-after" not in error.response.headers
    router.expect_metric("llmgw_router_requests_total", 1, model="phi-4", code="503")
    router.expect_metric("llmgw_router_refusals_total", 1, model="phi-4", reason="unplaceable")


def test_a_model_that_is_only_starting_is_retried_by_the_sdk(
    consul_url: str, start_router: StartRouter
) -> None:
    """The contrast that makes the refusals above mean something: a 503 with Retry-After and
    no x-should-retry is retried, as it should be for a model that will come up."""
    put_kv(consul_url, "llmgw/config/models", MODELS_YAML)
    router = start_router(consul_url, activation=False, retry_after_s=1)
    wait_until(lambda: router.app.discovery.snapshot.models, 10, "the models")
    error = _refused(router, "idle-one")
    assert error.status_code == 503
    assert error.code == "no_ready_replica"
    router.expect_metric("llmgw_router_requests_total", 3, model="idle-one", code="503")


def test_a_replica_dying_mid_stream_raises_in_the_sdk_instead_of_hanging(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    stub = stub_engine("r1", chunks=200, chunk_delay=0.05)
    register_replica(consul_url, "alpha", stub.port, "alpha-1")
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    sdk = client(router, timeout=30)
    stream = sdk.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "go"}], stream=True
    )
    received = 0
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            received += 1
            if received == 3:
                stub.kill()
    assert received >= 3
    assert "failed mid-stream" in caught.value.message
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "upstream_failed"


def test_a_stream_the_sdk_closes_after_done_counts_as_answered(
    consul_url: str, stub_engine: StartStub, start_router: StartRouter
) -> None:
    """The SDK stops reading at `data: [DONE]` and closes; an engine may end its body a moment
    later. The client got its whole answer, so the request is a 200, not a client that left."""
    stub = stub_engine("r1", chunks=3, done_linger=1.0)
    register_replica(consul_url, "alpha", stub.port, "alpha-1")
    router = start_router(consul_url)
    router.wait_ready("alpha", 1)
    sdk = client(router, timeout=30)
    for _ in range(3):
        chunks = list(
            sdk.chat.completions.create(
                model="alpha", messages=[{"role": "user", "content": "go"}], stream=True
            )
        )
        assert len(chunks) == 3
    router.expect_metric("llmgw_router_requests_total", 3, model="alpha", code="200")
    assert router.metric("llmgw_router_early_ends_total", model="alpha", kind="stream") == 0
