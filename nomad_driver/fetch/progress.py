"""How far the fetches of a model's weights have come, for the admin API, `llmgw ctl status` and
the metrics (watcher/fetch_progress.py bounds how often): read from each running fetch task's stdout (its `fetch progress:` lines) through
Nomad's logs API, when asked, so a slow download shows as moving rather than as a model that
does not start."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from nomad_driver.fetch.render import FETCH_TASK
from nomad_driver.fetch.run import PROGRESS_PREFIX
from nomad_driver.nomad import Nomad, NomadError

_LINE = re.compile(r"done=(\d+) total=(\d+|unknown) rate=(\d+) B/s")
READ_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class FetchProgress:
    alloc_id: str
    node: str
    done: int
    total: int | None
    rate: int  # bytes per second over the fetch's stall window

    def text(self) -> str:
        total = f" of {_size(self.total)}" if self.total else ""
        return f"{_size(self.done)}{total} at {_size(self.rate)}/s on {self.node or self.alloc_id[:8]}"


def _size(n: int | None) -> str:
    value = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"


def last_progress(stdout_tail: str) -> tuple[int, int | None, int] | None:
    for line in reversed(stdout_tail.splitlines()):
        if line.startswith(PROGRESS_PREFIX) and (m := _LINE.search(line)):
            total = None if m.group(2) == "unknown" else int(m.group(2))
            return int(m.group(1)), total, int(m.group(3))
    return None


def fetching(allocs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The live allocations whose fetch task runs now."""
    out = []
    for alloc in allocs:
        if alloc.get("ClientStatus") not in ("pending", "running"):
            continue
        state = (alloc.get("TaskStates") or {}).get(FETCH_TASK) or {}
        if state.get("State") == "running":
            out.append(alloc)
    return out


async def read_one(nomad: Nomad, alloc: Mapping[str, Any]) -> dict[str, Any] | None:
    """A running fetch's last progress line; None when its log cannot be read in time (it is
    left out rather than holding up the answer) or shows no progress yet."""
    alloc_id = str(alloc.get("ID") or "")
    try:
        # Not wait_for, which on Python 3.11 can lose a cancel that comes as the read finishes.
        async with asyncio.timeout(READ_TIMEOUT_S):
            tail = await asyncio.to_thread(nomad.log_tail, alloc_id, FETCH_TASK, "stdout")
    except (NomadError, TimeoutError):
        return None
    parsed = last_progress(tail)
    if parsed is None:
        return None
    p = FetchProgress(alloc_id, str(alloc.get("NodeName") or ""), *parsed)
    return {**asdict(p), "text": p.text()}
