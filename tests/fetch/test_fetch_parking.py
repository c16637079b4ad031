"""The watcher on the stand-in, with a model whose fetch is refused: five failed fetches park it,
and the reason it gives is the fetch's, in plain words, never an engine crash."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

from nomad_driver.fetch.render import HOST_VOLUME
from nomad_driver.variables import source_variable_path
from tests.fetch.servers import weights_server
from tests.fetch.test_fetch_standin import install_llmgw
from tests.watcher_support import node, read_state, until, watcher_on_standin

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
async def test_five_refused_fetches_park_the_model_naming_credentials_refused(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path
) -> None:
    engines, cache = tmp_path / "engines", tmp_path / "weights"
    cache.mkdir()
    with weights_server(
        {"/m/tiny.gguf": os.urandom(64 * 1024)}, tls_dir=tmp_path / "tls", token="sesame"
    ) as server:
        assert server.ca is not None
        install_llmgw(engines, server.ca)
        gpu_node = node("cpu-0", engines)
        gpu_node["meta"]["llmgw_models_dir"] = str(cache)
        gpu_node["host_volumes"] = {HOST_VOLUME: {"path": str(cache)}}
        text = textwrap.dedent(
            f"""
            profiles:
              cpu:
                engine: llama-cpp-python
                engine_version: 0.3.36
                gpus: 0
            models:
              tiny:
                source: {server.url("/m/tiny.gguf")}
                profile: cpu
                replicas: {{min: 1, max: 1}}
            """
        )
        standin, consul, _nomad, watcher = await watcher_on_standin(
            consul_url, start_standin, text, ident="w1", clock_speed=20.0, nodes=[gpu_node]
        )
        put = requests.put(
            f"{standin.url}/v1/var/{source_variable_path('tiny')}",
            json={"Items": {"LLMGW_SOURCE_TOKEN": "not-sesame"}},
            timeout=10,
        )
        assert put.status_code == 200, put.text
        await watcher.start()
        try:

            async def parked() -> Any:
                state = await read_state(consul, "tiny")
                return state if state is not None and state.parked else None

            state = await until(parked, 180, "tiny parked", every=0.3)
            assert state.last_error.startswith("fetch failed: credentials refused"), state.last_error
            assert state.consecutive_failures == 5
        finally:
            await watcher.stop()
            await watcher.consul.close()
            await consul.close()
