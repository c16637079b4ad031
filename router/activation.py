"""Bringing a model up for a request that found no ready replica.

The rule (DESIGN.md "Activation", and the note that followed the phi-4 incident): each request
for a model with no ready replica ignores the previous placement result and makes a fresh
attempt, then waits for *that attempt's* evaluation, not for the whole activation window.

The router never calls Nomad: the leading watcher is the one writer of every job's count. A
request *asks*: its router publishes the ask (numbered per model by this router process, with
its time; see `ActivityRecorder.ask`) in its `llmgw/inflight/<router>` key at once, the leader
sees it on its blocking query, applies the same rule as for load (0 -> 1, or the count the load
wants), makes the scale call, reads the evaluation and records the attempt in
`llmgw/state/<model>` (`attempt: {answered, asked, at, eval, result, reason}`), `answered`
naming each router's ask number it answers. A request waits for the attempt that answers its
router's ask (`Attempt.answers`: by number; by time against a watcher that numbers nothing):

- `unplaceable`: answered at once with Nomad's reason, and told not to retry;
- `placed`: waits for a ready replica up to the model's activation window, then gets 503
  `model_loading` with `Retry-After`;
- no answer within `Timeouts.evaluation_s` (30 s; no watcher leads, or it cannot reach Nomad):
  503 `activation_failed` with `Retry-After`.

A model that was unplaceable an hour ago but fits now, because another model was scaled down,
is therefore served, not refused on a stale answer.

Attempts: concurrent requests share the attempt in flight (one ask, one scale call, one
evaluation); an attempt that finished, placed or not, is never joined again, so a request that
arrives later asks afresh and sees what Nomad says now. A placed request waits until the first
of: a ready replica; the model parked by the watcher (`model_parked`, with the engine's error);
a later evaluation of the job failing to place, seen by another attempt of this router or by
the watcher (`model_unplaceable`); the model's definition removed; its activation window
(`model_loading`, the only answer that says retry). At most `max_waiting` requests wait per
model; more get 429 `model_overloaded`.

A refused ask writes no activity: nobody is being served, so nothing keeps the model asked for,
and the watcher takes the count it raised back down once the request has ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nomad_driver.spec import Model
from nomad_driver.state import Ask, ModelState
from router import errors
from router.config import Timeouts
from router.discovery import Discovery, Snapshot
from router.errors import RouterError
from router.metrics import RouterMetrics

log = logging.getLogger("llmgw.router.activation")


@dataclass(frozen=True)
class AttemptResult:
    placed: bool
    reason: str = ""
    eval_id: str = ""
    error: RouterError | None = None
    finished: float = 0.0
    # False when no attempt was needed after all (a replica became ready, or the model was
    # parked, before the watcher answered): nothing to count, and no demand to note.
    asked: bool = True
    # The state whose attempt answered: read on the request's own blocking read, it may be
    # newer than the snapshot the waiting loop goes on to read.
    word: ModelState | None = None


@dataclass
class Room:
    """The requests waiting for one model, and the latest refusal Nomad gave any attempt for it
    (a later evaluation of the same job releases requests placed by an earlier one)."""

    waiting: int = 0
    refusals: int = 0
    refusal: RouterError | None = None


class Activator:
    def __init__(
        self,
        ask: Callable[[str, float], Ask],
        served: Callable[[str], None],
        discovery: Discovery,
        metrics: RouterMetrics,
        timeouts: Timeouts,
        retry_after_s: int,
        max_waiting: int = 128,
    ) -> None:
        # `ask(model, after)` publishes an ask (its time later than `after`, the latest attempt
        # seen) and returns it; `served(model)` notes the model in use once placed (its
        # activity, written at once).
        self.ask = ask
        self.served = served
        self.discovery = discovery
        self.metrics = metrics
        self.timeouts = timeouts
        self.retry_after_s = retry_after_s
        self.max_waiting = max_waiting
        # Only attempts in flight: one that finished (placed, refused, failed) is dropped at
        # once, so the next request asks Nomad again rather than trusting an old answer.
        self._attempts: dict[str, asyncio.Task[AttemptResult]] = {}
        self._rooms: dict[str, Room] = {}

    async def close(self) -> None:
        tasks = list(self._attempts.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._attempts.clear()

    def in_flight(self, model: str) -> bool:
        room = self._rooms.get(model)
        return model in self._attempts or (room is not None and room.waiting > 0)

    def waiting(self, model: str) -> int:
        room = self._rooms.get(model)
        return room.waiting if room is not None else 0

    async def activate(self, model: Model, arrived: float) -> None:
        """Return once `model` has a ready replica, or raise the answer to give instead."""
        room = self._rooms.get(model.name)
        if room is None:
            room = self._rooms[model.name] = Room()
        if room.waiting >= self.max_waiting:
            self.metrics.refusals.labels(model.name, "overloaded").inc()
            raise errors.overloaded(model.name, room.waiting, self.retry_after_s)
        room.waiting += 1
        gauge = self.metrics.waiting.labels(model.name)
        gauge.inc()
        try:
            await self._wait(model, room, arrived)
        finally:
            room.waiting -= 1
            gauge.dec()
            if room.waiting == 0 and model.name not in self._attempts:
                self._rooms.pop(model.name, None)

    async def _wait(self, model: Model, room: Room, arrived: float) -> None:
        task = self._attempts.get(model.name)
        # A finished attempt stays in the table until its done-callback runs, a turn of the event
        # loop later; a request that arrives in between asks afresh too.
        if task is None or task.done():
            task = asyncio.create_task(self._attempt(model, room))
            self._attempts[model.name] = task
            task.add_done_callback(lambda done: self._attempt_done(model.name, done))
        # Shielded: one client giving up must not cancel the attempt the others are waiting on.
        result = await asyncio.shield(task)
        if result.error is not None:
            raise result.error
        if not result.placed:
            self.metrics.refusals.labels(model.name, "unplaceable").inc()
            raise errors.unplaceable(model.name, result.reason)
        refusals_seen = room.refusals
        # What the watcher has said about placement by the time this request's own attempt was
        # placed is about an evaluation no newer than the attempt's: only a later word counts.
        # Taken at arrival instead, a "no room" the watcher found while the attempt ran (before
        # another model was scaled down to make room) refused a request Nomad had just placed.
        # The word that answered may be newer than the snapshot, which then shows older words
        # (the attempt before this one's "no room") before it catches up: those are not later.
        known = _newer(self.discovery.snapshot.states.get(model.name), result.word)
        window = model.activation_timeout_s
        deadline = arrived + window
        while True:
            snapshot = self.discovery.snapshot
            if snapshot.ready.get(model.name):
                return
            answer = self._early_answer(model.name, snapshot, room, refusals_seen, known, result.eval_id)
            if answer is not None:
                raise answer
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.loading(model.name, window, self.retry_after_s)
            await self.discovery.wait_change(model.name, remaining)

    def _early_answer(
        self,
        name: str,
        snapshot: Snapshot,
        room: Room,
        refusals_seen: int,
        known: ModelState | None,
        own_eval: str,
    ) -> RouterError | None:
        """Why a placed request should stop waiting before its window ends, if it should: the
        answer it would get if it arrived now, instead of "loading" minutes later."""
        state = snapshot.states.get(name)
        if state is not None and state.parked:
            self.metrics.refusals.labels(name, "parked").inc()
            return errors.parked(name, state.consecutive_failures, state.last_error)
        if snapshot.models and name not in snapshot.models:
            self.metrics.refusals.labels(name, "removed").inc()
            return errors.removed(name)
        if room.refusals != refusals_seen and room.refusal is not None:
            # A later attempt of this router found no room (a replacement that fits nowhere now).
            self.metrics.refusals.labels(name, "unplaceable").inc()
            return room.refusal
        if (
            state is not None
            and state.unplaceable
            and state.placement_eval != own_eval
            and _placement_mark(state) != _placement_mark(known)
            and (known is None or state.updated_at > known.updated_at)
        ):
            # The watcher saw a later evaluation of the job (a rescheduled or replacement
            # allocation) fail to place.
            self.metrics.refusals.labels(name, "unplaceable").inc()
            return errors.unplaceable(name, state.placement_reason)
        return None

    def _attempt_done(self, name: str, task: asyncio.Task[AttemptResult]) -> None:
        if self._attempts.get(name) is task:
            del self._attempts[name]
        room = self._rooms.get(name)
        if room is not None and room.waiting == 0:
            del self._rooms[name]

    async def _attempt(self, model: Model, room: Room) -> AttemptResult:
        try:
            result = await self._ask_and_wait(model)
        except Exception as exc:
            self.metrics.activations.labels(model.name, "error").inc()
            log.exception("activation of %s failed", model.name)
            return AttemptResult(
                placed=False, error=activation_failed(model, str(exc)), finished=time.monotonic()
            )
        if result.error is not None:
            self.metrics.activations.labels(model.name, "error").inc()
            return result
        if not result.asked:
            return result
        self.metrics.activations.labels(model.name, "placed" if result.placed else "unplaceable").inc()
        if not result.placed:
            log.warning(
                "model %s is unplaceable (evaluation %s): %s", model.name, result.eval_id, result.reason
            )
            # Requests still waiting on an earlier placement hear this too: the replica they
            # wait for is the one Nomad just said fits nowhere.
            room.refusals += 1
            room.refusal = errors.unplaceable(model.name, result.reason)
            self.discovery.notify(model.name)
        else:
            # Noted once Nomad placed it, not before: a refused request is no demand.
            self.served(model.name)
        return result

    async def _ask_and_wait(self, model: Model) -> AttemptResult:
        """Ask the leading watcher and wait for its attempt for this ask (or a later one)."""
        state = self.discovery.snapshot.states.get(model.name)
        seen = state.attempt.asked if state is not None and state.attempt is not None else 0.0
        ask = self.ask(model.name, seen)
        window = self.timeouts.evaluation_s
        deadline = time.monotonic() + window
        reader = _StateReader(self.discovery, model.name)
        try:
            return await self._wait_for_answer(model, ask, deadline, reader)
        finally:
            reader.close()

    async def _wait_for_answer(
        self, model: Model, ask: Ask, deadline: float, reader: _StateReader
    ) -> AttemptResult:
        window = self.timeouts.evaluation_s
        while True:
            snapshot = self.discovery.snapshot
            state = snapshot.states.get(model.name)
            removed = bool(snapshot.models) and model.name not in snapshot.models
            if snapshot.ready.get(model.name) or removed or (state is not None and state.parked):
                # Served, or refused as parked or removed, by the waiting loop: no watcher
                # answers for a model it no longer has or will not place.
                return AttemptResult(placed=True, finished=time.monotonic(), asked=False)
            word = next(
                (
                    s
                    for s in (state, reader.state)
                    if s is not None and s.attempt is not None and s.attempt.answers(ask)
                ),
                None,
            )
            if word is not None and word.attempt is not None:
                attempt = word.attempt
                now = time.monotonic()
                if attempt.result == "unplaceable":
                    return AttemptResult(
                        placed=False, reason=attempt.reason, eval_id=attempt.eval, finished=now
                    )
                if attempt.result == "error":
                    log.warning("activation of %s failed: %s", model.name, attempt.reason)
                    return AttemptResult(
                        placed=False,
                        error=activation_failed(model, f"the watcher could not scale it: {attempt.reason}"),
                        finished=now,
                    )
                return AttemptResult(placed=True, eval_id=attempt.eval, finished=now, word=word)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return AttemptResult(
                    placed=False,
                    error=activation_failed(
                        model,
                        f"no watcher answered its activation within {window:.0f}s "
                        "(is a watcher running and leading, and can it reach Nomad?)",
                    ),
                    finished=time.monotonic(),
                )
            await reader.wait(remaining)


# Models whose waiting requests read their state key at once; more wait on the snapshot alone.
MAX_STATE_READS = 8


class _StateReader:
    """The model's state key, read with a blocking query of its own while a request waits on
    an activation, beside the snapshot's wake-ups (`Discovery.read_state`). A read that fails
    is not tried again for this wait: the snapshot still brings the answer."""

    def __init__(self, discovery: Discovery, model: str) -> None:
        self.discovery = discovery
        self.model = model
        self.state: ModelState | None = None
        self._index = 0
        self._read: asyncio.Task[tuple[int, ModelState | None]] | None = None
        self._failed = False

    async def wait(self, timeout: float) -> None:
        """Until the snapshot may have changed for the model, the key changed, or `timeout`."""
        if self._read is None and not self._failed and self.discovery.state_reads < MAX_STATE_READS:
            self._read = asyncio.create_task(self.discovery.read_state(self.model, self._index, timeout))
        changed = asyncio.create_task(self.discovery.wait_change(self.model, timeout))
        waiting: set[asyncio.Future[Any]] = {changed} if self._read is None else {changed, self._read}
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if self._read is not None and self._read.done():
            read, self._read = self._read, None
            try:
                self._index, self.state = read.result()
            except Exception as exc:  # Consul refused or went away: the snapshot carries on
                self._failed = True
                log.debug("reading %s's state for its activation failed: %s", self.model, exc)

    def close(self) -> None:
        if self._read is not None:
            self._read.cancel()
            self._read = None


def _newer(a: ModelState | None, b: ModelState | None) -> ModelState | None:
    """The later of two words of the watcher's on one model."""
    if a is None or b is None:
        return a or b
    return b if b.updated_at > a.updated_at else a


def _placement_mark(state: ModelState | None) -> tuple[str, float]:
    if state is None or not state.unplaceable:
        return ("", 0.0)
    return (state.placement_eval, state.updated_at)


def activation_failed(model: Model, why: str) -> RouterError:
    return errors.activation_failed(model.name, why)
