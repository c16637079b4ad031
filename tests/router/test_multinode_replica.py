"""A two-shard replica of a tiny model, run for real: the Nomad stand-in places the leader and
the shard on distinct nodes of the fabric chosen for it, the shard runs `ggml-rpc-server`, the
leader finds it through Consul and runs `llama-server --rpc`, and the router answers through it.
Killing the shard takes the replica down and it comes back and serves again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from devstack.fleet import effective_nodes
from nomad_driver.placement import choose_fabric, fabric_rooms
from nomad_driver.render import SHARD_GROUP, render_replica_job
from nomad_driver.spec import parse_models
from tests.fixtures.llama_cpp import llama_cpp_models
from tests.router.conftest import StartRouter, put_kv
from tests.watcher_support import read_state, until, watcher_on_standin

FABRICS = Path(__file__).resolve().parents[2] / "devstack" / "nodes" / "fabrics.yaml"


def allocs_of(standin_url: str, job_id: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{standin_url}/v1/job/{job_id}/allocations", timeout=10)
    return list(reply.json())


def ask(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model="tiny-split", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    return answer.choices[0].message.role


def rpc_server_pids() -> dict[int, str]:
    """Running ggml-rpc-server processes started from this test's engines dir: pid -> cmdline."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "ggml-rpc-server" in cmd and "/engines/llama.cpp/" in cmd:
            found[int(entry.name)] = cmd
    return found


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_two_shard_replica_serves_from_one_fabric_and_comes_back_after_losing_a_shard(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    # The dev fleet of several fabrics, with this test's llama.cpp installed on every node.
    nodes_file = effective_nodes(FABRICS, llama_cpp_engines, tmp_path / "nodes.yaml")
    standin = start_standin(nodes=nodes_file, clock_speed=5.0)
    text = llama_cpp_models("tiny-split", make_gguf(), nodes=2)
    (model,) = parse_models(text).models.values()

    nomad_nodes = [
        httpx.get(f"{standin.url}/v1/node/{n['ID']}", timeout=10).json()
        for n in httpx.get(f"{standin.url}/v1/nodes", timeout=10).json()
    ]
    # Only ib-a has two free nodes.
    fabric = choose_fabric(fabric_rooms(nomad_nodes, [], model.name), model.profile.nodes)
    assert fabric == "ib-a"

    job = render_replica_job(model, 0, fabric=fabric)
    reply = httpx.post(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10)
    assert reply.status_code == 200, reply.text
    put_kv(consul_url, "llmgw/config/models", text)
    router = start_router(consul_url)
    router.wait_ready("tiny-split", 1, timeout=180)
    assert ask(router.url) == "assistant"

    # Leader and shard on distinct nodes, both in the chosen fabric.
    by_id = {n["ID"]: n for n in nomad_nodes}
    running = [a for a in allocs_of(standin.url, model.job_id) if a["ClientStatus"] == "running"]
    assert sorted(a["TaskGroup"] for a in running) == ["engine", SHARD_GROUP]
    assert len({a["NodeID"] for a in running}) == 2
    assert {by_id[a["NodeID"]]["Meta"]["llmgw_fabric"] for a in running} == {"ib-a"}

    # The shard dies. The leader's llama-server finds out on its next request and aborts
    # ("Remote RPC server crashed"); Nomad restarts the shard and the leader, and the replica
    # serves again, whole. Until then clients get errors, never answers from half a model.
    (pid,) = rpc_server_pids()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 240
    failures = 0
    while True:
        try:
            assert ask(router.url) == "assistant"
            break
        except openai.APIError:
            failures += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    leader = next(
        a
        for a in allocs_of(standin.url, model.job_id)
        if a["TaskGroup"] == "engine" and a["ClientStatus"] == "running"
    )
    assert failures >= 1 and leader["TaskStates"]["engine"]["Restarts"] >= 1
    assert pid not in rpc_server_pids()


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_broken_split_model_parks_after_five_replica_starts_with_llama_cpps_error(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    nodes_file = effective_nodes(FABRICS, llama_cpp_engines, tmp_path / "nodes.yaml")
    text = llama_cpp_models("kev-split", make_gguf("kev"), nodes=2)
    _standin, consul, nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w1", clock_speed=20.0, nodes=str(nodes_file)
    )
    await watcher.start()
    try:

        async def parked() -> Any:
            state = await read_state(consul, "kev-split")
            return state if state is not None and state.parked else None

        state = await until(parked, 300, "kev-split parked", every=0.5)
        assert state.consecutive_failures == 5
        assert "unknown model architecture: 'kev'" in state.last_error
        # Parked as a whole: the shard freed its node too.
        job = nomad.get_job("llmgw-kev-split")
        assert job is not None
        assert {g["Name"]: g["Count"] for g in job["TaskGroups"]} == {"engine": 0, SHARD_GROUP: 0}
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()
