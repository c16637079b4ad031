"""The engine's own words for a failed start: the telling line of its stderr, read through
Nomad's logs API once per failed start, so a parked model names why it died."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from nomad_driver.nomad import Nomad, NomadError
from nomad_driver.watcher import parking
from nomad_driver.watcher.reconcile import Park

log = logging.getLogger("llmgw.watcher")

# (alloc, task, failures): one failed start.
StartKey = tuple[str, str, int]


class EngineErrors:
    def __init__(self, nomad: Nomad, wait_s: float) -> None:
        self.nomad = nomad
        # How long a read may wait for the stderr before falling back to Nomad's task event.
        self.wait_s = wait_s
        self._read: dict[StartKey, str] = {}

    def keep_only(self, starts: Iterable[StartKey]) -> None:
        """Forget the starts no decision parks any more."""
        wanted = set(starts)
        self._read = {k: v for k, v in self._read.items() if k in wanted}

    async def read(self, park: Park) -> str:
        """The line of the failed engine's stderr that says why it died; Nomad's task event
        only when that read fails or the engine wrote nothing telling. Bounded, because a pass
        waits for it."""
        key = (park.alloc_id, park.task, park.failures)
        if key in self._read:
            return self._read[key]
        line = ""
        if park.alloc_id and park.task:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.wait_s
            # An empty log is asked again only briefly: most engines that die write nothing
            # more, and parking must not wait seconds for them.
            patience = loop.time() + 0.5
            while True:
                try:
                    stderr = await asyncio.wait_for(
                        asyncio.to_thread(self.nomad.stderr_tail, park.alloc_id, park.task),
                        timeout=max(0.1, deadline - loop.time()),
                    )
                except (NomadError, TimeoutError) as exc:
                    log.warning(
                        "event=stderr_unavailable model=%s alloc=%s error=%r fallback=task_event",
                        park.model,
                        park.alloc_id,
                        str(exc) or type(exc).__name__,
                    )
                    break
                line = parking.telling_line(stderr)
                # Nothing written yet can be a log shipper a moment behind the exit; an engine
                # that wrote and said nothing telling will not say more.
                if line or stderr.strip() or loop.time() + 0.1 >= min(deadline, patience):
                    break
                await asyncio.sleep(0.1)
        error = line or park.event_error or "no error recorded"
        self._read[key] = error
        return error
