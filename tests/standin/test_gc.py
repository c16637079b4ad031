"""The stand-in's garbage collector: what Nomad's servers forget, and when (`core_sched.go`).

Driven in-process as the scheduler tests are: each evaluation is processed when the test says,
allocations change status when the test reports it, and the clock moves when the test moves it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import requests

from devstack.nomad.clock import Clock
from devstack.nomad.encode import rfc3339
from devstack.nomad.gc import Collected, GCConfig
from devstack.nomad.nodes import node_from_spec
from devstack.nomad.server import NomadServer
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import SECOND, mock_job, tiny_node, wait_for
from tests.standin.test_scheduler import live, pending_evals, register, report

Json = dict[str, Any]
HOUR = 3600.0


class HandClock(Clock):
    """A clock that moves only when the test moves it."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 1_700_000_000.0

    def now(self) -> float:
        return self.t


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[NomadServer]:
    nodes = [node_from_spec(tiny_node(f"tiny-{i}")) for i in range(2)]
    srv = NomadServer(nodes, None, tmp_path, HandClock(), GCConfig())
    for node in nodes:
        srv.store.upsert_node(node)
    try:
        yield srv
    finally:
        await srv.scheduler.stop()


def later(srv: NomadServer, seconds: float) -> None:
    assert isinstance(srv.clock, HandClock)
    srv.gc.witness()
    srv.clock.t += seconds
    srv.gc.witness()


POLICY = {
    "Attempts": 2,
    "Interval": 24 * 3600 * SECOND,
    "Delay": 5 * SECOND,
    "DelayFunction": "constant",
    "Unlimited": False,
}


def failed_then_replaced(srv: NomadServer) -> tuple[Json, Json]:
    """A job whose first allocation failed and was rescheduled; the replacement runs."""
    register(srv, mock_job("crash", count=1, ReschedulePolicy=POLICY))
    (first,) = live(srv, "crash")
    report(srv, first, "failed")
    srv.scheduler.process(pending_evals(srv, "crash")[0]["ID"])
    srv.scheduler.process(pending_evals(srv, "crash")[0]["ID"])  # the delayed follow-up
    (second,) = [a for a in live(srv, "crash") if a["ID"] != first["ID"]]
    report(srv, second, "running")
    return srv.store.allocs[first["ID"]], srv.store.allocs[second["ID"]]


async def test_a_forced_gc_collects_replaced_failures_and_keeps_what_runs(server: NomadServer) -> None:
    first, second = failed_then_replaced(server)
    assert first["NextAllocation"] == second["ID"]

    done = server.force_gc()
    assert first["ID"] not in server.store.allocs
    assert second["ID"] in server.store.allocs
    assert done.allocs == 1 and done.jobs == 0
    assert [a["ID"] for a in server.store.allocs_for_job("default", "crash")] == [second["ID"]]
    # The evaluation that placed only the failure goes with it; the one that placed the running
    # replacement stays, and so does the job.
    assert first["EvalID"] not in server.store.evals
    assert second["EvalID"] in server.store.evals
    assert ("default", "crash") in server.store.jobs


async def test_a_failure_waiting_to_be_rescheduled_is_kept(server: NomadServer) -> None:
    """Nomad needs it to carry the reschedule tracker forward (`allocGCEligible`)."""
    register(server, mock_job("crash", count=1, ReschedulePolicy=POLICY))
    (first,) = live(server, "crash")
    report(server, first, "failed")
    server.force_gc()
    assert first["ID"] in server.store.allocs


async def test_without_force_only_what_is_older_than_the_threshold_goes(server: NomadServer) -> None:
    first, _ = failed_then_replaced(server)
    later(server, 30 * 60)
    assert server.gc.collect(forced=False).allocs == 0  # half of eval_gc_threshold (1h)
    assert first["ID"] in server.store.allocs
    later(server, 31 * 60)
    assert server.gc.collect(forced=False).allocs == 1
    assert first["ID"] not in server.store.allocs


async def test_a_stopped_job_loses_its_history_after_an_hour_and_goes_after_four(
    server: NomadServer,
) -> None:
    register(server, mock_job("gone", count=2))
    allocs = live(server, "gone")
    stop = server.deregister("default", "gone", purge=False)
    server.scheduler.process(stop["EvalID"])
    for a in allocs:
        report(server, server.store.allocs[a["ID"]], "complete")
    assert server.store.jobs[("default", "gone")]["Status"] == "dead"

    later(server, 0.5 * HOUR)
    assert server.gc.collect(forced=False) == Collected()
    later(server, 0.6 * HOUR)
    # eval_gc_threshold (1h): the terminal evaluations and their allocations go, the job stays.
    done = server.gc.collect(forced=False)
    assert (done.jobs, done.evals, done.allocs) == (0, 2, 2)
    assert server.store.allocs_for_job("default", "gone") == []
    assert ("default", "gone") in server.store.jobs
    later(server, 3 * HOUR)
    assert server.gc.collect(forced=False).jobs == 1  # job_gc_threshold (4h)
    assert ("default", "gone") not in server.store.jobs
    assert server.store.evals_for_job("default", "gone") == []


async def test_a_running_job_is_never_collected(server: NomadServer) -> None:
    register(server, mock_job("keep", count=1))
    (alloc,) = live(server, "keep")
    report(server, alloc, "running")
    done = server.force_gc()
    assert (done.jobs, done.allocs) == (0, 0)
    assert alloc["ID"] in server.store.allocs


def test_system_gc_over_http_forgets_a_replaced_failure(start_standin: Any, tmp_path: Path) -> None:
    """`nomad system gc` against the process: the API answers as Nomad's does and the failed
    allocation is gone from every list."""
    standin: StandIn = start_standin(nodes=[tiny_node("tiny-0")], clock_speed=50, consul=False)
    client = standin.client()
    client.jobs.register_job(
        mock_job(
            "crash",
            config={"run_for": "100ms", "exit_code": 1},
            RestartPolicy={"Attempts": 0, "Mode": "fail", "Interval": 60 * SECOND, "Delay": SECOND},
            ReschedulePolicy={**POLICY, "Attempts": 1},
        )
    )

    def replaced() -> list[Json] | None:
        allocs = client.job.get_allocations("crash")
        return allocs if any(a["NextAllocation"] for a in allocs) else None

    first = next(a for a in wait_for(replaced, 20, "a replaced failure") if a["NextAllocation"])
    response = requests.put(f"{standin.url}/v1/system/gc", timeout=10)
    assert response.status_code == 200 and response.text == "null"
    assert first["ID"] not in {a["ID"] for a in client.job.get_allocations("crash")}
    assert requests.get(f"{standin.url}/v1/allocation/{first['ID']}", timeout=10).status_code == 404


def healthy(srv: NomadServer, alloc: Json) -> None:
    """What the client's health tracker reports once the allocation is healthy, and the
    evaluation the deployment watcher then creates (which marks a finished deployment
    successful)."""
    status = {"Healthy": True, "Timestamp": rfc3339(srv.clock.now_ns()), "Canary": False, "ModifyIndex": 0}
    srv.store.upsert_alloc({**srv.store.allocs[alloc["ID"]], "DeploymentStatus": status})
    evaluation = srv.deployment_eval(srv.store.deployments[alloc["DeploymentID"]])
    assert evaluation is not None
    srv.scheduler.process(evaluation["ID"])


def deployed(srv: NomadServer, job_id: str, version: str = "1h") -> Json:
    """Registers (a new version of) the job and lets its deployment succeed; returns it."""
    register(srv, mock_job(job_id, count=1, config={"run_for": version}))
    (alloc,) = [a for a in live(srv, job_id) if a["ClientStatus"] == "pending"]
    report(srv, alloc, "running")
    healthy(srv, alloc)
    deployment = srv.store.deployments[alloc["DeploymentID"]]
    assert deployment["Status"] == "successful"
    return deployment


async def test_a_replaced_deployment_goes_after_an_hour_and_an_active_one_stays(server: NomadServer) -> None:
    """`deploymentGC`: terminal, unchanged for deployment_gc_threshold (1h), and no allocation
    that is not terminal still under it. An active deployment stays however old it is."""
    first = deployed(server, "web")
    # A new version replaces the allocation; its own deployment stays running (nothing reports
    # the new allocation healthy).
    register(server, mock_job("web", count=1, config={"run_for": "2h"}))
    (second,) = [d for d in server.store.deployments_for_job("default", "web") if d["ID"] != first["ID"]]
    assert second["Status"] == "running"
    later(server, 0.5 * HOUR)
    assert server.gc.collect(forced=False).deployments == 0
    later(server, 0.6 * HOUR)
    assert server.gc.collect(forced=False).deployments == 1
    assert first["ID"] not in server.store.deployments
    assert [d["ID"] for d in server.store.deployments_for_job("default", "web")] == [second["ID"]]
    later(server, 24 * HOUR)
    assert server.force_gc().deployments == 0
    assert second["ID"] in server.store.deployments


async def test_a_forced_gc_collects_finished_deployments_whatever_their_age(server: NomadServer) -> None:
    """Except one whose allocation still runs: a running job's last deployment stays."""
    first = deployed(server, "web")
    second = deployed(server, "web", version="2h")
    done = server.force_gc()
    assert done.deployments == 1 and done.jobs == 0
    assert list(server.store.deployments) == [second["ID"]]
    assert first["ID"] not in {d["ID"] for d in server.store.deployments_for_job("default", "web")}


async def test_a_collected_or_purged_job_takes_its_deployments_with_it(tmp_path: Path) -> None:
    """Nomad deletes a job's deployments with the job (`deleteJobImpl`), so with a deployment
    threshold longer than the job's they go at the job's."""
    nodes = [node_from_spec(tiny_node("tiny-0"))]
    srv = NomadServer(nodes, None, tmp_path, HandClock(), GCConfig(deployment_threshold_s=24 * HOUR))
    srv.store.upsert_node(nodes[0])
    try:
        deployed(srv, "gone")
        (alloc,) = live(srv, "gone")
        stop = srv.deregister("default", "gone", purge=False)
        srv.scheduler.process(stop["EvalID"])
        report(srv, srv.store.allocs[alloc["ID"]], "complete")
        later(srv, 4.1 * HOUR)
        done = srv.gc.collect(forced=False)
        assert (done.jobs, done.deployments) == (1, 1)
        assert srv.store.deployments == {} and srv.store.deployments_for_job("default", "gone") == []

        # A purge (`nomad job stop -purge`) does the same at once.
        deployed(srv, "purged")
        srv.deregister("default", "purged", purge=True)
        assert srv.store.deployments == {}
    finally:
        await srv.scheduler.stop()


def test_deployments_collected_on_the_interval_are_gone_from_the_api(start_standin: Any) -> None:
    """`--deployment-gc-threshold` against the process: a replaced version's deployment goes from
    `/v1/deployments` and `/v1/deployment/<id>` answers 404; the running one stays."""
    standin: StandIn = start_standin(
        nodes=[tiny_node("tiny-0")],
        clock_speed=20,
        consul=False,
        extra_args=["--gc-interval", "10s", "--deployment-gc-threshold", "20s"],
    )
    client = standin.client()

    def deployment(status: str) -> Json | None:
        found: Json | None = requests.get(f"{standin.url}/v1/job/web/deployment", timeout=10).json()
        return found if found is not None and found["Status"] == status else None

    client.jobs.register_job(mock_job("web", count=1))
    first = wait_for(lambda: deployment("successful"), 20, "the first deployment successful")
    # The new version's allocation takes half an hour (of the stand-in's clock) to count as healthy.
    minute = 60 * SECOND
    slow = {
        "MaxParallel": 1,
        "MinHealthyTime": 30 * minute,
        "HealthyDeadline": 60 * minute,
        "ProgressDeadline": 120 * minute,
    }
    client.jobs.register_job(mock_job("web", count=1, config={"run_for": "2h"}, Update=slow))
    second = wait_for(lambda: deployment("running"), 20, "the second deployment running")

    def collected() -> bool:
        listed = requests.get(f"{standin.url}/v1/deployments", timeout=10).json()
        return first["ID"] not in {d["ID"] for d in listed}

    wait_for(collected, 30, "the first deployment collected")
    assert requests.get(f"{standin.url}/v1/deployment/{first['ID']}", timeout=10).status_code == 404
    listed = requests.get(f"{standin.url}/v1/deployments", timeout=10).json()
    assert [d["ID"] for d in listed] == [second["ID"]]
    assert (
        requests.get(f"{standin.url}/v1/deployment/{second['ID']}", timeout=10).json()["Status"] == "running"
    )
