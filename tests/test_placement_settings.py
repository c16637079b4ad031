"""Placement settings reach Nomad the same way from `llmgw apply` and from the watcher: a fleet
whose GPU nodes are in a `gpu` node pool gets its model jobs there, and `NOMAD_NAMESPACE` decides
the namespace a job is registered in."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from typer.testing import CliRunner

from devstack import demo_models, fleet
from devstack.nomad.nodes import load_nodes
from nomad_driver.cli.app import app
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.placement import latest_placement_failure
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.watcher_support import engines_dir, node, until

pytestmark = pytest.mark.timeout(120)

GPU = {"model": "NVIDIA L4", "memory_mib": 23034, "count": 1}


def pool_fleet(engines: Path) -> list[dict[str, Any]]:
    """The operating guide's layout: a general node in `default` for llmgw's own services, the GPU
    nodes in a pool of their own."""
    general = {**node("general-0", engines), "node_pool": "default"}
    return [general, *({**node(f"gpu-{i}", engines, [GPU]), "node_pool": "gpu"} for i in range(2))]


def models(pool: str | None, *names: str) -> str:
    placement = f"    node_pool: {pool}\n" if pool else ""
    text = (
        "profiles:\n  l4:\n    engine: llama-cpp-python\n    engine_version: 0.3.36\n    gpus: 1\n"
        f"    gpu_memory_mib: 20000\n    cpu_mhz: 500\n    memory_mib: 512\n{placement}models:\n"
    )
    for name in names:
        text += f"  {name}:\n    source: file:///tmp/{name}.gguf\n    profile: l4\n    replicas: {{min: 1, max: 1}}\n"
    return text


def placed_on(nomad: Nomad, job_id: str) -> set[str]:
    allocs = requests.get(f"{nomad.address}/v1/job/{job_id}/allocations", timeout=5).json()
    return {str(a["NodeName"]) for a in allocs}


async def test_apply_and_the_watcher_place_model_jobs_in_the_gpu_pool(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin = start_standin(nodes=pool_fleet(engines_dir(tmp_path)), clock_speed=20.0)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    monkeypatch.delenv("NOMAD_NAMESPACE", raising=False)
    nomad = Nomad(standin.url)

    # apply, with the pool in the profile
    path = tmp_path / "models.yaml"
    path.write_text(models("gpu", "by-apply"))
    # In a thread: apply runs its own event loop, as it does from a shell.
    result = await asyncio.to_thread(CliRunner().invoke, app, ["apply", str(path)])
    assert result.exit_code == 0, result.output
    job = nomad.get_job("llmgw-by-apply")
    assert job is not None and job["NodePool"] == "gpu"
    nodes = await until(lambda: placed_on(nomad, "llmgw-by-apply"), 30, "an allocation for by-apply")
    assert nodes <= {"gpu-0", "gpu-1"}

    # the watcher, registering a model only Consul knows about, renders the same placement
    consul = Consul(consul_url)
    watcher = Watcher(
        Consul(consul_url), nomad, WatcherConfig(wait_s=5, lock_delay_s=0.5, tick_s=0.5), ident="pools"
    )
    try:
        await consul.kv_put(CONFIG_MODELS_KEY, models("gpu", "by-apply", "by-watcher"))
        await watcher.start()
        await until(lambda: nomad.get_job("llmgw-by-watcher"), 60, "the watcher to register by-watcher")
        registered = nomad.get_job("llmgw-by-watcher")
        assert registered is not None and registered["NodePool"] == "gpu"
        nodes = await until(lambda: placed_on(nomad, "llmgw-by-watcher"), 30, "an allocation for by-watcher")
        assert nodes <= {"gpu-0", "gpu-1"}
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


def test_a_model_without_the_pool_is_told_why_it_fits_nowhere(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure this replaces: a job in `default` on a fleet whose GPUs are all in `gpu`."""
    standin = start_standin(nodes=pool_fleet(engines_dir(tmp_path)), consul=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    monkeypatch.delenv("NOMAD_NAMESPACE", raising=False)
    path = tmp_path / "models.yaml"
    path.write_text(models(None, "nowhere"))
    # Unplaceable on purpose: without a terminal, apply needs to be told that is intended.
    applied = CliRunner().invoke(app, ["apply", "--allow-unplaceable", str(path)])
    assert applied.exit_code == 0, applied.output
    nomad = Nomad(standin.url)
    job = nomad.get_job("llmgw-nowhere")
    assert job is not None and job["NodePool"] == "default"
    evaluations = requests.get(f"{standin.url}/v1/job/llmgw-nowhere/evaluations", timeout=5).json()
    failure = latest_placement_failure(evaluations, job)
    assert failure is not None
    # What an operator reads: the GPU it wants, and the nodes of the pool it was in, ruled out.
    assert (
        failure.reason
        == "no node has 1 x nvidia/gpu with memory >= 20000 MiB: 1 node filtered (missing devices)"
    )
    assert f"FITS NOWHERE: 1 replica: {failure.reason}" in applied.output, "the plan said it first"
    assert not placed_on(nomad, "llmgw-nowhere")


def test_apply_registers_in_nomad_namespace_not_in_default(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh Nomad has only `default`: a job meant for `llm`, never created, is refused with
    # Nomad's own words instead of landing in `default`, where nothing of llmgw looks.
    standin = start_standin(nodes=pool_fleet(engines_dir(tmp_path)), consul=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    monkeypatch.setenv("NOMAD_NAMESPACE", "llm")
    path = tmp_path / "models.yaml"
    path.write_text(models("gpu", "elsewhere"))
    result = CliRunner().invoke(app, ["apply", str(path)])
    assert result.exit_code == 3, result.output
    assert 'nonexistent namespace "llm"' in result.output
    assert Nomad(standin.url, namespace="default").get_job("llmgw-elsewhere") is None


def test_a_pool_no_node_is_in_is_refused_with_nomads_words(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin = start_standin(nodes=pool_fleet(engines_dir(tmp_path)), consul=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    monkeypatch.delenv("NOMAD_NAMESPACE", raising=False)
    path = tmp_path / "models.yaml"
    path.write_text(models("gpus", "typo"))
    result = CliRunner().invoke(app, ["apply", str(path)])
    assert result.exit_code == 3, result.output
    assert 'job "llmgw-typo" is in nonexistent node pool "gpus"' in result.output


def test_the_dev_stack_runs_models_in_a_gpu_pool_and_llmgw_beside_it(tmp_path: Path) -> None:
    """The dev stack's fleet is laid out as the operating guide says, and its demo models ask for
    the GPU pool, so `make demo` exercises the placement an operator will have."""
    out = fleet.effective_nodes(
        fleet.DEMO_FLEET, tmp_path / "engines", tmp_path / "nodes.yaml", gpu_pool="gpu"
    )
    nodes = load_nodes(out)
    pools = {n["Name"]: n["NodePool"] for n in nodes}
    assert pools.pop("general-0") == "default"
    # The two nodes kept entirely free for the multi-node demo model have a pool of their own.
    assert {pools.pop("gpu-a10-0"), pools.pop("gpu-a10-1")} == {"multinode"}
    assert pools and set(pools.values()) == {"gpu"}
    assert all(n["NodeResources"]["Devices"] for n in nodes if n["NodePool"] in ("gpu", "multinode"))
    demo = parse_models(demo_models.TEMPLATE.read_text(), str(demo_models.TEMPLATE))
    assert {m.profile.node_pool for m in demo.models.values() if m.profile.nodes == 1} == {"gpu"}
    assert {m.profile.node_pool for m in demo.models.values() if m.profile.nodes > 1} == {"multinode"}
    assert fleet.big_gpu_node(tmp_path)["node_pool"] == "gpu"
