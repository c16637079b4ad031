"""`/v1/job/<id>/plan`: Nomad's request and response shapes (`nomad/structs/structs.go`
`JobPlanRequest`, `JobPlanResponse`, `DesiredUpdates`, `nomad/structs/diff.go`), answers
computed by the scheduler step that places for real, and nothing written: no index moves, no
evaluation, allocation or job appears."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nomad
import pytest
import requests

from nomad_driver.placement import summarize_placement
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import eval_done, live_allocs, mock_job, wait_for
from tests.standin.test_placement import METRIC_FIELDS

# structs.JobPlanResponse, with its embedded WriteMeta (Index).
PLAN_RESPONSE_FIELDS = {
    "Annotations", "FailedTGAllocs", "JobModifyIndex", "CreatedEvals", "Diff", "NextPeriodicLaunch",
    "Warnings", "Index",
}  # fmt: skip
ANNOTATION_FIELDS = {"DesiredTGUpdates", "PreemptedAllocs"}
DESIRED_UPDATES_FIELDS = {
    "Ignore", "Place", "Migrate", "Stop", "InPlaceUpdate", "DestructiveUpdate", "Canary", "Preemptions",
    "Disconnect", "Reconnect", "RescheduleNow", "RescheduleLater",
}  # fmt: skip
JOB_DIFF_FIELDS = {"Type", "ID", "Fields", "Objects", "TaskGroups"}
GROUP_DIFF_FIELDS = {"Type", "Name", "Fields", "Objects", "Tasks", "Updates"}
TASK_DIFF_FIELDS = {"Type", "Name", "Fields", "Objects", "Annotations"}
FIELD_DIFF_FIELDS = {"Type", "Name", "Old", "New", "Annotations"}
OBJECT_DIFF_FIELDS = {"Type", "Name", "Fields", "Objects"}
# structs.Evaluation (nomad/structs/eval.go)
EVAL_FIELDS = {
    "ID", "Namespace", "Priority", "Type", "TriggeredBy", "JobID", "JobModifyIndex", "NodeID",
    "NodeModifyIndex", "DeploymentID", "Status", "StatusDescription", "Wait", "WaitUntil", "NextEval",
    "PreviousEval", "BlockedEval", "RelatedEvals", "FailedTGAllocs", "PlanAnnotations", "ClassEligibility",
    "QuotaLimitReached", "MissingNonNodeResources", "EscapedComputedClass", "AnnotatePlan",
    "QueuedAllocations", "LeaderACL", "SnapshotIndex", "CreateIndex", "ModifyIndex", "CreateTime", "ModifyTime",
}  # fmt: skip


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


@pytest.fixture
def client(standin: StandIn) -> nomad.Nomad:
    return standin.client()


def plan(standin: StandIn, body: dict[str, Any], job_id: str | None = None, diff: bool = False) -> Any:
    job_id = job_id or body["Job"]["ID"]
    resp = requests.post(f"{standin.url}/v1/job/{job_id}/plan", json={**body, "Diff": diff}, timeout=10)
    return resp


def indexes(standin: StandIn) -> dict[str, str]:
    """The index each table answers with: any write would raise one of them."""
    out = {}
    for path in ("jobs", "evaluations", "allocations", "nodes"):
        resp = requests.get(f"{standin.url}/v1/{path}", timeout=10)
        out[path] = resp.headers["X-Nomad-Index"]
    return out


def gpu_job(job_id: str, memory_mib: int, count: int = 1) -> dict[str, Any]:
    body = mock_job(job_id, count=count)
    body["Job"]["TaskGroups"][0]["Tasks"][0]["Resources"]["Devices"] = [
        {
            "Name": "nvidia/gpu",
            "Count": 1,
            "Constraints": [
                {"LTarget": "${device.attr.memory}", "Operand": ">=", "RTarget": f"{memory_mib} MiB"}
            ],
        }
    ]
    return body


def test_plan_of_a_new_job_has_nomads_fields_and_writes_nothing(
    standin: StandIn, client: nomad.Nomad
) -> None:
    before = indexes(standin)
    resp = plan(standin, mock_job("fresh", count=2))
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert set(answer) == PLAN_RESPONSE_FIELDS
    assert resp.headers["X-Nomad-Index"] == "0"
    assert answer["JobModifyIndex"] == 0 and answer["Index"] == 0
    assert answer["FailedTGAllocs"] is None and answer["CreatedEvals"] is None
    assert answer["Diff"] is None, "no diff unless asked"
    assert answer["NextPeriodicLaunch"] == "0001-01-01T00:00:00Z" and answer["Warnings"] == ""
    assert set(answer["Annotations"]) == ANNOTATION_FIELDS
    updates = answer["Annotations"]["DesiredTGUpdates"]["g"]
    assert set(updates) == DESIRED_UPDATES_FIELDS
    assert updates["Place"] == 2 and sum(updates.values()) == 2
    assert answer["Annotations"]["PreemptedAllocs"] is None

    assert indexes(standin) == before
    assert client.evaluations.get_evaluations() == []
    assert client.jobs.get_jobs() == []

    # With Diff, a new job is Added throughout, and its task is annotated as Nomad's are.
    diff = plan(standin, mock_job("fresh", count=2), diff=True).json()["Diff"]
    assert (diff["Type"], diff["ID"]) == ("Added", "fresh")
    (group,) = diff["TaskGroups"]
    assert group["Type"] == "Added" and group["Updates"] == {"create": 2}
    (count,) = [f for f in group["Fields"] if f["Name"] == "Count"]
    assert (count["Old"], count["New"], count["Annotations"]) == ("", "2", ["forces create"])
    (task,) = group["Tasks"]
    assert task["Type"] == "Added" and task["Annotations"] == ["forces create"]
    assert indexes(standin) == before


def test_plan_of_a_job_that_fits_nowhere_matches_what_registering_it_reports(
    standin: StandIn, client: nomad.Nomad
) -> None:
    body = gpu_job("too-big", memory_mib=200_000)
    before = indexes(standin)
    answer = plan(standin, body).json()
    assert indexes(standin) == before, "a plan that fails to place writes nothing either"
    failed = answer["FailedTGAllocs"]["g"]
    assert set(failed) == METRIC_FIELDS
    assert failed["NodesFiltered"] == 3 and failed["ConstraintFiltered"] == {"missing devices": 3}
    (blocked,) = answer["CreatedEvals"]
    assert set(blocked) == EVAL_FIELDS
    assert blocked["Status"] == "blocked" and blocked["TriggeredBy"] == "queued-allocs"
    assert (blocked["CreateIndex"], blocked["ModifyIndex"]) == (0, 0), "never stored"
    # The blocked evaluation exists only in the answer.
    resp = requests.get(f"{standin.url}/v1/evaluation/{blocked['ID']}", timeout=10)
    assert resp.status_code == 404
    assert answer["Annotations"]["DesiredTGUpdates"]["g"]["Place"] == 1
    assert client.evaluations.get_evaluations() == []

    # Registered for real, the scheduler fails it with the same metrics.
    evaluation = eval_done(client, client.jobs.register_job(body)["EvalID"])
    job = client.job.get_job("too-big")
    assert summarize_placement(answer["FailedTGAllocs"], job) == summarize_placement(
        evaluation["FailedTGAllocs"], job
    )
    assert "no node has 1 x nvidia/gpu with memory >= 200000 MiB: 3 nodes filtered (missing devices)" in (
        summarize_placement(answer["FailedTGAllocs"], job)
    )


def test_plan_of_a_running_job_counts_its_updates_and_changes_nothing(
    standin: StandIn, client: nomad.Nomad
) -> None:
    client.jobs.register_job(mock_job("web", count=2))
    wait_for(lambda: len(live_allocs(client, "web")) == 2, what="two allocations")
    wait_for(lambda: client.job.get_job("web")["Status"] == "running", what="job running")
    job = client.job.get_job("web")
    evals = client.job.get_evaluations("web")
    allocs = live_allocs(client, "web")
    before = indexes(standin)

    same = plan(standin, mock_job("web", count=2), diff=True).json()
    assert same["JobModifyIndex"] == job["JobModifyIndex"] == same["Index"]
    assert same["Annotations"]["DesiredTGUpdates"]["g"]["Ignore"] == 2
    assert same["Diff"]["Type"] == "None"

    # A new count is a new job version: Nomad updates the running allocations in place
    # (`genericAllocUpdateFn`) and places the one more.
    more = plan(standin, mock_job("web", count=3), diff=True).json()
    updates = more["Annotations"]["DesiredTGUpdates"]["g"]
    assert (updates["Place"], updates["InPlaceUpdate"], updates["Ignore"]) == (1, 2, 0)
    diff = more["Diff"]
    assert set(diff) == JOB_DIFF_FIELDS and diff["Type"] == "Edited" and diff["ID"] == "web"
    (group,) = diff["TaskGroups"]
    assert set(group) == GROUP_DIFF_FIELDS and group["Type"] == "Edited"
    assert group["Updates"] == {"create": 1, "in-place update": 2}
    (count,) = [f for f in group["Fields"] if f["Name"] == "Count"]
    assert set(count) == FIELD_DIFF_FIELDS
    assert (count["Type"], count["Old"], count["New"], count["Annotations"]) == (
        "Edited",
        "2",
        "3",
        ["forces create"],
    )

    changed = mock_job("web", count=2, config={"run_for": "2h"})
    destructive = plan(standin, changed, diff=True).json()
    assert destructive["Annotations"]["DesiredTGUpdates"]["g"]["DestructiveUpdate"] == 2
    (task,) = destructive["Diff"]["TaskGroups"][0]["Tasks"]
    assert set(task) == TASK_DIFF_FIELDS
    assert task["Type"] == "Edited" and task["Annotations"] == ["forces create/destroy update"]
    (config,) = [o for o in task["Objects"] if o["Name"] == "Config"]
    assert set(config) == OBJECT_DIFF_FIELDS
    assert {(f["Name"], f["Old"], f["New"]) for f in config["Fields"] if f["Type"] == "Edited"} == {
        ("run_for", "1h", "2h")
    }
    assert destructive["Diff"]["TaskGroups"][0]["Updates"] == {"create/destroy update": 2}

    meta = mock_job("web", count=2)
    meta["Job"]["Meta"] = {"owner": "ops"}
    # Job meta reaches the tasks as NOMAD_META_*, so Nomad replaces them (`tasksUpdated`).
    with_meta = plan(standin, meta, diff=True).json()
    assert with_meta["Annotations"]["DesiredTGUpdates"]["g"]["DestructiveUpdate"] == 2
    assert {(f["Type"], f["Name"], f["New"]) for f in with_meta["Diff"]["Fields"]} == {
        ("Added", "Meta[owner]", "ops")
    }

    assert indexes(standin) == before
    after = client.job.get_job("web")
    assert (after["Version"], after["JobModifyIndex"], after["TaskGroups"][0]["Count"]) == (
        job["Version"],
        job["JobModifyIndex"],
        2,
    )
    assert client.job.get_evaluations("web") == evals
    # The same allocations, at the same version: none stopped, replaced or updated in place.
    assert sorted((a["ID"], a["JobVersion"], a["NodeID"]) for a in live_allocs(client, "web")) == sorted(
        (a["ID"], a["JobVersion"], a["NodeID"]) for a in allocs
    )


def test_plan_refuses_what_nomad_refuses(standin: StandIn) -> None:
    def refused(body: Any, job_id: str = "x") -> tuple[int, str]:
        resp = requests.post(f"{standin.url}/v1/job/{job_id}/plan", json=body, timeout=10)
        return resp.status_code, resp.text

    assert refused({}) == (400, "Job must be specified")
    assert refused({"Job": {"Name": "x"}}) == (400, "Job must have a valid ID")
    assert refused(mock_job("y")) == (400, "Job ID does not match")
    invalid = mock_job("x")
    invalid["Job"]["TaskGroups"][0]["Tasks"][0]["Driver"] = ""
    code, text = refused(invalid)
    assert code == 500 and "Missing task driver" in text
    pooled = mock_job("x")
    pooled["Job"]["NodePool"] = "gpu"
    # Admission validators' refusals come back together as one multierror
    # (`admissionValidators`), the node pool's first.
    assert refused(pooled) == (500, '1 error occurred:\n\t* job "x" is in nonexistent node pool "gpu"\n\n')
    pooled["Job"]["TaskGroups"][0]["Tasks"][0]["Driver"] = ""
    code, text = refused(pooled)
    assert code == 500 and text.startswith('2 errors occurred:\n\t* job "x" is in nonexistent node pool')
    assert "Missing task driver" in text
    resp = requests.get(f"{standin.url}/v1/job/x/plan", timeout=10)
    assert resp.status_code == 405
