"""What the watcher needs to know about use, so it never scales a replica away under a request.

Two keys, both written by a background loop at most once per interval, never on a request's
path, so a busy router writes a few keys per interval, not one per request, and a slow Consul
never shows in a request's latency:

- `llmgw/activity/<model>`: when the model was last asked for, as Unix time. Noted when a
  request starts and again when it ends: the idle clock starts when the last request ends.
- `llmgw/inflight/<router>`: this router's requests in flight, per model, with the replicas
  they are on (`{"router", "at", "interval_s", "models": {model: {"requests", "replicas"}}}`).
  Rewritten every interval while any request is open, and once more when the last one ends;
  a router that stops refreshing it (a crash) is ignored once `at` is three intervals old.
  One key per router, not per request or per model, so it costs the same however busy the
  router is; the watcher sums it over routers (see docs/design.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from nomad_driver.state import activity_key, inflight_key
from router.discovery import ConsulUnavailable

log = logging.getLogger("llmgw.router.activity")

Writer = Callable[[str, str], Awaitable[None]]

# The "replica" of a request still waiting for one (activation): counted as in flight for the
# model, on no replica.
WAITING = ""


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

    def touch(self, model: str) -> None:
        self._pending[model] = time.time()

    def begin(self, model: str, replica: str) -> None:
        """A request was sent to `replica` (or waits for one, `WAITING`); it counts as in
        flight until `end`."""
        on_model = self._open.setdefault(model, {})
        on_model[replica] = on_model.get(replica, 0) + 1

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
        # The idle clock starts now, not when the request began.
        if demand:
            self.touch(model)

    def in_flight(self) -> dict[str, Any]:
        """The in-flight key's value as of now."""
        return {
            "router": self.router_id,
            "at": round(time.time(), 3),
            "interval_s": self.interval_s,
            "models": {
                model: {"requests": sum(replicas.values()), "replicas": sorted(r for r in replicas if r)}
                for model, replicas in sorted(self._open.items())
            },
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
            await asyncio.sleep(self.interval_s)
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
            try:
                await self._write(inflight_key(self.router_id), json.dumps(self.in_flight()))
            except ConsulUnavailable as exc:
                log.warning("could not publish requests in flight: %s", exc)
                return
            self._published_busy = busy
