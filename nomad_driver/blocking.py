"""The blocking-query loop every watch of llmgw's runs: the watcher's six and the router's three.

Both Consul and Nomad answer a blocking read with an index to pass back next time. The rules
(Consul's "Blocking Queries" doc, Nomad's the same): an index that goes backwards means the
server's state was reset (a restored snapshot, a new dev agent), so start over from 0; an index
must never be 0 after the first read, or the next call returns at once and the loop spins.

On top of those, each loop takes a token from a small bucket before every call (Consul's advice
for blocking loops), because an index that moves on every write of an unrelated key would
otherwise turn a long poll into a busy loop; and when the far side fails, it logs once, backs off
with full jitter and keeps its last reading, marked stale. It never raises for the far side's
failures, so whoever reads it keeps serving what it knew.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("llmgw.watch")

T = TypeVar("T")

# Two calls at once, then ten a second at most: a loop whose index moves on every write still
# sees a change within a tenth of a second, and Consul sees no busy loop.
RATE_PER_S = 10.0
BURST = 2
# Full jitter from half a second up to this: watchers and routers that lost Consul together do
# not come back in the same instant, and none serves from a stale reading for long once it is back.
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 10.0


class ServiceError(Exception):
    """Consul or Nomad failed a call or refused it: the far side's problem, which a watch rides
    out, never a bug of llmgw's. Both clients' errors derive from it."""


def next_index(previous: int, returned: int | str | None) -> int:
    try:
        new = int(returned) if returned is not None else 0
    except (TypeError, ValueError):
        # A proxy or a garbage answer: do not block on it, but do not spin either.
        return 1
    if new < previous:
        return 0
    return max(new, 1)


def backoff_delay(attempt: int, base: float = BACKOFF_BASE_S, cap: float = BACKOFF_CAP_S) -> float:
    """Full-jitter exponential backoff, so watchers that lost Consul together do not all come
    back in the same instant."""
    return random.uniform(0, min(cap, base * (2 ** min(attempt, 16))))


class TokenBucket:
    """A burst of `burst` calls, then at most `rate` a second."""

    def __init__(self, rate: float = RATE_PER_S, burst: int = BURST) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    async def take(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


@dataclass(frozen=True)
class Reading(Generic[T]):
    """What one blocking read answered, and at which index; never changed once taken."""

    index: int
    data: T
    taken_at: float  # monotonic


class Watch(Generic[T]):
    """One collection kept current by blocking reads. `fetch(index)` makes one read and returns
    the new index (by `next_index`) and the data; `on_change` is called after each reading whose
    index moved (and after the first). The latest is in `snapshot`; `ok` says whether the last
    call succeeded, `error` why it did not."""

    def __init__(
        self,
        name: str,
        fetch: Callable[[int], Awaitable[tuple[int, T]]],
        *,
        on_change: Callable[[], None],
        rate: float = RATE_PER_S,
        logger: logging.Logger = log,
    ) -> None:
        self.name = name
        self.fetch = fetch
        self.on_change = on_change
        self.bucket = TokenBucket(rate)
        self.log = logger
        self.snapshot: Reading[T] | None = None
        self.ok = False  # the last call succeeded
        self.error = ""  # the last failure's message while not ok
        self.calls = 0
        self.reads = 0  # calls that succeeded
        self.last_success: float | None = None  # monotonic

    async def run(self) -> None:
        index = 0
        failures = 0
        while True:
            await self.bucket.take()
            self.calls += 1
            try:
                new_index, data = await self.fetch(index)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Whatever the far side or a bug in reading it raised, the watch keeps running:
                # a watch task that died would leave `ok` true over a snapshot that never moves
                # again, and a leader would act on it. Not ok until a read succeeds.
                unexpected = not isinstance(exc, (ServiceError, ValueError, KeyError, TypeError))
                message = str(exc) or type(exc).__name__
                if unexpected:
                    message = f"{type(exc).__name__}: {message}"
                if failures == 0:
                    # Once per outage: a log line per retry would bury everything else.
                    self.log.log(
                        logging.ERROR if unexpected else logging.WARNING,
                        "event=watch_failed watch=%s error=%r (serving from the last snapshot)",
                        self.name,
                        message,
                        exc_info=exc if unexpected else None,
                    )
                failures += 1
                self.ok = False
                self.error = message
                # Start over from a plain read: a Consul that restarted has a lower index, and a
                # blocking read with the old one would be held for the whole wait (a minute of
                # stale replicas, found by bench/soak.py).
                index = 0
                await asyncio.sleep(backoff_delay(failures))
                continue
            if failures:
                self.log.info("event=watch_recovered watch=%s after_failures=%d", self.name, failures)
                failures = 0
            self.ok = True
            self.error = ""
            self.reads += 1
            self.last_success = time.monotonic()
            if self.snapshot is None or new_index != self.snapshot.index or new_index != index:
                self.snapshot = Reading(new_index, data, self.last_success)
                self.on_change()
            index = new_index
