"""A watcher stopped while a pass reads through Nomad stops. On Python 3.11 `asyncio.wait_for`
returns the result of a read that finished as the cancel came, and the cancel is lost: the pass
went on, and `Watcher.stop()` waited for it forever (a CI run sat in it until pytest-timeout, the
watcher's Consul session lapsed). The reads that a pass or an answer waits on are timed with
`asyncio.timeout` instead, which keeps such a cancel."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from nomad_driver.fetch.progress import read_one
from nomad_driver.nomad import Nomad
from nomad_driver.watcher.engine_errors import EngineErrors

WORDS = "llama_model_load: error loading model: unknown model architecture: 'kev'\n"


class HeldNomad(Nomad):
    """Its log reads return when the test lets them: the one thing the test must time."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")
        self.entered = threading.Event()
        self.let_go = threading.Event()

    def log_tail(self, alloc_id: str, task: str, kind: str, nbytes: int = 4096) -> str:
        self.entered.set()
        self.let_go.wait(10)
        return WORDS


async def ends_of_reads_cancelled_as_they_finish(read: Any) -> set[str]:
    """How reads ended that were cancelled while their result made its way through the loop:
    the thread's result is queued, then the loop takes 0 to 5 turns before the cancel."""
    ends = set()
    for turns in range(6):
        nomad = HeldNomad()
        task = asyncio.ensure_future(read(nomad))
        assert await asyncio.to_thread(nomad.entered.wait, 10)
        nomad.let_go.set()
        time.sleep(0.1)  # the thread returns; its result waits in the loop's queue
        for _ in range(turns):
            await asyncio.sleep(0)
        if not task.cancel():
            continue  # the read ended before the cancel: nothing was lost
        try:
            await task
        except asyncio.CancelledError:
            ends.add("cancelled")
        else:
            ends.add(f"returned after {turns} turns")
    return ends


async def test_a_stderr_read_cancelled_as_it_finishes_ends_cancelled() -> None:
    async def read(nomad: Nomad) -> str:
        return await EngineErrors(nomad, wait_s=5.0).read_start("kev", "a1", "engine", 5, "Exit Code: 1")

    assert await ends_of_reads_cancelled_as_they_finish(read) == {"cancelled"}


async def test_a_progress_read_cancelled_as_it_finishes_ends_cancelled() -> None:
    async def read(nomad: Nomad) -> Any:
        return await read_one(nomad, {"ID": "a1", "NodeName": "n1"})

    assert await ends_of_reads_cancelled_as_they_finish(read) == {"cancelled"}
