"""A two-shard replica of a tiny model, run for real by a watcher: it registers the job pinned to
the one fabric with room, the Nomad stand-in places the leader and the shard on distinct nodes
of it, the shard runs `ggml-rpc-server`, the leader finds it through Consul and runs
`llama-server --rpc`, and the router answers through it. Killing the shard takes the replica
down and it comes back whole and serves again; a broken model, or a shard that cannot start,
parks after five replica starts."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from devstack.fleet import effective_nodes
from nomad_driver.placement import job_fabric
from nomad_driver.render import SHARD_GROUP
from nomad_driver.spec import parse_models
from nomad_driver.watcher.admin import WatcherCollector, model_status
from tests.fixtures.llama_cpp import llama_cpp_models
from tests.router.conftest import StartRouter
from tests.watcher_support import read_state, until, watcher_on_standin

FABRICS = Path(__file__).resolve().parents[2] / "devstack" / "nodes" / "fabrics.yaml"


def allocs_of(standin_url: str, job_id: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{standin_url}/v1/job/{job_id}/allocations", timeout=10)
    return list(reply.json())


def leader_restarts(standin_url: str, job_id: str) -> int:
    (leader,) = [
        a
        for a in allocs_of(standin_url, job_id)
        if a["TaskGroup"] == "engine" and a["ClientStatus"] == "running"
    ]
    return int(leader["TaskStates"]["engine"]["Restarts"])


def ask(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    answer = client.chat.completions.create(
        model="tiny-split", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    return answer.choices[0].message.role


async def sample_failures(consul: Any, model: str, seen: list[int]) -> None:
    """Appends the model's stored consecutive failures every 0.1 s, so a test can say that the
    count never moved, not only where it ended."""
    while True:
        state = await read_state(consul, model)
        seen.append(state.consecutive_failures if state else 0)
        await asyncio.sleep(0.1)


def rpc_server_pids(job_id: str = "llmgw-tiny-split") -> dict[int, str]:
    """Running ggml-rpc-server processes of the job's allocations: pid -> cmdline."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "ggml-rpc-server" in cmd.split(" ", 1)[0] and f"NOMAD_JOB_ID={job_id}".encode() in environ:
            found[int(entry.name)] = cmd
    return found


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_the_watcher_pins_a_two_shard_replica_to_one_fabric_and_restarts_it_whole_after_losing_a_shard(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    # The dev fleet of several fabrics, with this test's llama.cpp installed on every node.
    nodes_file = effective_nodes(FABRICS, llama_cpp_engines, tmp_path / "nodes.yaml")
    text = llama_cpp_models("tiny-split", make_gguf(), nodes=2)
    standin, consul, nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w1", clock_speed=5.0, nodes=str(nodes_file)
    )
    (model,) = parse_models(text).models.values()
    seen: list[int] = []
    await watcher.start()
    sampler = asyncio.create_task(sample_failures(consul, "tiny-split", seen))
    try:
        router = start_router(consul_url)
        await asyncio.to_thread(router.wait_ready, "tiny-split", 1, 180)
        assert await asyncio.to_thread(ask, router.url) == "assistant"
        # The leader waits for its shard, then its template restarts it into llama-server:
        # asked for, so the bring-up counted no failed start at any moment.
        sampler.cancel()
        assert seen and max(seen) == 0, seen

        # The watcher registered it pinned to the one fabric with two free nodes.
        job = nomad.get_job(model.job_id)
        assert job is not None and job_fabric(job) == "ib-a"
        nomad_nodes = [
            httpx.get(f"{standin.url}/v1/node/{n['ID']}", timeout=10).json()
            for n in httpx.get(f"{standin.url}/v1/nodes", timeout=10).json()
        ]
        by_id = {n["ID"]: n for n in nomad_nodes}
        running = [a for a in allocs_of(standin.url, model.job_id) if a["ClientStatus"] == "running"]
        assert sorted(a["TaskGroup"] for a in running) == ["engine", SHARD_GROUP]
        assert len({a["NodeID"] for a in running}) == 2
        assert {by_id[a["NodeID"]]["Meta"]["llmgw_fabric"] for a in running} == {"ib-a"}

        # It stays up while it serves: nothing about its shard changes, so nothing restarts the
        # leader (a check that connects to the shard fails while the leader holds it: a
        # ggml-rpc-server serves one client, and its short accept queue fills with the checks).
        restarts = leader_restarts(standin.url, model.job_id)
        await asyncio.sleep(30)
        assert await asyncio.to_thread(ask, router.url) == "assistant"
        assert leader_restarts(standin.url, model.job_id) == restarts

        # Shown as one replica with its shard and fabric, wherever operators look.
        await until(
            lambda: model_status(watcher, "tiny-split")["shards_running"] == 1, 30, "the shard listed"
        )
        status = model_status(watcher, "tiny-split")
        assert (status["nodes"], status["fabric"]) == (2, "ib-a")
        assert sorted(status["replica_nodes"]) == ["ib-a-0", "ib-a-1"]
        (row,) = [r for r in watcher.replicas if r["model"] == "tiny-split"]
        assert row["state"] == "ready" and row["fabric"] == "ib-a"
        assert [s["state"] for s in row["shards"]] == ["running"]
        registry = CollectorRegistry()
        registry.register(WatcherCollector(watcher))
        metrics = generate_latest(registry).decode()
        assert 'llmgw_model_replica_shards_running{fabric="ib-a",model="tiny-split"} 1.0' in metrics

        # The shard dies. The leader's llama-server finds out on its next request and aborts
        # ("Remote RPC server crashed"), or its template restarts it when the shard's check
        # fails; Nomad restarts the shard, and the replica serves again, whole. Until then
        # clients get errors, never answers from half a model.
        (pid,) = rpc_server_pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 240
        failures = 0
        while True:
            try:
                assert await asyncio.to_thread(ask, router.url) == "assistant"
                break
            except openai.APIError:
                failures += 1
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)
        leader = next(
            a
            for a in allocs_of(standin.url, model.job_id)
            if a["TaskGroup"] == "engine" and a["ClientStatus"] == "running"
        )
        assert failures >= 1 and leader["TaskStates"]["engine"]["Restarts"] >= 1
        assert pid not in rpc_server_pids()
        # Counted right: the replica had been healthy, so losing a shard was no failed start.
        state = await until(lambda: read_state(consul, "tiny-split"), 30, "the state")
        assert state.consecutive_failures == 0 and not state.parked
        assert nomad.get_job(model.job_id)["TaskGroups"][1]["Count"] == 1
    finally:
        sampler.cancel()
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_shard_slow_to_listen_is_waited_for_and_the_bring_up_counts_no_failed_start(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    # Nomad registers the shard's service when its task starts, before ggml-rpc-server listens
    # (on a GPU node, CUDA's start alone takes seconds). A leader that connected then aborted
    # ("Failed to connect"), a failed start of a replica that was only coming up.
    shard = next(llama_cpp_engines.glob("llama.cpp/*/ggml-rpc-server"))
    real = shard.with_name("ggml-rpc-server.real")
    shard.rename(real)
    shard.write_text(f'#!/bin/sh\nsleep 4\nexec {real} "$@"\n')
    shard.chmod(0o755)
    nodes_file = effective_nodes(FABRICS, llama_cpp_engines, tmp_path / "nodes.yaml")
    text = llama_cpp_models("tiny-split", make_gguf(), nodes=2)
    standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w1", clock_speed=5.0, nodes=str(nodes_file)
    )
    (model,) = parse_models(text).models.values()
    seen: list[int] = []
    await watcher.start()
    sampler = asyncio.create_task(sample_failures(consul, "tiny-split", seen))
    try:
        await until(
            lambda: (d := watcher.decisions.get("tiny-split")) is not None and d.ready == 1,
            180,
            "the replica ready",
        )
        sampler.cancel()
        assert seen and max(seen) == 0, seen
        (leader,) = [a for a in allocs_of(standin.url, model.job_id) if a["TaskGroup"] == "engine"]
        stderr = httpx.get(
            f"{standin.url}/v1/client/fs/logs/{leader['ID']}",
            params={"task": "engine", "type": "stderr", "plain": "true", "origin": "start"},
            timeout=10,
        ).text
        assert "Failed to connect" not in stderr, stderr[-2000:]
        assert not [
            e for e in leader["TaskStates"]["engine"]["Events"] if e["Type"] == "Terminated" and e["ExitCode"]
        ], leader["TaskStates"]["engine"]["Events"]
    finally:
        sampler.cancel()
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


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


BROKEN_RPC_SERVER = """#!/bin/sh
echo "ggml_backend_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected" >&2
exit 1
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_shard_that_cannot_start_parks_the_model_after_five_replica_starts_naming_the_shard(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    # The nodes' ggml-rpc-server dies at once, as on a node whose driver is broken: the leader
    # waits for a shard that never comes, and only the watcher can end that wait.
    rpc = llama_cpp_engines / "llama.cpp" / "b6500" / "ggml-rpc-server"
    rpc.unlink()
    rpc.write_text(BROKEN_RPC_SERVER)
    rpc.chmod(0o755)
    nodes_file = effective_nodes(FABRICS, llama_cpp_engines, tmp_path / "nodes.yaml")
    text = llama_cpp_models("shardless", make_gguf(), nodes=2)
    _standin, consul, nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w1", clock_speed=20.0, nodes=str(nodes_file)
    )
    await watcher.start()
    try:

        async def parked() -> Any:
            state = await read_state(consul, "shardless")
            return state if state is not None and state.parked else None

        state = await until(parked, 300, "shardless parked", every=0.5)
        # Five replica starts, each restarted whole by the watcher, not the shard's many exits.
        assert state.consecutive_failures == 5
        # The cause is the shard's: which allocation, on which node, in its own words.
        assert state.last_error.startswith("shard "), (
            state.last_error,
            task_events(nomad, "llmgw-shardless"),
        )
        assert " on node ib-a-" in state.last_error
        assert "no CUDA-capable device is detected" in state.last_error
        job = nomad.get_job("llmgw-shardless")
        assert job is not None
        assert {g["Name"]: g["Count"] for g in job["TaskGroups"]} == {"engine": 0, SHARD_GROUP: 0}
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


def task_events(nomad: Any, job_id: str) -> list[tuple[str, str, str, list[tuple[int, str, str]]]]:
    """Each allocation's task events, for a failure message that shows the order Nomad saw."""
    out = []
    for alloc in nomad.request_json("job", job_id, "allocations"):
        for task, st in (alloc.get("TaskStates") or {}).items():
            events = [(e["Time"], e["Type"], e.get("DisplayMessage", "")) for e in st.get("Events") or []]
            out.append((alloc["ID"][:8], alloc["TaskGroup"], task, events))
    return out


def fabric_node(name: str, fabric: str, engines: Path) -> dict[str, Any]:
    return {
        "name": name,
        "datacenter": "dc1",
        "node_class": "l4",
        "cpu_mhz": 32000,
        "cpu_cores": 16,
        "memory_mib": 65536,
        "disk_mb": 1000000,
        "attributes": {"driver.raw_exec": "1", "driver.mock_driver": "1"},
        "meta": {
            "llmgw_engines_dir": str(engines),
            "llmgw_engine_llama_cpp": "b6500",
            "llmgw_gpu_class": "l4",
            "llmgw_gpu_count": "1",
            "llmgw_fabric": fabric,
        },
        "gpus": [{"model": "NVIDIA L4", "memory_mib": 24564, "count": 1}],
    }


def filler_job(node: str) -> dict[str, Any]:
    """Someone else's one-GPU job on `node`: that node is not entirely free."""
    return {
        "ID": f"filler-{node}",
        "Name": f"filler-{node}",
        "Type": "service",
        "Datacenters": ["dc1"],
        "Constraints": [{"LTarget": "${node.unique.name}", "RTarget": node, "Operand": "="}],
        "TaskGroups": [
            {
                "Name": "work",
                "Count": 1,
                "Tasks": [
                    {
                        "Name": "work",
                        "Driver": "mock_driver",
                        "Config": {"run_for": "1h"},
                        "Resources": {
                            "CPU": 100,
                            "MemoryMB": 64,
                            "Devices": [{"Name": "nvidia/gpu", "Count": 1}],
                        },
                    }
                ],
            }
        ],
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_model_needing_three_free_nodes_where_each_fabric_has_two_is_unplaceable_until_one_frees(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    nodes = [fabric_node(f"{f}-{i}", f, llama_cpp_engines) for f in ("ib-a", "ib-b") for i in range(3)]
    text = llama_cpp_models("wide", make_gguf(), nodes=3)
    standin, consul, nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w1", clock_speed=5.0, nodes=nodes
    )
    for node in ("ib-a-0", "ib-b-0"):
        nomad.register_job(filler_job(node))

    async def fillers_running() -> bool:
        allocs = await asyncio.to_thread(httpx.get, f"{standin.url}/v1/allocations", timeout=10)
        return sum(1 for a in allocs.json() if a["ClientStatus"] == "running") == 2

    await until(fillers_running, 30, "the fillers running")
    await watcher.start()
    try:
        reason = "needs 3 entirely free nodes in one fabric; largest free blocks: ib-a 2, ib-b 2"

        async def unplaceable() -> Any:
            state = await read_state(consul, "wide")
            return state if state is not None and state.unplaceable else None

        state = await until(unplaceable, 60, "wide unplaceable")
        assert state.placement_reason == reason
        # Its job is still pinned to one fabric, and asks Nomad for nothing while none has room.
        job = nomad.get_job("llmgw-wide")
        assert job is not None and job_fabric(job) in ("ib-a", "ib-b")
        assert [g["Count"] for g in job["TaskGroups"]] == [0, 0]
        await asyncio.sleep(2)  # passes go on; the reason stays the fabrics', not Nomad's
        state = await read_state(consul, "wide")
        assert state is not None and state.placement_reason == reason

        # A node of ib-b frees: the replica moves there and lands on its three nodes.
        await asyncio.to_thread(
            httpx.delete, f"{standin.url}/v1/job/filler-ib-b-0", params={"purge": "true"}, timeout=10
        )

        async def placed() -> list[str]:
            allocs = await asyncio.to_thread(allocs_of, standin.url, "llmgw-wide")
            live = sorted(a["NodeName"] for a in allocs if a["ClientStatus"] in ("pending", "running"))
            return live if len(live) == 3 else []

        assert await until(placed, 60, "three allocations placed") == ["ib-b-0", "ib-b-1", "ib-b-2"]
        job = nomad.get_job("llmgw-wide")
        assert job is not None and job_fabric(job) == "ib-b"

        async def placeable() -> Any:
            state = await read_state(consul, "wide")
            return state if state is not None and not state.unplaceable else None

        await until(placeable, 30, "wide placeable again")
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()
