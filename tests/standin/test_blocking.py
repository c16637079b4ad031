"""Blocking queries: `index` and `wait` as Nomad parses them, answers that wake within
milliseconds of the change they wait for (never on a timer), and a timeout that returns the
same data and index when nothing changed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import requests

from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import NO_DEPLOYMENTS, eval_done, mock_job, scale, wait_for


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False)


def _later(delay: float, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_job_read_blocks_until_that_job_changes(standin: StandIn) -> None:
    client = standin.client(timeout=30)
    client.jobs.register_job(mock_job("b", count=1, **NO_DEPLOYMENTS))
    first = requests.get(f"{standin.url}/v1/job/b", timeout=5)
    index = int(first.headers["X-Nomad-Index"])
    assert index == first.json()["ModifyIndex"]
    assert first.headers["X-Nomad-KnownLeader"] == "true" and first.headers["X-Nomad-LastContact"] == "0"
    # Let the job settle (status pending -> running) so that only the scale below changes it.
    wait_for(lambda: client.job.get_job("b")["Status"] == "running", what="job running")
    index = int(requests.get(f"{standin.url}/v1/job/b", timeout=5).headers["X-Nomad-Index"])

    changed_at: list[float] = []

    def change() -> None:
        changed_at.append(time.monotonic())
        scale(client, "b", "g", 2)

    thread = _later(0.5, change)
    started = time.monotonic()
    answer = requests.get(f"{standin.url}/v1/job/b", params={"index": str(index), "wait": "30s"}, timeout=40)
    woke = time.monotonic()
    thread.join()
    assert answer.status_code == 200
    assert int(answer.headers["X-Nomad-Index"]) > index
    assert answer.json()["TaskGroups"][0]["Count"] == 2
    assert woke - started >= 0.4  # it did block
    assert woke - changed_at[0] < 1.0  # and woke on the change, not on a timer


def test_allocations_query_wakes_on_placement(standin: StandIn) -> None:
    client = standin.client(timeout=30)
    index = int(requests.get(f"{standin.url}/v1/job/p/allocations", timeout=5).headers["X-Nomad-Index"])
    thread = _later(0.3, lambda: client.jobs.register_job(mock_job("p", count=1)))
    started = time.monotonic()
    answer = requests.get(
        f"{standin.url}/v1/job/p/allocations", params={"index": str(index), "wait": "30s"}, timeout=40
    )
    thread.join()
    assert time.monotonic() - started < 2.0
    assert [a["Name"] for a in answer.json()] == ["p.g[0]"]


def test_blocking_query_times_out_with_the_same_index(standin: StandIn) -> None:
    client = standin.client(timeout=30)
    result = client.jobs.register_job(mock_job("idle", count=1))
    eval_done(client, result["EvalID"])
    wait_for(lambda: client.job.get_job("idle")["Status"] == "running", what="job running")
    first = requests.get(f"{standin.url}/v1/job/idle", timeout=5)
    index = int(first.headers["X-Nomad-Index"])
    started = time.monotonic()
    answer = requests.get(
        f"{standin.url}/v1/job/idle", params={"index": str(index), "wait": "1s"}, timeout=10
    )
    elapsed = time.monotonic() - started
    assert answer.status_code == 200
    assert int(answer.headers["X-Nomad-Index"]) == index
    assert answer.json() == first.json()
    # 1s plus Nomad's jitter of up to wait/16; a generous upper bound for a loaded machine.
    assert 0.9 <= elapsed < 3.0


def test_evaluation_list_blocks_on_the_evals_table(standin: StandIn) -> None:
    client = standin.client(timeout=30)
    index = int(requests.get(f"{standin.url}/v1/evaluations", timeout=5).headers["X-Nomad-Index"])
    thread = _later(0.3, lambda: client.jobs.register_job(mock_job("e")))
    answer = requests.get(
        f"{standin.url}/v1/evaluations", params={"index": str(index), "wait": "30s"}, timeout=40
    )
    thread.join()
    assert any(e["JobID"] == "e" for e in answer.json())


def test_bad_index_and_wait_are_rejected(standin: StandIn) -> None:
    bad_wait = requests.get(f"{standin.url}/v1/jobs", params={"index": "1", "wait": "soon"}, timeout=5)
    assert (bad_wait.status_code, bad_wait.text) == (400, "Invalid wait time")
    bad_index = requests.get(f"{standin.url}/v1/jobs", params={"index": "x"}, timeout=5)
    assert (bad_index.status_code, bad_index.text) == (400, "Invalid index")
