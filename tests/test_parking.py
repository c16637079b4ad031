"""What counts as a start failure, and which line of an engine's stderr is the real error."""

from __future__ import annotations

from typing import Any

from nomad_driver.watcher.parking import Ledger, count_start_failures, last_error, telling_line

KEV_STDERR = """\
llama_model_loader: loaded meta data with 12 key-value pairs and 21 tensors from /tmp/kev.gguf
llama_model_loader: - kv   0:                       general.architecture str              = kev
llama_model_load: error loading model: unknown model architecture: 'kev'
llama_load_model_from_file: failed to load model
Traceback (most recent call last):
  File "/x/llama_cpp/server/__main__.py", line 97, in main
ValueError: Failed to load model from file: /tmp/kev.gguf
"""


def ev(kind: str, t: int, **kw: Any) -> dict[str, Any]:
    return {"Type": kind, "Time": t, **kw}


def alloc(aid: str, *events: dict[str, Any], status: str = "failed") -> dict[str, Any]:
    return {"ID": aid, "ClientStatus": status, "TaskStates": {"engine": {"Events": list(events)}}}


def crash(t: int) -> list[dict[str, Any]]:
    return [
        ev("Started", t),
        ev("Terminated", t + 1, DisplayMessage="Exit Code: 1", Details={"exit_code": "1"}),
    ]


def test_each_exit_before_healthy_is_one_failure_including_restarts_in_place() -> None:
    a = alloc("a", ev("Received", 1), *crash(10), ev("Restarting", 12), *crash(20), ev("Not Restarting", 22))
    b = alloc("b", *crash(30))
    count = count_start_failures([a, b], frozenset())
    assert count.consecutive == 3
    assert count.last_failed is not None and count.last_failed.alloc_id == "b"
    assert count.last_failed.error == "Exit Code: 1"


def test_driver_failure_counts_without_a_started_event() -> None:
    a = alloc("a", ev("Driver Failure", 5, DriverError="failed to start task: boom"))
    count = count_start_failures([a], frozenset())
    assert count.consecutive == 1
    assert (
        count.last_failed is not None
        and count.last_failed.error == "Driver Failure: failed to start task: boom"
    )


def test_a_healthy_start_resets_the_count() -> None:
    a = alloc("a", *crash(10))
    b = alloc("b", ev("Started", 20), ev("Terminated", 90), status="failed")  # was healthy, then died
    c = alloc("c", *crash(100))
    assert count_start_failures([a, b, c], frozenset({(20, "b")})).consecutive == 1
    assert count_start_failures([a, b, c], frozenset()).consecutive == 3


def test_a_running_replica_that_turned_healthy_resets_and_one_still_loading_does_not_count() -> None:
    a = alloc("a", *crash(10), *crash(20))
    running = alloc("r", ev("Started", 30), status="running")
    assert count_start_failures([a, running], frozenset()).consecutive == 2
    assert count_start_failures([a, running], frozenset({(30, "r")})).consecutive == 0


def test_a_stop_we_asked_for_is_not_a_failure() -> None:
    a = alloc(
        "a", ev("Started", 10), ev("Killing", 11), ev("Terminated", 12), ev("Killed", 13), status="complete"
    )
    assert count_start_failures([a], frozenset()).consecutive == 0


def test_failures_at_or_before_the_baseline_are_forgiven() -> None:
    a = alloc("a", *crash(10), *crash(20))
    b = alloc("b", *crash(30))
    count = count_start_failures([a, b], frozenset(), Ledger(after_ns=20))
    assert count.consecutive == 1
    assert count_start_failures([a, b], frozenset()).newest_start_ns == 30


def test_garbage_allocations_are_ignored() -> None:
    assert (
        count_start_failures(
            [{"ID": "x", "TaskStates": "?"}, {"TaskStates": {"t": None}}], frozenset()
        ).consecutive
        == 0
    )


def test_the_telling_line_is_the_loaders_error_not_the_traceback() -> None:
    assert telling_line(KEV_STDERR) == "error loading model: unknown model architecture: 'kev'"


def test_last_error_falls_back_to_nomads_event_when_stderr_says_nothing() -> None:
    a = alloc("a", *crash(10))
    failed = count_start_failures([a], frozenset()).last_failed
    assert last_error(failed, "loading...\nbye\n") == "Exit Code: 1"
    assert "unknown model architecture: 'kev'" in last_error(failed, KEV_STDERR)
    assert last_error(None, None) == ""
