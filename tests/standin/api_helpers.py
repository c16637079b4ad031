"""Shared pieces of the stand-in API tests: small fleets, mock jobs, and waiting for the
scheduler (which answers a register at once and places a moment later). The committed fleets
(`devstack/nodes/*.yaml`) offer `mock_driver` on every node, so tests use them as they are."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import nomad
import yaml

from devstack.nomad.nodes import node_from_spec
from devstack.nomad.server import NomadServer

T = TypeVar("T")
SECOND = 1_000_000_000


def tiny_fleet(tmp_path: Path, count: int = 2, cpu_mhz: int = 4000, memory_mib: int = 4096) -> Path:
    """`count` small CPU-only nodes, so a test can fill them with a few allocations."""
    nodes = [tiny_node(f"tiny-{i}", cpu_mhz, memory_mib) for i in range(count)]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"nodes": nodes}))
    return path


def tiny_node(name: str, cpu_mhz: int = 4000, memory_mib: int = 4096, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "cpu_mhz": cpu_mhz,
        "cpu_cores": 2,
        "memory_mib": memory_mib,
        "attributes": {"driver.mock_driver": "1"},
        **extra,
    }


# A group that opts out of deployments, as llmgw's model jobs do: Nomad refuses to scale a job
# while its deployment is active, which is not what the tests that scale are about.
NO_DEPLOYMENTS: dict[str, Any] = {"Update": {"MaxParallel": 0}}


def mock_job(
    job_id: str,
    count: int = 1,
    cpu: int = 100,
    memory_mb: int = 64,
    config: dict[str, Any] | None = None,
    group: str = "g",
    **group_extra: Any,
) -> dict[str, Any]:
    """A minimal API job: one group, one mock_driver task that runs for an hour by default."""
    return {
        "Job": {
            "ID": job_id,
            "TaskGroups": [
                {
                    "Name": group,
                    "Count": count,
                    "Tasks": [
                        {
                            "Name": "t",
                            "Driver": "mock_driver",
                            "Config": config if config is not None else {"run_for": "1h"},
                            "Resources": {"CPU": cpu, "MemoryMB": memory_mb},
                        }
                    ],
                    **group_extra,
                }
            ],
        }
    }


def scale(client: nomad.Nomad, job_id: str, group: str, count: int | None, **body: Any) -> dict[str, Any]:
    """python-nomad has no scale method; its Requester reaches the endpoint as llmgw does."""
    response = client.job.request(
        job_id, "scale", method="post", json={"Count": count, "Target": {"Group": group}, **body}
    )
    result: dict[str, Any] = response.json()
    return result


def wait_for(fn: Callable[[], T | None], timeout: float = 10.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def eval_done(client: nomad.Nomad, eval_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """The evaluation once the scheduler has processed it (no longer pending)."""

    def check() -> dict[str, Any] | None:
        evaluation: dict[str, Any] = client.evaluation.get_evaluation(eval_id)
        return evaluation if evaluation["Status"] != "pending" else None

    return wait_for(check, timeout, f"evaluation {eval_id} to be processed")


def live_allocs(client: nomad.Nomad, job_id: str) -> list[dict[str, Any]]:
    return [a for a in client.job.get_allocations(job_id) if a["DesiredStatus"] == "run"]


@asynccontextmanager
async def tiny_server(tmp_path: Path, count: int) -> AsyncIterator[NomadServer]:
    """An in-process stand-in server (no HTTP, no client) with `count` tiny nodes named tiny-<i>;
    its scheduler stopped on the way out."""
    nodes = [node_from_spec(tiny_node(f"tiny-{i}")) for i in range(count)]
    srv = NomadServer(nodes, None, tmp_path)
    for node in nodes:
        srv.store.upsert_node(node)
    try:
        yield srv
    finally:
        await srv.scheduler.stop()
