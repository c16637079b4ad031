"""The stand-in's HTTP API through python-nomad, as llmgw uses it: Nomad's defaults on register,
its versions, its error texts and status codes, and the read endpoints' shapes."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nomad
import pytest
import requests
from nomad.api import exceptions

from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import (
    NO_DEPLOYMENTS,
    SECOND,
    eval_done,
    live_allocs,
    mock_job,
    scale,
    wait_for,
)


def n_live(client: nomad.Nomad, job_id: str, n: int) -> list[dict[str, Any]] | None:
    allocs = live_allocs(client, job_id)
    return allocs if len(allocs) == n else None


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


@pytest.fixture
def client(standin: StandIn) -> nomad.Nomad:
    return standin.client()


def test_register_fills_in_nomads_defaults(client: nomad.Nomad) -> None:
    job = mock_job("defaults")
    task = job["Job"]["TaskGroups"][0]["Tasks"][0]
    del task["Resources"]
    job["Job"]["TaskGroups"][0]["Services"] = [
        {"Checks": [{"Type": "tcp", "Interval": 10 * SECOND, "Timeout": 2 * SECOND}]}
    ]
    before = time.time_ns()
    result = client.jobs.register_job(job)
    assert result["EvalID"] and result["JobModifyIndex"] > 0 and result["Warnings"] == ""

    got = client.job.get_job("defaults")
    assert (got["Region"], got["Namespace"], got["Name"], got["Type"]) == (
        "global",
        "default",
        "defaults",
        "service",
    )
    assert (got["Priority"], got["Datacenters"], got["NodePool"]) == (50, ["*"], "default")
    assert got["Version"] == 0 and got["Stop"] is False
    assert before <= got["SubmitTime"] <= time.time_ns()
    assert got["Status"] in ("pending", "running")
    group = got["TaskGroups"][0]
    assert group["RestartPolicy"] == {
        "Attempts": 2,
        "Interval": 30 * 60 * SECOND,
        "Delay": 15 * SECOND,
        "Mode": "fail",
        "RenderTemplates": False,
    }
    assert group["ReschedulePolicy"] == {
        "Attempts": 0,
        "Interval": 0,
        "Delay": 30 * SECOND,
        "DelayFunction": "exponential",
        "MaxDelay": 3600 * SECOND,
        "Unlimited": True,
    }
    assert group["EphemeralDisk"]["SizeMB"] == 300
    assert group["Update"]["MaxParallel"] == 1 and group["Update"]["HealthCheck"] == "checks"
    assert group["Migrate"]["MaxParallel"] == 1
    (service,) = group["Services"]
    assert service["Name"] == "defaults-g"
    assert (service["Provider"], service["AddressMode"], service["OnUpdate"]) == (
        "consul",
        "auto",
        "require_healthy",
    )
    assert service["Checks"][0]["Name"] == 'service: "defaults-g" check'
    task = group["Tasks"][0]
    assert (task["Resources"]["CPU"], task["Resources"]["MemoryMB"]) == (100, 300)
    assert task["KillTimeout"] == 5 * SECOND
    assert task["LogConfig"] == {"MaxFiles": 10, "MaxFileSizeMB": 10, "Disabled": False}


def test_batch_jobs_get_batch_policies(client: nomad.Nomad) -> None:
    job = mock_job("batchy", config={"run_for": "10ms"})
    job["Job"]["Type"] = "batch"
    client.jobs.register_job(job)
    group = client.job.get_job("batchy")["TaskGroups"][0]
    assert group["RestartPolicy"]["Attempts"] == 3
    assert group["ReschedulePolicy"]["DelayFunction"] == "constant"
    assert group["ReschedulePolicy"]["Attempts"] == 1 and group["ReschedulePolicy"]["Unlimited"] is False


def test_reregister_makes_a_new_version_only_when_the_spec_changes(client: nomad.Nomad) -> None:
    first = client.jobs.register_job(mock_job("ver"))
    same = client.job.register_job("ver", mock_job("ver"))
    assert client.job.get_job("ver")["Version"] == 0
    assert same["JobModifyIndex"] == first["JobModifyIndex"]
    assert same["EvalID"] != first["EvalID"]  # an unchanged job is still evaluated again

    changed = mock_job("ver")
    changed["Job"]["Meta"] = {"llmgw_def_hash": "abc"}
    result = client.job.register_job("ver", changed)
    got = client.job.get_job("ver")
    assert got["Version"] == 1 and got["Meta"] == {"llmgw_def_hash": "abc"}
    assert result["JobModifyIndex"] > first["JobModifyIndex"] == got["CreateIndex"]
    versions = client.job.get_versions("ver")["Versions"]
    assert [v["Version"] for v in versions] == [1, 0]


def test_register_places_allocations_on_the_small_fleet(client: nomad.Nomad) -> None:
    result = client.jobs.register_job(mock_job("web", count=3))
    evaluation = eval_done(client, result["EvalID"])
    assert evaluation["Status"] == "complete" and evaluation["FailedTGAllocs"] is None
    assert evaluation["TriggeredBy"] == "job-register" and evaluation["QueuedAllocations"] == {"g": 0}
    allocs = wait_for(
        lambda: (
            [a for a in client.job.get_allocations("web") if a["ClientStatus"] == "running"]
            if len(client.job.get_allocations("web")) == 3
            and all(a["ClientStatus"] == "running" for a in client.job.get_allocations("web"))
            else None
        ),
        what="three running allocations",
    )
    assert sorted(a["Name"] for a in allocs) == ["web.g[0]", "web.g[1]", "web.g[2]"]
    fleet = {"gpu-4090-0", "gpu-l4-0", "gpu-h100-0"}
    assert {a["NodeName"] for a in allocs} <= fleet
    assert all(a["EvalID"] == result["EvalID"] and a["JobVersion"] == 0 for a in allocs)
    wait_for(lambda: client.job.get_job("web")["Status"] == "running", what="job running")
    summary = wait_for(
        lambda: (s := client.job.get_summary("web"))["Summary"]["g"]["Running"] == 3 and s, what="summary"
    )
    assert summary["Summary"]["g"]["Queued"] == 0
    full = client.allocation.get_allocation(allocs[0]["ID"])
    assert full["Job"]["ID"] == "web" and full["Metrics"]["NodesEvaluated"] >= 1
    assert full["TaskStates"]["t"]["State"] == "running"


def test_scale_to_zero_and_back(client: nomad.Nomad) -> None:
    client.jobs.register_job(mock_job("sc", count=2, **NO_DEPLOYMENTS))
    wait_for(lambda: len(live_allocs(client, "sc")) == 2, what="two allocations")
    down = scale(client, "sc", "g", 0, Message="idle")
    evaluation = eval_done(client, down["EvalID"])
    assert evaluation["TriggeredBy"] == "job-scaling"
    assert live_allocs(client, "sc") == []
    stopped = client.job.get_allocations("sc")
    assert {a["DesiredDescription"] for a in stopped} == {"alloc not needed due to job update"}
    wait_for(
        lambda: all(a["ClientStatus"] == "complete" for a in client.job.get_allocations("sc")), what="stops"
    )
    wait_for(lambda: client.job.get_job("sc")["Status"] == "dead", what="job dead at zero")
    assert client.job.get_job("sc")["Version"] == 1

    up = scale(client, "sc", "g", 2)
    eval_done(client, up["EvalID"])
    names = sorted(a["Name"] for a in live_allocs(client, "sc"))
    assert names == ["sc.g[0]", "sc.g[1]"]  # indexes are reused
    wait_for(lambda: client.job.get_job("sc")["Status"] == "running", what="job running again")

    status = client.job.request("sc", "scale", method="get").json()
    group = status["TaskGroups"]["g"]
    assert group["Desired"] == 2
    assert [e["Count"] for e in group["Events"]] == [2, 0]  # newest first
    assert group["Events"][1]["Message"] == "idle" and group["Events"][1]["PreviousCount"] == 2


def test_scale_errors_carry_nomads_messages(client: nomad.Nomad) -> None:
    client.jobs.register_job(mock_job("se"))
    cases: list[tuple[dict[str, Any], type[exceptions.BaseNomadException], str]] = [
        (
            {"Count": -1, "Target": {"Group": "g"}},
            exceptions.BadRequestNomadException,
            "scaling action count can't be negative",
        ),
        (
            {"Count": 1, "Target": {}},
            exceptions.BadRequestNomadException,
            "missing task group name for scaling action",
        ),
        (
            {"Count": 1, "Target": {"Group": "nope"}},
            exceptions.BadRequestNomadException,
            'task group "nope" specified for scaling does not exist in job',
        ),
        (
            {"Count": 1, "Target": {"Group": "g", "Job": "other"}},
            exceptions.BadRequestNomadException,
            "job ID in payload did not match URL",
        ),
        (
            {"Count": 1, "Error": True, "Target": {"Group": "g"}},
            exceptions.BadRequestNomadException,
            "scaling action should not contain count if error is true",
        ),
    ]
    for body, exc_type, message in cases:
        with pytest.raises(exc_type) as info:
            client.job.request("se", "scale", method="post", json=body)
        assert info.value.nomad_resp.text == message
    with pytest.raises(exceptions.URLNotFoundNomadException) as missing:
        client.job.request("ghost", "scale", method="post", json={"Count": 1, "Target": {"Group": "g"}})
    assert missing.value.nomad_resp.text == 'job "ghost" not found'


def test_bad_requests_get_nomads_error_texts(standin: StandIn, client: nomad.Nomad) -> None:
    with pytest.raises(exceptions.BadRequestNomadException) as info:
        client.jobs.register_job({"NotAJob": {}})
    assert info.value.nomad_resp.text == "Job must be specified"
    assert info.value.nomad_resp.headers["Content-Type"].startswith("text/plain")
    with pytest.raises(exceptions.BadRequestNomadException) as info:
        client.jobs.register_job({"Job": {"TaskGroups": []}})
    assert info.value.nomad_resp.text == "Job ID hasn't been provided"
    with pytest.raises(exceptions.BadRequestNomadException) as info:
        client.job.register_job("other", mock_job("mine"))
    assert info.value.nomad_resp.text == "Job ID does not match name"

    typed = mock_job("typed")
    typed["Job"]["Priority"] = "high"
    with pytest.raises(exceptions.BadRequestNomadException) as info:
        client.jobs.register_job(typed)
    assert (
        info.value.nomad_resp.text
        == "json: cannot unmarshal string into Go struct field Job.Priority of type int"
    )

    # Validation runs behind Nomad's RPC layer, which gives no status code: 500, multierror text.
    bad = mock_job("neg", count=-1)
    with pytest.raises(exceptions.BaseNomadException) as invalid:
        client.jobs.register_job(bad)
    assert invalid.value.nomad_resp.status_code == 500
    assert invalid.value.nomad_resp.text == (
        "1 error occurred:\n\t* Task group g validation failed: Task group count can't be negative\n\n"
    )

    for call, text in (
        (lambda: client.job.get_job("ghost"), "job not found"),
        (lambda: client.evaluation.get_evaluation("00000000-0000-0000-0000-000000000000"), "eval not found"),
        (lambda: client.allocation.get_allocation("00000000-0000-0000-0000-000000000000"), "alloc not found"),
        (lambda: client.node.get_node("00000000-0000-0000-0000-000000000000"), "node not found"),
    ):
        with pytest.raises(exceptions.URLNotFoundNomadException) as nf:
            call()
        assert nf.value.nomad_resp.text == text

    # Sub-collections of an unknown job are empty lists, not 404s (hashicorp/nomad#3215).
    assert client.job.get_allocations("ghost") == []
    assert client.job.get_evaluations("ghost") == []
    wrong = requests.patch(f"{standin.url}/v1/jobs", timeout=5)
    assert wrong.status_code == 405


def test_validate_answers_200_with_validation_errors(client: nomad.Nomad) -> None:
    ok = client.validate.validate_job(mock_job("fine"))
    assert ok.status_code == 200 and ok.json()["ValidationErrors"] is None
    bad = mock_job("bad")
    bad["Job"]["TaskGroups"][0]["Tasks"][0]["Driver"] = ""
    answer = client.validate.validate_job(bad)
    assert answer.status_code == 200
    assert answer.json()["ValidationErrors"] == [
        "Task group g validation failed: Task t validation failed: Missing task driver"
    ]


def test_deregister_stops_and_purge_removes(client: nomad.Nomad) -> None:
    client.jobs.register_job(mock_job("gone", count=2))
    wait_for(lambda: len(live_allocs(client, "gone")) == 2, what="allocations")
    result = client.job.deregister_job("gone")
    assert eval_done(client, result["EvalID"])["TriggeredBy"] == "job-deregister"
    job = client.job.get_job("gone")
    assert job["Stop"] is True and job["Version"] == 0
    assert live_allocs(client, "gone") == []
    wait_for(lambda: client.job.get_job("gone")["Status"] == "dead", what="job dead")

    client.job.deregister_job("gone", purge=True)
    with pytest.raises(exceptions.URLNotFoundNomadException):
        client.job.get_job("gone")
    assert all(j["ID"] != "gone" for j in client.jobs.get_jobs())


def test_jobs_list_filters_by_prefix(client: nomad.Nomad) -> None:
    for job_id in ("llmgw-a", "llmgw-b", "other"):
        client.jobs.register_job(mock_job(job_id))
    listed = client.jobs.get_jobs(prefix="llmgw-")
    assert [j["ID"] for j in listed] == ["llmgw-a", "llmgw-b"]
    stub = listed[0]
    assert stub["Type"] == "service" and stub["JobSummary"]["JobID"] == "llmgw-a"
    assert "TaskGroups" not in stub


def test_nodes_allocations_and_eligibility(standin: StandIn, client: nomad.Nomad) -> None:
    nodes = client.nodes.get_nodes()
    assert sorted(n["Name"] for n in nodes) == ["gpu-4090-0", "gpu-h100-0", "gpu-l4-0"]
    assert "NodeResources" not in nodes[0]
    with_resources = client.nodes.get_nodes(resources=True)
    assert all(n["NodeResources"]["Devices"] for n in with_resources)
    h100 = next(n for n in nodes if n["Name"] == "gpu-h100-0")
    assert client.node.get_node(h100["ID"])["NodeResources"]["Devices"][0]["Name"] == "NVIDIA H100 80GB HBM3"

    others = [n["ID"] for n in nodes if n["ID"] != h100["ID"]]
    for node_id in others:
        client.node.eligible_node(node_id, ineligible=True)
    assert client.node.get_node(others[0])["SchedulingEligibility"] == "ineligible"
    client.jobs.register_job(mock_job("pinned", count=2))
    allocs = wait_for(lambda: n_live(client, "pinned", 2), what="placement")
    assert {a["NodeID"] for a in allocs} == {h100["ID"]}
    on_node = client.node.get_allocations(h100["ID"])
    assert {a["ID"] for a in on_node} >= {a["ID"] for a in allocs}


def test_drain_moves_allocations_elsewhere(client: nomad.Nomad) -> None:
    client.jobs.register_job(mock_job("mover", count=2))
    allocs = wait_for(lambda: n_live(client, "mover", 2), what="placement")
    node_id = allocs[0]["NodeID"]
    answer = client.node.drain_node_with_spec(node_id, {"Deadline": 60 * SECOND})
    assert answer["EvalIDs"]
    for eval_id in answer["EvalIDs"]:
        assert eval_done(client, eval_id)["TriggeredBy"] == "node-drain"
    moved = live_allocs(client, "mover")
    assert len(moved) == 2 and all(a["NodeID"] != node_id for a in moved)
    old = [a for a in client.job.get_allocations("mover") if a["NodeID"] == node_id]
    assert old and all(a["DesiredDescription"] == "alloc is being migrated" for a in old)
    node = wait_for(
        lambda: (n := client.node.get_node(node_id))["DrainStrategy"] is None and n, what="drain end"
    )
    assert node["SchedulingEligibility"] == "ineligible" and node["LastDrain"]["Status"] == "complete"


def test_logs_plain_and_framed(client: nomad.Nomad, standin: StandIn) -> None:
    client.jobs.register_job(
        mock_job("talk", config={"run_for": "1h", "stdout_string": "hello from the task\n"})
    )
    (alloc,) = wait_for(
        lambda: [a for a in live_allocs(client, "talk") if a["ClientStatus"] == "running"], what="run"
    )
    url = f"{standin.url}/v1/client/fs/logs/{alloc['ID']}"
    plain = requests.get(url, params={"task": "t", "type": "stdout", "plain": "true"}, timeout=5)
    assert plain.status_code == 200 and plain.text == "hello from the task\n"
    tail = requests.get(
        url,
        params={"task": "t", "type": "stdout", "plain": "true", "origin": "end", "offset": "5"},
        timeout=5,
    )
    assert tail.text == "task\n"
    framed = requests.get(url, params={"task": "t", "type": "stdout"}, timeout=5).json()
    assert base64.b64decode(framed["Data"]) == b"hello from the task\n" and framed["Offset"] == 20
    bad = requests.get(url, params={"task": "t", "type": "journal"}, timeout=5)
    assert bad.status_code == 400 and bad.text == 'illegal log type: "journal"'


def test_default_standin_serves_the_small_fleet_with_consul(nomad_standin: StandIn) -> None:
    client = nomad_standin.client()
    assert nomad_standin.consul_url and nomad_standin.consul_url.startswith("http://127.0.0.1:")
    assert client.status.leader.get_leader() == "127.0.0.1:4647"
    agent = client.agent.get_agent()
    assert agent["config"]["Region"] == "global" and agent["member"]["Status"] == "alive"
    assert len(client.nodes.get_nodes()) == 3


def test_sigterm_stops_the_allocations_processes(
    start_standin: Callable[..., StandIn], tmp_path: Path
) -> None:
    standin = start_standin(consul=False)
    client = standin.client()
    pid_file = tmp_path / "task.pid"
    job = mock_job("proc")
    job["Job"]["TaskGroups"][0]["Tasks"][0].update(
        {
            "Driver": "raw_exec",
            "Config": {"command": "/bin/sh", "args": ["-c", f"echo $$ > {pid_file}; exec sleep 600"]},
        }
    )
    client.jobs.register_job(job)
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), what="the task to write its PID")
    task_pid = int(pid_file.read_text())
    os.kill(task_pid, 0)  # running

    standin.stop()
    assert standin.process.returncode == 0
    assert "Traceback" not in standin.log_tail()

    def gone() -> bool:
        try:
            os.kill(task_pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout=10, what=f"task process {task_pid} to be gone")
