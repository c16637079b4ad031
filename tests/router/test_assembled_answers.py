"""A non-streamed request to an engine that cannot stop non-streamed work goes upstream as a
stream (router/assemble.py): the client must not tell. The real openai SDK gets, through the
router, the answer the engine itself gives without a stream; llama-server, which stops
non-streamed work on its own, keeps its answers untouched."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import openai
import pytest

from router.assemble import Assembler
from tests.fixtures.engines import MakeGguf, StartLlamaServer
from tests.fixtures.llama_cpp import StartLlamaCpp, llama_cpp_models
from tests.router.conftest import StartRouter, register_replica, wait_until
from tests.router.test_client_gone import LONG_ASCII_ANSWER, defined_as_llama_cpp_python

MODEL = "tiny"
# Greedy, so that the engine gives the same answer twice; ASCII only, so that each streamed
# event is one token (see test_client_gone.py).
SAME_ANSWER = {"temperature": 0.0, "seed": 1, "logit_bias": LONG_ASCII_ANSWER}


def chunk(delta: dict[str, object], finish: str | None = None, **extra: object) -> bytes:
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }
    return b"data: " + json.dumps(body).encode()


def test_tool_calls_arrive_whole_with_no_content() -> None:
    assembler = Assembler(chat=True)
    events = [
        chunk({"role": "assistant", "content": None}),
        chunk(
            {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get"}}]}
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Oslo"}'}}]}),
        chunk({}, "tool_calls"),
        b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}',
        b"data: [DONE]",
    ]
    for event in events:
        assembler.feed_event(event)
    body, counted = assembler.answer()
    assert assembler.done and not counted
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1" and body["created"] == 7
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "content": None,
        "role": "assistant",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'}}
        ],
    }
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}


def test_reasoning_and_logprobs_are_joined_in_order() -> None:
    assembler = Assembler(chat=True)
    for piece in ("a", "b"):
        assembler.feed_event(
            chunk(
                {"reasoning_content": piece.upper(), "content": piece},
                logprobs=None,
            ).replace(b'"logprobs": null', b'"logprobs": {"content": [{"token": "%s"}]}' % piece.encode())
        )
    assembler.feed_event(chunk({}, "stop"))
    body, counted = assembler.answer()
    message = body["choices"][0]["message"]
    assert message["content"] == "ab" and message["reasoning_content"] == "AB"
    assert body["choices"][0]["logprobs"] == {"content": [{"token": "a"}, {"token": "b"}]}
    # No usage in the stream: the router counts the tokens it saw.
    assert counted and body["usage"] == {"prompt_tokens": 0, "completion_tokens": 2, "total_tokens": 2}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_sdk_gets_the_engines_own_non_streamed_answer(
    consul_url: str,
    make_gguf: MakeGguf,
    llama_server: StartLlamaServer,
    start_router: StartRouter,
    tmp_path: Path,
) -> None:
    gguf = make_gguf()
    engine = llama_server(gguf, n_ctx=2048)
    register_replica(consul_url, MODEL, engine.port, "tiny-1")
    router = start_router(consul_url, models_file=defined_as_llama_cpp_python(tmp_path, gguf))
    router.wait_ready(MODEL, 1)
    direct = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="sk-test", max_retries=0)
    routed = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sk-test", max_retries=0)
    messages = [{"role": "user", "content": "Say hello"}]

    own = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **SAME_ANSWER)  # type: ignore[arg-type]
    raw = routed.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        **SAME_ANSWER,  # type: ignore[arg-type]
    )
    got = raw.parse()
    assert raw.headers["x-llmgw-usage"] == "counted"
    assert raw.headers["content-type"] == "application/json"
    assert got.object == own.object == "chat.completion"
    assert got.id.startswith("chatcmpl-") and got.model == own.model
    assert got.choices[0].message.content == own.choices[0].message.content
    assert got.choices[0].message.role == own.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == own.choices[0].finish_reason == "length"
    assert own.usage is not None and got.usage is not None
    assert got.usage.completion_tokens == own.usage.completion_tokens == 24
    # The same fields, whatever their values (prompt_tokens is not known from a stream).
    assert set(got.model_dump()) == set(own.model_dump())
    assert set(got.choices[0].model_dump()) == set(own.choices[0].model_dump())

    own_text = direct.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, **SAME_ANSWER)  # type: ignore[arg-type]
    got_text = routed.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, **SAME_ANSWER)  # type: ignore[arg-type]
    assert got_text.object == own_text.object == "text_completion"
    assert got_text.choices[0].text == own_text.choices[0].text
    assert got_text.choices[0].finish_reason == own_text.choices[0].finish_reason
    assert set(got_text.model_dump()) == set(own_text.model_dump())

    # A request the engine refuses is its own error, as without a stream.
    bad = [{"role": "nobody"}]
    with pytest.raises(openai.APIStatusError) as own_error:
        direct.chat.completions.create(model=MODEL, messages=bad)  # type: ignore[arg-type]
    with pytest.raises(openai.APIStatusError) as got_error:
        routed.chat.completions.create(model=MODEL, messages=bad)  # type: ignore[arg-type]
    assert got_error.value.status_code == own_error.value.status_code
    assert got_error.value.body == own_error.value.body
    router.expect_metric("llmgw_router_requests_total", 2, model=MODEL, code="200")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_llama_server_stops_a_non_streamed_answer_whose_client_left(
    consul_url: str,
    make_gguf: MakeGguf,
    llama_cpp_server: StartLlamaCpp,
    start_router: StartRouter,
    tmp_path: Path,
) -> None:
    """llama-server looks at the connection of a non-streamed request only when nothing else
    happens on the engine for a second, and this test reads /slots all the time, as a busy
    engine's other requests would wake it: passed through, the answer ran on for nobody. So the
    router asks for a stream and assembles it, and a client that leaves still costs nothing:
    the one slot is free again at once."""
    gguf = make_gguf()
    # One slot, and room to generate far past the tiny model's trained context.
    engine = llama_cpp_server(
        gguf,
        n_ctx=8192,
        extra_args=["-np", "1", "--context-shift", "--override-kv", "llama.context_length=int:8192"],
    )
    register_replica(consul_url, MODEL, engine.port, "tiny-1")
    models = tmp_path / "models.yaml"
    models.write_text(llama_cpp_models(MODEL, gguf))
    router = start_router(consul_url, models_file=str(models))
    router.wait_ready(MODEL, 1)

    def generating() -> bool:
        slots = httpx.get(f"{engine.url}/slots", timeout=5).json()
        return any(slot.get("is_processing") for slot in slots)

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        # Far more than the engine makes before the client leaves: llama-server writes a few
        # thousand tokens a second of the tiny model when the machine is quiet, so a shorter
        # answer can end before the client leaves, and then there is nothing to cancel.
        "max_tokens": 200_000,
        "temperature": 1.0,
        "logit_bias": LONG_ASCII_ANSWER,
    }
    answer = httpx.post(f"{router.url}/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=30)
    # Assembled, with the usage the engine streamed (it honours stream_options), not counted.
    assert answer.status_code == 200 and "x-llmgw-usage" not in answer.headers
    assert answer.json()["usage"]["prompt_tokens"] > 0

    def leave_after(seconds: float) -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{router.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=seconds)
            )

    leaving = threading.Thread(target=leave_after, args=(3.0,))
    leaving.start()
    wait_until(generating, 3, "llama-server to start on the long answer")
    leaving.join()
    # 200,000 tokens take this engine minutes; a slot free within seconds was cancelled.
    wait_until(lambda: not generating(), 5, "llama-server to free its slot")
    router.expect_metric("llmgw_router_requests_total", 1, model=MODEL, code="499")
