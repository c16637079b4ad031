"""One clock for the whole stand-in, so tests can shorten Nomad's restart and reschedule delays
(seconds to minutes in real Nomad) without changing any rule that uses them."""

from __future__ import annotations

import asyncio
import time


class Clock:
    """Wall time running `speed` times faster than real time. Timestamps it hands out
    (`now_ns`, used for Nomad's `Time` fields and reschedule intervals) advance at the same
    rate as its sleeps, so intervals and delays stay consistent with each other."""

    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError("clock speed must be positive")
        self.speed = speed
        self._wall0 = time.time()
        self._mono0 = time.monotonic()

    def now(self) -> float:
        return self._wall0 + (time.monotonic() - self._mono0) * self.speed

    def now_ns(self) -> int:
        return int(self.now() * 1e9)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.speed)
