"""Closing an event stream is immediate, whatever its reader thread is waiting for: a watcher that
stops (SIGTERM, a test's teardown) must not wait for Nomad's next heartbeat, up to 10 s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from nomad_driver.nomad import EventStream, Nomad


async def test_a_stream_waiting_between_heartbeats_closes_at_once(start_standin: Callable[..., Any]) -> None:
    standin = start_standin(consul=False, extra_args=["--event-heartbeat", "30"])
    stream = EventStream(Nomad(standin.url), ["Job"], 1)
    # Connected and waiting: nothing to say for 30 s.
    assert await stream.next(1.0) is None
    started = time.monotonic()
    stream.close()
    closed_in = time.monotonic() - started
    stream._thread.join(5)
    ended_in = time.monotonic() - started
    assert closed_in < 0.5, closed_in
    assert not stream._thread.is_alive() and ended_in < 2.0, ended_in
    await asyncio.sleep(0)
