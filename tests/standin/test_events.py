"""The event stream: NDJSON frames `{"Index", "Events"}` with `{}` heartbeats, topic filters,
and a start index, read with python-nomad's stream reader as llmgw would."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import eval_done, mock_job

Json = dict[str, Any]


@pytest.fixture
def standin(start_standin: Callable[..., StandIn]) -> StandIn:
    return start_standin(consul=False, extra_args=["--event-heartbeat", "0.3"])


def frames(standin: StandIn, params: list[tuple[str, str]], seconds: float) -> Iterator[Json]:
    """Frames of one subscription, for at most `seconds`."""
    with requests.get(f"{standin.url}/v1/event/stream", params=params, stream=True, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"] == "application/json"
        deadline = time.monotonic() + seconds
        for line in response.iter_lines():
            yield json.loads(line)
            if time.monotonic() > deadline:
                return


def events_until(
    standin: StandIn, params: list[tuple[str, str]], want: Callable[[list[Json]], bool]
) -> list[Json]:
    seen: list[Json] = []
    for frame in frames(standin, params, 10):
        seen.extend(frame.get("Events", []))
        if want(seen):
            return seen
    raise AssertionError(
        f"stream ended without the wanted events; saw {[(e['Topic'], e['Type']) for e in seen]}"
    )


def test_python_nomad_stream_sees_job_eval_and_allocation_events(standin: StandIn) -> None:
    client = standin.client()
    thread, stop, events = client.event.stream.get_stream(index=0, timeout=10)
    thread.start()
    try:
        time.sleep(0.3)  # let the subscription start; index 0 means "from now on"
        result = client.jobs.register_job(mock_job("ev", count=1))
        eval_done(client, result["EvalID"])
        seen: list[Json] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                frame = events.get(timeout=0.5)
            except queue.Empty:
                continue
            seen.extend(frame["Events"])
            kinds = {(e["Topic"], e["Type"]) for e in seen}
            if {
                ("Job", "JobRegistered"),
                ("Evaluation", "EvaluationUpdated"),
                ("Allocation", "PlanResult"),
            } <= kinds:
                break
    finally:
        stop.set()
        thread.join(5)  # it notices the stop at the next line; heartbeats come every 0.3s here
    job_event = next(e for e in seen if e["Topic"] == "Job")
    assert job_event["Key"] == "ev" and job_event["Namespace"] == "default"
    assert job_event["Payload"]["Job"]["ID"] == "ev" and job_event["Index"] > 0
    alloc_event = next(e for e in seen if e["Topic"] == "Allocation")
    assert alloc_event["FilterKeys"][0] == "ev"
    assert "Job" not in alloc_event["Payload"]["Allocation"]  # stripped, as Nomad does
    evaluation = next(e for e in seen if e["Topic"] == "Evaluation")
    assert evaluation["Payload"]["Evaluation"]["JobID"] == "ev"


def test_topic_filters_and_heartbeats(standin: StandIn) -> None:
    client = standin.client()
    client.jobs.register_job(mock_job("other"))
    lines = frames(standin, [("topic", "Job:mine"), ("topic", "Evaluation:mine")], 10)
    assert next(lines) == {}  # a heartbeat at once
    client.jobs.register_job(mock_job("mine"))
    got: list[Json] = []
    heartbeats = 0
    for frame in lines:
        if frame == {}:
            heartbeats += 1
        got.extend(frame.get("Events", []))
        if heartbeats >= 2 and {e["Topic"] for e in got} >= {"Job", "Evaluation"}:
            break
    assert got and all(e["Topic"] in ("Job", "Evaluation") for e in got)
    assert all(e["Key"] == "mine" or "mine" in (e["FilterKeys"] or []) for e in got)


def test_stream_from_an_index_replays_what_happened_since(standin: StandIn) -> None:
    client = standin.client()
    start = int(requests.get(f"{standin.url}/v1/jobs", timeout=5).headers["X-Nomad-Index"])
    result = client.jobs.register_job(mock_job("past"))
    eval_done(client, result["EvalID"])
    seen = events_until(
        standin,
        [("index", str(start)), ("topic", "Job")],
        lambda evs: any(e["Key"] == "past" for e in evs),
    )
    assert all(e["Index"] >= start for e in seen)
    bad = requests.get(f"{standin.url}/v1/event/stream", params={"index": "soon"}, timeout=5)
    assert bad.status_code == 400 and bad.text.startswith("Unable to parse index")


def test_heartbeats_keep_coming_while_only_other_topics_commit(standin: StandIn) -> None:
    """Commits this subscriber does not follow send it nothing, so they must not hold back its
    heartbeats either: a stream kept busy only by them would go silent until the client's read
    timeout ended it (the watcher's Job stream did, once a minute, while allocations churned)."""
    client = standin.client()
    lines = frames(standin, [("topic", "Job:mine")], 10)
    assert next(lines) == {}
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            client.jobs.register_job(mock_job(f"other-{i}"))  # a commit every ~0.1 s
            i += 1
            time.sleep(0.1)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        for heartbeats, frame in enumerate(lines, start=1):
            assert frame == {}, frame  # nothing of "mine" was committed
            if heartbeats == 4:
                break
        # Every 0.3 s here: four in well under the 10 s a silent stream would take.
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        thread.join(5)
