"""The rendered fetch, run by the stand-in's client as Nomad would run it: the prestart task
gets its credentials from the model's Variable, fills the node's `llmgw-weights` host volume,
and the engine starts only after it, reading the weights from there."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devstack.nomad.client import ClientRunner
from devstack.nomad.state import StateStore
from devstack.nomad.taskstate import RestartTracker
from nomad_driver.fetch.prefetch import render_prefetch_job
from nomad_driver.fetch.render import FETCH_TASK, HOST_VOLUME, weights_of
from nomad_driver.render import render_job
from nomad_driver.spec import Model, parse_models
from nomad_driver.variables import source_variable_path
from tests.fetch.servers import WeightsServer, weights_server
from tests.standin.client_helpers import (
    Json,
    event_types,
    make_alloc,
    make_node,
    new_store,
    running_client,
    task_state,
    wait_alloc,
)

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = os.urandom(1024 * 1024 + 5)
# The engine stand-in: reads the file the rendered `--model` names, says how big it is, serves.
ENGINE = (
    "import os, sys, time; n = len(open(sys.argv[1], 'rb').read()); "
    "print(n, 'LLMGW_SOURCE_TOKEN' in os.environ, flush=True); time.sleep(3600)"
)


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RestartTracker, "jitter", 0.0)


@dataclass
class Node:
    store: StateStore
    client: ClientRunner
    cache: Path
    server: WeightsServer


def install_llmgw(engines: Path, ca: Path) -> None:
    """`<engines_dir>/llmgw/bin/llmgw`, as docs/operating.md has operators install it, on a node
    that trusts the test source's CA."""
    script = engines / "llmgw" / "bin" / "llmgw"
    script.parent.mkdir(parents=True)
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            SSL_CERT_FILE={ca} PYTHONPATH={REPO} exec {sys.executable} -m nomad_driver.cli "$@"
            """
        )
    )
    script.chmod(0o755)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    engines, cache = tmp_path / "engines", tmp_path / "weights"
    cache.mkdir()
    meta = {"llmgw_engines_dir": str(engines), "llmgw_models_dir": str(cache)}
    store = new_store(
        make_node(
            Meta=meta,
            HostVolumes={HOST_VOLUME: {"Path": str(cache), "ReadOnly": False}},
        )
    )
    with weights_server({"/m/tiny.gguf": WEIGHTS}, tls_dir=tmp_path / "tls", token="sesame") as server:
        assert server.ca is not None
        install_llmgw(engines, server.ca)
        async with running_client(store, tmp_path / "data", clock_speed=50) as client:
            yield Node(store, client, cache, server)


def model(server: WeightsServer) -> Model:
    text = f"""
        profiles:
          cpu:
            engine: llama-cpp-python
            engine_version: 0.3.36
            gpus: 0
        models:
          tiny:
            source: {server.url("/m/tiny.gguf")}
            profile: cpu
    """
    return parse_models(textwrap.dedent(text)).models["tiny"]


def job_for(m: Model) -> Json:
    """The rendered job with its engine swapped for a process that reads the weights the
    rendered command line names; the fetch task is left exactly as rendered."""
    job = render_job(m)
    engine = job["TaskGroups"][0]["Tasks"][0]
    engine["Config"] = {"command": sys.executable, "args": ["-c", ENGINE, weights_of(m).model_arg]}
    return job


def set_token(store: StateStore, m: Model, token: str) -> None:
    path = source_variable_path(m.name)
    store.variables[("default", path)] = {
        "Namespace": "default",
        "Path": path,
        "Items": {"LLMGW_SOURCE_TOKEN": token},
    }


def start(node: Node, job: Json) -> str:
    alloc = make_alloc(job)
    node.store.upsert_alloc(alloc)
    node.client.start_alloc(alloc["ID"])
    return str(alloc["ID"])


def engine_running(alloc: Json) -> bool:
    return task_state(alloc).get("State") == "running"


async def wait_running(node: Node, alloc_id: str) -> Json:
    alloc = await wait_alloc(node.store, alloc_id, lambda a: engine_running(a) or failed(a), timeout=60)
    assert not failed(alloc), stderr(node, alloc_id, FETCH_TASK)
    return alloc


def failed(alloc: Json) -> bool:
    return alloc.get("ClientStatus") == "failed"


def stderr(node: Node, alloc_id: str, task: str) -> str:
    return node.client.log_path(alloc_id, task, "stderr").read_text()


async def engine_said(node: Node, alloc_id: str) -> str:
    path = node.client.log_path(alloc_id, "engine", "stdout")
    for _ in range(200):
        if path.exists() and path.read_text():
            return path.read_text().strip()
        await asyncio.sleep(0.05)
    raise AssertionError("the engine wrote nothing")


async def test_credentials_from_the_models_variable_reach_the_fetch_before_the_engine_starts(
    node: Node,
) -> None:
    m = model(node.server)
    set_token(node.store, m, "sesame")
    alloc_id = start(node, job_for(m))
    alloc = await wait_running(node, alloc_id)
    fetch = task_state(alloc, FETCH_TASK)
    assert fetch["State"] == "dead" and not fetch["Failed"], event_types(alloc, FETCH_TASK)
    # The engine read the whole file, and the token reached only the fetch, never the engine.
    assert await engine_said(node, alloc_id) == f"{len(WEIGHTS)} False"
    assert (node.cache / "tiny" / "tiny.gguf").read_bytes() == WEIGHTS
    assert node.server.bytes_served == len(WEIGHTS)


async def test_a_second_replica_on_the_same_node_downloads_zero_bytes(node: Node) -> None:
    m = model(node.server)
    set_token(node.store, m, "sesame")
    first = start(node, job_for(m))
    await wait_running(node, first)
    node.server.reset_counts()
    second = start(node, job_for(m))
    await wait_running(node, second)
    assert await engine_said(node, second) == f"{len(WEIGHTS)} False"
    assert node.server.bytes_served == 0 and node.server.requests == 0
    out = node.client.log_path(second, FETCH_TASK, "stdout").read_text()
    assert "nothing to download" in out


async def test_a_wrong_token_fails_the_start_with_credentials_refused_and_no_engine(node: Node) -> None:
    m = model(node.server)
    set_token(node.store, m, "not-sesame")
    alloc_id = start(node, job_for(m))
    alloc = await wait_alloc(node.store, alloc_id, failed, timeout=60)
    assert (
        stderr(node, alloc_id, FETCH_TASK)
        .strip()
        .splitlines()[-1]
        .startswith("fetch failed: credentials refused")
    )
    terminated = [e for e in task_state(alloc, FETCH_TASK)["Events"] if e["Type"] == "Terminated"]
    assert terminated and terminated[-1]["ExitCode"] == 10
    assert "Started" not in event_types(alloc, "engine")


async def test_a_node_without_the_host_volume_refuses_the_task(tmp_path: Path) -> None:
    store = new_store(make_node(Meta={"llmgw_models_dir": str(tmp_path)}))
    with weights_server({"/m/tiny.gguf": WEIGHTS}, tls_dir=tmp_path / "tls") as server:
        async with running_client(store, tmp_path / "data", clock_speed=50) as client:
            alloc = make_alloc(job_for(model(server)))
            store.upsert_alloc(alloc)
            client.start_alloc(alloc["ID"])
            done = await wait_alloc(store, alloc["ID"], failed, timeout=30)
    setup = [e for e in task_state(done, FETCH_TASK)["Events"] if e["Type"] == "Setup Failure"]
    assert setup and setup[0]["DisplayMessage"].endswith(f"missing {HOST_VOLUME}")


async def test_a_prefetched_on_demand_model_starts_without_a_download(node: Node) -> None:
    """`llmgw ctl prefetch`'s job fills the node's cache ahead; the model's first start then
    downloads nothing and costs the engine's load only."""
    m = model(node.server)
    set_token(node.store, m, "sesame")
    prefetch = render_prefetch_job(m, ["gpu-node-0"])
    assert prefetch["Type"] == "sysbatch"
    assert {"LTarget": "${node.unique.name}", "RTarget": "gpu-node-0", "Operand": "set_contains_any"} in (
        prefetch["TaskGroups"][0]["Constraints"]
    )
    alloc = make_alloc(prefetch)
    alloc["TaskGroup"] = prefetch["TaskGroups"][0]["Name"]
    node.store.upsert_alloc(alloc)
    node.client.start_alloc(alloc["ID"])
    done = await wait_alloc(
        node.store, alloc["ID"], lambda a: a.get("ClientStatus") in ("complete", "failed")
    )
    assert done["ClientStatus"] == "complete", stderr(node, alloc["ID"], FETCH_TASK)
    assert node.server.bytes_served == len(WEIGHTS)

    node.server.reset_counts()
    first_start = start(node, job_for(m))
    await wait_running(node, first_start)
    assert await engine_said(node, first_start) == f"{len(WEIGHTS)} False"
    assert node.server.bytes_served == 0
