"""What the routers say is in flight (their `llmgw/inflight/<router>` keys): summed per model for
the idle clock and the scaling rules, and the keys of routers gone for an hour removed."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping

from nomad_driver.consul import Consul, ConsulError, KVEntry
from nomad_driver.state import INFLIGHT_PREFIX, Ask, RouterInFlight, parse_inflight

log = logging.getLogger("llmgw.watcher")

# A router's in-flight key that has not been refreshed for this long belongs to a router that is
# gone; the leader deletes it.
INFLIGHT_FORGET_AFTER_S = 3600.0


def requests_in_flight(
    kv: Mapping[str, KVEntry], now: float, least_grace_s: float
) -> tuple[dict[str, int], dict[str, set[str]], float]:
    """Requests in flight per model summed over the routers that still refresh their key,
    the replicas those requests are on, and the grace for the idle clock: the longest
    publishing interval of any router (`least_grace_s`, the routers' default, when none
    publishes)."""
    requests: dict[str, int] = {}
    replicas: dict[str, set[str]] = {}
    grace = least_grace_s
    for _, router in _live_routers(kv, now):
        grace = max(grace, router.interval_s)
        for model, n in router.requests.items():
            requests[model] = requests.get(model, 0) + n
            replicas.setdefault(model, set()).update(router.replicas.get(model, ()))
    return requests, replicas, grace


def asks(kv: Mapping[str, KVEntry], now: float) -> dict[str, tuple[Ask, ...]]:
    """Each live router's latest ask per model: what the leader answers with an activation
    attempt, until that attempt answers every one (`Attempt.answers`)."""
    latest: dict[str, list[Ask]] = {}
    for key, router in _live_routers(kv, now):
        # An older router names no process and numbers nothing: known by its key, answered by time.
        asker = router.asker or key.removeprefix(INFLIGHT_PREFIX)
        for model, at in router.asked.items():
            latest.setdefault(model, []).append(Ask(asker, router.ask_seq.get(model, 0), at))
    return {model: tuple(found) for model, found in latest.items()}


def routers_change_at(kv: Mapping[str, KVEntry], now: float) -> float:
    """When what the routers' records say next changes with nothing written: one going stale, or
    one dated ahead coming due (inf: never)."""
    return min(
        (router.changes_at(now) for _, router in _parsed_routers(kv)),
        default=math.inf,
    )


async def forget_gone_routers(consul: Consul, kv: Mapping[str, KVEntry], now: float) -> None:
    """Delete in-flight keys of routers gone for an hour (each router restart makes a new
    key); check-and-set, so a router that came back and wrote meanwhile keeps its key."""
    for key, entry in kv.items():
        if not key.startswith(INFLIGHT_PREFIX):
            continue
        router = parse_inflight(entry.value)
        if router is not None and router.at > now - INFLIGHT_FORGET_AFTER_S:
            continue
        try:
            await consul.kv_delete(key, cas=entry.modify_index)
        except ConsulError as exc:
            log.warning("event=inflight_cleanup_failed key=%s error=%r", key, str(exc))
            return


def _live_routers(kv: Mapping[str, KVEntry], now: float) -> Iterator[tuple[str, RouterInFlight]]:
    """The routers' in-flight records that parse and are still refreshed, with their keys."""
    return ((key, router) for key, router in _parsed_routers(kv) if router.live(now))


def _parsed_routers(kv: Mapping[str, KVEntry]) -> Iterator[tuple[str, RouterInFlight]]:
    for key, entry in kv.items():
        if key.startswith(INFLIGHT_PREFIX):
            router = parse_inflight(entry.value)
            if router is not None:
                yield key, router
