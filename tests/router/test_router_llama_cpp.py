"""A `llama.cpp` model end to end: rendered, placed by the Nomad stand-in on a node with
llama.cpp installed, run as the real `llama-server`, found ready in Consul through its `/health`
check, and answered through the router with the openai SDK."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from devstack.llama_cpp import llama_cpp_node
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from tests.fixtures.llama_cpp import llama_cpp_models
from tests.router.conftest import StartRouter, put_kv


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_llama_cpp_model_serves_through_the_router(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"nodes": [llama_cpp_node("cpu-0", llama_cpp_engines)]}))
    standin = start_standin(nodes=nodes)
    text = llama_cpp_models("tiny", make_gguf())
    (model,) = parse_models(text).models.values()
    job = render_job(model)
    assert job["TaskGroups"][0]["Services"][0]["Checks"][0]["Path"] == "/health"
    reply = httpx.post(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10)
    assert reply.status_code == 200, reply.text
    put_kv(consul_url, "llmgw/config/models", text)
    router = start_router(consul_url)
    router.wait_ready("tiny", 1, timeout=120)

    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert answer.choices[0].message.role == "assistant"
    # It is llama.cpp's server that answered: it reports its own timings.
    raw = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert raw.status_code == 200, raw.text
    assert "timings" in raw.json()
