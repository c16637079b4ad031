"""Real llama.cpp (llama-cpp-python's server) on tiny GGUF files: it answers OpenAI-style, and it
refuses an unknown architecture the way the cluster's nodes did in the incident."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from devstack.llama_engine import LlamaServerError
from tests.fixtures.engines import MakeGguf, StartLlamaServer

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60.0)


def test_tiny_llama_gguf_answers_a_chat_completion(
    make_gguf: MakeGguf, llama_server: StartLlamaServer
) -> None:
    server = llama_server(make_gguf())
    reply = _client(server.url).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
    )
    # Random weights give gibberish: only the shape of the answer is the engine's promise.
    assert reply.choices, reply
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert reply.usage is not None and reply.usage.prompt_tokens > 0


def test_tiny_llama_gguf_streams_a_chat_completion_in_chunks(
    make_gguf: MakeGguf, llama_server: StartLlamaServer
) -> None:
    server = llama_server(make_gguf())
    stream = _client(server.url).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
    )
    chunks = list(stream)
    assert len(chunks) >= 2, chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[-1] in {"stop", "length"}


def test_kev_architecture_makes_the_engine_exit_with_unknown_model_architecture(
    make_gguf: MakeGguf, llama_server: StartLlamaServer
) -> None:
    server = llama_server(make_gguf("kev"), ready=False)
    code = server.wait_exit(timeout=120.0)
    assert code != 0
    assert "unknown model architecture: 'kev'" in server.stderr_text()


def test_waiting_for_an_engine_that_cannot_load_reports_its_error(
    make_gguf: MakeGguf, llama_server: StartLlamaServer
) -> None:
    with pytest.raises(
        LlamaServerError, match=r"(?s)exited with status [1-9].*unknown model architecture: 'kev'"
    ):
        llama_server(make_gguf("kev"))
