"""`llmgw plan` and `llmgw apply` for multi-node models, against a real Consul and the Nomad
stand-in on a fleet of several fabrics (devstack/nodes/fabrics.yaml: ib-a with 2 nodes, ib-b 1,
ethernet 1): the plan asks Nomad about the whole replica (its leader and every shard), pinned to
the fabric the watcher would choose, names that fabric, says in the placement module's words
when no fabric has room, and counts replicas, not allocations; apply registers a running replica
whole, in its fabric."""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner, Result

from devstack.fleet import effective_nodes
from nomad_driver.cli.app import app
from nomad_driver.node_meta import FABRIC_KEY, interpolated
from nomad_driver.nomad import Nomad
from nomad_driver.render import SHARD_GROUP, render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.multinode import pin_to_fabric, set_replica_count
from tests.fixtures.nomad import StandIn

pytestmark = pytest.mark.timeout(180)

FABRICS = Path(__file__).resolve().parent.parent / "devstack" / "nodes" / "fabrics.yaml"


def models_text(nodes: int, source: str = "file:///nowhere/split.gguf") -> str:
    return textwrap.dedent(
        f"""
        profiles:
          split:
            engine: llama.cpp
            engine_version: b6500
            gpus: 1
            gpu_memory_mib: 20000
            cpu_mhz: 500
            memory_mib: 512
            nodes: {nodes}
          one-l4:
            engine: llama.cpp
            engine_version: b6500
            gpus: 1
            cpu_mhz: 500
            memory_mib: 512
        models:
          split:
            source: {source}
            profile: split
            replicas: {{min: 0, max: 1}}
        """
    )


FILLER = parse_models(
    models_text(2) + "  filler:\n    source: file:///nowhere/filler.gguf\n    profile: one-l4\n"
).models["filler"]


@pytest.fixture
def cluster(
    consul_url: str, start_standin: Callable[..., StandIn], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> StandIn:
    nodes = effective_nodes(FABRICS, tmp_path / "engines", tmp_path / "fabrics.yaml")
    standin = start_standin(nodes=nodes, consul=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    return standin


def run(*args: str) -> Result:
    return CliRunner().invoke(app, list(args))


def plan_json(path: Path) -> tuple[int, dict[str, Any]]:
    result = run("plan", str(path), "--json")
    return result.exit_code, json.loads(result.stdout)


def mocked(job: dict[str, Any]) -> dict[str, Any]:
    """The job with Nomad's mock driver in every task: it runs, and starts no engine."""
    for group in job["TaskGroups"]:
        task = group["Tasks"][0]
        task.update(Driver="mock_driver", Config={"run_for": "1h"})
        task.pop("Artifacts", None)
        task.pop("Templates", None)
    return job


def node_names(url: str) -> dict[str, str]:
    return {n["ID"]: n["Name"] for n in httpx.get(f"{url}/v1/nodes", timeout=10).json()}


def running_on(url: str, job_id: str, count: int) -> list[str]:
    names = node_names(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        allocs = httpx.get(f"{url}/v1/job/{job_id}/allocations", timeout=10).json()
        live = sorted(names[a["NodeID"]] for a in allocs if a["ClientStatus"] == "running")
        if len(live) == count:
            return live
        time.sleep(0.2)
    raise AssertionError(f"{job_id}: {count} running allocations not within 30s")


def fill(url: str, *node_names_: str) -> None:
    """A one-GPU job on each named node, so that it is no longer entirely free."""
    for name in node_names_:
        job = mocked(render_job(FILLER))
        job["ID"] = job["Name"] = f"filler-{name}"
        job["Constraints"] = [{"LTarget": "${node.unique.name}", "RTarget": name, "Operand": "="}]
        httpx.post(f"{url}/v1/jobs", json={"Job": job}, timeout=10).raise_for_status()
        running_on(url, f"filler-{name}", 1)


def test_a_two_node_model_plans_into_the_fabric_that_holds_it(cluster: StandIn, tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(models_text(2))
    code, doc = plan_json(path)
    assert code == 6, doc
    (split,) = doc["models"]
    placement = split["placement"]
    # One replica: its leader and its shard, both on ib-a, the one fabric with two free nodes.
    assert (placement["fits"], placement["count"], placement["fabric"]) == (True, 1, "ib-a")
    assert placement["updates"] == {"Place": 1}, "counted in replicas, not allocations"
    assert placement["candidates"] == [{"node_class": "l4", "gpu_model": "NVIDIA L4", "nodes": 2}]
    text = run("plan", str(path))
    assert "fits: 1 replica when first asked for (on demand), in fabric ib-a (2 nodes)" in text.stdout


def test_a_model_wider_than_any_fabric_fits_nowhere_with_the_placement_modules_reason(
    cluster: StandIn, tmp_path: Path
) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(models_text(3))
    code, doc = plan_json(path)
    assert code == 7, doc
    assert doc["outcome"] == "fits nowhere" and doc["summary"]["fits_nowhere"] == 1
    placement = doc["models"][0]["placement"]
    assert (placement["fits"], placement["fabric"]) == (False, None)
    assert placement["reason"] == (
        "needs 3 entirely free nodes in one fabric; largest free blocks: ethernet 1, ib-a 2, ib-b 1"
    )
    text = run("plan", str(path))
    assert text.exit_code == 7
    assert f"FITS NOWHERE: 1 replica when first asked for (on demand): {placement['reason']}" in text.stdout


def test_the_plan_asks_nomad_for_the_shards_too(cluster: StandIn, tmp_path: Path) -> None:
    """Only ib-a-1 is free: the leader alone would fit there, the replica does not."""
    fill(cluster.url, "ib-a-0", "ib-b-0", "eth-0")
    path = tmp_path / "models.yaml"
    path.write_text(models_text(2))
    code, doc = plan_json(path)
    assert code == 7, doc
    reason = doc["models"][0]["placement"]["reason"]
    assert reason.startswith(
        "needs 2 entirely free nodes in one fabric; largest free blocks: ethernet 0, ib-a 1, ib-b 0; "
    ), reason
    # Nomad's own answer for the unpinned replica: its shard has nowhere to go.
    assert "no node has 1 x nvidia/gpu with memory >= 20000 MiB: " in reason.split("; ", 2)[2], reason


def test_a_changed_running_replica_is_planned_and_applied_whole_in_its_fabric(
    cluster: StandIn, consul_url: str, tmp_path: Path
) -> None:
    old_text = models_text(2)
    old = parse_models(old_text).models["split"]
    # Running on demand: a request scaled it to one replica, leader and shard, on ib-a.
    job = mocked(render_job(old))
    set_replica_count(job, 1)
    nodes = [httpx.get(f"{cluster.url}/v1/node/{i}", timeout=10).json() for i in node_names(cluster.url)]
    assert pin_to_fabric(job, old, nodes, []) == "ib-a"
    httpx.post(f"{cluster.url}/v1/jobs", json={"Job": job}, timeout=10).raise_for_status()
    assert running_on(cluster.url, old.job_id, 2) == ["ib-a-0", "ib-a-1"]
    httpx.put(f"{consul_url}/v1/kv/{CONFIG_MODELS_KEY}", content=old_text, timeout=10).raise_for_status()

    path = tmp_path / "models.yaml"
    # No other fabric has two free nodes, so a rollout beside it could only wait (`surge`, the
    # default, plans "CANNOT SURGE"): `update: replace` replaces it in place, in its fabric.
    changed = models_text(2, source="file:///nowhere/split-v2.gguf")
    path.write_text(changed.replace("nodes: 2\n", "nodes: 2\n    update: replace\n", 1))
    code, doc = plan_json(path)
    assert code == 6, doc
    (split,) = doc["models"]
    assert split["change"] == "changed" and split["replaces_replicas"]
    placement = split["placement"]
    # Its own nodes are its room: the new version goes where the old one runs.
    assert (placement["fits"], placement["count"], placement["fabric"]) == (True, 1, "ib-a")
    assert placement["updates"]["DestructiveUpdate"] == 1, "one replica, though two allocations"
    assert "re-places 1 running replica (" in run("plan", str(path)).stdout

    applied = run("apply", "--auto-approve", str(path))
    assert applied.exit_code == 0, applied.output
    registered = Nomad(cluster.url).get_job(old.job_id)
    assert registered is not None
    counts = {g["Name"]: g["Count"] for g in registered["TaskGroups"]}
    assert counts == {"engine": 1, SHARD_GROUP: 1}, "the running replica keeps its shard"
    fabric = {"LTarget": interpolated(FABRIC_KEY), "RTarget": "ib-a", "Operand": "="}
    assert fabric in registered["Constraints"]
