"""What the watcher needs to know about use, so it never scales a replica away under a request.

Two keys, both written by a background loop at most once per interval, never on a request's
path, so a busy router writes a few keys per interval, not one per request, and a slow Consul
never shows in a request's latency:

- `llmgw/activity/<model>`: when the model was last asked for, as Unix time. Noted when a
  request starts and again when it ends: the idle clock starts when the last request ends.
- `llmgw/inflight/<router>`: this router's requests in flight, per model, with the replicas
  they are on and its latest ask (`{"router", "asker", "at", "interval_s", "models": {model:
  {"requests", "replicas", "asked", "ask_seq"}}}`). Rewritten every interval while any request
  is open, and once more when the last one ends; at once for an ask (a request with no ready
  replica, which the leading watcher answers), for the first request on a model with none open
  here (so the watcher never takes a replica that just got a request for idle), and soon after
  a model's requests double (a burst the watcher's load rule answers at once); a router that
  stops refreshing it (a crash) is ignored once `at` is three intervals old.
  One key per router, not per request or per model, so it costs the same however busy the
  router is; the watcher sums it over routers (see docs/design.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from nomad_driver.blocking import TokenBucket
from nomad_driver.state import Ask, activity_key, inflight_key
from router.discovery import ConsulUnavailable

log = logging.getLogger("llmgw.router.activity")

Writer = Callable[[str, str], Awaitable[None]]

# The "replica" of a request still waiting for one (activation): counted as in flight for the
# model, on no replica.
WAITING = ""
# Prompt writes (an ask, a burst) are at most this often once a few came in a row: a storm of
# asks is one write, while an ask that follows a write by less than the gap (the next request
# of a client that was just answered) still goes at once.
PROMPT_GAP_S = 0.02
PROMPT_BURST = 3
# An ask is a time in milliseconds (as published); one after another is at least this much later.
ASK_STEP_S = 0.001


def default_router_id() -> str:
    """Stable for the life of a Nomad allocation, unique per process elsewhere."""
    alloc = os.environ.get("NOMAD_ALLOC_ID")
    return alloc or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ActivityRecorder:
    def __init__(self, write: Writer, interval_s: float, router_id: str | None = None) -> None:
        self._write = write
        self.interval_s = interval_s
        self.router_id = router_id or default_router_id()
        self._pending: dict[str, float] = {}
        # model -> replica -> requests open on it.
        self._open: dict[str, dict[str, int]] = {}
        # Whether the last published in-flight key named any request: one more write after
        # the last request ends says so, then an idle router writes nothing.
        self._published_busy = False
        self._task: asyncio.Task[None] | None = None
        # The latest ask per model, published while the model has requests open.
        self._asks: dict[str, Ask] = {}
        # Asks are numbered per model for the life of this process, never reset: the leader
        # records the numbers it answers. The key is per Nomad allocation, which a restarted
        # router keeps, so the numbers belong to the process, not to the key.
        self.asker = f"{self.router_id}/{uuid.uuid4().hex[:8]}"
        self._ask_seq: dict[str, int] = {}
        # Requests per model as last published: twice that is a burst worth writing at once.
        self._published: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._prompt_writes = TokenBucket(1 / PROMPT_GAP_S, PROMPT_BURST)

    def ask(self, model: str, after: float = 0.0) -> Ask:
        """A request found no ready replica: publish an ask at once and return it; the leader's
        attempt answers it by its number (`Attempt.answers`). Called while that request counts
        as in flight (`begin(model, WAITING)`), so the ask goes out with it.

        Its time matters only to a watcher from before asks were numbered, which compares times
        across routers: never at or below `after`, the latest attempt this router has seen, so
        that a clock behind another router's does not take an attempt made before this request
        as its answer (as a Lamport clock, short of asks made before that attempt was seen)."""
        at = max(round(time.time(), 3), round(after + ASK_STEP_S, 3))
        seq = self._ask_seq[model] = self._ask_seq.get(model, 0) + 1
        previous = self._asks.get(model)
        ask = Ask(self.asker, seq, max(at, previous.at if previous is not None else 0.0))
        self._asks[model] = ask
        self._wake.set()
        return ask

    def served(self, model: str) -> None:
        """The leader placed a replica for this router's ask: the model is in use from now, and
        written at once so the watcher does not take it down before the request ends."""
        self.touch(model)
        self._wake.set()

    def touch(self, model: str) -> None:
        self._pending[model] = time.time()

    def begin(self, model: str, replica: str) -> None:
        """A request was sent to `replica` (or waits for one, `WAITING`); it counts as in
        flight until `end`."""
        on_model = self._open.setdefault(model, {})
        on_model[replica] = on_model.get(replica, 0) + 1
        total = sum(on_model.values())
        # The first request on a replica of a model with none published, or twice as many as
        # published (a burst): written at once. Unknown until the next interval, a request that
        # began just after a write could see its replica scaled away as idle. A request that
        # waits for a replica is written with its ask (`ask`), which follows at once.
        published = self._published.get(model, 0)
        first = replica != WAITING and published == 0
        if first or (total >= 2 and total >= 2 * published):
            self._wake.set()

    def end(self, model: str, replica: str, *, demand: bool = True) -> None:
        """`demand=False` for a wait that ended without a replica (refused, or the client
        left): an answer of "unplaceable" or "parked" must not keep the model asked for."""
        on_model = self._open.get(model)
        if on_model is not None:
            left = on_model.get(replica, 0) - 1
            if left > 0:
                on_model[replica] = left
            else:
                on_model.pop(replica, None)
                if not on_model:
                    del self._open[model]
                    self._asks.pop(model, None)
        # The idle clock starts now, not when the request began.
        if demand:
            self.touch(model)

    def in_flight(self) -> dict[str, Any]:
        """The in-flight key's value as of now."""
        models: dict[str, Any] = {}
        for model, replicas in sorted(self._open.items()):
            use: dict[str, Any] = {
                "requests": sum(replicas.values()),
                "replicas": sorted(r for r in replicas if r),
            }
            ask = self._asks.get(model)
            if ask is not None:
                use["asked"] = ask.at
                use["ask_seq"] = ask.seq
            models[model] = use
        return {
            "router": self.router_id,
            "asker": self.asker,
            "at": round(time.time(), 3),
            "interval_s": self.interval_s,
            "models": models,
        }

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # The last requests before a shutdown still count as use; and a router going away
        # holds no requests any more.
        self._open.clear()
        await self.flush()

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for (a cancel can be swallowed on 3.11 by wait_for).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            self._wake.clear()
            await self._prompt_writes.take()
            await self.flush()

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for model, at in pending.items():
            try:
                await self._write(activity_key(model), f"{at:.3f}")
            except ConsulUnavailable as exc:
                # Keep it for the next round unless a newer request already replaced it.
                self._pending.setdefault(model, at)
                log.warning("could not record activity for %s: %s", model, exc)
        if self._open or self._published_busy:
            busy = bool(self._open)
            value = self.in_flight()
            try:
                await self._write(inflight_key(self.router_id), json.dumps(value))
            except ConsulUnavailable as exc:
                log.warning("could not publish requests in flight: %s", exc)
                return
            self._published_busy = busy
            self._published = {m: use["requests"] for m, use in value["models"].items()}
