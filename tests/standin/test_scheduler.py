"""The scheduler: placements and stops against the desired count, blocked evaluations that wait
for capacity, and rescheduling of failed allocations per ReschedulePolicy.

Most tests drive the pure step in-process (a server that is not started: no worker, no client),
so each evaluation is processed exactly when the test says and allocations change client status
only when the test reports it, as a Nomad client would. Two run the whole stand-in process with
a fast clock, so the delays really elapse."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nomad
import pytest

from devstack.nomad.encode import parse_rfc3339_ns, rfc3339
from devstack.nomad.reconcile import next_delay, reschedule_eligible
from devstack.nomad.server import NomadServer
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import (
    NO_DEPLOYMENTS,
    SECOND,
    eval_done,
    live_allocs,
    mock_job,
    tiny_fleet,
    tiny_node,
    tiny_server,
    wait_for,
)

Json = dict[str, Any]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[NomadServer]:
    async with tiny_server(tmp_path, count=2) as srv:
        yield srv


def register(srv: NomadServer, job: Json) -> str:
    result = srv.register(job)
    srv.scheduler.process(result["EvalID"])
    eval_id: str = result["EvalID"]
    return eval_id


def live(srv: NomadServer, job_id: str) -> list[Json]:
    allocs = srv.store.allocs_for_job("default", job_id)
    return sorted((a for a in allocs if a["DesiredStatus"] == "run"), key=lambda a: a["Name"])


def report(srv: NomadServer, alloc: Json, status: str, finished_ns: int | None = None) -> Json:
    """What a client's Node.UpdateAlloc would write: the task's end and the client status."""
    finished = finished_ns if finished_ns is not None else srv.clock.now_ns()
    state = {
        "State": "dead" if status in ("failed", "complete") else "running",
        "Failed": status == "failed",
        "FinishedAt": rfc3339(finished) if status in ("failed", "complete") else rfc3339(0),
    }
    updated = {**srv.store.allocs[alloc["ID"]], "ClientStatus": status, "TaskStates": {"t": state}}
    srv.store.upsert_alloc(updated)
    srv.scheduler.on_alloc_update(updated)
    return updated


def pending_evals(srv: NomadServer, job_id: str) -> list[Json]:
    return [e for e in srv.store.evals_for_job("default", job_id) if e["Status"] == "pending"]


async def test_scale_down_stops_the_highest_indexes_and_scale_up_reuses_them(server: NomadServer) -> None:
    register(server, mock_job("s", count=4, **NO_DEPLOYMENTS))
    assert [a["Name"] for a in live(server, "s")] == [f"s.g[{i}]" for i in range(4)]

    down = server.scale("default", "s", {"Count": 2, "Target": {"Group": "g"}})
    server.scheduler.process(down["EvalID"])
    assert [a["Name"] for a in live(server, "s")] == ["s.g[0]", "s.g[1]"]
    stopped = [a for a in server.store.allocs_for_job("default", "s") if a["DesiredStatus"] == "stop"]
    assert sorted(a["Name"] for a in stopped) == ["s.g[2]", "s.g[3]"]

    up = server.scale("default", "s", {"Count": 3, "Target": {"Group": "g"}})
    server.scheduler.process(up["EvalID"])
    assert [a["Name"] for a in live(server, "s")] == ["s.g[0]", "s.g[1]", "s.g[2]"]
    # The two survivors were updated in place to the new job version rather than replaced.
    assert {a["Job"]["Version"] for a in live(server, "s")} == {2}


async def test_failed_placement_creates_a_blocked_eval_that_capacity_unblocks(server: NomadServer) -> None:
    eval_id = register(server, mock_job("big", count=3, cpu=3000))
    evaluation = server.store.evals[eval_id]
    assert evaluation["Status"] == "complete"
    assert evaluation["QueuedAllocations"] == {"g": 1}
    metric = evaluation["FailedTGAllocs"]["g"]
    assert metric["NodesEvaluated"] == 2 and metric["NodesExhausted"] == 2
    assert metric["DimensionExhausted"] == {"cpu": 2}
    blocked = server.store.evals[evaluation["BlockedEval"]]
    assert blocked["Status"] == "blocked"
    assert blocked["TriggeredBy"] == "queued-allocs"
    assert blocked["StatusDescription"] == "created to place remaining allocations"
    assert blocked["PreviousEval"] == eval_id and blocked["FailedTGAllocs"] == evaluation["FailedTGAllocs"]
    assert len(live(server, "big")) == 2
    assert server.store.job_summaries[("default", "big")]["Summary"]["g"]["Queued"] == 1

    # Capacity that still does not fit re-blocks the same evaluation.
    server.scheduler.process(blocked["ID"])
    assert server.store.evals[blocked["ID"]]["Status"] == "blocked"

    server.put_node(tiny_node("tiny-2"))
    server.scheduler.process(blocked["ID"])
    done = server.store.evals[blocked["ID"]]
    assert done["Status"] == "complete"
    assert len(live(server, "big")) == 3
    assert server.store.job_summaries[("default", "big")]["Summary"]["g"]["Queued"] == 0


async def test_a_later_successful_eval_cancels_the_blocked_one(server: NomadServer) -> None:
    eval_id = register(server, mock_job("shrink", count=3, cpu=3000, **NO_DEPLOYMENTS))
    blocked_id = server.store.evals[eval_id]["BlockedEval"]
    down = server.scale("default", "shrink", {"Count": 1, "Target": {"Group": "g"}})
    server.scheduler.process(down["EvalID"])
    assert server.store.evals[blocked_id]["Status"] == "canceled"
    assert server.store.jobs[("default", "shrink")]["Status"] == "running"


async def test_failed_allocation_is_rescheduled_after_its_delay(server: NomadServer) -> None:
    register(server, mock_job("fl", count=1))
    (first,) = live(server, "fl")
    failed_at = server.clock.now_ns()
    report(server, first, "failed", failed_at)

    (failure_eval,) = pending_evals(server, "fl")
    assert failure_eval["TriggeredBy"] == "alloc-failure"
    server.scheduler.process(failure_eval["ID"])
    # The default service policy waits 30s first, so a follow-up evaluation is made for then.
    (followup,) = pending_evals(server, "fl")
    assert followup["TriggeredBy"] == "alloc-failure"
    assert followup["StatusDescription"] == "created for delayed rescheduling"
    assert parse_rfc3339_ns(followup["WaitUntil"]) == failed_at + 30 * SECOND
    assert server.store.evals[failure_eval["ID"]]["NextEval"] == followup["ID"]
    assert server.store.allocs[first["ID"]]["FollowupEvalID"] == followup["ID"]
    assert live(server, "fl")[0]["ID"] == first["ID"]  # no replacement yet

    server.scheduler.process(followup["ID"])
    (second,) = [a for a in live(server, "fl") if a["ID"] != first["ID"]]
    old = server.store.allocs[first["ID"]]
    assert second["Name"] == first["Name"] and second["PreviousAllocation"] == first["ID"]
    assert old["NextAllocation"] == second["ID"] and old["DesiredStatus"] == "stop"
    assert old["DesiredDescription"] == "alloc was rescheduled because it failed"
    (event,) = second["RescheduleTracker"]["Events"]
    assert event["PrevAllocID"] == first["ID"] and event["PrevNodeID"] == first["NodeID"]
    assert event["Delay"] == 30 * SECOND

    # The next failure waits twice as long (exponential).
    report(server, second, "failed")
    (again,) = pending_evals(server, "fl")
    server.scheduler.process(again["ID"])
    (followup2,) = pending_evals(server, "fl")
    delay = parse_rfc3339_ns(followup2["WaitUntil"]) - parse_rfc3339_ns(
        server.store.allocs[second["ID"]]["TaskStates"]["t"]["FinishedAt"]
    )
    assert delay == 60 * SECOND


async def test_spent_reschedule_policy_leaves_the_job_short(server: NomadServer) -> None:
    policy = {
        "Attempts": 1,
        "Interval": 3600 * SECOND,
        "Delay": 5 * SECOND,
        "DelayFunction": "constant",
        "Unlimited": False,
    }
    register(server, mock_job("spent", count=2, ReschedulePolicy=policy))
    first, other = live(server, "spent")
    report(server, other, "running")
    report(server, first, "failed")
    server.scheduler.process(pending_evals(server, "spent")[0]["ID"])
    server.scheduler.process(pending_evals(server, "spent")[0]["ID"])  # the follow-up
    replacement = next(a for a in live(server, "spent") if a["PreviousAllocation"] == first["ID"])

    report(server, replacement, "failed")
    assert pending_evals(server, "spent") == []  # policy spent: Nomad makes no evaluation
    register(server, mock_job("spent", count=2, ReschedulePolicy=policy))  # even a re-evaluation
    running = [a for a in live(server, "spent") if a["ClientStatus"] != "failed"]
    assert [a["ID"] for a in running] == [other["ID"]]
    assert server.store.jobs[("default", "spent")]["Status"] == "running"
    summary = server.store.job_summaries[("default", "spent")]["Summary"]["g"]
    assert (summary["Running"], summary["Failed"]) == (1, 2)


async def test_allocations_on_a_node_that_goes_down_are_replaced(server: NomadServer) -> None:
    register(server, mock_job("lost", count=1))
    (alloc,) = live(server, "lost")
    node = server.store.nodes[alloc["NodeID"]]
    answer = server.put_node(tiny_node(node["Name"], status="down"))
    (eval_id,) = answer["EvalIDs"]
    assert server.store.evals[eval_id]["TriggeredBy"] == "node-update"
    server.scheduler.process(eval_id)
    old = server.store.allocs[alloc["ID"]]
    assert (old["DesiredStatus"], old["ClientStatus"]) == ("stop", "lost")
    (replacement,) = live(server, "lost")
    assert replacement["NodeID"] != alloc["NodeID"] and replacement["PreviousAllocation"] == alloc["ID"]


async def test_a_changed_group_replaces_allocations_and_a_count_change_does_not(server: NomadServer) -> None:
    # Without deployments, so every allocation is replaced at once (test_deployments rolls).
    register(server, mock_job("upd", count=2, **NO_DEPLOYMENTS))
    before = {a["Name"]: a["ID"] for a in live(server, "upd")}

    changed = mock_job("upd", count=2, config={"run_for": "2h"}, **NO_DEPLOYMENTS)
    register(server, changed)
    after = live(server, "upd")
    assert {a["Name"] for a in after} == set(before)
    assert not {a["ID"] for a in after} & set(before.values())
    old = [server.store.allocs[i] for i in before.values()]
    assert {a["DesiredDescription"] for a in old} == {"alloc is being updated due to job update"}
    assert {a["NextAllocation"] for a in old} == {a["ID"] for a in after}
    assert {a["Job"]["Version"] for a in after} == {1}


async def test_finished_batch_allocations_are_not_replaced(server: NomadServer) -> None:
    job = mock_job("once", count=1, config={"run_for": "1s"})
    job["Job"]["Type"] = "batch"
    register(server, job)
    (alloc,) = live(server, "once")
    report(server, alloc, "complete")
    again = server.register(job)  # an identical re-register: evaluated, nothing to place
    server.scheduler.process(again["EvalID"])
    assert [a["ID"] for a in live(server, "once")] == [alloc["ID"]]
    assert server.store.jobs[("default", "once")]["Status"] == "dead"


def test_reschedule_delay_functions() -> None:
    def alloc_with(delays: list[int], last_reschedule: int = 0) -> Json:
        events = [
            {"RescheduleTime": last_reschedule, "Delay": d, "PrevAllocID": "", "PrevNodeID": ""}
            for d in delays
        ]
        return {
            "RescheduleTracker": {"Events": events} if events else None,
            "TaskStates": None,
            "ModifyTime": 0,
        }

    exp = {"Delay": 30 * SECOND, "DelayFunction": "exponential", "MaxDelay": 3600 * SECOND, "Unlimited": True}
    assert next_delay(alloc_with([]), exp) == 30 * SECOND
    assert next_delay(alloc_with([30 * SECOND]), exp) == 60 * SECOND
    assert next_delay(alloc_with([2400 * SECOND]), exp) == 3600 * SECOND  # capped
    fib = {"Delay": 5 * SECOND, "DelayFunction": "fibonacci", "MaxDelay": 100 * SECOND}
    assert next_delay(alloc_with([5 * SECOND, 5 * SECOND]), fib) == 10 * SECOND
    assert next_delay(alloc_with([5 * SECOND, 10 * SECOND]), fib) == 15 * SECOND
    const = {"Delay": 5 * SECOND, "DelayFunction": "constant"}
    assert next_delay(alloc_with([5 * SECOND, 5 * SECOND]), const) == 5 * SECOND

    limited = {"Attempts": 2, "Interval": 600 * SECOND, "Unlimited": False}
    now = 10_000 * SECOND
    assert reschedule_eligible(alloc_with([5], now - 10 * SECOND), limited, now)
    two = alloc_with([5, 5], now - 10 * SECOND)
    assert not reschedule_eligible(two, limited, now)
    assert reschedule_eligible(alloc_with([5, 5], now - 700 * SECOND), limited, now)  # outside the interval
    assert not reschedule_eligible(alloc_with([]), {"Attempts": 0, "Unlimited": False}, now)


# ----- the whole process, with the clock sped up ----------------------------------------------


def test_failing_task_is_rescheduled_once_then_left_failed(
    start_standin: Callable[..., StandIn], tmp_path: Path
) -> None:
    standin = start_standin(nodes=tiny_fleet(tmp_path), clock_speed=50, consul=False)
    client = standin.client()
    job = mock_job(
        "crash",
        config={"run_for": "100ms", "exit_code": 1},
        RestartPolicy={"Attempts": 0, "Mode": "fail", "Interval": 60 * SECOND, "Delay": SECOND},
        ReschedulePolicy={
            "Attempts": 1,
            "Interval": 3600 * SECOND,
            "Delay": 5 * SECOND,
            "DelayFunction": "constant",
            "Unlimited": False,
        },
    )
    client.jobs.register_job(job)

    def chain() -> list[Json] | None:
        allocs = client.job.get_allocations("crash")
        return allocs if len(allocs) == 2 and all(a["ClientStatus"] == "failed" for a in allocs) else None

    allocs = wait_for(chain, timeout=20, what="the failed allocation and its failed replacement")
    replacement = next(a for a in allocs if a["RescheduleTracker"])
    first = next(a for a in allocs if a["ID"] != replacement["ID"])
    assert first["NextAllocation"] == replacement["ID"]
    assert client.allocation.get_allocation(replacement["ID"])["PreviousAllocation"] == first["ID"]
    assert replacement["RescheduleTracker"]["Events"][0]["Delay"] == 5 * SECOND
    triggers = [e["TriggeredBy"] for e in client.job.get_evaluations("crash")]
    assert triggers.count("alloc-failure") == 2  # the failure report and its delayed follow-up
    wait_for(lambda: client.job.get_job("crash")["Status"] == "dead", what="job dead once nothing can run")
    assert client.job.get_summary("crash")["Summary"]["g"]["Failed"] == 2


def test_blocked_eval_places_when_a_node_is_added(start_standin: Callable[..., StandIn]) -> None:
    standin = start_standin(nodes=[tiny_node("tiny-0")], consul=False)
    client: nomad.Nomad = standin.client()
    result = client.jobs.register_job(mock_job("wait", count=2, cpu=3000))
    evaluation = eval_done(client, result["EvalID"])
    assert evaluation["FailedTGAllocs"]["g"]["NodesExhausted"] == 1
    blocked = client.evaluation.get_evaluation(evaluation["BlockedEval"])
    assert blocked["Status"] == "blocked"
    assert len(live_allocs(client, "wait")) == 1

    standin.add_node(tiny_node("tiny-extra"))
    wait_for(lambda: client.evaluation.get_evaluation(blocked["ID"])["Status"] == "complete", what="unblock")
    nodes = {a["NodeName"] for a in live_allocs(client, "wait")}
    assert nodes == {"tiny-0", "tiny-extra"}
