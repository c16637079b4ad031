"""The stand-in client's mock_driver: exit codes, start errors, restarts and kills, with the
task events and statuses a real Nomad client reports for the same configuration."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.state import StateStore
from devstack.nomad.taskstate import RestartTracker, go_duration
from tests.standin.client_helpers import (
    Json,
    add_alloc,
    dead,
    event_types,
    events_of,
    make_alloc,
    make_job,
    mock_task,
    new_store,
    restart_policy,
    running_client,
    start_alloc,
    task_state,
    wait_alloc,
)


@dataclass
class Harness:
    store: StateStore
    client: ClientRunner
    updates: list[Json] = field(default_factory=list)


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nomad adds up to 25% to each restart delay; without it the delay in the message is exact.
    monkeypatch.setattr(RestartTracker, "jitter", 0.0)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    store = new_store()
    updates: list[Json] = []
    async with running_client(store, tmp_path / "data", clock_speed=100, on_update=updates.append) as client:
        yield Harness(store, client, updates)


def run(h: Harness, job: Json) -> str:
    return start_alloc(h.store, h.client, job)


async def test_batch_task_that_exits_zero_completes_the_alloc(harness: Harness) -> None:
    job = make_job([mock_task(run_for="2s", exit_code=0)], job_type="batch")
    alloc_id = run(harness, job)
    running = await wait_alloc(harness.store, alloc_id, lambda a: a["ClientStatus"] == "running")
    assert running["ClientDescription"] == "Tasks are running"
    assert task_state(running)["StartedAt"] != "0001-01-01T00:00:00Z"

    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert alloc["ClientStatus"] == "complete"
    assert alloc["ClientDescription"] == "All tasks have completed"
    assert event_types(alloc) == ["Received", "Task Setup", "Started", "Terminated"]
    events = task_state(alloc)["Events"]
    assert [e["DisplayMessage"] for e in events] == [
        "Task received by client",
        "Building Task Directory",
        "Task started by client",
        "Exit Code: 0",
    ]
    assert task_state(alloc)["Failed"] is False
    assert task_state(alloc)["FinishedAt"] != "0001-01-01T00:00:00Z"
    # The core reacts to client updates: it saw the final one.
    assert harness.updates[-1]["ClientStatus"] == "complete"


async def test_failing_task_restarts_per_policy_then_fails_the_alloc(harness: Harness) -> None:
    job = make_job(
        [mock_task(run_for="1s", exit_code=1)],
        restart=restart_policy(attempts=2, interval_s=1800, delay_s=15),
    )
    alloc_id = run(harness, job)
    alloc = await wait_alloc(harness.store, alloc_id, dead)

    state = task_state(alloc)
    assert alloc["ClientStatus"] == "failed"
    assert alloc["ClientDescription"] == "Failed tasks"
    assert state["Failed"] is True
    assert state["Restarts"] == 2
    assert state["LastRestart"] != "0001-01-01T00:00:00Z"
    restarting = events_of(alloc, "Restarting")
    assert [e["DisplayMessage"] for e in restarting] == ["Task restarting in 15s"] * 2
    assert restarting[0]["RestartReason"] == "Restart within policy"
    assert restarting[0]["Details"]["start_delay"] == str(15 * 1_000_000_000)
    terminated = events_of(alloc, "Terminated")
    assert [e["DisplayMessage"] for e in terminated] == ["Exit Code: 1"] * 3
    assert terminated[0]["ExitCode"] == 1
    not_restarting = events_of(alloc, "Not Restarting")
    assert len(not_restarting) == 1
    assert not_restarting[0]["DisplayMessage"] == (
        'Exceeded allowed attempts 2 in interval 30m0s and mode is "fail"'
    )
    assert not_restarting[0]["FailsTask"] is True
    assert harness.updates[-1]["ID"] == alloc_id
    assert harness.updates[-1]["ClientStatus"] == "failed"


async def test_service_task_that_exits_zero_is_restarted_too(harness: Harness) -> None:
    job = make_job([mock_task(run_for="1s", exit_code=0)], restart=restart_policy(attempts=1, delay_s=5))
    alloc_id = run(harness, job)
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert event_types(alloc).count("Restarting") == 1
    assert alloc["ClientStatus"] == "failed"
    assert events_of(alloc, "Not Restarting")[0]["DisplayMessage"] == (
        'Exceeded allowed attempts 1 in interval 30m0s and mode is "fail"'
    )


async def test_unrecoverable_start_error_fails_at_once(harness: Harness) -> None:
    job = make_job([mock_task(start_error="no GPU left on this node")])
    alloc_id = run(harness, job)
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert event_types(alloc) == ["Received", "Task Setup", "Driver Failure", "Not Restarting"]
    failure = events_of(alloc, "Driver Failure")[0]
    assert failure["DisplayMessage"] == "no GPU left on this node"
    assert failure["DriverError"] == "no GPU left on this node"
    assert events_of(alloc, "Not Restarting")[0]["DisplayMessage"] == "Error was unrecoverable"
    assert alloc["ClientStatus"] == "failed"
    assert task_state(alloc)["StartedAt"] == "0001-01-01T00:00:00Z"


async def test_recoverable_start_error_counts_against_the_policy(harness: Harness) -> None:
    job = make_job(
        [mock_task(start_error="device busy", start_error_recoverable=True)],
        restart=restart_policy(attempts=1, interval_s=60, delay_s=2),
    )
    alloc_id = run(harness, job)
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert event_types(alloc) == [
        "Received",
        "Task Setup",
        "Driver Failure",
        "Restarting",
        "Driver Failure",
        "Not Restarting",
    ]
    assert events_of(alloc, "Not Restarting")[0]["DisplayMessage"] == (
        'Exceeded allowed attempts 1 in interval 1m0s and mode is "fail"'
    )


async def test_exit_signal_and_message_are_reported_as_nomad_formats_them(harness: Harness) -> None:
    job = make_job(
        [mock_task(run_for=1_000_000, exit_code=2, exit_signal=9, exit_err_msg="boom")],
        job_type="batch",
        restart=restart_policy(attempts=0),
    )
    alloc_id = run(harness, job)
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    terminated = events_of(alloc, "Terminated")[0]
    assert terminated["DisplayMessage"] == 'Exit Code: 2, Signal: 9, Exit Message: "boom"'
    assert terminated["Details"]["exit_message"] == "boom"
    assert events_of(alloc, "Not Restarting")[0]["DisplayMessage"] == "Policy allows no restarts"
    assert alloc["ClientStatus"] == "failed"


async def test_mode_delay_waits_out_the_interval_instead_of_failing(harness: Harness) -> None:
    job = make_job(
        [mock_task(run_for="1s", exit_code=1)],
        restart=restart_policy(attempts=1, interval_s=120, delay_s=1, mode="delay"),
    )
    alloc_id = run(harness, job)
    alloc = await wait_alloc(
        harness.store, alloc_id, lambda a: len(events_of(a, "Restarting")) >= 2, timeout=30
    )
    second = events_of(alloc, "Restarting")[1]
    assert second["RestartReason"] == "Exceeded allowed attempts, applying a delay"
    assert second["DisplayMessage"].startswith(
        "Exceeded allowed attempts, applying a delay - Task restarting in 1m"
    )
    assert not events_of(alloc, "Not Restarting")
    assert task_state(alloc)["Failed"] is False


async def test_stopping_an_alloc_kills_its_task_and_completes_it(harness: Harness) -> None:
    job = make_job([mock_task(run_for="1h", kill_after="3s")])
    alloc_id = run(harness, job)
    await wait_alloc(harness.store, alloc_id, lambda a: a["ClientStatus"] == "running")
    stored = harness.store.allocs[alloc_id]
    harness.store.upsert_alloc(dict(stored, DesiredStatus="stop"))
    harness.client.stop_alloc(alloc_id)
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert alloc["ClientStatus"] == "complete"
    assert alloc["DesiredStatus"] == "stop", "the client must not overwrite the server's fields"
    assert event_types(alloc)[-3:] == ["Killing", "Terminated", "Killed"]
    killing = events_of(alloc, "Killing")[0]
    assert killing["DisplayMessage"] == "Sent interrupt. Waiting 5s before force killing"
    assert killing["Details"]["kill_timeout"] == "5s"
    assert events_of(alloc, "Killed")[0]["DisplayMessage"] == "Task successfully killed"
    assert task_state(alloc)["Failed"] is False


async def test_a_failed_task_kills_its_siblings(harness: Harness) -> None:
    job = make_job(
        [mock_task("engine", run_for="1s", exit_code=1), mock_task("sidecar", run_for="1h")],
        restart=restart_policy(attempts=0),
    )
    alloc_id = run(harness, job)
    alloc = await wait_alloc(
        harness.store,
        alloc_id,
        lambda a: all(s["State"] == "dead" for s in (a["TaskStates"] or {"x": {"State": ""}}).values()),
    )
    assert alloc["ClientStatus"] == "failed"
    sibling = events_of(alloc, "Sibling Task Failed", task="sidecar")[0]
    assert sibling["DisplayMessage"] == 'Task\'s sibling "engine" failed'
    assert task_state(alloc, "sidecar")["Failed"] is False


async def test_a_thousand_mock_allocs_run_and_stop_together(tmp_path: Path) -> None:
    store = new_store()
    client = ClientRunner(store, Clock(speed=100), tmp_path / "data", None)
    job = make_job([mock_task(run_for="10h")])
    ids = [add_alloc(store, make_alloc(job, index=i)) for i in range(1000)]
    started = time.monotonic()
    try:
        for alloc_id in ids:
            client.start_alloc(alloc_id)
        for alloc_id in ids:
            await wait_alloc(store, alloc_id, lambda a: a["ClientStatus"] == "running", timeout=120)
        elapsed_start = time.monotonic() - started
        for alloc_id in ids:
            store.upsert_alloc(dict(store.allocs[alloc_id], DesiredStatus="stop"))
            client.stop_alloc(alloc_id)
        for alloc_id in ids:
            await wait_alloc(store, alloc_id, lambda a: a["ClientStatus"] == "complete", timeout=120)
    finally:
        await client.shutdown()
    # Generous: the point is that mock allocs cost milliseconds, not that this machine is fast.
    assert elapsed_start < 60, f"1000 mock allocs took {elapsed_start:.1f}s to start"


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"),
        (15 * 10**9, "15s"),
        (30 * 60 * 10**9, "30m0s"),
        (24 * 3600 * 10**9, "24h0m0s"),
        (90 * 10**9, "1m30s"),
        (1_500_000_000, "1.5s"),
        (16_234_567_891, "16.234567891s"),
        (250_000_000, "250ms"),
        (1_500, "1.5µs"),
        (117_000_000_000 + 5, "1m57.000000005s"),
    ],
)
def test_durations_print_as_go_prints_them(ns: int, text: str) -> None:
    # Nomad's messages embed Go's Duration.String(): "in interval 30m0s", "restarting in 15s".
    assert go_duration(ns) == text


async def test_mock_output_lands_in_the_task_logs(harness: Harness) -> None:
    job = make_job(
        [
            mock_task(
                run_for="10s",
                stdout_string="tick\n",
                stdout_repeat=2,
                stdout_repeat_duration="1s",
                stderr_string="model loaded\n",
            )
        ],
        job_type="batch",
    )
    alloc_id = run(harness, job)
    await wait_alloc(harness.store, alloc_id, dead)
    assert harness.client.log_path(alloc_id, "engine", "stdout").read_text() == "tick\n" * 3
    assert harness.client.log_path(alloc_id, "engine", "stderr").read_text() == "model loaded\n"
