"""Bringing a model up for a request that found no ready replica.

The rule (DESIGN.md "Activation", and the note that followed the phi-4 incident): each request
for a model with no ready replica ignores the previous placement result and makes a fresh
attempt, a Nomad scale call, then waits for *that attempt's* evaluation, not for the whole
activation window. Nomad answers an evaluation in well under a second, so:

- not placed (the evaluation's `FailedTGAllocs`): the request is answered at once with Nomad's
  reason, and the client is told not to retry;
- placed: the request waits for a ready replica up to the model's activation window, then gets
  503 `model_loading` with `Retry-After`.

A model that was unplaceable an hour ago but fits now, because another model was scaled down,
is therefore served, not refused on a stale answer.

Attempts: concurrent requests share the attempt in flight (one scale call, one evaluation); an
attempt that finished, placed or not, is never joined again, so a request that arrives later
asks Nomad afresh and sees what Nomad says now (a replacement that fits nowhere any more). A
placed request waits until the first of: a ready replica; the model parked by the watcher
(`model_parked`, with the engine's error); a later evaluation of the job failing to place, seen
by another attempt of this router or by the watcher (`model_unplaceable`); the model's
definition removed; its activation window (`model_loading`, the only answer that says retry).
At most `max_waiting` requests wait per model; more get 429 `model_overloaded`.

An attempt that raised the job's count and was refused puts the count back (only if nobody
changed the job since), and writes no activity: nobody is being served, so nothing should keep
the model asked for. Parked models never get here: parking is the watcher's decision and only
a definition change or `llmgw ctl retry` lifts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from nomad_driver.blocking import next_index
from nomad_driver.spec import Model
from nomad_driver.state import ModelState, activity_key
from router import errors
from router.config import NomadSettings, Timeouts
from router.discovery import ConsulUnavailable, Discovery, Snapshot
from router.errors import RouterError
from router.metrics import RouterMetrics

log = logging.getLogger("llmgw.router.activation")

EVAL_DONE = ("complete", "failed", "canceled")


@dataclass(frozen=True)
class AttemptResult:
    placed: bool
    reason: str = ""
    eval_id: str = ""
    error: RouterError | None = None
    finished: float = 0.0


class NomadError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NomadClient:
    """The three Nomad calls the router makes, on aiohttp so nothing blocks the event loop."""

    def __init__(self, settings: NomadSettings) -> None:
        self.settings = settings
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        headers = {"X-Nomad-Token": self.settings.token} if self.settings.token else {}
        self._http = aiohttp.ClientSession(
            base_url=self.settings.addr,
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=self.settings.ssl_context() or False, limit=16),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=70),
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _params(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        params = dict(extra or {})
        if self.settings.namespace:
            params["namespace"] = self.settings.namespace
        if self.settings.region:
            params["region"] = self.settings.region
        return params

    async def _call(
        self, method: str, path: str, *, params: Mapping[str, str] | None = None, body: Any = None
    ) -> tuple[Any, str | None]:
        if self._http is None:
            raise NomadError(0, "nomad client is not started")
        try:
            async with self._http.request(method, path, params=self._params(params), json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    # Nomad's errors are plain text, the message itself.
                    raise NomadError(resp.status, text.strip()[:500] or f"HTTP {resp.status}")
                return json.loads(text), resp.headers.get("X-Nomad-Index")
        except aiohttp.ClientError as exc:
            raise NomadError(0, f"cannot reach Nomad at {self.settings.addr}: {exc}") from exc
        except TimeoutError as exc:
            raise NomadError(0, f"Nomad at {self.settings.addr} did not answer {method} {path}") from exc

    async def job(self, job_id: str) -> Mapping[str, Any]:
        job, _ = await self._call("GET", f"/v1/job/{quote(job_id, safe='')}")
        return job if isinstance(job, dict) else {}

    async def scale(self, job_id: str, group: str, count: int, message: str) -> Mapping[str, Any]:
        """Nomad's reply: `EvalID` (empty when nothing was evaluated) and `JobModifyIndex`."""
        body = {"Count": count, "Target": {"Group": group}, "Message": message}
        reply, _ = await self._call("POST", f"/v1/job/{quote(job_id, safe='')}/scale", body=body)
        return reply if isinstance(reply, dict) else {}

    async def evaluation(self, eval_id: str, index: int, wait_s: float) -> tuple[Mapping[str, Any], int]:
        params = {"index": str(index), "wait": f"{max(1, int(wait_s))}s"} if index else {}
        reply, header = await self._call("GET", f"/v1/evaluation/{quote(eval_id, safe='')}", params=params)
        try:
            new_index = int(header or 0)
        except ValueError:
            new_index = 0
        return (reply if isinstance(reply, dict) else {}), new_index


def summarize(failed_tg_allocs: Mapping[str, Any], job: Mapping[str, Any] | None) -> str:
    """Nomad's reason in the words the watcher uses everywhere else (imported when first needed,
    so the router starts without the control plane's modules loaded)."""
    from nomad_driver.placement import summarize_placement

    return summarize_placement(dict(failed_tg_allocs), job=dict(job) if job is not None else None)


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
        nomad: NomadClient,
        discovery: Discovery,
        metrics: RouterMetrics,
        timeouts: Timeouts,
        retry_after_s: int,
        max_waiting: int = 128,
    ) -> None:
        self.nomad = nomad
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
        # What the watcher said about placement before this request: only a newer word counts
        # (the older one is what this request's own attempt asks Nomad about afresh).
        known = _placement_mark(self.discovery.snapshot.states.get(model.name))
        task = self._attempts.get(model.name)
        if task is None:
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
        known: tuple[str, float],
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
            and _placement_mark(state) != known
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
            result = await self._scale_and_evaluate(model)
        except NomadError as exc:
            self.metrics.activations.labels(model.name, "error").inc()
            log.warning("activation of %s failed: %s", model.name, exc)
            return AttemptResult(placed=False, error=_nomad_failure(model, exc), finished=time.monotonic())
        except Exception as exc:
            self.metrics.activations.labels(model.name, "error").inc()
            log.exception("activation of %s failed", model.name)
            return AttemptResult(
                placed=False,
                error=RouterError(
                    503,
                    "activation_failed",
                    f"activating model '{model.name}' failed: {exc}",
                    type_="server_error",
                ),
                finished=time.monotonic(),
            )
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
        return result

    async def _scale_and_evaluate(self, model: Model) -> AttemptResult:
        job = await self.nomad.job(model.job_id)
        groups = job.get("TaskGroups") or []
        if not groups:
            raise NomadError(404, f"job {model.job_id} has no task group")
        group = groups[0]
        group_name = str(group.get("Name") or "")
        current = int(group.get("Count") or 0)
        # At least one, at least the minimum, never past the maximum; an already running count
        # is kept, and scaling to it still makes Nomad evaluate the job afresh.
        target = min(max(current, model.replicas_min, 1), max(model.replicas_max, 1))
        try:
            reply = await self.nomad.scale(
                model.job_id,
                group_name,
                target,
                f"llmgw router: request for {model.name} with no ready replica",
            )
        except NomadError as exc:
            if exc.status == 400 and "active deployment" in str(exc):
                # A deployment is rolling the job out right now: its allocations are placed
                # and starting, which is what this attempt would have asked for.
                await self._record_activity(model)
                return AttemptResult(placed=True, finished=time.monotonic())
            raise
        eval_id = str(reply.get("EvalID") or "")
        if not eval_id:
            await self._record_activity(model)
            return AttemptResult(placed=True, finished=time.monotonic())
        evaluation = await self._wait_evaluation(eval_id)
        failed = evaluation.get("FailedTGAllocs") or {}
        if failed:
            if target != current:
                await self._undo(model, group_name, current, target, reply.get("JobModifyIndex"))
            return AttemptResult(
                placed=False, reason=summarize(failed, job), eval_id=eval_id, finished=time.monotonic()
            )
        if evaluation.get("Status") == "failed":
            raise NomadError(
                500, f"evaluation {eval_id} failed: {evaluation.get('StatusDescription') or 'no description'}"
            )
        # Written once Nomad placed it, not before: a refused request is no demand, and the
        # watcher must be free to scale down a model nobody could be served by.
        await self._record_activity(model)
        return AttemptResult(placed=True, eval_id=eval_id, finished=time.monotonic())

    async def _record_activity(self, model: Model) -> None:
        # The watcher scales idle models down by this key; a model being activated is in use.
        try:
            await self.discovery.put_kv(activity_key(model.name), f"{time.time():.3f}")
        except ConsulUnavailable as exc:
            log.warning("could not record activity for %s after activation: %s", model.name, exc)

    async def _undo(self, model: Model, group: str, previous: int, raised: int, modify_index: Any) -> None:
        """Put the count back after a refused attempt, so that Nomad's blocked evaluation does
        not start the model later for a client that was told "unplaceable" and left. Only while
        the job is as this attempt left it: a count someone else set since (the watcher,
        another router, an operator) is theirs to keep."""
        try:
            job = await self.nomad.job(model.job_id)
            groups = job.get("TaskGroups") or []
            count = int(groups[0].get("Count") or 0) if groups else -1
            if count != raised or (modify_index and job.get("JobModifyIndex") != modify_index):
                log.info(
                    "not undoing the activation of %s: its job changed since (count %d)", model.name, count
                )
                return
            await self.nomad.scale(
                model.job_id,
                group,
                previous,
                f"llmgw router: undo the activation of {model.name}: Nomad could not place it",
            )
        except NomadError as exc:
            log.warning("could not put %s's count back to %d: %s", model.name, previous, exc)

    async def _wait_evaluation(self, eval_id: str) -> Mapping[str, Any]:
        deadline = time.monotonic() + self.timeouts.evaluation_s
        index = 0
        while True:
            started = time.monotonic()
            evaluation, returned = await self.nomad.evaluation(eval_id, index, min(deadline - started, 10.0))
            if evaluation.get("Status") in EVAL_DONE:
                return evaluation
            if time.monotonic() >= deadline:
                raise NomadError(
                    504,
                    f"evaluation {eval_id} still {evaluation.get('Status') or 'pending'} after "
                    f"{self.timeouts.evaluation_s:.0f}s",
                )
            index = next_index(index, returned)
            # A server that answers a blocking read at once must not turn this into a busy loop.
            if time.monotonic() - started < 0.05:
                await asyncio.sleep(0.05)


def _placement_mark(state: ModelState | None) -> tuple[str, float]:
    if state is None or not state.unplaceable:
        return ("", 0.0)
    return (state.placement_eval, state.updated_at)


def _nomad_failure(model: Model, exc: NomadError) -> RouterError:
    if exc.status == 404:
        return RouterError(
            503,
            "model_not_deployed",
            f"model '{model.name}' has no Nomad job {model.job_id}: {exc}; run 'llmgw apply' with its definition",
            type_="model_unavailable",
            headers=errors.NO_RETRY,
        )
    return RouterError(
        503,
        "activation_failed",
        f"model '{model.name}' has no ready replica and asking Nomad to start one failed: {exc}",
        type_="server_error",
        headers=((b"retry-after", b"5"),),
    )
