"""Index rules for Consul's and Nomad's blocking queries, shared by every watch loop.

Both APIs answer a blocking read with an index to pass back next time. The rules (Consul's
"Blocking Queries" doc, Nomad's the same): an index that goes backwards means the server's
state was reset (a restored snapshot, a new dev agent), so start over from 0; an index must
never be 0 after the first read, or the next call returns at once and the loop spins.
"""

from __future__ import annotations

import random


def next_index(previous: int, returned: int | str | None) -> int:
    try:
        new = int(returned) if returned is not None else 0
    except (TypeError, ValueError):
        # A proxy or a garbage answer: do not block on it, but do not spin either.
        return 1
    if new < previous:
        return 0
    return max(new, 1)


def changed(previous: int, returned: int) -> bool:
    """A blocking read may return on timeout with the same index: nothing to do then."""
    return returned != previous


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Full-jitter exponential backoff, so watchers that lost Consul together do not all come
    back in the same instant."""
    return random.uniform(0, min(cap, base * (2 ** min(attempt, 16))))
