"""How the watcher treats a multi-node replica: one start per replica whichever shard failed,
the job registered with its leader and all shards (or none), and scaled as a whole on the
Nomad stand-in. Where it goes: tests/test_multinode_fabric_steps.py."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import httpx

from nomad_driver.nomad import Nomad
from nomad_driver.placement import fabric_constraint
from nomad_driver.render import SHARD_GROUP, render_job
from nomad_driver.spec import parse_models
from nomad_driver.watcher.decisions import ModelView, Park
from nomad_driver.watcher.multinode import scale_replica, set_replica_count
from nomad_driver.watcher.reconcile import reconcile
from tests.test_reconcile import crashed, running

MODELS = textwrap.dedent(
    """
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
        replicas: {min: 1, max: 1}
    """
)
WIDE = parse_models(MODELS).models["wide"]


def in_group(alloc: dict[str, Any], group: str) -> dict[str, Any]:
    return {**alloc, "TaskGroup": group, "JobID": WIDE.job_id}


def test_shard_failures_do_not_count_only_the_replicas_starts_do() -> None:
    # Four replica starts failed; their shards failed too (ten times between them): four, not 14.
    allocs = [in_group(crashed(f"l{i}", 10 * i + 10), "engine") for i in range(4)]
    allocs += [in_group(crashed(f"s{i}", 10 * i + 12), SHARD_GROUP) for i in range(10)]
    d = reconcile(ModelView(model=WIDE, job=render_job(WIDE), allocs=tuple(allocs), now=1e6))
    assert d.state.consecutive_failures == 4
    assert not any(isinstance(a, Park) for a in d.actions)
    # The fifth replica start parks it.
    allocs.append(in_group(crashed("l4", 155), "engine"))
    d = reconcile(ModelView(model=WIDE, job=render_job(WIDE), allocs=tuple(allocs), now=1e6))
    (park,) = [a for a in d.actions if isinstance(a, Park)]
    assert park.failures == 5 and park.alloc_id == "l4"
    # A live replica is one replica starting, not three.
    live = (in_group(running("l", 1), "engine"), in_group(running("s1", 1), SHARD_GROUP))
    assert reconcile(ModelView(model=WIDE, job=render_job(WIDE), allocs=live, now=1e6)).starting == 1


def test_a_shard_failing_again_after_its_leader_restarted_in_place_is_the_same_replica_start() -> None:
    # Seen under load in CI: a shard failed, Nomad restarted it before the watcher's next pass,
    # its registration re-rendered the leader's template (a restart in place, asked for), and
    # the shard failed again in the leader's new start. One replica start, restarted whole by
    # the watcher once it looks: one failure, not two, or the model parks a start early.
    leader_events = [
        {"Type": "Started", "Time": 10},
        {
            "Type": "Restart Signaled",
            "Time": 30,
            "DisplayMessage": "Template with change_mode restart re-rendered",
        },
        {"Type": "Terminated", "Time": 31, "DisplayMessage": "Exit Code: 130, Signal: 2"},
        {"Type": "Restarting", "Time": 31},
        {"Type": "Started", "Time": 32},
    ]
    shard_events = [
        {"Type": "Started", "Time": 5},
        {"Type": "Terminated", "Time": 20, "DisplayMessage": "Exit Code: 1"},
        {"Type": "Restarting", "Time": 20},
        {"Type": "Started", "Time": 29},
        {"Type": "Terminated", "Time": 40, "DisplayMessage": "Exit Code: 1"},
        {"Type": "Not Restarting", "Time": 40},
    ]
    leader = {
        "ID": "lead",
        "ClientStatus": "running",
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"Events": leader_events}},
    }
    shard = {
        "ID": "shard",
        "ClientStatus": "failed",
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"Events": shard_events}},
    }
    allocs = (in_group(leader, "engine"), in_group(shard, SHARD_GROUP))
    job = render_job(WIDE)
    job["Constraints"].append(fabric_constraint("ib-a"))
    d = reconcile(ModelView(model=WIDE, job=job, allocs=allocs, now=1e6))
    assert d.state.consecutive_failures == 1
    assert d.state.last_error.startswith("shard shard")
    # The leader still waits for a shard that is gone: the replica is restarted whole.
    assert d.state.replica_restarted == "lead@32"


def test_a_replica_runs_with_all_its_shards_or_not_at_all() -> None:
    job = render_job(WIDE)
    set_replica_count(job, 1)
    assert [g["Count"] for g in job["TaskGroups"]] == [1, 2]
    set_replica_count(job, 0)
    assert [g["Count"] for g in job["TaskGroups"]] == [0, 0]


def leading(what: str) -> None:
    """A leader well inside its lease: nothing is refused."""


def test_scaling_a_replica_scales_its_shards_with_it(start_standin: Callable[..., Any]) -> None:
    node = {
        "datacenter": "dc1",
        "cpu_mhz": 8000,
        "memory_mib": 8192,
        "attributes": {"driver.mock_driver": "1"},
        "meta": {"llmgw_engine_llama_cpp": "b6500", "llmgw_gpu_count": "1"},
        "gpus": [{"model": "NVIDIA L4", "memory_mib": 24564, "count": 1}],
    }
    standin = start_standin(nodes=[{**node, "name": f"n{i}"} for i in range(3)], consul=False)
    job = render_job(WIDE)
    for group in job["TaskGroups"]:
        group["Tasks"][0].update(Driver="mock_driver", Config={"run_for": "1h"})
        group["Tasks"][0].pop("Artifacts", None)
        group["Tasks"][0].pop("Templates", None)
    nomad = Nomad(standin.url)
    nomad.register_job(job)
    scale_replica(nomad, WIDE.job_id, "engine", 0, "llmgw: parked wide", WIDE, check_lease=leading)
    counts = {
        g["Name"]: g["Count"] for g in httpx.get(f"{standin.url}/v1/job/{WIDE.job_id}").json()["TaskGroups"]
    }
    assert counts == {"engine": 0, SHARD_GROUP: 0}
    scale_replica(
        nomad, WIDE.job_id, "engine", 1, "llmgw: wide should have 1 replicas", WIDE, check_lease=leading
    )
    counts = {
        g["Name"]: g["Count"] for g in httpx.get(f"{standin.url}/v1/job/{WIDE.job_id}").json()["TaskGroups"]
    }
    assert counts == {"engine": 1, SHARD_GROUP: 2}
