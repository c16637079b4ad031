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


def test_a_credentials_template_that_fails_is_a_failed_start_that_names_it() -> None:
    # With ACLs on and no policy for the job's identity, the fetch task's template cannot read
    # the model's Variable: Nomad kills the task before it ever starts (a Killing event that
    # fails the task, "Template failed: ...") and the allocation fails. Each is a failed start,
    # so five of them park the model with Nomad's words, not a crash loop of reschedules.
    words = (
        "Template failed: nomad.var.get(llmgw/sources/m@default.global): "
        "Unexpected response code: 403 (Permission denied)"
    )
    allocs = [
        {
            **alloc(
                "failed",
                {
                    "fetch": [
                        event("Received", 10 * i),
                        event("Task Setup", 10 * i + 1),
                        event("Killing", 10 * i + 2, FailsTask=True, DisplayMessage=words),
                    ],
                    "engine": [event("Received", 10 * i)],
                },
            ),
            "ID": f"a{i}",
            "CreateIndex": 10 + i,
        }
        for i in range(5)
    ]
    starts = starts_of(allocs[0])
    assert [(s.task, s.failed, s.error) for s in starts] == [("fetch", True, words)]
    failures = count_start_failures(allocs, frozenset())
    assert failures.consecutive == 5
    assert failures.last_failed is not None and failures.last_failed.error == words


def test_a_stop_asked_for_before_the_start_is_no_failed_start() -> None:
    # A scale-down that stops an allocation still in its prestart: Killing without FailsTask.
    a = alloc(
        "complete", {"fetch": [event("Received", 1), event("Killing", 2, DisplayMessage="Sent interrupt")]}
    )
    assert starts_of(a) == []


def test_a_running_task_killed_because_its_template_failed_is_a_failed_start() -> None:
    words = "Template failed: nomad.var.get(llmgw/sources/m@default.global): Unexpected response code: 403"
    a = alloc(
        "failed",
        {
            "engine": [
                event("Started", 1),
                event("Killing", 5, FailsTask=True, DisplayMessage=words),
                event("Terminated", 6, ExitCode=137),
            ]
        },
    )
    assert [(s.task, s.failed) for s in starts_of(a)] == [("engine", True)]
