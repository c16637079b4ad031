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


def test_failures_behind_a_start_still_loading_still_count_after_nomad_forgets_them() -> None:
    """Two replicas: one loads slowly (its outcome undecided), the other fails and is restarted
    in place, again and again. Nomad keeps ten events per task, so after a few restarts it no
    longer shows the first failures; counted pass by pass, each of them still counts."""
    loader = alloc("slow", ev("Started", 5), status="running")
    events: list[dict[str, Any]] = []
    ledger = Ledger()
    for i in range(8):
        t = 100 * (i + 1)
        events += [*crash(t), ev("Restarting", t + 2)]
        sibling = alloc("sib", *events[-10:], status="running")  # Nomad's newest ten
        count = count_start_failures([loader, sibling], frozenset(), ledger)
        ledger = count.ledger
        assert count.consecutive == i + 1, f"pass {i}: {count.consecutive} != {i + 1}"
    shown = count_start_failures([loader, sibling], frozenset()).consecutive
    assert shown < 8, "Nomad still shows every failure: nothing forgotten, nothing tested"
    # A watcher started now, from the stored ledger and what Nomad shows, agrees.
    assert count_start_failures([loader, sibling], frozenset(), ledger).consecutive == 8
    # The loader fails at last: one more, and the ledger folds everything it named.
    died = alloc("slow", ev("Started", 5), ev("Terminated", 900, DisplayMessage="Exit Code: 1"))
    count = count_start_failures([died, sibling], frozenset(), ledger)
    assert count.consecutive == 9
    assert count.ledger.later == () and count.ledger.counted == 9
    # Or it turns healthy: a replica serves, so the model is degraded, not counting
    # (watcher/partial.py), and every start shown so far is forgiven.
    serving = count_start_failures([loader, sibling], frozenset({(5, "slow")}), ledger)
    assert serving.consecutive == 0 and serving.serving
    assert serving.ledger.after_ns == 800


def test_what_is_remembered_behind_a_loading_start_is_bounded() -> None:
    loader = alloc("slow", ev("Started", 5), status="running")
    failed = [alloc(f"f{i}", *crash(100 * (i + 1))) for i in range(30)]
    count = count_start_failures([loader, *failed], frozenset(), remember=10)
    assert count.consecutive == 30  # the model parks on this count; the rest need no memory
    assert len(count.ledger.later) == 10


def test_a_template_restart_is_asked_for_not_a_failure() -> None:
    # A multi-node leader is restarted by its template whenever its shard set changes, on every
    # bring-up: Nomad's own sequence (taskrunner lifecycle.Restart with the template hook's
    # event, then the exit, then the restart tracker's "Restarting" with no delay).
    signaled = ev(
        "Restart Signaled",
        11,
        DisplayMessage="Template with change_mode restart re-rendered",
        RestartReason="",
    )
    exited = ev("Terminated", 12, DisplayMessage="Exit Code: 0, Signal: 15", Details={"exit_code": "0"})
    a = alloc(
        "a", ev("Started", 10), signaled, exited, ev("Restarting", 13), ev("Started", 14), status="running"
    )
    count = count_start_failures([a], frozenset())
    assert count.consecutive == 0
    # The stand-in's own words for the same restart.
    standin = ev("Restart Signaled", 11, RestartReason="template with change_mode restart re-rendered")
    b = alloc("b", ev("Started", 10), standin, ev("Terminated", 12), ev("Restarting", 13), status="running")
    assert count_start_failures([b], frozenset()).consecutive == 0


def test_a_restart_for_a_failing_health_check_is_a_failure() -> None:
    # check_restart restarts with the same event type, but for a failure: it counts.
    signaled = ev("Restart Signaled", 11, RestartReason='healthcheck: check "engine ready" unhealthy')
    a = alloc("a", ev("Started", 10), signaled, ev("Terminated", 12), ev("Restarting", 13), status="running")
    assert count_start_failures([a], frozenset()).consecutive == 1


def test_a_start_nomad_reports_after_a_newer_failure_still_counts() -> None:
    """Nomad's clients report to the servers in batches, and a client cut off for a while
    reports late: a failed start can reach the watcher after a newer start's failure."""
    newer = alloc("b", *crash(20))
    first = count_start_failures([newer], frozenset())
    assert first.consecutive == 1
    # Allocation a's start began at 10 and failed; its events arrive only now.
    late = alloc("a", *crash(10))
    now = count_start_failures([late, newer], frozenset(), first.ledger)
    assert now.consecutive == 2
    # A watcher started afresh, with nothing stored, agrees; and so does one from the ledger
    # once Nomad forgot both allocations.
    assert count_start_failures([late, newer], frozenset()).consecutive == 2
    assert count_start_failures([], frozenset(), now.ledger).consecutive == 2
    # Reported again (an unchanged view), it is not counted twice.
    assert count_start_failures([late, newer], frozenset(), now.ledger).consecutive == 2


def test_a_serving_replica_holds_the_count_at_zero_whatever_its_sibling_does() -> None:
    """One replica serves; another slot crash-loops on a bad node: the model is not parked
    (watcher/partial.py), and the starts so far are forgiven."""
    serving = alloc("a", ev("Started", 5), status="running")
    looping = alloc("b", *crash(10), ev("Restarting", 12), *crash(20), ev("Restarting", 22), *crash(30))
    count = count_start_failures([serving, looping], frozenset({(5, "a")}))
    assert count.consecutive == 0 and count.serving
    assert count.ledger.after_ns == 30
    # The serving replica goes; the slot fails twice more: two, counted from there.
    died = alloc("a", ev("Started", 5), ev("Terminated", 40, DisplayMessage="Exit Code: 137"))
    again = alloc("b", *looping["TaskStates"]["engine"]["Events"], *crash(50), *crash(60))
    assert count_start_failures([died, again], frozenset(), count.ledger).consecutive == 2
