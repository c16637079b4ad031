"""A GPU replica runs on exactly the GPUs Nomad allocated it, or fails its start saying why.

Nomad interpolates a task's `env` before it adds the device plugin's variables, so a task env of
`CUDA_VISIBLE_DEVICES = "${NVIDIA_VISIBLE_DEVICES}"` reaches the engine as that literal text, and
a CUDA build of llama.cpp then serves from the CPU, healthy. These tests look where the engine
looks: at the environment of the engine process itself, on stand-in nodes whose engines see
GPUs as CUDA does (devstack/fake_cuda.py)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.fake_cuda import visible
from devstack.fleet import effective_nodes
from nomad_driver.engines import gpu_check, llama_cpp
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.watcher.admin import model_status
from tests.fixtures.llama_cpp import llama_cpp_models
from tests.watcher_support import read_state, until, watcher_on_standin

FABRICS = Path(__file__).resolve().parents[1] / "devstack" / "nodes" / "fabrics.yaml"


def gpu_node(name: str, engines: Path, count: int, lost: int = 0) -> dict[str, Any]:
    gpus: dict[str, Any] = {"model": "NVIDIA L4", "memory_mib": 24564, "count": count}
    if lost:
        gpus["lost"] = lost
    return {
        "name": name,
        "datacenter": "dc1",
        "cpu_mhz": 32000,
        "cpu_cores": 16,
        "memory_mib": 65536,
        "disk_mb": 1000000,
        "attributes": {"driver.raw_exec": "1"},
        "meta": {"llmgw_engines_dir": str(engines), "llmgw_engine_llama_cpp": "b6500"},
        "gpus": [gpus],
    }


def gpu_models(name: str, gguf: Path, gpus: int) -> str:
    return (
        "profiles:\n  gpu:\n    engine: llama.cpp\n    engine_version: b6500\n"
        f"    gpus: {gpus}\n    cpu_mhz: 500\n    memory_mib: 512\n    context: 256\n"
        f"models:\n  {name}:\n    source: file://{gguf}\n    profile: gpu\n"
        "    replicas: {min: 1, max: 1}\n"
    )


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def engine_process(alloc_id: str, program: str) -> tuple[int, dict[str, str]] | None:
    """The process of allocation `alloc_id` that runs `program` (after every exec), with the
    environment it was started with."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            env = process_env(int(entry.name))
        except OSError:
            continue
        if env.get("NOMAD_ALLOC_ID") == alloc_id and Path(argv0).name == program:
            return int(entry.name), env
    return None


def allocated_gpus(alloc: dict[str, Any]) -> str:
    devices = alloc["AllocatedResources"]["Tasks"]["engine"]["Devices"]
    return ",".join(i for d in devices for i in d["DeviceIDs"])


def running_allocs(url: str, job_id: str) -> list[dict[str, Any]]:
    stubs = httpx.get(f"{url}/v1/job/{job_id}/allocations", timeout=10).json()
    return [
        httpx.get(f"{url}/v1/allocation/{a['ID']}", timeout=10).json()
        for a in stubs
        if a["ClientStatus"] == "running"
    ]


async def engine_env(url: str, alloc: dict[str, Any], program: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = engine_process(alloc["ID"], program)
        if found:
            return found[1]
        await asyncio.sleep(0.2)
    raise AssertionError(f"no {program} process of allocation {alloc['ID']} within {timeout}s")


def test_cuda_visibility_follows_cudas_rules() -> None:
    gpus: list[dict[str, object]] = [{"uuid": "GPU-aaa1"}, {"uuid": "GPU-bbb2"}, {"uuid": "GPU-ccc3"}]
    assert visible(gpus, None) == gpus
    assert visible(gpus, "") == []
    assert visible(gpus, "GPU-ccc3,GPU-aaa1") == [gpus[2], gpus[0]]
    assert visible(gpus, "1") == [gpus[1]]
    # Enumeration stops at the first entry that names no GPU: a literal never matches.
    assert visible(gpus, "${NVIDIA_VISIBLE_DEVICES}") == []
    assert visible(gpus, "GPU-bbb2,GPU-zzz,GPU-aaa1") == [gpus[1]]


@pytest.mark.timeout(120)
async def test_a_gpu_models_engine_process_sees_exactly_its_allocations_gpus(
    tmp_path: Path,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    # A node with three GPUs and a model that asks for two: the engine must see the two Nomad
    # gave it, in its own environment, not the node's three nor the literal variable.
    standin = start_standin(nodes=[gpu_node("gpu-3x-l4", llama_cpp_engines, 3)])
    (model,) = parse_models(gpu_models("two-gpus", make_gguf(), 2)).models.values()
    reply = httpx.put(f"{standin.url}/v1/jobs", json={"Job": render_job(model)}, timeout=10)
    assert reply.status_code == 200, reply.text
    allocs = await until(lambda: running_allocs(standin.url, model.job_id), 30, "the replica running")
    (alloc,) = allocs
    env = await engine_env(standin.url, alloc, "llama-server", 60)
    given = allocated_gpus(alloc)
    assert len(given.split(",")) == 2
    assert env["CUDA_VISIBLE_DEVICES"] == given
    # It serves, and its output says it found exactly those two devices.
    stderr = Path(standin.data_dir, "alloc", alloc["ID"], "alloc", "logs", "engine.stderr.0")
    await until(lambda: "found 2 CUDA devices" in stderr.read_text(errors="replace"), 30, "CUDA's log")
    assert "GPU check passed: the engine sees 2 GPU(s)" in stderr.read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_leader_and_the_shard_of_a_two_node_replica_each_see_their_allocations_gpu(
    tmp_path: Path,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    nodes_file = effective_nodes(FABRICS, llama_cpp_engines, tmp_path / "nodes.yaml")
    standin = start_standin(nodes=nodes_file)
    (model,) = parse_models(llama_cpp_models("gpu-split", make_gguf(), nodes=2)).models.values()
    job = render_job(model)
    job["Constraints"].append({"LTarget": "${meta.llmgw_fabric}", "RTarget": "ib-a", "Operand": "="})
    reply = httpx.put(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10)
    assert reply.status_code == 200, reply.text

    async def both_running() -> list[dict[str, Any]] | None:
        allocs = running_allocs(standin.url, model.job_id)
        return allocs if len(allocs) == 2 else None

    allocs = await until(both_running, 60, "leader and shard running")
    by_group = {a["TaskGroup"]: a for a in allocs}
    shard_env = await engine_env(standin.url, by_group["shard"], "ggml-rpc-server", 60)
    assert shard_env["CUDA_VISIBLE_DEVICES"] == allocated_gpus(by_group["shard"])
    # The leader runs llama-server once its template lists the shard.
    leader_env = await engine_env(standin.url, by_group["engine"], "llama-server", 120)
    assert leader_env["CUDA_VISIBLE_DEVICES"] == allocated_gpus(by_group["engine"])
    assert leader_env["CUDA_VISIBLE_DEVICES"] != shard_env["CUDA_VISIBLE_DEVICES"]


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_node_that_hands_out_a_gpu_the_engine_cannot_see_fails_each_start_and_parks_naming_it(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    # Nomad's plugin still offers the GPU; the driver no longer has it. Without the check the
    # engine would log CUDA's complaint and serve from the CPU, healthy.
    nodes = [gpu_node("gpu-lost", llama_cpp_engines, 1, lost=1)]
    text = gpu_models("blind", make_gguf(), 1)
    standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w1", clock_speed=20.0, nodes=nodes
    )
    await watcher.start()
    try:

        async def parked() -> Any:
            state = await read_state(consul, "blind")
            return state if state is not None and state.parked else None

        state = await until(parked, 240, "blind parked", every=0.5)
        assert state.consecutive_failures == 5
        node = httpx.get(f"{standin.url}/v1/nodes", timeout=10).json()[0]
        uuid = httpx.get(f"{standin.url}/v1/node/{node['ID']}", timeout=10).json()["NodeResources"][
            "Devices"
        ][0]["Instances"][0]["ID"]
        expected = f'asked for 1 GPU(s), the engine sees 0; Nomad gave "{uuid}" as CUDA_VISIBLE_DEVICES'
        assert state.last_error == f"{gpu_check.FAILED_PREFIX}: {expected}"
        # Where operators look: the admin API's model (and so `ctl status`) carries the cause.
        await until(lambda: model_status(watcher, "blind")["parked"], 30, "status parked")
        assert expected in model_status(watcher, "blind")["last_error"]
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


def test_the_check_refuses_a_literal_device_list_as_nomad_would_have_passed_it(
    tmp_path: Path, llama_cpp_engines: Path
) -> None:
    # The rendered task's own command line, run with what a task env of the old form gave the
    # engine: the device variable's name, not its value.
    server = str(llama_cpp_engines / "llama.cpp" / "b6500" / "llama-server")
    config = gpu_check.checked_command(1, llama_cpp.gpu_probe(server), server, ["--version"])
    env = {
        "PATH": "/usr/bin:/bin",
        "NVIDIA_VISIBLE_DEVICES": "${NVIDIA_VISIBLE_DEVICES}",
        "LLMGW_DEVSTACK_NODE_GPUS": '[{"uuid": "GPU-1234", "name": "NVIDIA L4", "memory_mib": 24564}]',
    }
    done = subprocess.run(
        [str(config["command"]), *map(str, config["args"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        f"{gpu_check.FAILED_PREFIX}: asked for 1 GPU(s), the engine sees 0; "
        'Nomad gave "${NVIDIA_VISIBLE_DEVICES}" as CUDA_VISIBLE_DEVICES'
    )
    # Unset: said as such.
    del env["NVIDIA_VISIBLE_DEVICES"]
    done = subprocess.run(
        [str(config["command"]), *map(str, config["args"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "Nomad gave nothing (NVIDIA_VISIBLE_DEVICES is not set)" in done.stderr
    # The right one: the engine runs, here its version.
    env["NVIDIA_VISIBLE_DEVICES"] = "GPU-1234"
    done = subprocess.run(
        [str(config["command"]), *map(str, config["args"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert "GPU check passed: the engine sees 1 GPU(s)" in done.stderr
