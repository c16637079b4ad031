"""Asks are answered by number, not by comparing clocks (issue 33, item 9).

The routers' own recorders publish, the watcher reads their records as it does from Consul,
`reconcile` decides, and the attempt is recorded as `acting` records it; only time is made up.
Router "ahead" runs 30 s ahead and "behind" 10 s behind (the most a record may be off and still
count: 60 s ahead, three intervals behind), the watcher on time."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

import router.activity
from nomad_driver.consul import KVEntry
from nomad_driver.state import Ask, Attempt, ModelState, ask_numbers, inflight_key, parse_inflight
from nomad_driver.watcher.decisions import Activate
from nomad_driver.watcher.in_flight import asks
from nomad_driver.watcher.reconcile import reconcile
from router.activity import WAITING, ActivityRecorder
from tests.test_reconcile import LAZY, NOW, job, view

AHEAD_S = 30.0
BEHIND_S = -10.0


class Clocks:
    """One made-up `time` module for the recorders: `skew` is the clock of the router that
    calls it."""

    def __init__(self) -> None:
        self.skew = 0.0

    def time(self) -> float:
        return NOW + self.skew


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    clocks = Clocks()
    monkeypatch.setattr(router.activity, "time", SimpleNamespace(time=clocks.time))
    return clocks


def recorder(name: str) -> ActivityRecorder:
    return ActivityRecorder(lambda key, value: None, 5.0, router_id=name)  # type: ignore[arg-type,return-value]


def ask(clocks: Clocks, r: ActivityRecorder, skew: float, seen: Attempt | None) -> Ask:
    """A request on `r` finds no ready replica and asks, having seen `seen` (or no attempt)."""
    clocks.skew = skew
    r.begin("lazy", WAITING)
    return r.ask("lazy", seen.asked if seen is not None else 0.0)


def watcher_answers(
    clocks: Clocks, routers: list[tuple[ActivityRecorder, float]], state: ModelState
) -> Attempt | None:
    """One leader pass over the routers' records: the attempt it records, or None when it
    finds every ask answered."""
    kv: dict[str, KVEntry] = {}
    for index, (r, skew) in enumerate(routers, 1):
        clocks.skew = skew
        kv[inflight_key(r.router_id)] = KVEntry(
            inflight_key(r.router_id), json.dumps(r.in_flight()).encode(), index
        )
    asked = asks(kv, NOW).get("lazy", ())
    d = reconcile(view(LAZY, job=job(LAZY, 1), in_flight=len(routers), asks=asked, state=state))
    activations = [a for a in d.actions if isinstance(a, Activate)]
    if not activations:
        return None
    (activate,) = activations
    # As the leader records it (`acting.Actor.apply_decision`).
    return Attempt(asked=activate.asked, at=NOW, eval="e", result="placed", answered=ask_numbers(asked))


def test_two_routers_whose_clocks_disagree_each_get_the_attempt_that_answers_their_own_ask(
    clocks: Clocks,
) -> None:
    ahead, behind = recorder("ahead"), recorder("behind")
    first_ask = ask(clocks, ahead, AHEAD_S, None)
    first = watcher_answers(clocks, [(ahead, AHEAD_S)], ModelState())
    assert first is not None and first.answers(first_ask)
    first = first.model_copy(update={"result": "unplaceable", "reason": "no room then"})

    # The other router asks before the first attempt reaches it, so its ask's time, by a clock
    # 40 s behind, is far below that attempt's: by time it would take that old "no room" as
    # its answer.
    late_ask = ask(clocks, behind, BEHIND_S, None)
    assert late_ask.at < first.asked
    assert not first.answers(late_ask)

    # The watcher sees the ask unanswered (by time it saw none, and the router waited for
    # nothing) and answers both routers' asks in one attempt.
    both = [(ahead, AHEAD_S), (behind, BEHIND_S)]
    second = watcher_answers(clocks, both, ModelState(attempt=first))
    assert second is not None
    assert second.answered == {ahead.asker: 1, behind.asker: 1}
    assert second.answers(late_ask) and second.answers(first_ask)
    # Answered: no third attempt while both still wait.
    assert watcher_answers(clocks, both, ModelState(attempt=second)) is None

    # The router ahead asks again (a request after its first was answered): answered afresh,
    # though its new ask's time is no later than what the watcher has seen.
    again = ask(clocks, ahead, AHEAD_S, second)
    assert not second.answers(again)
    third = watcher_answers(clocks, both, ModelState(attempt=second))
    assert third is not None and third.answers(again) and third.answers(late_ask)


def test_a_router_restarted_in_its_allocation_keeps_its_key_but_not_its_numbers(clocks: Clocks) -> None:
    """The in-flight key is the Nomad allocation's, which a restarted router keeps; its asks
    start again at 1, and an attempt that answered the old process's fifth ask is no answer."""
    old = recorder("alloc-1")
    for _ in range(5):
        ask(clocks, old, 0.0, None)
    answered_old = watcher_answers(clocks, [(old, 0.0)], ModelState())
    assert answered_old is not None

    restarted = recorder("alloc-1")
    first = ask(clocks, restarted, 0.0, answered_old)
    assert first.seq == 1 and first.asker != old.asker
    assert not answered_old.answers(first)
    assert watcher_answers(clocks, [(restarted, 0.0)], ModelState(attempt=answered_old)) is not None


def test_against_a_watcher_that_numbers_nothing_a_router_waits_by_time(clocks: Clocks) -> None:
    """An attempt without `answered` (an older watcher) answers by time, for the router and for
    a newer watcher taking over alike: both read the same attempt the same way."""
    r = recorder("r")
    mine = ask(clocks, r, 0.0, None)
    old_answer = Attempt(asked=mine.at, at=NOW, result="placed")
    assert old_answer.answered is None and old_answer.answers(mine)
    assert watcher_answers(clocks, [(r, 0.0)], ModelState(attempt=old_answer)) is None
    earlier = Attempt(asked=mine.at - 1, at=NOW, result="placed")
    assert not earlier.answers(mine)
    assert watcher_answers(clocks, [(r, 0.0)], ModelState(attempt=earlier)) is not None
    # What an older watcher writes reads back as numbering nothing.
    stored = ModelState.model_validate_json(json.dumps({"attempt": {"asked": mine.at, "result": "placed"}}))
    assert stored.attempt is not None and stored.attempt.answered is None


def test_a_router_that_numbers_nothing_is_answered_by_time_beside_numbered_ones(clocks: Clocks) -> None:
    """An older router publishes only its ask's time: the watcher answers it by time (the old
    rule, clocks and all), and the numbered asks by number, in the same attempt."""
    new = recorder("new")
    ask(clocks, new, 0.0, None)
    value: dict[str, Any] = {
        "router": "old",
        "at": NOW,
        "interval_s": 5.0,
        "models": {"lazy": {"requests": 1, "replicas": [], "asked": NOW + 2}},
    }
    kv = {
        inflight_key("new"): KVEntry(inflight_key("new"), json.dumps(new.in_flight()).encode(), 1),
        inflight_key("old"): KVEntry(inflight_key("old"), json.dumps(value).encode(), 2),
    }
    found = sorted(asks(kv, NOW)["lazy"], key=lambda a: a.asker)
    assert found == [Ask(new.asker, 1, NOW), Ask("old", 0, NOW + 2)]
    d = reconcile(view(LAZY, job=job(LAZY, 1), in_flight=2, asks=tuple(found)))
    (activate,) = [a for a in d.actions if isinstance(a, Activate)]
    assert (activate.asked, ask_numbers(found)) == (NOW + 2, {new.asker: 1})
    attempt = Attempt(asked=activate.asked, answered=ask_numbers(found), result="placed")
    assert all(attempt.answers(a) for a in found)
    # The older router's later ask is unanswered by time.
    assert not attempt.answers(Ask("old", 0, NOW + 3))


def test_ask_numbers_are_published_beside_ask_times_and_bad_ones_are_not_asks() -> None:
    r = recorder("r1")
    r.begin("lazy", WAITING)
    first, second = r.ask("lazy"), r.ask("lazy")
    assert (first.seq, second.seq) == (1, 2) and second.at >= first.at
    value = r.in_flight()
    assert value["asker"] == r.asker and value["asker"].startswith("r1/")
    assert value["models"]["lazy"] == {"requests": 1, "replicas": [], "asked": second.at, "ask_seq": 2}
    parsed = parse_inflight(json.dumps(value))
    assert parsed is not None and (parsed.asker, parsed.ask_seq) == (r.asker, {"lazy": 2})
    # Numbers outlive the model's requests: the process's next ask is never a number it used.
    r.end("lazy", WAITING, demand=False)
    r.begin("lazy", WAITING)
    assert r.ask("lazy").seq == 3
    for bad in (0, -1, True, 1.5, "3", 2**60):
        odd = {**value, "models": {"lazy": {"requests": 1, "asked": second.at, "ask_seq": bad}}}
        read = parse_inflight(json.dumps(odd))
        assert read is not None and read.ask_seq == {} and read.asked == {"lazy": second.at}
    nameless = parse_inflight(json.dumps({**value, "asker": ""}))
    assert nameless is not None and nameless.ask_seq == {}
