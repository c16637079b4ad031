"""One model's trouble is that model's: a state value no clock can show, a reconcile that raises,
or a watch whose read raises something unexpected, never stops the others or freezes the
leader on an old snapshot."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from nomad_driver.blocking import Watch
from nomad_driver.state import ActionError, ModelState
from nomad_driver.watcher.isolation import BrokenModels, reconcile_each
from nomad_driver.watcher.reconcile import reconcile
from tests.test_reconcile import KEV, LAZY, job, view

# Valid JSON, a valid float, and no calendar holds it: a hand-edited key or a broken writer.
ABSURD_SINCE = 1e300


def test_a_refusal_whose_time_no_calendar_holds_is_shown_not_fatal() -> None:
    state = ModelState(
        last_action_error=ActionError(action="scale", status=403, message="denied", since=ABSURD_SINCE)
    )
    decision = reconcile(view(job=job(KEV, 1), state=state), 5)
    assert decision.health == "critical"
    assert "an unreadable time (1e+300)" in decision.health_output


def test_a_model_whose_reconcile_raises_is_shown_broken_and_the_others_are_reconciled() -> None:
    other = LAZY
    healthy = view(other, job=job(other, 0))
    # A request count that is no number: reconcile raises for this model alone.
    poisoned = dataclasses.replace(view(job=job(KEV, 1)), in_flight="many")  # type: ignore[arg-type]
    broken = BrokenModels()
    decisions = reconcile_each({"kev": poisoned, other.name: healthy}, 5, {}, broken)
    assert decisions[other.name] == reconcile(healthy, 5)
    assert decisions["kev"].health == "critical"
    assert decisions["kev"].actions == ()
    assert "llmgw cannot reconcile this model (reconcile failed: TypeError" in decisions["kev"].health_output
    assert set(broken.why) == {"kev"}
    # Mended: shown as usual again.
    reconcile_each({"kev": view(job=job(KEV, 1))}, 5, decisions, broken)
    assert broken.why == {}


async def test_a_watch_whose_read_raises_something_unexpected_is_not_ok_and_recovers() -> None:
    calls = 0

    async def fetch(index: int) -> tuple[int, Any]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("a bug in reading the answer")
        await asyncio.sleep(0.05)
        return calls, {"read": calls}

    watch = Watch("test", fetch, on_change=lambda: None, rate=100.0)
    task = asyncio.create_task(watch.run())
    try:
        for _ in range(100):
            if calls >= 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        # Not ok while it cannot read: the leader does not act on what it read before.
        assert not watch.ok and "RuntimeError: a bug in reading the answer" in watch.error
        assert not task.done()
        for _ in range(300):
            if watch.ok:
                break
            await asyncio.sleep(0.01)
        assert watch.ok and watch.snapshot is not None and watch.snapshot.data["read"] >= 3
    finally:
        task.cancel()


def test_a_purged_and_recreated_job_still_parks_after_five_failed_starts() -> None:
    # The ledger was written against the old job, at version 7. `nomad job stop -purge` (or
    # Nomad's GC, or a rebuilt cluster) and the watcher's register give a job at version 0 with
    # a new CreateIndex: its starts are the current definition's, and they count.
    from tests.test_reconcile import NOW, crashed

    state = ModelState(count_def_hash=KEV.def_hash, count_job_version=7, count_job_create_index=100)
    recreated = {**job(KEV, 1), "Version": 0, "CreateIndex": 900}
    base = int(NOW * 1e9) - 10_000_000_000
    allocs = tuple(
        {**crashed(f"a{i}", base + i * 1000), "JobVersion": 0, "CreateIndex": 901 + i} for i in range(5)
    )
    decision = reconcile(view(job=recreated, allocs=allocs, state=state), 5)
    assert decision.state.parked, decision.state
    assert decision.state.consecutive_failures == 5
    # Written down for the next pass: the new job's versions count from 0.
    assert (decision.state.count_job_version, decision.state.count_job_create_index) == (0, 900)


def test_a_written_state_is_waited_for_until_the_kv_shows_it_and_no_longer() -> None:
    """The leader remembers a state it wrote until its KV snapshot catches up, so the next pass
    does not redo the write; but not forever: a key deleted since, or a Consul whose indexes
    went back (a restored snapshot), would otherwise leave the watcher on a state nobody holds."""
    from nomad_driver.watcher.fenced import PENDING_FOR_S, FencedStates

    states = FencedStates(None, None)  # type: ignore[arg-type]
    written = ModelState(consecutive_failures=3)
    states._written["m"] = (120, written, 1000.0)
    states.settle(kv_index=110, now=1001.0)
    assert states.pending("m") == (120, written)  # the snapshot is older than the write
    states.settle(kv_index=120, now=1002.0)
    assert states.pending("m") is None  # the snapshot covers it, whatever it says of the key
    states._written["m"] = (500, written, 1000.0)
    states.settle(kv_index=30, now=1000.0 + PENDING_FOR_S + 1)  # indexes went back: not waited for
    assert states.pending("m") is None
