"""The one blocking-query loop (nomad_driver/blocking.py) that the watcher's and the router's
watches run on: its index rules, its token bucket, and how it rides out a far side that fails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from nomad_driver import blocking
from nomad_driver.blocking import ServiceError, TokenBucket, Watch, next_index
from nomad_driver.consul import ConsulUnavailable
from nomad_driver.nomad import NomadError


def test_an_index_that_goes_backwards_starts_over_and_none_is_ever_zero() -> None:
    assert next_index(10, "12") == 12
    assert next_index(10, "3") == 0  # the server was reset: read plainly again
    assert next_index(0, "0") == 1  # never block on 0, or the next call returns at once
    assert next_index(0, None) == 1  # no index header at all
    assert next_index(5, "garbage") == 1


def test_both_clients_errors_are_what_a_watch_rides_out() -> None:
    assert issubclass(ConsulUnavailable, ServiceError)
    assert issubclass(NomadError, ServiceError)


async def test_an_index_that_moves_on_every_call_is_held_to_the_buckets_rate() -> None:
    calls = 0

    async def busy(index: int) -> tuple[int, int]:
        nonlocal calls
        calls += 1
        return index + 1, calls  # a new index at once, every time: a busy index

    watch: Watch[int] = Watch("busy", busy, on_change=lambda: None, rate=20.0)
    started = time.monotonic()
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    elapsed = time.monotonic() - started
    # The burst of 2, then 20 a second: about 12 in half a second, never hundreds.
    assert calls <= 2 + 20 * elapsed + 1
    assert calls >= 5


async def test_the_bucket_lets_a_burst_through_at_once() -> None:
    bucket = TokenBucket(rate=1.0, burst=2)
    started = time.monotonic()
    await bucket.take()
    await bucket.take()
    assert time.monotonic() - started < 0.1


async def test_a_failing_far_side_keeps_the_last_reading_and_starts_over_from_a_plain_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blocking, "backoff_delay", lambda attempt: 0.01)
    asked: list[int] = []
    changes = 0
    answers: list[tuple[int, str] | Exception] = [
        (7, "first"),
        (7, "first"),  # the wait ran out with nothing new: no change
        ConsulUnavailable("consul GET /v1/kv/llmgw/: connection refused"),
        ConsulUnavailable("consul GET /v1/kv/llmgw/: connection refused"),
        (9, "second"),
    ]

    async def fetch(index: int) -> tuple[int, str]:
        asked.append(index)
        if not answers:
            await asyncio.sleep(3600)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def changed() -> None:
        nonlocal changes
        changes += 1

    watch: Watch[str] = Watch("kv", fetch, on_change=changed, rate=1000.0)
    task = asyncio.create_task(watch.run())
    deadline = time.monotonic() + 5
    while len(asked) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    # While it fails, the last reading stays, marked not ok, with the reason.
    assert watch.snapshot is not None and watch.snapshot.data == "first"
    while len(asked) < 6 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert asked[:5] == [0, 7, 7, 0, 0]  # after a failure, a plain read, not the old index
    assert asked[5] == 9
    assert watch.ok and watch.error == "" and watch.snapshot is not None
    assert watch.snapshot.data == "second" and watch.snapshot.index == 9
    assert changes == 2  # the first reading and the new one, not the empty wait
    assert watch.calls == 6 and watch.reads == 3


async def test_a_bug_in_a_fetch_is_not_taken_for_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    """Said as a bug (an error with its traceback, not the outage's warning), and the watch is
    not ok while it lasts, so nothing acts on its old snapshot; it keeps trying rather than
    dying with `ok` left as it was (issue: one watch task's death froze the leader's view)."""

    async def broken(index: int) -> tuple[int, None]:
        raise AttributeError("a bug of llmgw's own")

    watch: Watch[None] = Watch("broken", broken, on_change=lambda: None, rate=100.0)
    watch.ok = True  # as after earlier reads
    with caplog.at_level(logging.WARNING):
        task = asyncio.create_task(watch.run())
        await asyncio.sleep(0.3)
    try:
        assert not task.done()
        assert not watch.ok and watch.error == "AttributeError: a bug of llmgw's own"
        (record,) = [r for r in caplog.records if "watch=broken" in r.getMessage()]
        assert record.levelno == logging.ERROR and record.exc_info is not None
    finally:
        task.cancel()
