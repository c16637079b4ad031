"""`llmgw/activity/<model>`: when a model was last asked for, so the watcher can scale idle
replicas down. Requests only note the time in memory; a background loop writes each model's
latest time at most once per interval, so a busy router writes a few keys per interval, not
one per request, and a slow Consul never shows in a request's latency."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nomad_driver.state import activity_key
from router.discovery import ConsulUnavailable

log = logging.getLogger("llmgw.router.activity")

Writer = Callable[[str, str], Awaitable[None]]


class ActivityRecorder:
    def __init__(self, write: Writer, interval_s: float) -> None:
        self._write = write
        self.interval_s = interval_s
        self._pending: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def touch(self, model: str) -> None:
        self._pending[model] = time.time()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # The last requests before a shutdown still count as use.
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
