"""The watcher on the stand-in with the fetch: five refused fetches park the model with the fetch's
reason in plain words, never an engine crash; a slow one shows its progress and is left to finish."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from nomad_driver.fetch.render import HOST_VOLUME
from nomad_driver.variables import source_variable_path
from nomad_driver.watcher.admin import create_app
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


@pytest.mark.slow
async def test_a_slow_source_shows_its_progress_and_the_model_starts_when_it_is_done(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path
) -> None:
    """A source far slower than the engine's start: the admin API shows bytes done, total and
    rate while it moves, nothing counts as a failure, and the replica runs once it is done."""
    size = 1024 * 1024
    engines, cache = tmp_path / "engines", tmp_path / "weights"
    cache.mkdir()
    with weights_server(
        {"/m/tiny.gguf": os.urandom(size)}, tls_dir=tmp_path / "tls", token="sesame", rate=96 * 1024
    ) as server:
        assert server.ca is not None
        install_llmgw(engines, server.ca)
        gpu_node = node("cpu-0", engines)
        gpu_node["meta"]["llmgw_models_dir"] = str(cache)
        # A minimum rate under what the source gives: slow, but moving.
        gpu_node["meta"]["llmgw_fetch_min_rate"] = "16K"
        gpu_node["meta"]["llmgw_fetch_stall_window"] = "2"
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
        standin, consul, nomad, watcher = await watcher_on_standin(
            consul_url, start_standin, text, ident="w1", clock_speed=1.0, nodes=[gpu_node]
        )
        requests.put(
            f"{standin.url}/v1/var/{source_variable_path('tiny')}",
            json={"Items": {"LLMGW_SOURCE_TOKEN": "sesame"}},
            timeout=10,
        ).raise_for_status()
        await watcher.start()
        admin = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(watcher)), base_url="http://admin"
        )
        try:

            async def moving() -> Any:
                answer = (await admin.get("/v1/admin/models/tiny")).json()
                fetches = answer.get("fetch") or []
                return fetches[0] if fetches and 0 < fetches[0]["done"] < size else None

            progress = await until(moving, 60, "a fetch under way in the admin API", every=0.3)
            assert progress["total"] == size and progress["rate"] > 0
            assert " of 1.0 MiB at " in progress["text"]
            # The fleet's list (what `llmgw ctl status` shows) and the metrics say it too.
            listed = (await admin.get("/v1/admin/models")).json()["models"]
            tiny = next(m for m in listed if m["model"] == "tiny")
            assert tiny["reason"].startswith("fetching weights: ") and " of 1.0 MiB at " in tiny["reason"]
            assert tiny["fetch"] and tiny["fetch"][0]["total"] == size
            scraped = {
                s.name: (s.labels, s.value)
                for f in text_string_to_metric_families((await admin.get("/metrics")).text)
                for s in f.samples
                if s.name.startswith("llmgw_model_fetch_")
            }
            assert scraped["llmgw_model_fetch_total_bytes"] == ({"model": "tiny", "node": "cpu-0"}, size)
            assert 0 < scraped["llmgw_model_fetch_bytes"][1] <= size
            # Moving slowly is no failure.
            state = await read_state(consul, "tiny")
            assert state is None or state.consecutive_failures == 0

            async def done() -> Any:
                return (cache / "tiny" / "tiny.gguf").exists()

            await until(done, 60, "the download finished", every=0.3)
            assert server.bytes_served == size

            # One fetch, never killed nor restarted while it moved, and it ended well. (The
            # engine that follows is not installed on this node; its failure is its own.)
            def fetch_over() -> Any:
                allocs = nomad._json(nomad._request("job", "llmgw-tiny", "allocations"), "allocs")
                first = min(allocs, key=lambda a: a["CreateIndex"])
                return first if first["TaskStates"]["fetch"]["State"] == "dead" else None

            alloc = await until(fetch_over, 30, "the fetch task over", every=0.3)
            fetch_events = [e["Type"] for e in alloc["TaskStates"]["fetch"]["Events"]]
            assert fetch_events.count("Started") == 1 and "Restarting" not in fetch_events
            assert alloc["TaskStates"]["fetch"]["Failed"] is False
        finally:
            await admin.aclose()
            await watcher.stop()
            await watcher.consul.close()
            await consul.close()
