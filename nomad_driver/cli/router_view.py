"""What routers say of the replicas, for `llmgw ctl replicas --router URL`.

The watcher knows where replicas run; only a router knows which of them it keeps out of
rotation (outlier ejection, router/outliers.py), and each router decides on what it saw itself.
So ctl asks each router named for its view (`GET /v1/router/replicas`) and joins it to the
watcher's rows by address, the one thing both read from Consul's catalog.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

ROUTER_REPLICAS_PATH = "/v1/router/replicas"
# What a router's row contributes to a replica, as `routing` entries in ctl's JSON.
ROUTING_FIELDS = (
    "status",
    "in_flight",
    "ejected",
    "ejected_for_s",
    "ejection_reason",
    "ejections",
    "failures_in_a_row",
)


def router_replicas(url: str, key: str | None, timeout: float = 5.0) -> list[dict[str, Any]]:
    """One router's rows. Raises RuntimeError with a line that says what went wrong."""
    url = url if "://" in url else f"http://{url}"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.get(url.rstrip("/") + ROUTER_REPLICAS_PATH, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach the router at {url}: {exc or type(exc).__name__}") from exc
    if resp.status_code in (401, 403):
        raise RuntimeError(
            f"the router at {url} refused the key ({resp.status_code}); set LLMGW_ROUTER_API_KEY"
        )
    if resp.status_code != 200:
        raise RuntimeError(
            f"the router at {url} answered {resp.status_code} to {ROUTER_REPLICAS_PATH}; "
            "is it older than this llmgw?"
        )
    try:
        rows = resp.json()["replicas"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"the router at {url} sent a replica list without 'replicas'") from exc
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def join_routing(rows: list[dict[str, Any]], views: Iterable[tuple[str, list[dict[str, Any]]]]) -> None:
    """Add to each watcher row a `routing` list: one entry per router that knows the replica."""
    for row in rows:
        row["routing"] = []
    by_address = {str(r.get("address")): r for r in rows if r.get("address")}
    for url, replicas in views:
        for replica in replicas:
            known = by_address.get(str(replica.get("address")))
            if known is not None:
                known["routing"].append({"router": url, **{f: replica.get(f) for f in ROUTING_FIELDS}})


def routing_cell(entries: list[dict[str, Any]], several: bool) -> str:
    """`in rotation`, or `ejected 25s (consecutive_5xx, 2nd time)`; one line per router when
    several were asked, each with its address."""
    lines = []
    for entry in entries:
        if entry.get("ejected"):
            times = entry.get("ejections") or 0
            reason = entry.get("ejection_reason") or "?"
            extra = f", {ordinal(times)} time" if isinstance(times, int) and times > 1 else ""
            text = f"ejected {float(entry.get('ejected_for_s') or 0):.0f}s ({reason}{extra})"
        else:
            text = "in rotation"
            failures = entry.get("failures_in_a_row") or 0
            if failures:
                text += f", {failures} failed in a row"
        lines.append(f"{entry['router']}: {text}" if several else text)
    return "\n".join(lines)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
