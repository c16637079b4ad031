"""What the watcher makes of the fetch task: a completed fetch is a step of a start and never a
failed one; a failed fetch is a failed start that names the fetch's cause."""

from __future__ import annotations

from typing import Any

from nomad_driver.watcher.parking import count_start_failures, starts_of, telling_line

SECOND = 1_000_000_000


def event(kind: str, t: int, **extra: Any) -> dict[str, Any]:
    return {"Type": kind, "Time": t * SECOND, **extra}


def alloc(status: str, tasks: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "ID": "a1",
        "ClientStatus": status,
        "JobVersion": 0,
        "CreateIndex": 10,
        "TaskStates": {name: {"Events": events} for name, events in tasks.items()},
    }


def test_a_completed_fetch_is_no_failed_start() -> None:
    a = alloc(
        "running",
        {
            "fetch": [event("Started", 1), event("Terminated", 90, ExitCode=0)],
            "engine": [event("Started", 91)],
        },
    )
    starts = starts_of(a)
    assert [(s.task, s.failed) for s in starts] == [("engine", False)]
    assert count_start_failures([a], frozenset()).consecutive == 0


def test_a_fetch_under_way_is_no_start_yet() -> None:
    a = alloc("pending", {"fetch": [event("Started", 1)], "engine": []})
    assert starts_of(a) == []


def test_a_failed_fetch_is_a_failed_start_that_names_the_fetch() -> None:
    a = alloc(
        "failed",
        {
            "fetch": [
                event("Started", 1),
                event("Terminated", 2, ExitCode=10),
                event("Restarting", 2),
                event("Started", 17),
                event("Terminated", 18, ExitCode=10),
                event("Not Restarting", 18),
            ],
            "engine": [event("Sibling Task Failed", 18)],
        },
    )
    starts = starts_of(a)
    assert [(s.task, s.failed) for s in starts] == [("fetch", True), ("fetch", True)]
    assert count_start_failures([a], frozenset()).consecutive == 2
    stderr = (
        "fetch failed: credentials refused (HTTP 403 from s3 source s3://weights/m.gguf)\n"
        "Traceback: an error that is not the cause\n"
    )
    assert (
        telling_line(stderr)
        == "fetch failed: credentials refused (HTTP 403 from s3 source s3://weights/m.gguf)"
    )
