"""The admin API's fleet views (`/v1/admin/summary`, `/nodes`, `/replicas`, `/models`) and the
`llmgw ctl` verbs that read them, against the Nomad stand-in's small fleet and a real Consul:
an unhealthy GPU, a drained node, replicas that are ready and that nobody asks for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.spec import Model, parse_models
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.summary import IDLE_AFTER_S
from nomad_driver.watcher.admin import create_app
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.test_watcher_nomad import mock_job, models_text, until

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

GPU_PROFILE = """
  onegpu:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 1
    gpu_memory_mib: 20000
    cpu_mhz: 500
    memory_mib: 512
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ready_mock_job(model: Model, port: int) -> dict[str, Any]:
    """A mock replica that runs for an hour and passes its check: the check is a TCP connect to
    a port this test listens on, since the mock driver itself listens nowhere."""
    job = mock_job(model, 1, run_for="1h")
    service = job["TaskGroups"][0]["Services"][0]
    service["Checks"] = [
        {"Name": "engine ready", "Type": "tcp", "PortLabel": str(port), "Interval": 1_000_000_000,
         "Timeout": 1_000_000_000}
    ]  # fmt: skip
    return job


class Stack:
    def __init__(self, watcher: Watcher, nomad: Nomad, addr: str, offset: list[float]) -> None:
        self.watcher, self.nomad, self.addr, self.offset = watcher, nomad, addr, offset

    async def get(self, path: str) -> Any:
        # Async: the admin server runs on this test's own event loop.
        async with httpx.AsyncClient(timeout=10) as http:
            resp = await http.get(f"{self.addr}{path}")
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def ctl(self, *args: str, addr: str | None = None) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nomad_driver.cli",
            "ctl",
            "--addr",
            addr or self.addr,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "COLUMNS": "240"},  # wide enough that no cell is cut
        )
        out, err = await proc.communicate()
        return proc.returncode or 0, out.decode(), err.decode()


@pytest.fixture
async def stack(consul_url: str, start_standin: Callable[..., Any]) -> AsyncIterator[Stack]:
    import uvicorn

    text = models_text(
        idle=("file:///tmp/idle.gguf", "cpu", 1),
        gpu=("file:///tmp/gpu.gguf", "onegpu", 1),
        big=("file:///tmp/big.gguf", "huge", 1),
    ).replace("models:\n", GPU_PROFILE + "models:\n", 1)
    models = parse_models(text).models
    standin = start_standin(clock_speed=1.0)
    nomad = Nomad(standin.url)

    # Drain the L4 node before anything runs, so nothing is placed there.
    nodes = {n["Name"]: n["ID"] for n in httpx.get(f"{standin.url}/v1/nodes", timeout=10).json()}
    drained = httpx.post(
        f"{standin.url}/v1/node/{nodes['gpu-l4-0']}/drain",
        json={"NodeID": nodes["gpu-l4-0"], "DrainSpec": {"Deadline": 3_600_000_000_000}},
        timeout=10,
    )
    assert drained.status_code == 200, drained.text

    listener = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    for name in ("idle", "gpu"):
        nomad.register_job(ready_mock_job(models[name], port))

    consul = Consul(consul_url)
    await consul.kv_put(CONFIG_MODELS_KEY, text)
    # The summary names a replica idle after ten minutes; the test moves the watcher's clock.
    offset = [0.0]
    watcher = Watcher(
        Consul(consul_url),
        nomad,
        WatcherConfig(wait_s=10, lock_delay_s=0.5, tick_s=0.5),
        clock=lambda: time.time() + offset[0],
        ident="admin",
    )
    await watcher.start()
    admin_port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(watcher), host="127.0.0.1", port=admin_port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started, 20, "admin API listening", every=0.05)
    try:
        yield Stack(watcher, nomad, f"http://127.0.0.1:{admin_port}", offset)
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await serving
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()
        listener.close()
        await listener.wait_closed()


def by(items: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    return {str(i[key]): i for i in items}


async def test_summary_nodes_and_replicas_of_a_fleet_with_a_broken_gpu_a_drain_and_idle_replicas(
    stack: Stack,
) -> None:
    async def settled() -> dict[str, Any] | None:
        s = await stack.get("/v1/admin/summary")
        done = s["replicas"]["ready"] == 2 and s["unplaceable"] and s["nodes"]["total"] == 3
        return s if done else None

    summary = await until(settled, 60, "two ready replicas and big unplaceable", every=0.3)
    # Nothing ran on the L4 node, so its drain finished at once: it is left ineligible.
    assert summary["nodes"] == {"total": 3, "ready": 2, "ineligible": 1, "draining": 0, "down": 0}
    gpus = by(summary["gpus"], "class")
    assert set(gpus) == {"rtx4090", "l4", "h100"}
    # The drained node's card is not room; the broken H100 is neither used nor free.
    assert gpus["l4"] == {"class": "l4", "total": 1, "used": 0, "free": 0, "unhealthy": 0, "unavailable": 1}
    assert gpus["h100"]["total"] == 8 and gpus["h100"]["unhealthy"] == 1
    assert sum(g["used"] for g in gpus.values()) == 1  # the gpu model's replica holds one card
    assert sum(g["free"] for g in gpus.values()) == 1 + 7 - 1  # 4090 + healthy H100s - the used one
    assert summary["replicas"] == {"total": 2, "ready": 2, "starting": 0}
    assert summary["models"]["total"] == 3 and summary["models"]["satisfied"] == 2
    assert [u["model"] for u in summary["unplaceable"]] == ["big"]
    assert summary["parked"] == [] and summary["idle_replicas"] == []
    fabrics = by(summary["fabrics"], "fabric")
    assert fabrics["ethernet"]["nodes"] == 2 and fabrics["infiniband"]["nodes"] == 1

    # Ten minutes and more without a request: both replicas are named idle, with their cards.
    stack.offset[0] = IDLE_AFTER_S + 60
    idle = (await stack.get("/v1/admin/summary"))["idle_replicas"]
    assert sorted((r["model"], r["gpus"]) for r in idle) == [("gpu", 1), ("idle", 0)]
    assert all(r["idle_seconds"] >= IDLE_AFTER_S for r in idle)

    nodes = by((await stack.get("/v1/admin/nodes"))["nodes"], "name")
    l4, h100 = nodes["gpu-l4-0"], nodes["gpu-h100-0"]
    assert l4["draining"] is False and l4["eligibility"] == "ineligible" and l4["state"] == "ineligible"
    assert nodes["gpu-4090-0"]["draining"] is False and nodes["gpu-4090-0"]["status"] == "ready"
    assert h100["gpus"][0]["unhealthy"] == 1 and h100["gpus"][0]["total"] == 8
    assert h100["fabric"] == "infiniband" and h100["class"] == "h100" and h100["datacenter"] == "dc1"
    assert h100["engines"] == {"llama-cpp-python": ["0.3.36"], "llama.cpp": ["b6500"]}
    assert h100["id"] and h100["pool"] == "default" and h100["models_cached"] == []

    replicas = by((await stack.get("/v1/admin/replicas"))["replicas"], "model")
    assert set(replicas) == {"idle", "gpu"}
    for r in replicas.values():
        assert r["state"] == "ready" and r["node"] in nodes and r["node"] != "gpu-l4-0"
        assert r["address"].startswith("127.0.0.1:") and len(r["alloc_id"]) == 36
        assert r["since"] > 0 and r["last_request_at"] is None

    models = by((await stack.get("/v1/admin/models"))["models"], "model")
    assert (models["gpu"]["replicas_min"], models["gpu"]["replicas_max"]) == (1, 2)

    # The same through `llmgw ctl`, as scripts read it.
    code, out, err = await stack.ctl("nodes", "--json")
    assert code == 0, err
    assert {n["name"] for n in json.loads(out)["nodes"]} == set(nodes)
    code, out, err = await stack.ctl("replicas", "--json")
    assert code == 0, err
    assert {r["model"] for r in json.loads(out)["replicas"]} == {"idle", "gpu"}
    code, out, err = await stack.ctl("replicas")
    assert code == 0 and "ready" in out and "gpu" in out, err
    code, out, err = await stack.ctl("nodes")
    assert code == 0 and "gpu-h100-0" in out and "ineligible" in out, err


async def test_ctl_retry_shares_the_groups_address_and_its_unreachable_message(stack: Stack) -> None:
    await until(lambda: stack.watcher.leadership.is_leader and stack.watcher.passes, 20, "leading")
    code, out, err = await stack.ctl("retry", "idle")
    assert code == 0 and "idle: retried" in out, err
    code, _, err = await stack.ctl("retry", "nope")
    assert code == 4 and "unknown model 'nope'" in err
    code, _, err = await stack.ctl("retry", "idle", addr="http://127.0.0.1:1")
    assert code == 3 and "cannot reach the llmgw admin API at http://127.0.0.1:1" in err
