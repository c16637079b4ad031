"""Activating an on-demand multi-node model through the router and the watcher that answers its
ask, on the Nomad stand-in: its
leader and every shard are scaled up and placed, never the leader alone (half a replica that
waits for shards nobody asked for)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from openai import APIStatusError, OpenAI

from nomad_driver.placement import fabric_constraint
from nomad_driver.render import SHARD_GROUP, render_job
from nomad_driver.spec import parse_models
from tests.router.conftest import StartRouter, put_kv, wait_until
from tests.router.fleet import WatcherThread

MODELS = """
profiles:
  split:
    engine: llama.cpp
    engine_version: b6500
    gpus: 1
    cpu_mhz: 200
    memory_mib: 128
    nodes: 3
models:
  wide:
    source: file:///nowhere/wide.gguf
    profile: split
    replicas: {min: 0, max: 1}
    activation_timeout: 1s
"""


def node(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "datacenter": "dc1",
        "cpu_mhz": 8000,
        "memory_mib": 8192,
        "attributes": {"driver.mock_driver": "1"},
        "meta": {"llmgw_engine_llama_cpp": "b6500", "llmgw_fabric": "ib-a", "llmgw_gpu_count": "1"},
        "gpus": [{"model": "NVIDIA L4", "memory_mib": 24564, "count": 1}],
    }


@pytest.mark.slow
def test_activating_a_multi_node_model_starts_its_leader_and_all_its_shards(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    watcher_for: Callable[..., WatcherThread],
) -> None:
    standin = start_standin(nodes=[node(f"ib-a-{i}") for i in range(3)])
    (model,) = parse_models(MODELS).models.values()
    job = render_job(model)
    job["Constraints"].append(fabric_constraint("ib-a"))
    for group in job["TaskGroups"]:
        # Processes that run and serve nothing: this is about what Nomad is asked to place.
        group["Tasks"][0].update(Driver="mock_driver", Config={"run_for": "1h"})
        group["Tasks"][0].pop("Artifacts", None)
        group["Tasks"][0].pop("Templates", None)
        group["Services"] = []
    assert [g["Count"] for g in job["TaskGroups"]] == [0, 0]
    assert httpx.post(f"{standin.url}/v1/jobs", json={"Job": job}, timeout=10).status_code == 200
    put_kv(consul_url, "llmgw/config/models", MODELS)
    router = start_router(consul_url, activation=True)
    wait_until(lambda: "wide" in router.app.discovery.snapshot.models, 10, "the model's definition")
    # The leading watcher answers the router's ask: it scales the whole replica.
    watcher = watcher_for(consul_url, standin.url)
    wait_until(watcher.leads_and_acts, 30, "the watcher to lead with every watch read")

    client = OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(APIStatusError) as refused:
        client.completions.create(model="wide", prompt="hi", max_tokens=2)
    # Placed, and still loading when its one-second window ran out.
    assert refused.value.status_code == 503
    assert (refused.value.body or {}).get("code") == "model_loading"

    counts = {
        g["Name"]: g["Count"]
        for g in httpx.get(f"{standin.url}/v1/job/{model.job_id}", timeout=10).json()["TaskGroups"]
    }
    assert counts == {"engine": 1, SHARD_GROUP: 2}

    def placed() -> bool:
        allocs = httpx.get(f"{standin.url}/v1/job/{model.job_id}/allocations", timeout=10).json()
        live = [a for a in allocs if a["ClientStatus"] == "running"]
        return sorted(a["TaskGroup"] for a in live) == ["engine", SHARD_GROUP, SHARD_GROUP]

    wait_until(placed, 20, "the leader and both shards running")
