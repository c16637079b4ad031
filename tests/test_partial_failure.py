"""One bad slot beside a serving replica (docs/watcher.md, "Partial failure"): the model is not
parked; it is shown degraded, naming the failing replica's node and the engine's cause, while its
good replica keeps serving. On the stand-in, with a GPU node whose GPU the engine cannot see."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from nomad_driver.engines import gpu_check
from nomad_driver.watcher.admin import model_status
from tests.test_gpu_visibility import gpu_node
from tests.watcher_support import read_state, until, watcher_on_standin


def failed_starts(url: str, job_id: str, node_name: str) -> int:
    """Engine starts on `node_name` that ended in the GPU check's exit, as Nomad shows them."""
    nodes = {n["ID"]: n["Name"] for n in httpx.get(f"{url}/v1/nodes", timeout=10).json()}
    count = 0
    for alloc in httpx.get(f"{url}/v1/job/{job_id}/allocations", timeout=10).json():
        if nodes.get(alloc["NodeID"]) != node_name:
            continue
        events = (alloc.get("TaskStates") or {}).get("engine", {}).get("Events") or []
        count += sum(1 for e in events if e["Type"] == "Terminated")
    return count


async def test_one_crash_looping_slot_beside_a_serving_replica_is_degraded_not_parked(
    consul_url: str,
    start_standin: Callable[..., Any],
    llama_cpp_engines: Path,
    make_gguf: Callable[..., Path],
) -> None:
    nodes = [gpu_node("gpu-good", llama_cpp_engines, 1), gpu_node("gpu-bad", llama_cpp_engines, 1, lost=1)]
    text = (
        "profiles:\n  gpu:\n    engine: llama.cpp\n    engine_version: b6500\n"
        "    gpus: 1\n    cpu_mhz: 500\n    memory_mib: 512\n    context: 256\n"
        f"models:\n  pair:\n    source: file://{make_gguf()}\n    profile: gpu\n"
        "    replicas: {min: 2, max: 2}\n"
    )
    standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, text, ident="w1", clock_speed=20.0, nodes=nodes
    )
    await watcher.start()
    try:

        def degraded() -> dict[str, Any] | None:
            if "pair" not in watcher.decisions:
                return None
            status = model_status(watcher, "pair")
            return status if status["state"] == "degraded" else None

        status = await until(degraded, 240, "pair degraded", every=0.5)
        assert status["ready"] == 1
        assert "on node gpu-bad" in status["degraded"]
        assert gpu_check.FAILED_PREFIX in status["degraded"], status["degraded"]
        assert status["health"] == "warning"
        # More failed starts on the bad node than the parking threshold, and still not parked:
        # the good replica serves throughout.
        await until(lambda: failed_starts(standin.url, "llmgw-pair", "gpu-bad") > 5, 240, "six failed starts")
        state = await read_state(consul, "pair")
        assert state is not None and not state.parked
        assert state.consecutive_failures == 0
        assert model_status(watcher, "pair")["ready"] == 1
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()
