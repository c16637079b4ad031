"""Hand-built jobs, allocations and nodes for driving the stand-in's ClientRunner directly,
shaped as the scheduler leaves them in the store (Nomad's JSON field names)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.state import StateStore
from devstack.processes import alive

Json = dict[str, Any]

SECOND = 1_000_000_000

NODE_ID = "6b3f5a52-0000-4000-8000-000000000001"


def make_node(**overrides: Any) -> Json:
    node = {
        "ID": NODE_ID,
        "Name": "gpu-node-0",
        "Datacenter": "dc1",
        "NodeClass": "h100",
        "NodePool": "default",
        "Attributes": {"kernel.name": "linux", "driver.raw_exec": "1", "unique.hostname": "gpu-node-0"},
        "Meta": {"rack": "r42", "llmgw_gpu_class": "h100"},
        "Status": "ready",
    }
    node.update(overrides)
    return node


def restart_policy(
    attempts: int = 2, interval_s: float = 1800, delay_s: float = 1, mode: str = "fail"
) -> Json:
    return {
        "Attempts": attempts,
        "Interval": int(interval_s * SECOND),
        "Delay": int(delay_s * SECOND),
        "Mode": mode,
    }


def mock_task(name: str = "engine", **config: Any) -> Json:
    return {"Name": name, "Driver": "mock_driver", "Config": config, "KillTimeout": 5 * SECOND}


def raw_exec_task(name: str, command: str, args: list[str], **extra: Any) -> Json:
    task: Json = {
        "Name": name,
        "Driver": "raw_exec",
        "Config": {"command": command, "args": args},
        "KillTimeout": 5 * SECOND,
        "Resources": {"CPU": 500, "MemoryMB": 256},
    }
    task.update(extra)
    return task


def make_job(
    tasks: list[Json],
    *,
    job_id: str = "llmgw-tiny",
    job_type: str = "service",
    restart: Json | None = None,
    group_services: list[Json] | None = None,
    group_meta: dict[str, str] | None = None,
    job_meta: dict[str, str] | None = None,
) -> Json:
    return {
        "ID": job_id,
        "Name": job_id,
        "Namespace": "default",
        "Region": "global",
        "Type": job_type,
        "Datacenters": ["dc1"],
        "Meta": job_meta,
        "TaskGroups": [
            {
                "Name": "engine",
                "Count": 1,
                "Tasks": tasks,
                "RestartPolicy": restart or restart_policy(),
                "Services": group_services,
                "Meta": group_meta,
            }
        ],
    }


def make_alloc(
    job: Json,
    *,
    index: int = 0,
    ports: dict[str, int] | None = None,
    devices: dict[str, list[str]] | None = None,
) -> Json:
    """An allocation as placed: `ports` maps label -> host port; `devices` task -> GPU IDs."""
    task_resources: Json = {}
    for task in job["TaskGroups"][0]["Tasks"]:
        ids = (devices or {}).get(task["Name"])
        task_resources[task["Name"]] = {
            "Cpu": {"CpuShares": 500},
            "Memory": {"MemoryMB": 256, "MemoryMaxMB": 0},
            "Networks": None,
            "Devices": (
                [{"Vendor": "nvidia", "Type": "gpu", "Name": "NVIDIA H100 80GB HBM3", "DeviceIDs": ids}]
                if ids
                else None
            ),
        }
    alloc_id = str(uuid.uuid4())
    return {
        "ID": alloc_id,
        "Namespace": "default",
        "EvalID": str(uuid.uuid4()),
        "Name": f"{job['ID']}.engine[{index}]",
        "NodeID": NODE_ID,
        "NodeName": "gpu-node-0",
        "JobID": job["ID"],
        "Job": job,
        "TaskGroup": "engine",
        "DesiredStatus": "run",
        "DesiredDescription": "",
        "ClientStatus": "pending",
        "ClientDescription": "",
        "TaskStates": None,
        "DeploymentStatus": None,
        "AllocatedResources": {
            "Tasks": task_resources,
            "Shared": {
                "Ports": [
                    {"Label": label, "Value": value, "To": 0, "HostIP": "127.0.0.1"}
                    for label, value in (ports or {}).items()
                ],
                "Networks": None,
            },
        },
    }


def new_store(node: Json | None = None) -> StateStore:
    store = StateStore()
    store.upsert_node(node or make_node())
    return store


def add_alloc(store: StateStore, alloc: Json) -> str:
    store.upsert_alloc(alloc)
    return str(alloc["ID"])


@asynccontextmanager
async def running_client(
    store: StateStore,
    data_dir: Path,
    *,
    clock_speed: float,
    consul_url: str | None = None,
    on_update: Callable[[Json], None] | None = None,
) -> AsyncIterator[ClientRunner]:
    """A ClientRunner on `store` whose clock runs `clock_speed` times real time; shut down (its
    tasks killed) on the way out."""
    client = ClientRunner(store, Clock(speed=clock_speed), data_dir, consul_url, on_update)
    try:
        yield client
    finally:
        await client.shutdown()


def start_alloc(store: StateStore, client: ClientRunner, job: Json, **alloc_kw: Any) -> str:
    """Place one allocation of `job` (make_alloc's keywords) and have the client start it."""
    alloc_id = add_alloc(store, make_alloc(job, **alloc_kw))
    client.start_alloc(alloc_id)
    return alloc_id


async def wait_alloc(
    store: StateStore, alloc_id: str, predicate: Callable[[Json], bool], timeout: float = 30.0
) -> Json:
    """Wait until the stored alloc satisfies `predicate`, woken by the store's own index."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        alloc = store.allocs[alloc_id]
        if predicate(alloc):
            return alloc
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise AssertionError(
                f"alloc {alloc_id} did not reach the expected state in {timeout}s: "
                f"ClientStatus={alloc.get('ClientStatus')!r} TaskStates={summarize(alloc)}"
            )
        await store.wait(["allocs"], store.table_index["allocs"], min(remaining, 1.0))


def task_state(alloc: Json, task: str = "engine") -> Json:
    return (alloc.get("TaskStates") or {}).get(task) or {}


def dead(alloc: Json) -> bool:
    return task_state(alloc).get("State") == "dead"


def event_types(alloc: Json, task: str = "engine") -> list[str]:
    return [e["Type"] for e in task_state(alloc, task).get("Events") or []]


def events_of(alloc: Json, type_: str, task: str = "engine") -> list[Json]:
    return [e for e in task_state(alloc, task).get("Events") or [] if e["Type"] == type_]


def summarize(alloc: Json) -> dict[str, list[str]]:
    return {
        name: [f"{e['Type']}: {e['DisplayMessage']}" for e in state.get("Events") or []]
        for name, state in (alloc.get("TaskStates") or {}).items()
    }


async def all_gone(pids: list[int], timeout: float = 5.0) -> bool:
    """True once none of `pids` runs; signals are delivered asynchronously, so allow a moment."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(alive(p) for p in pids):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
