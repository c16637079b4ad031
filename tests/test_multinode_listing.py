"""How a multi-node replica is listed (`/v1/admin/replicas`, `ctl replicas`, the fleet summary):
one replica, its leader's row, with its shards and fabric beside it, never its shards as
replicas of their own that would read as "starting" forever and inflate the totals."""

from __future__ import annotations

from typing import Any

from nomad_driver.render import SHARD_GROUP
from nomad_driver.summary import fleet_summary
from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.replicas import list_replicas, node_fabrics
from tests.test_multinode_replica_rules import WIDE
from tests.test_reconcile import KEV

NOW = 1e6


def alloc(aid: str, job: str, group: str, node: str, status: str = "running", **kw: Any) -> dict[str, Any]:
    return {
        "ID": aid,
        "JobID": job,
        "TaskGroup": group,
        "NodeID": node,
        "NodeName": f"name-{node}",
        "ClientStatus": status,
        "DesiredStatus": "run",
        "TaskStates": {"engine": {"Events": [{"Type": "Started", "Time": 5}]}},
        **kw,
    }


def engine_entry(alloc_id: str, model: str) -> dict[str, Any]:
    return {
        "Service": {"ID": f"_nomad-task-{alloc_id}-engine-llmgw-engine-http", "Meta": {"model": model},
                    "Address": "10.0.0.1", "Port": 20000},
        "Checks": [{"Status": "passing"}],
    }  # fmt: skip


def test_a_multi_node_replica_is_one_row_with_its_shards_and_fabric() -> None:
    leader_id = "11111111-0000-0000-0000-000000000000"
    allocs = [
        alloc(leader_id, WIDE.job_id, "engine", "n1"),
        alloc("22222222-0000-0000-0000-000000000000", WIDE.job_id, SHARD_GROUP, "n2"),
        alloc("33333333-0000-0000-0000-000000000000", WIDE.job_id, SHARD_GROUP, "n3", status="pending"),
        # A shard Nomad replaced, and one stopped: neither is part of the replica now.
        alloc("44444444-0000-0000-0000-000000000000", WIDE.job_id, SHARD_GROUP, "n4", status="failed",
              NextAllocation="33333333-0000-0000-0000-000000000000"),
        alloc("55555555-0000-0000-0000-000000000000", WIDE.job_id, SHARD_GROUP, "n4", DesiredStatus="stop"),
        alloc("66666666-0000-0000-0000-000000000000", KEV.job_id, "engine", "n5"),
    ]  # fmt: skip
    nodes = [{"ID": f"n{i}", "Meta": {"llmgw_fabric": "ib-a" if i < 5 else "eth"}} for i in range(1, 6)]
    views = {"wide": ModelView(model=WIDE), "kev": ModelView(model=KEV)}
    rows, _ = list_replicas(views, [engine_entry(leader_id, "wide")], allocs, {}, NOW, node_fabrics(nodes))
    assert [(r["model"], r["node"], r["state"], r["fabric"]) for r in rows] == [
        ("kev", "name-n5", "starting", "eth"),
        ("wide", "name-n1", "ready", "ib-a"),
    ]
    wide = rows[1]
    assert [(s["node"], s["state"], s["fabric"]) for s in wide["shards"]] == [
        ("name-n2", "running", "ib-a"),
        ("name-n3", "starting", "ib-a"),
    ]
    assert rows[0]["shards"] == []
    # The fleet summary counts replicas, not processes.
    totals = fleet_summary([], allocs, rows, {}, NOW)["replicas"]
    assert totals == {"total": 2, "ready": 1, "starting": 1}
