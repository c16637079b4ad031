"""llama.cpp's own engine, `llama-server`, as `make setup` builds it: it serves a tiny model, it
fails a model of an unknown architecture with llama.cpp's own words (which the watcher keeps as
the reason it parks the model), and it splits one model over `ggml-rpc-server` shards, which is
what a multi-node replica runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from devstack.llama_cpp import llama_cpp_node
from nomad_driver.watcher.parking import telling_line
from tests.fixtures.llama_cpp import StartLlamaCpp, StartShard, llama_cpp_models
from tests.watcher_support import read_state, until, watcher_on_standin

ARCH_ERROR = "unknown model architecture: 'kev'"

pytestmark = pytest.mark.timeout(300)


def chat(url: str, model: str = "tiny") -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.choices[0].message.role == "assistant"
    return reply.choices[0].message.content or ""


def test_llama_server_serves_a_tiny_model_and_says_when_it_is_ready(
    llama_cpp_server: StartLlamaCpp, make_gguf: Any
) -> None:
    server = llama_cpp_server(make_gguf(), extra_args=["--alias", "tiny"])
    assert httpx.get(f"{server.url}/health", timeout=5).json() == {"status": "ok"}
    chat(server.url)
    models = httpx.get(f"{server.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_an_unknown_architecture_exits_with_llama_cpps_own_error(
    llama_cpp_server: StartLlamaCpp, make_gguf: Any
) -> None:
    server = llama_cpp_server(make_gguf("kev"), ready=False)
    assert server.wait_exit(timeout=60) != 0
    assert ARCH_ERROR in server.stderr_text()


def test_a_file_missing_on_the_node_is_the_cause_the_watcher_keeps(
    llama_cpp_server: StartLlamaCpp, tmp_path: Path
) -> None:
    # A file:// source is read where it lies (raw_exec): a node without the file fails the start,
    # and the cause must say which file, not only that loading failed.
    missing = tmp_path / "nowhere" / "m.gguf"
    server = llama_cpp_server(missing, ready=False)
    assert server.wait_exit(timeout=60) != 0
    assert telling_line(server.stderr_text()) == (
        f"failed to open GGUF file '{missing}' (No such file or directory)"
    )


def test_one_model_split_over_two_rpc_shards_answers_and_dies_with_a_shard(
    llama_cpp_server: StartLlamaCpp, rpc_shard: StartShard, make_gguf: Any
) -> None:
    shards = [rpc_shard(), rpc_shard()]
    leader = llama_cpp_server(make_gguf(), rpc=[s.address for s in shards], extra_args=["--alias", "tiny"])
    chat(leader.url)

    # The shards really hold the model: without one the leader cannot answer and does not limp
    # on, which is why a multi-node replica is restarted as a whole.
    shards[1].stop()
    with pytest.raises(openai.APIError):
        chat(leader.url)
    leader.wait_exit(timeout=60)


@pytest.mark.slow
async def test_the_watcher_parks_a_llama_cpp_model_with_the_engines_own_error(
    consul_url: str, start_standin: Callable[..., Any], llama_cpp_engines: Path, make_gguf: Any
) -> None:
    text = llama_cpp_models("kev", make_gguf("kev"))
    _standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url,
        start_standin,
        text,
        ident="w1",
        clock_speed=20.0,
        nodes=[llama_cpp_node("cpu-0", llama_cpp_engines)],
    )
    await watcher.start()
    try:

        async def parked() -> Any:
            state = await read_state(consul, "kev")
            return state if state is not None and state.parked else None

        state = await until(parked, 150, "kev parked", every=0.3)
        assert ARCH_ERROR in state.last_error
        assert state.consecutive_failures == 5
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()
