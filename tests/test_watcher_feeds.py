"""The watcher's jobs and allocations, followed through Nomad's event stream (watcher/feeds.py),
on the stand-in's real HTTP API: a change reaches the feed without the namespace being listed
again, another job's restart in place wakes no pass, and a stream that ends, or the passing of
the resync interval, lists again from scratch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from nomad_driver.nomad import Nomad, NomadError
from nomad_driver.watcher.feeds import AllocationFeed, JobFeed
from nomad_driver.watcher.watch import JobCache, jobs_fetch, kept_allocation
from tests.fixtures.nomad import StandIn
from tests.standin.api_helpers import NO_DEPLOYMENTS, mock_job, scale

Json = dict[str, Any]
WAIT_S = 2.0


async def until(
    fetch: Callable[[int], Awaitable[tuple[int, Any]]],
    index: int,
    ok: Callable[[Any], bool],
    timeout: float = 15.0,
) -> tuple[int, Any]:
    """Call `fetch` as a Watch does, from `index`, until what it holds satisfies `ok`."""
    deadline = time.monotonic() + timeout
    data: Any = None
    while time.monotonic() < deadline:
        index, data = await fetch(index)
        if ok(data):
            return index, data
    raise AssertionError(f"timed out; last reading: {data!r}"[:2000])


def of_job(allocs: tuple[Json, ...], job_id: str) -> list[Json]:
    return [a for a in allocs if a.get("JobID") == job_id]


def running(allocs: tuple[Json, ...], job_id: str, n: int) -> bool:
    return len([a for a in of_job(allocs, job_id) if a.get("ClientStatus") == "running"]) == n


@pytest.fixture
def nomad(nomad_standin: StandIn) -> Nomad:
    return Nomad(nomad_standin.url)


async def test_a_model_scaled_up_reaches_the_feeds_as_events_without_listing_again(
    nomad_standin: StandIn, nomad: Nomad
) -> None:
    client = nomad_standin.client()
    client.jobs.register_job(mock_job("llmgw-feed", **NO_DEPLOYMENTS))
    allocs = AllocationFeed(nomad, WAIT_S, kept_allocation)
    jobs = JobFeed(nomad, WAIT_S, jobs_fetch(nomad, WAIT_S, JobCache()))
    try:
        index, held = await until(allocs.fetch, 0, lambda a: running(a, "llmgw-feed", 1))
        jobs_index, by_id = await jobs.fetch(0)
        assert by_id["llmgw-feed"]["TaskGroups"][0]["Count"] == 1

        scale(client, "llmgw-feed", "g", 2)
        _, by_id = await until(
            jobs.fetch, jobs_index, lambda j: j["llmgw-feed"]["TaskGroups"][0]["Count"] == 2
        )
        _, held = await until(allocs.fetch, index, lambda a: running(a, "llmgw-feed", 2))

        # Both came from events; the new allocation is its list entry, with the job version the
        # count of starts needs, which the event alone does not carry.
        assert (allocs.lists, jobs.lists) == (1, 1)
        versions = {a["JobVersion"] for a in of_job(held, "llmgw-feed")}
        assert versions == {by_id["llmgw-feed"]["Version"]}

        client.job.deregister_job("llmgw-feed", purge=True)
        _, by_id = await until(jobs.fetch, jobs_index, lambda j: "llmgw-feed" not in j)
        assert jobs.lists == 1
    finally:
        allocs.close()
        jobs.close()


async def test_another_jobs_task_restarting_in_place_moves_no_index_until_it_lets_go(
    nomad_standin: StandIn, nomad: Nomad
) -> None:
    client = nomad_standin.client()
    restarts = {"RestartPolicy": {"Attempts": 100, "Interval": 3_600 * 10**9, "Delay": 10**8, "Mode": "fail"}}
    client.jobs.register_job(
        mock_job("other-team", config={"run_for": "300ms", "exit_code": 1}, **restarts, **NO_DEPLOYMENTS)
    )
    feed = AllocationFeed(nomad, 0.5, kept_allocation)
    try:
        index, held = await until(feed.fetch, 0, lambda a: running(a, "other-team", 1))
        (alloc,) = of_job(held, "other-team")
        # Several restarts in place: each is an allocation event, none changes what it holds.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            new_index, held = await feed.fetch(index)
            assert new_index == index, "a restart in place of another job's task would wake a pass"
        restarted = client.allocation.get_allocation(alloc["ID"])["TaskStates"]["t"]["Restarts"]
        assert restarted >= 3, f"the task restarted {restarted} times; the test needs a few"

        client.job.deregister_job("other-team")
        new_index, held = await until(feed.fetch, index, lambda a: not of_job(a, "other-team"))
        assert new_index > index
        assert feed.lists == 1
    finally:
        feed.close()


async def test_a_stream_that_ends_is_an_error_and_the_next_fetch_lists_again(
    nomad_standin: StandIn, nomad: Nomad
) -> None:
    client = nomad_standin.client()
    client.jobs.register_job(mock_job("llmgw-drop", **NO_DEPLOYMENTS))
    feed = AllocationFeed(nomad, WAIT_S, kept_allocation)
    try:
        index, _ = await until(feed.fetch, 0, lambda a: running(a, "llmgw-drop", 1))
        stream = feed.stream
        assert stream is not None
        for _ in range(100):
            if stream._response is not None:
                break
            await asyncio.sleep(0.05)
        assert stream._response is not None, "the stream never answered"
        stream._response.close()  # the connection drops, as a restarting server's does
        with pytest.raises(NomadError, match="event/stream"):
            for _ in range(10):
                await feed.fetch(index)
        assert feed.stream is None
        # A Watch calls again from 0 after a failure: the whole list, and a new stream.
        scale(client, "llmgw-drop", "g", 2)
        index, _held = await until(feed.fetch, 0, lambda a: running(a, "llmgw-drop", 2))
        assert feed.lists >= 2 and feed.stream is not None
    finally:
        feed.close()


async def test_after_the_resync_interval_the_feed_lists_again(nomad_standin: StandIn, nomad: Nomad) -> None:
    now = [1000.0]
    feed = AllocationFeed(nomad, 0.2, kept_allocation, resync_s=60.0, clock=lambda: now[0])
    try:
        index, _ = await feed.fetch(0)
        index, _ = await feed.fetch(index)
        assert feed.lists == 1
        now[0] += 61.0
        await feed.fetch(index)
        assert feed.lists == 2
    finally:
        feed.close()
        await asyncio.sleep(0)


async def test_a_resync_that_finds_what_is_held_keeps_the_index_the_reader_has(
    nomad_standin: StandIn, nomad: Nomad
) -> None:
    """Another job registered moves the namespace's job index; listing llmgw's jobs again finds
    them unchanged, and a new index would wake a pass over every model for nothing."""
    client = nomad_standin.client()
    client.jobs.register_job(mock_job("llmgw-held", **NO_DEPLOYMENTS))
    now = [1000.0]
    feed = JobFeed(nomad, 0.2, jobs_fetch(nomad, 0.2, JobCache()), resync_s=60.0, clock=lambda: now[0])
    try:
        index, jobs = await feed.fetch(0)
        assert set(jobs) == {"llmgw-held"}
        client.jobs.register_job(mock_job("tenant", **NO_DEPLOYMENTS))
        now[0] += 61.0
        again, jobs = await feed.fetch(index)
        assert feed.lists == 2
        assert again == index and set(jobs) == {"llmgw-held"}

        scale(client, "llmgw-held", "g", 2)
        now[0] += 61.0
        moved, jobs = await feed.fetch(again)
        assert feed.lists == 3
        assert moved > again and jobs["llmgw-held"]["TaskGroups"][0]["Count"] == 2
    finally:
        feed.close()
        await asyncio.sleep(0)
