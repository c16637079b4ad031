"""Fabric choice against the Nomad stand-in's fleet of several fabrics (devstack/nodes/
fabrics.yaml): a two-shard replica fits in one fabric only and lands there on two distinct
nodes; with a node of that fabric taken, nothing fits and the reason names every fabric and its
largest free block; freeing the node lets it place there again. The engines are Nomad's mock
driver here: what is tested is where Nomad puts the shards, given llmgw's constraints."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from devstack.fleet import effective_nodes
from nomad_driver.placement import choose_fabric, fabric_constraint, fabric_rooms, no_fabric_reason
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.watcher.multinode import set_replica_count

FABRICS = Path(__file__).resolve().parents[1] / "devstack" / "nodes" / "fabrics.yaml"

MODELS = textwrap.dedent(
    """
    profiles:
      two-l4:
        engine: llama.cpp
        engine_version: b6500
        gpus: 1
        gpu_memory_mib: 20000
        cpu_mhz: 500
        memory_mib: 512
        nodes: 2
      one-l4:
        engine: llama.cpp
        engine_version: b6500
        gpus: 1
        cpu_mhz: 500
        memory_mib: 512
    models:
      split:
        source: file:///nowhere/split.gguf
        profile: two-l4
      filler:
        source: file:///nowhere/filler.gguf
        profile: one-l4
    """
)
SET = parse_models(MODELS)


def mocked(job: dict[str, Any]) -> dict[str, Any]:
    for group in job["TaskGroups"]:
        task = group["Tasks"][0]
        task.update(Driver="mock_driver", Config={"run_for": "1h"})
        task.pop("Artifacts", None)
        task.pop("Templates", None)
    return job


def fleet_now(url: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, str]]:
    nodes = [
        httpx.get(f"{url}/v1/node/{n['ID']}", timeout=10).json() for n in httpx.get(f"{url}/v1/nodes").json()
    ]
    allocs = httpx.get(f"{url}/v1/allocations", params={"resources": "true"}, timeout=10).json()
    names = {n["ID"]: n["Name"] for n in nodes}
    return nodes, allocs, names


def running_on(url: str, job_id: str, names: dict[str, str], count: int) -> list[str]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        allocs = httpx.get(f"{url}/v1/job/{job_id}/allocations", timeout=10).json()
        live = sorted(names[a["NodeID"]] for a in allocs if a["ClientStatus"] == "running")
        if len(live) == count:
            return live
        time.sleep(0.2)
    raise AssertionError(f"{job_id}: {count} running allocations not within 30s")


def test_a_two_shard_replica_lands_in_the_one_fabric_that_holds_it(
    tmp_path: Path, start_standin: Callable[..., Any]
) -> None:
    nodes_file = effective_nodes(FABRICS, tmp_path / "engines", tmp_path / "nodes.yaml")
    standin = start_standin(nodes=nodes_file, consul=False)
    split, filler = SET.models["split"], SET.models["filler"]

    # ib-a-0 is taken by a one-GPU model: no fabric has two free nodes.
    job = mocked(render_job(filler))
    job["Constraints"] = [{"LTarget": "${node.unique.name}", "RTarget": "ib-a-0", "Operand": "="}]
    httpx.post(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10).raise_for_status()
    nodes, allocs, names = fleet_now(standin.url)
    running_on(standin.url, filler.job_id, names, 1)
    nodes, allocs, names = fleet_now(standin.url)
    rooms = fabric_rooms(nodes, allocs, "split")
    assert choose_fabric(rooms, 2) is None
    assert no_fabric_reason(rooms, 2) == (
        "needs 2 entirely free nodes in one fabric; largest free blocks: ethernet 1, ib-a 1, ib-b 1"
    )

    # Freed, ib-a holds it; the watcher's job lands on both its nodes and nowhere else.
    httpx.delete(
        f"{standin.url}/v1/job/{filler.job_id}", params={"purge": "true"}, timeout=10
    ).raise_for_status()
    deadline = time.monotonic() + 30
    while choose_fabric(fabric_rooms(*fleet_now(standin.url)[:2], "split"), 2) is None:
        assert time.monotonic() < deadline, "ib-a-0 not freed"
        time.sleep(0.2)
    nodes, allocs, names = fleet_now(standin.url)
    job = mocked(render_job(split))
    set_replica_count(job, 1)
    assert choose_fabric(fabric_rooms(nodes, allocs, "split"), 2) == "ib-a"
    job["Constraints"].append(fabric_constraint("ib-a"))
    httpx.post(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10).raise_for_status()
    assert running_on(standin.url, split.job_id, names, 2) == ["ib-a-0", "ib-a-1"]
