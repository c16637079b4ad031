"""Deployments in the stand-in, as Nomad makes them: one per job version for a service group with
`max_parallel > 0` (which Nomad's default update strategy has), allocation health within
min_healthy_time / healthy_deadline / progress_deadline, statuses and descriptions in Nomad's
words, the deployment endpoints, and `Job.Scale` refused while one is active."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from devstack.nomad.encode import parse_rfc3339_ns
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import NO_DEPLOYMENTS, SECOND, eval_done, live_allocs, mock_job, wait_for

MINUTE = 60 * SECOND
# The stand-in's clock runs this much faster, so Nomad's default min_healthy_time of 10s is half
# a second here and a ten-minute progress deadline thirty.
SPEED = 20.0

# Field names of nomad/structs/deployment.go `Deployment` and `DeploymentState`, alloc.go
# `AllocDeploymentStatus` and structs.go `DeploymentUpdateResponse` (with its WriteMeta).
DEPLOYMENT_FIELDS = {
    "ID", "Namespace", "JobID", "JobVersion", "JobModifyIndex", "JobSpecModifyIndex", "JobCreateIndex",
    "IsMultiregion", "TaskGroups", "Status", "StatusDescription", "EvalPriority", "CreateIndex",
    "ModifyIndex", "CreateTime", "ModifyTime",
}  # fmt: skip
DEPLOYMENT_STATE_FIELDS = {
    "AutoRevert", "AutoPromote", "ProgressDeadline", "RequireProgressBy", "Promoted", "PlacedCanaries",
    "DesiredCanaries", "DesiredTotal", "PlacedAllocs", "HealthyAllocs", "UnhealthyAllocs",
}  # fmt: skip
ALLOC_DEPLOYMENT_STATUS_FIELDS = {"Healthy", "Timestamp", "Canary", "ModifyIndex"}
UPDATE_RESPONSE_FIELDS = {
    "EvalID", "EvalCreateIndex", "DeploymentModifyIndex", "RevertedJobVersion",
    "Index", "LastContact", "KnownLeader", "NextToken",
}  # fmt: skip

# An update strategy whose allocations take half an hour (of the stand-in's clock) to count as
# healthy: its deployment stays running for the whole test.
SLOW = {
    "Update": {
        "MaxParallel": 1,
        "MinHealthyTime": 30 * MINUTE,
        "HealthyDeadline": 60 * MINUTE,
        "ProgressDeadline": 120 * MINUTE,
    }
}


class Api:
    def __init__(self, standin: StandIn) -> None:
        self.url = standin.url
        self.client = standin.client()

    def get(self, path: str, **params: str) -> Any:
        reply = requests.get(f"{self.url}{path}", params=params, timeout=30)
        assert reply.status_code == 200, f"GET {path}: {reply.status_code} {reply.text}"
        return reply.json()

    def post(self, path: str, body: Any = None) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, timeout=10)

    def register(self, job: dict[str, Any]) -> dict[str, Any]:
        reply = self.post("/v1/jobs", job)
        assert reply.status_code == 200, reply.text
        result: dict[str, Any] = reply.json()
        return result

    def scale(self, job_id: str, count: int | None, **body: Any) -> requests.Response:
        return self.post(f"/v1/job/{job_id}/scale", {"Count": count, "Target": {"Group": "g"}, **body})

    def deployment(self, job_id: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.get(f"/v1/job/{job_id}/deployment")
        return found

    def deployment_with(self, job_id: str, status: str, timeout: float = 20) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            found = self.deployment(job_id)
            return found if found is not None and found["Status"] == status else None

        return wait_for(check, timeout, f"{job_id}'s deployment {status}")


@pytest.fixture
def api(start_standin: Callable[..., StandIn]) -> Api:
    return Api(start_standin(consul=False, clock_speed=SPEED))


def test_a_service_job_without_an_update_block_deploys_and_succeeds_once_healthy(api: Api) -> None:
    result = api.register(mock_job("web", count=2))
    client_job = api.get("/v1/job/web")
    assert client_job["TaskGroups"][0]["Update"]["MaxParallel"] == 1  # Nomad's default, filled in
    eval_done(api.client, result["EvalID"])

    first = api.deployment("web")
    assert first is not None and set(first) == DEPLOYMENT_FIELDS
    assert (first["JobID"], first["JobVersion"], first["Namespace"]) == ("web", 0, "default")
    assert first["JobCreateIndex"] == client_job["CreateIndex"]
    state = first["TaskGroups"]["g"]
    assert set(state) == DEPLOYMENT_STATE_FIELDS
    assert (state["DesiredTotal"], state["PlacedAllocs"], state["ProgressDeadline"]) == (2, 2, 10 * MINUTE)
    assert state["RequireProgressBy"] != "0001-01-01T00:00:00Z"
    allocs = live_allocs(api.client, "web")
    assert {a["DeploymentStatus"] for a in allocs} == {None}
    full = api.get(f"/v1/allocation/{allocs[0]['ID']}")
    assert full["DeploymentID"] == first["ID"]

    done = api.deployment_with("web", "successful")
    assert done["StatusDescription"] == "Deployment completed successfully"
    assert done["TaskGroups"]["g"]["HealthyAllocs"] == 2
    statuses = [a["DeploymentStatus"] for a in live_allocs(api.client, "web")]
    assert all(set(s) == ALLOC_DEPLOYMENT_STATUS_FIELDS for s in statuses)
    assert all(s["Healthy"] is True and s["Canary"] is False and s["ModifyIndex"] > 0 for s in statuses)
    assert api.get("/v1/job/web")["Stable"] is True
    scale_status = api.get("/v1/job/web/scale")["TaskGroups"]["g"]
    assert {k: scale_status[k] for k in ("Desired", "Placed", "Running", "Healthy", "Unhealthy")} == {
        "Desired": 2,
        "Placed": 2,
        "Running": 2,
        "Healthy": 2,
        "Unhealthy": 0,
    }
    members = api.get(f"/v1/deployment/allocations/{done['ID']}")
    assert {a["ID"] for a in members} == {a["ID"] for a in allocs}
    assert [d["ID"] for d in api.get("/v1/deployments")] == [done["ID"]]
    assert api.get(f"/v1/deployment/{done['ID']}") == done

    # A later evaluation of the same version (an unchanged job registered again) makes none.
    eval_done(api.client, api.register(mock_job("web", count=2))["EvalID"])
    assert [d["ID"] for d in api.get("/v1/job/web/deployments")] == [done["ID"]]


def test_scale_is_refused_with_nomads_text_while_the_deployment_is_active(api: Api) -> None:
    api.register(mock_job("slow", count=1, **SLOW))
    running = api.deployment_with("slow", "running")
    assert running["StatusDescription"] == "Deployment is running"

    refused = api.scale("slow", 0, Message="park")
    assert (refused.status_code, refused.text) == (400, "job scaling blocked due to active deployment")
    assert api.get("/v1/job/slow")["TaskGroups"][0]["Count"] == 1
    # Only a count is refused: a scaling event without one is still recorded.
    assert api.scale("slow", None, Message="note", Error=True).status_code == 200

    failed = api.post(f"/v1/deployment/fail/{running['ID']}")
    assert failed.status_code == 200, failed.text
    assert set(failed.json()) == UPDATE_RESPONSE_FIELDS and failed.json()["EvalID"]
    after = api.deployment("slow")
    assert after is not None
    assert (after["Status"], after["StatusDescription"]) == ("failed", "Deployment marked as failed")
    again = api.post(f"/v1/deployment/fail/{running['ID']}")
    assert (again.status_code, again.text) == (500, "can't fail terminal deployment")

    accepted = api.scale("slow", 0, Message="park")
    assert accepted.status_code == 200, accepted.text
    wait_for(lambda: live_allocs(api.client, "slow") == [], what="scaled to zero")


def test_max_parallel_zero_opts_out_and_scale_is_never_blocked(api: Api) -> None:
    result = api.register(mock_job("opt", count=1, **NO_DEPLOYMENTS))
    eval_done(api.client, result["EvalID"])
    assert api.deployment("opt") is None and api.get("/v1/job/opt/deployments") == []
    (alloc,) = live_allocs(api.client, "opt")
    assert api.get(f"/v1/allocation/{alloc['ID']}")["DeploymentID"] == ""
    for count in (2, 0, 1):
        reply = api.scale("opt", count)
        assert reply.status_code == 200, reply.text
    assert api.get("/v1/deployments") == []
    # Health is still judged, by the migrate strategy, as a drain would need it.
    wait_for(
        lambda: any((a["DeploymentStatus"] or {}).get("Healthy") for a in live_allocs(api.client, "opt")),
        20,
        "an allocation found healthy without a deployment",
    )
    assert api.get("/v1/deployments") == []


def test_a_new_version_cancels_the_running_deployment_and_a_stop_cancels_its_own(api: Api) -> None:
    api.register(mock_job("ver", count=1, **SLOW))
    first = api.deployment_with("ver", "running")
    api.register(mock_job("ver", count=1, config={"run_for": "2h"}, **SLOW))
    second = wait_for(
        lambda: (d := api.deployment("ver")) is not None and d["ID"] != first["ID"] and d,
        what="a deployment for version 1",
    )
    assert second["JobVersion"] == 1 and second["Status"] == "running"
    old = api.get(f"/v1/deployment/{first['ID']}")
    assert (old["Status"], old["StatusDescription"]) == ("cancelled", "Cancelled due to newer version of job")
    listed = api.get("/v1/job/ver/deployments")
    assert [d["ID"] for d in listed] == [second["ID"], first["ID"]]  # newest first

    requests.delete(f"{api.url}/v1/job/ver", timeout=10).raise_for_status()
    stopped = api.deployment_with("ver", "cancelled")
    assert stopped["ID"] == second["ID"]
    assert stopped["StatusDescription"] == "Cancelled because job is stopped"


def test_opting_out_later_cancels_the_deployment_and_replaces_nothing(api: Api) -> None:
    api.register(mock_job("late", count=1, **SLOW))
    running = api.deployment_with("late", "running")
    (before,) = live_allocs(api.client, "late")
    result = api.register(mock_job("late", count=1, **NO_DEPLOYMENTS))
    eval_done(api.client, result["EvalID"])
    cancelled = api.get(f"/v1/deployment/{running['ID']}")
    assert cancelled["StatusDescription"] == "Cancelled due to newer version of job"
    assert api.get("/v1/job/late/deployments")[0]["ID"] == running["ID"]  # no new one
    (after,) = live_allocs(api.client, "late")
    assert after["ID"] == before["ID"] and after["JobVersion"] == 1  # updated in place
    assert api.scale("late", 2).status_code == 200


def test_the_progress_deadline_fails_a_deployment_whose_allocations_never_turn_healthy(api: Api) -> None:
    crash = mock_job(
        "crash",
        count=1,
        config={"run_for": "1s", "exit_code": 1},
        RestartPolicy={"Attempts": 0, "Mode": "fail"},
        Update={"MaxParallel": 1, "MinHealthyTime": 10 * SECOND, "HealthyDeadline": MINUTE},
    )
    crash["Job"]["TaskGroups"][0]["Update"]["ProgressDeadline"] = 2 * MINUTE
    api.register(crash)
    running = api.deployment_with("crash", "running")
    assert api.scale("crash", 0).text == "job scaling blocked due to active deployment"
    # Unhealthy allocations are replaced meanwhile (progress-based), and the job stays blocked.
    wait_for(
        lambda: any((a["DeploymentStatus"] or {}).get("Healthy") is False for a in _all_allocs(api, "crash")),
        20,
        "an allocation found unhealthy",
    )
    failed = api.deployment_with("crash", "failed", timeout=30)
    assert failed["ID"] == running["ID"]
    assert failed["StatusDescription"] == "Failed due to progress deadline"
    assert failed["TaskGroups"]["g"]["UnhealthyAllocs"] >= 1
    assert api.scale("crash", 0).status_code == 200


def test_without_a_progress_deadline_the_first_unhealthy_allocation_fails_the_deployment(api: Api) -> None:
    api.register(
        mock_job(
            "strict",
            count=1,
            config={"run_for": "1s", "exit_code": 1},
            RestartPolicy={"Attempts": 0, "Mode": "fail"},
            Update={"MaxParallel": 1, "ProgressDeadline": 0},
        )
    )
    failed = api.deployment_with("strict", "failed")
    assert failed["StatusDescription"] == "Failed due to unhealthy allocations"
    assert failed["TaskGroups"]["g"]["UnhealthyAllocs"] == 1


def test_a_rolling_update_replaces_max_parallel_allocations_at_a_time(api: Api) -> None:
    api.register(mock_job("roll", count=3))
    first = api.deployment_with("roll", "successful")
    api.register(mock_job("roll", count=3, config={"run_for": "2h"}))
    second = api.deployment_with("roll", "running")
    assert second["ID"] != first["ID"] and second["TaskGroups"]["g"]["DesiredTotal"] == 3

    seen_new: list[int] = []
    done = threading.Event()

    def watch() -> None:
        # No more than max_parallel (1) replacement is ever waiting to be found healthy.
        while not done.is_set():
            allocs = live_allocs(api.client, "roll")
            unsettled = [
                a
                for a in allocs
                if a["JobVersion"] == 1 and (a["DeploymentStatus"] or {}).get("Healthy") is None
            ]
            seen_new.append(len(unsettled))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        finished = api.deployment_with("roll", "successful", timeout=30)
    finally:
        done.set()
        watcher.join()
    assert finished["ID"] == second["ID"] and finished["TaskGroups"]["g"]["HealthyAllocs"] == 3
    assert max(seen_new) == 1
    assert {a["JobVersion"] for a in live_allocs(api.client, "roll")} == {1}


def test_deployment_changes_are_events_on_the_deployment_topic(api: Api) -> None:
    api.register(mock_job("ev", count=1))
    done = api.deployment_with("ev", "successful")
    params = {"topic": "Deployment", "index": "1"}
    seen: list[dict[str, Any]] = []
    with requests.get(f"{api.url}/v1/event/stream", params=params, stream=True, timeout=10) as reply:
        for line in reply.iter_lines():
            seen.extend(json.loads(line).get("Events") or [])
            if any(e["Payload"]["Deployment"]["Status"] == "successful" for e in seen):
                break
    assert {(e["Topic"], e["Type"], e["Key"]) for e in seen} == {
        ("Deployment", "DeploymentStatusUpdate", done["ID"])
    }
    assert seen[0]["Payload"]["Deployment"]["Status"] == "running"


def test_deployment_reads_are_blocking_queries(api: Api) -> None:
    index = int(requests.get(f"{api.url}/v1/deployments", timeout=10).headers["X-Nomad-Index"])
    timer = threading.Timer(0.5, lambda: api.register(mock_job("later", count=1, **SLOW)))
    timer.start()
    started = time.monotonic()
    reply = requests.get(f"{api.url}/v1/deployments", params={"index": str(index), "wait": "20s"}, timeout=30)
    took = time.monotonic() - started
    timer.join()
    assert reply.status_code == 200 and int(reply.headers["X-Nomad-Index"]) > index
    assert [d["JobID"] for d in reply.json()] == ["later"]
    assert 0.3 < took < 10


def test_promote_pause_and_unknown_deployments(api: Api) -> None:
    api.register(mock_job("promo", count=1, **SLOW))
    running = api.deployment_with("promo", "running")
    paused = api.post(f"/v1/deployment/pause/{running['ID']}", {"DeploymentID": running["ID"], "Pause": True})
    assert paused.status_code == 200, paused.text
    got = api.deployment("promo")
    assert got is not None and (got["Status"], got["StatusDescription"]) == ("paused", "Deployment is paused")
    assert api.scale("promo", 2).text == "job scaling blocked due to active deployment"  # paused is active
    resumed = api.post(
        f"/v1/deployment/pause/{running['ID']}", {"DeploymentID": running["ID"], "Pause": False}
    )
    assert resumed.status_code == 200
    promoted = api.post(
        f"/v1/deployment/promote/{running['ID']}", {"DeploymentID": running["ID"], "All": True}
    )
    assert promoted.status_code == 200 and promoted.json()["EvalID"]
    got = api.deployment("promo")
    assert got is not None and got["Status"] == "running" and got["TaskGroups"]["g"]["Promoted"] is True
    mismatch = api.post(f"/v1/deployment/promote/{running['ID']}", {"DeploymentID": "other", "All": True})
    assert (mismatch.status_code, mismatch.text) == (400, "Deployment ID does not match")

    missing = requests.get(f"{api.url}/v1/deployment/no-such-id", timeout=10)
    assert (missing.status_code, missing.text) == (404, "deployment not found")
    assert api.get("/v1/job/no-such-job/deployment") is None


def test_promoting_a_deployment_without_canaries_succeeds_as_nomad_does(api: Api) -> None:
    """Nomad has no "no canaries to promote" refusal: `StateStore.UpdateDeploymentPromotion`
    skips groups that want no canaries, marks the named groups promoted, pushes their progress
    deadline out by a full ProgressDeadline and stores the watcher's evaluation. Nomad's
    `nomad deployment promote` on a rolling update therefore succeeds, and so does the stand-in."""
    api.register(mock_job("plain", count=1, **SLOW))
    running = wait_for(
        lambda: (
            (d := api.deployment_with("plain", "running"))
            and parse_rfc3339_ns(d["TaskGroups"]["g"]["RequireProgressBy"])
            and d
        ),
        20,
        "a running deployment with a progress deadline",
    )
    before = parse_rfc3339_ns(running["TaskGroups"]["g"]["RequireProgressBy"])
    asked = time.time_ns()
    promoted = api.post(
        f"/v1/deployment/promote/{running['ID']}", {"DeploymentID": running["ID"], "All": True}
    )
    assert promoted.status_code == 200, promoted.text
    assert set(promoted.json()) == UPDATE_RESPONSE_FIELDS
    evaluation = eval_done(api.client, promoted.json()["EvalID"])
    assert (evaluation["TriggeredBy"], evaluation["DeploymentID"]) == ("deployment-watcher", running["ID"])
    got = api.deployment("plain")
    assert got is not None
    state = got["TaskGroups"]["g"]
    assert (got["Status"], state["Promoted"], state["DesiredCanaries"]) == ("running", True, 0)
    # Reset from the promotion on: the stand-in's clock runs SPEED times faster than real time.
    after = parse_rfc3339_ns(state["RequireProgressBy"])
    assert after > before and after >= asked + 120 * MINUTE // int(SPEED) - 5 * SECOND


def test_promote_and_pause_need_the_deployment_id_in_the_body_and_refuse_a_finished_deployment(
    api: Api,
) -> None:
    api.register(mock_job("finished", count=1))
    finished = api.deployment_with("finished", "successful", timeout=30)
    for action in ("promote", "pause"):
        missing = api.post(f"/v1/deployment/{action}/{finished['ID']}", {"All": True})
        assert (missing.status_code, missing.text) == (400, "DeploymentID must be specified"), action
    terminal = api.post(
        f"/v1/deployment/promote/{finished['ID']}", {"DeploymentID": finished["ID"], "All": True}
    )
    assert (terminal.status_code, terminal.text) == (500, "can't promote terminal deployment")
    unknown = api.post("/v1/deployment/promote/no-such-id", {"DeploymentID": "no-such-id", "All": True})
    assert (unknown.status_code, unknown.text) == (500, "deployment not found")


def _all_allocs(api: Api, job_id: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = api.get(f"/v1/job/{job_id}/allocations", all="true")
    return found
