"""Outlier ejection: which replicas this router keeps out of rotation for a while, and why.

Envoy's rules, with its defaults: a replica that answers 5xx or times out `consecutive` times
in a row is ejected for `base_s` times the number of times it has been ejected, up to `max_s`,
so a replica that keeps failing stays out longer each time. A connection that is refused or
breaks ejects at once, for `connect_s`, bridging the seconds until the replica's Consul check
turns critical. Ejected replicas still serve when nothing else is left (trying a replica that
failed a moment ago beats refusing), and a success puts a replica's back-off back at the start.

Without this, a replica that fails fast (an instant 500) always has the fewest requests
outstanding, and least-outstanding routing sent it more traffic than a healthy one.

No I/O: the request path reports outcomes, `on_eject` is told of each ejection.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass

# Envoy's outlier detection defaults (consecutive_5xx, base_ejection_time, max_ejection_time).
CONSECUTIVE_FAILURES = 5
BASE_EJECTION_S = 30.0
MAX_EJECTION_S = 300.0

# Why a replica was ejected, as `llmgw_router_ejections_total` labels it.
CONSECUTIVE_5XX = "consecutive_5xx"
CONNECTION = "connection"
REASONS = (CONSECUTIVE_5XX, CONNECTION)


@dataclass
class Standing:
    failures: int = 0  # 5xx or timeouts in a row
    ejections: int = 0  # times ejected since its last success
    until: float = 0.0  # ejected until (monotonic); 0 when in rotation
    reason: str = ""  # why it was last ejected (REASONS)


class Outliers:
    def __init__(
        self,
        *,
        consecutive: int = CONSECUTIVE_FAILURES,
        base_s: float = BASE_EJECTION_S,
        max_s: float = MAX_EJECTION_S,
        connect_s: float = 5.0,
        on_eject: Callable[[Hashable, str, float], None] = lambda replica, reason, seconds: None,
    ) -> None:
        self.consecutive = consecutive
        self.base_s = base_s
        self.max_s = max_s
        self.connect_s = connect_s
        self.on_eject = on_eject
        self._standing: dict[Hashable, Standing] = {}
        # Replicas ejected now or a moment ago: the request path checks this is empty first.
        self._ejected: dict[Hashable, float] = {}

    def succeeded(self, replica: Hashable) -> None:
        if replica in self._standing:
            del self._standing[replica]

    def failed(self, replica: Hashable, now: float) -> None:
        """A 5xx answer or a timeout."""
        standing = self._standing.setdefault(replica, Standing())
        standing.failures += 1
        if standing.failures >= self.consecutive and standing.until <= now:
            standing.failures = 0
            standing.ejections += 1
            seconds = min(self.max_s, self.base_s * standing.ejections)
            self._eject(replica, standing, now + seconds, CONSECUTIVE_5XX, seconds)

    def connection_failed(self, replica: Hashable, now: float) -> None:
        """Refused, or the connection broke: out at once, briefly."""
        standing = self._standing.setdefault(replica, Standing())
        if standing.until < now + self.connect_s:
            self._eject(replica, standing, now + self.connect_s, CONNECTION, self.connect_s)

    def _eject(
        self, replica: Hashable, standing: Standing, until: float, reason: str, seconds: float
    ) -> None:
        standing.until = until
        standing.reason = reason
        self._ejected[replica] = until
        self.on_eject(replica, reason, seconds)

    def standing(self, replica: Hashable) -> Standing | None:
        """The replica's record: None while it has no failure since its last success."""
        return self._standing.get(replica)

    def ejected(self, now: float) -> set[Hashable]:
        return {r for r, until in self._ejected.items() if until > now}

    def any_ejected(self) -> bool:
        return bool(self._ejected)

    def in_rotation(self, candidates: Collection[Hashable], now: float) -> list[Hashable]:
        """The candidates not ejected; all of them when every one is."""
        ejected = self._ejected
        healthy = [r for r in candidates if ejected.get(r, 0.0) <= now]
        for replica in [r for r, until in ejected.items() if until <= now]:
            del ejected[replica]
        return healthy or list(candidates)

    def forget(self, replica: Hashable) -> None:
        self._standing.pop(replica, None)
        self._ejected.pop(replica, None)
