"""One file from a source into a `.part` file, resumed where an earlier try stopped.

No wall-clock limit: a 140 GB model over a slow link takes as long as it takes, as long as bytes
keep arriving. The stall rule is the only clock: the download fails ("too slow") when fewer than
`min_rate` bytes per second arrived over the last `window_s` seconds, or nothing at all for
`window_s`. A connection that drops mid-file is resumed with a Range request, so a restart, a
killed fetch or a flaky link costs only the bytes not yet on disk.
"""

from __future__ import annotations

import errno
import hashlib
import re
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from nomad_driver.fetch.errors import (
    CredentialsRefused,
    FetchError,
    NoSpace,
    NotFound,
    TooSlow,
    Unreachable,
)
from nomad_driver.fetch.sources import Source

# Tries in a row that brought no new byte before the source counts as unreachable; a try that
# makes progress resets the count, so a long download over a flaky link never runs out.
ATTEMPTS_WITHOUT_PROGRESS = 5
RETRY_DELAY_S = 2.0
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_CONTENT_RANGE_UNSATISFIED = re.compile(r"bytes \*/(\d+)")


@dataclass(frozen=True)
class StallRule:
    min_rate: float = 100 * 1024  # bytes per second
    window_s: float = 300.0


@dataclass(frozen=True)
class Progress:
    done: int
    total: int | None
    rate: float  # bytes per second over the stall window


class _Meter:
    """Bytes over time, for the rate shown and for the stall rule."""

    def __init__(self, rule: StallRule, done: int) -> None:
        self.rule = rule
        self.started = time.monotonic()
        self.samples: deque[tuple[float, int]] = deque([(self.started, done)])

    def add(self, done: int) -> float:
        now = time.monotonic()
        self.samples.append((now, done))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.rule.window_s:
            self.samples.popleft()
        t0, d0 = self.samples[0]
        rate = (done - d0) / max(now - t0, 1e-6)
        window_seen = now - self.started >= self.rule.window_s and now - t0 >= self.rule.window_s * 0.99
        if window_seen and rate < self.rule.min_rate:
            raise TooSlow(self.rule.min_rate, self.rule.window_s, f"{int(rate)} B/s")
        return rate


def _refused(response: httpx.Response, source: Source) -> FetchError | None:
    code = response.status_code
    if code in (401, 403):
        return CredentialsRefused(f"HTTP {code} from {source.kind} source {_shown(source)}")
    if code == 404:
        return NotFound(f"HTTP 404 for {_shown(source)}")
    if code >= 500:
        return Unreachable(f"HTTP {code} from {_shown(source)}")
    if code >= 400 and code != 416:
        return FetchError(f"HTTP {code} from {_shown(source)}")
    return None


def _shown(source: Source) -> str:
    return source.text.split("?", 1)[0]


def _write_error(exc: OSError, part: Path) -> FetchError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"disk full while writing {part}")
    return FetchError(f"writing {part}: {exc}")


def download(
    source: Source,
    part: Path,
    rule: StallRule,
    *,
    reserve: Callable[[int, int], None] = lambda total, have: None,
    on_progress: Callable[[Progress], None] = lambda p: None,
    progress_every_s: float = 5.0,
) -> int:
    """Fill `part` with the whole file; returns its size. `reserve(total, have)` is called once
    the size is known, before any byte is written (the cache makes room there)."""
    if source.kind == "file":
        return _copy_local(source, part, reserve)
    without_progress = 0
    reserved = False
    timeout = httpx.Timeout(connect=30.0, read=rule.window_s, write=30.0, pool=30.0)
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        while True:
            have = part.stat().st_size if part.exists() else 0
            headers = source.headers({"Range": f"bytes={have}-"} if have else {})
            before = have
            try:
                with client.stream("GET", source.url, headers=headers) as response:
                    refused = _refused(response, source)
                    if refused is not None:
                        raise refused
                    total, have = _start_offset(response, have, part)
                    if total is not None and have >= total:
                        return have
                    if not reserved and total is not None:
                        reserve(total, have)
                        reserved = True
                    meter = _Meter(rule, have)
                    last_report = 0.0
                    with part.open("ab") as out:
                        # As the bytes come, not in fixed buffers: the stall rule judges each
                        # arrival, and a buffer of 256 KiB at a trickle's 4 KiB/s held the verdict
                        # back a minute past its window. Faster too (0.59 s against 0.88 s for 256 MiB).
                        for chunk in response.iter_bytes():
                            try:
                                out.write(chunk)
                            except OSError as exc:
                                raise _write_error(exc, part) from exc
                            have += len(chunk)
                            rate = meter.add(have)
                            now = time.monotonic()
                            if now - last_report >= progress_every_s:
                                last_report = now
                                on_progress(Progress(have, total, rate))
                    if total is None or have >= total:
                        on_progress(Progress(have, total, meter.add(have)))
                        return have
            except httpx.ReadTimeout as exc:
                raise TooSlow(rule.min_rate, rule.window_s, "no byte arrived") from exc
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last_error: FetchError = Unreachable(f"{_shown(source)}: {exc}")
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                last_error = Unreachable(f"{_shown(source)}: connection dropped: {exc}")
            except Unreachable as exc:
                last_error = exc
            after = part.stat().st_size if part.exists() else 0
            without_progress = 0 if after > before else without_progress + 1
            if without_progress >= ATTEMPTS_WITHOUT_PROGRESS:
                raise last_error
            time.sleep(RETRY_DELAY_S)


def _start_offset(response: httpx.Response, have: int, part: Path) -> tuple[int | None, int]:
    """(total size, bytes kept) for this response: a 206 continues `part`; a 200 (a server
    that ignores Range) starts it over; a 416 means `part` already holds the whole file."""
    if response.status_code == 416:
        m = _CONTENT_RANGE_UNSATISFIED.match(response.headers.get("content-range", ""))
        total = int(m.group(1)) if m else None
        if total is not None and have == total:
            return total, have
        part.unlink(missing_ok=True)
        raise httpx.RemoteProtocolError("range not satisfiable; starting over")
    if response.status_code == 206:
        m = _CONTENT_RANGE.match(response.headers.get("content-range", ""))
        if m and int(m.group(1)) == have:
            return (None if m.group(3) == "*" else int(m.group(3))), have
        part.unlink(missing_ok=True)
        raise httpx.RemoteProtocolError("range answered from another offset; starting over")
    if have:
        part.unlink(missing_ok=True)
    length = response.headers.get("content-length")
    return (int(length) if length and length.isdigit() else None), 0


def _copy_local(source: Source, part: Path, reserve: Callable[[int, int], None]) -> int:
    path = Path(source.url)
    try:
        size = path.stat().st_size
    except FileNotFoundError as exc:
        raise NotFound(f"{path}: no such file") from exc
    except PermissionError as exc:
        raise CredentialsRefused(f"{path}: permission denied") from exc
    reserve(size, 0)
    try:
        shutil.copyfile(path, part)
    except OSError as exc:
        raise _write_error(exc, part) from exc
    return size


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1024 * 1024), b""):
            digest.update(block)
    return digest.hexdigest()
