"""System jobs: one allocation of each group on every feasible node, following nodes as they
join, become eligible, drain or go down, as Nomad's system scheduler and node reconciler do.

Most tests drive the pure step in-process, as test_scheduler.py does, so each evaluation runs
exactly when the test says; one runs the whole stand-in with python-nomad."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from devstack.nomad.answers import ApiError
from devstack.nomad.nodes import node_id
from devstack.nomad.server import NomadServer
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import eval_done, live_allocs, mock_job, tiny_node, tiny_server, wait_for

Json = dict[str, Any]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[NomadServer]:
    async with tiny_server(tmp_path, count=3) as srv:
        yield srv


def system_job(job_id: str = "sys", cpu: int = 100, **group_extra: Any) -> Json:
    body = mock_job(job_id, cpu=cpu, **group_extra)
    body["Job"]["Type"] = "system"
    del body["Job"]["TaskGroups"][0]["Count"]
    return body


def register(srv: NomadServer, body: Json) -> Json:
    result = srv.register(body)
    srv.scheduler.process(result["EvalID"])
    evaluation: Json = srv.store.evals[result["EvalID"]]
    return evaluation


def run_evals(srv: NomadServer, eval_ids: list[str] | None) -> list[Json]:
    for eval_id in eval_ids or []:
        srv.scheduler.process(eval_id)
    return [srv.store.evals[e] for e in eval_ids or []]


def live_by_node(srv: NomadServer, job_id: str = "sys") -> dict[str, Json]:
    out: dict[str, Json] = {}
    for alloc in srv.store.allocs_for_job("default", job_id):
        if alloc["DesiredStatus"] == "run" and alloc["ClientStatus"] not in ("complete", "failed", "lost"):
            assert alloc["NodeName"] not in out, f"two live allocations on {alloc['NodeName']}"
            out[alloc["NodeName"]] = alloc
    return out


async def test_one_allocation_per_node_and_count_is_one(server: NomadServer) -> None:
    evaluation = register(server, system_job())
    assert server.store.jobs[("default", "sys")]["TaskGroups"][0]["Count"] == 1
    allocs = live_by_node(server)
    assert sorted(allocs) == ["tiny-0", "tiny-1", "tiny-2"]
    assert {a["Name"] for a in allocs.values()} == {"sys.g[0]"}
    assert evaluation["Status"] == "complete"
    assert evaluation["FailedTGAllocs"] is None and evaluation["BlockedEval"] == ""
    assert evaluation["QueuedAllocations"] == {"g": 0}
    assert server.store.jobs[("default", "sys")]["Status"] == "running"


async def test_count_above_one_is_rejected(server: NomadServer) -> None:
    body = system_job()
    body["Job"]["TaskGroups"][0]["Count"] = 2
    with pytest.raises(ApiError) as err:
        server.register(body)
    assert err.value.code == 500
    assert "Job task group g has count 2. Count cannot exceed 1 with system scheduler" in err.value.message


async def test_constraint_filtered_nodes_are_skipped_without_failure(server: NomadServer) -> None:
    server.put_node(tiny_node("tiny-0", meta={"role": "gpu"}))
    constraint = [{"LTarget": "${meta.role}", "RTarget": "gpu", "Operand": "="}]
    evaluation = register(server, system_job(Constraints=constraint))
    assert sorted(live_by_node(server)) == ["tiny-0"]
    # Filtered nodes are not failures: nothing is reported and nothing waits.
    assert evaluation["FailedTGAllocs"] is None and evaluation["BlockedEval"] == ""
    assert not [e for e in server.store.evals.values() if e["Status"] == "blocked"]


async def test_every_node_filtered_reports_the_filters_but_blocks_nothing(server: NomadServer) -> None:
    constraint = [{"LTarget": "${meta.role}", "RTarget": "gpu", "Operand": "="}]
    evaluation = register(server, system_job(Constraints=constraint))
    assert live_by_node(server) == {}
    metric = evaluation["FailedTGAllocs"]["g"]
    assert metric["NodesFiltered"] == 3 and metric["NodesExhausted"] == 0
    # Same node class: after the first node, Nomad's class cache rejects the others unchecked.
    assert metric["ConstraintFiltered"] == {"${meta.role} = gpu": 1, "computed class ineligible": 2}
    assert evaluation["BlockedEval"] == ""


async def test_nodes_that_join_or_become_eligible_get_an_allocation(server: NomadServer) -> None:
    register(server, system_job())
    added = server.put_node(tiny_node("tiny-3"))
    (evaluation,) = run_evals(server, added["EvalIDs"])
    assert evaluation["TriggeredBy"] == "node-update" and evaluation["NodeID"] == node_id("tiny-3")
    assert "tiny-3" in live_by_node(server)

    # An ineligible node keeps what runs there (Nomad's node reconciler ignores it) but gets
    # nothing new; becoming eligible again evaluates the system job for it.
    late = server.put_node(tiny_node("tiny-4", eligibility="ineligible"))
    run_evals(server, late["EvalIDs"])
    assert "tiny-4" not in live_by_node(server)
    server.set_eligibility(node_id("tiny-1"), {"Eligibility": "ineligible"})
    assert "tiny-1" in live_by_node(server)
    eligible = server.set_eligibility(node_id("tiny-4"), {"Eligibility": "eligible"})
    run_evals(server, eligible["EvalIDs"])
    assert sorted(live_by_node(server)) == ["tiny-0", "tiny-1", "tiny-2", "tiny-3", "tiny-4"]

    # A new job version stops it on the ineligible node and replaces it everywhere else.
    body = system_job()
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Config"] = {"run_for": "2h"}
    register(server, body)
    allocs = live_by_node(server)
    assert sorted(allocs) == ["tiny-0", "tiny-2", "tiny-3", "tiny-4"]
    assert {a["Job"]["Version"] for a in allocs.values()} == {1}
    old_on_ineligible = [
        a for a in server.store.allocs_for_job("default", "sys") if a["NodeName"] == "tiny-1"
    ]
    assert [a["DesiredDescription"] for a in old_on_ineligible] == ["alloc not needed due to job update"]
    replaced = [a for a in server.store.allocs_for_job("default", "sys") if a["NodeName"] == "tiny-0"]
    assert {a["DesiredStatus"] for a in replaced} == {"run", "stop"}
    new = next(a for a in replaced if a["DesiredStatus"] == "run")
    old = next(a for a in replaced if a["DesiredStatus"] == "stop")
    assert new["PreviousAllocation"] == old["ID"]
    assert old["DesiredDescription"] == "alloc is being updated due to job update"


async def test_drain_down_and_removal(server: NomadServer) -> None:
    register(server, system_job())

    # A drain that ignores system jobs leaves them running and completes without them.
    kept = server.drain(node_id("tiny-0"), {"DrainSpec": {"Deadline": "1h", "IgnoreSystemJobs": True}})
    assert kept["EvalIDs"] is None
    assert "tiny-0" in live_by_node(server)
    assert server.store.nodes[node_id("tiny-0")]["DrainStrategy"] is None
    assert server.store.nodes[node_id("tiny-0")]["LastDrain"]["Status"] == "complete"

    # A full drain stops it there, and nothing replaces it on the draining node.
    drained = server.drain(node_id("tiny-1"), {"DrainSpec": {"Deadline": "1h"}})
    (evaluation,) = run_evals(server, drained["EvalIDs"])
    assert evaluation["TriggeredBy"] == "node-drain"
    assert "tiny-1" not in live_by_node(server)
    (stopped,) = [a for a in server.store.allocs_for_job("default", "sys") if a["NodeName"] == "tiny-1"]
    assert stopped["DesiredDescription"] == "alloc not needed as node is tainted"
    assert server.store.nodes[node_id("tiny-1")]["LastDrain"]["Status"] == "complete"

    # A node that goes down loses its allocation; it is not placed elsewhere.
    down = server.put_node(tiny_node("tiny-2", status="down"))
    run_evals(server, down["EvalIDs"])
    (lost,) = [a for a in server.store.allocs_for_job("default", "sys") if a["NodeName"] == "tiny-2"]
    assert lost["ClientStatus"] == "lost" and lost["DesiredStatus"] == "stop"
    assert sorted(live_by_node(server)) == ["tiny-0"]


async def test_full_node_fails_and_blocks_until_room_frees(server: NomadServer) -> None:
    # tiny nodes have 4000 MHz; fill tiny-2 so the system job's 1000 MHz no longer fits there.
    filler = mock_job("filler", cpu=3500)
    filler["Job"]["Constraints"] = [{"LTarget": "${node.unique.name}", "RTarget": "tiny-2", "Operand": "="}]
    register(server, filler)
    evaluation = register(server, system_job(cpu=1000))
    assert sorted(live_by_node(server)) == ["tiny-0", "tiny-1"]
    metric = evaluation["FailedTGAllocs"]["g"]
    assert metric["NodesExhausted"] == 1 and metric["DimensionExhausted"] == {"cpu": 1}
    assert metric["CoalescedFailures"] == 0
    assert evaluation["QueuedAllocations"] == {"g": 1}
    blocked = server.store.evals[evaluation["BlockedEval"]]
    assert blocked["Status"] == "blocked" and blocked["NodeID"] == node_id("tiny-2")

    stop = server.deregister("default", "filler", purge=False)
    server.scheduler.process(stop["EvalID"])
    server.scheduler.process(blocked["ID"])
    assert server.store.evals[blocked["ID"]]["Status"] == "complete"
    assert sorted(live_by_node(server)) == ["tiny-0", "tiny-1", "tiny-2"]


async def test_a_failed_allocation_is_replaced_on_its_node_by_the_next_eval(server: NomadServer) -> None:
    register(server, system_job())
    first = live_by_node(server)["tiny-1"]
    failed = {**server.store.allocs[first["ID"]], "ClientStatus": "failed"}
    server.store.upsert_alloc(failed)
    server.scheduler.on_alloc_update(failed)
    # System jobs have no reschedule policy: the failure itself creates no evaluation.
    assert not [e for e in server.store.evals.values() if e["Status"] == "pending"]
    assert server.store.jobs[("default", "sys")]["TaskGroups"][0]["ReschedulePolicy"] is None

    register(server, system_job())  # an identical register: a new evaluation, same version
    replacement = live_by_node(server)["tiny-1"]
    assert replacement["ID"] != first["ID"]
    assert replacement["PreviousAllocation"] == first["ID"]
    assert replacement["NodeID"] == first["NodeID"]


async def test_scaling_to_zero_stops_everything_and_above_one_is_refused(server: NomadServer) -> None:
    register(server, system_job())
    with pytest.raises(ApiError) as err:
        server.scale("default", "sys", {"Count": 2, "Target": {"Group": "g"}})
    assert err.value.code == 400
    result = server.scale("default", "sys", {"Count": 0, "Target": {"Group": "g"}})
    server.scheduler.process(result["EvalID"])
    assert live_by_node(server) == {}


def test_system_job_over_the_api_follows_the_fleet(start_standin: Callable[..., StandIn]) -> None:
    standin = start_standin(consul=False)
    client = standin.client()
    body = system_job()
    result = client.jobs.register_job(body)
    evaluation = eval_done(client, result["EvalID"])
    assert evaluation["Status"] == "complete"
    nodes = {n["ID"]: n["Name"] for n in client.nodes.get_nodes()}
    placed = wait_for(lambda: live_allocs(client, "sys") if len(live_allocs(client, "sys")) == 3 else None)
    assert {a["NodeID"] for a in placed} == set(nodes)
    wait_for(lambda: all(a["ClientStatus"] == "running" for a in live_allocs(client, "sys")), what="running")

    added = standin.add_node(tiny_node("late-node"))
    assert added["EvalIDs"], added
    eval_done(client, added["EvalIDs"][0])
    on_new = wait_for(
        lambda: [a for a in live_allocs(client, "sys") if a["NodeID"] == node_id("late-node")],
        what="allocation on the new node",
    )
    assert on_new[0]["Name"] == "sys.g[0]"
    summary = client.job.get_summary("sys")
    assert summary["Summary"]["g"]["Queued"] == 0


def test_restart_policy_applies_and_a_failure_waits_for_the_next_eval(
    start_standin: Callable[..., StandIn],
) -> None:
    standin = start_standin(nodes=[tiny_node("only")], clock_speed=20, consul=False)
    client = standin.client()
    body = system_job(RestartPolicy={"Attempts": 1, "Interval": "10m", "Delay": "1s", "Mode": "fail"})
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Config"] = {"run_for": "100ms", "exit_code": 1}
    eval_done(client, client.jobs.register_job(body)["EvalID"])

    def failed() -> dict[str, Any] | None:
        allocs = client.job.get_allocations("sys")
        return allocs[0] if len(allocs) == 1 and allocs[0]["ClientStatus"] == "failed" else None

    first = wait_for(failed, timeout=20, what="the allocation to fail after its restart")
    assert first["TaskStates"]["t"]["Restarts"] == 1
    # No reschedule policy: the failure creates no evaluation and no replacement.
    assert [e["TriggeredBy"] for e in client.job.get_evaluations("sys")] == ["job-register"]
    assert len(client.job.get_allocations("sys")) == 1

    eval_done(client, client.jobs.register_job(body)["EvalID"])
    allocs = client.job.get_allocations("sys")
    (replacement,) = [a for a in allocs if a["ID"] != first["ID"]]
    assert replacement["NodeID"] == first["NodeID"]
    full = client.allocation.get_allocation(replacement["ID"])
    assert full["PreviousAllocation"] == first["ID"]
