"""`llmgw fetch`: bring one model's weights into the node's cache, or find them there.

What it prints is what an operator and the watcher read: progress lines on stdout
(`fetch progress: done=… total=… rate=… B/s`, every few seconds), and, when it fails, one last
stderr line `fetch failed: <cause> (<detail>)` with the cause's own exit code (errors.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from nomad_driver.fetch import cache
from nomad_driver.fetch.download import Progress, StallRule, download, sha256_of
from nomad_driver.fetch.errors import Corrupt, FetchError
from nomad_driver.fetch.sources import SourceError, parse_source

PROGRESS_PREFIX = "fetch progress: "
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?", re.I)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str | None) -> int | None:
    """`500G`, `1.5T`, `100K`, `12345`; None for nothing, or for a node meta key the node does not
    set (Nomad leaves `${meta.x}` as written when the node has no `x`)."""
    if text is None or not text.strip() or text.strip().startswith("${"):
        return None
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r} (say 500G, 100M, or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_seconds(text: str | None) -> float | None:
    """`300`, `90.5`; None for nothing or an unset node meta key, as parse_size."""
    if text is None or not text.strip() or text.strip().startswith("${"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if value <= 0:
        raise ValueError(f"the stall window must be above 0 seconds, got {text!r}")
    return value


def progress_line(p: Progress) -> str:
    total = p.total if p.total is not None else "unknown"
    return f"{PROGRESS_PREFIX}done={p.done} total={total} rate={int(p.rate)} B/s"


@dataclass(frozen=True)
class FetchRequest:
    source: str
    model: str
    cache_root: Path
    max_bytes: int | None = None
    rule: StallRule = field(default_factory=StallRule)
    progress_every_s: float = 5.0


def fetch(req: FetchRequest, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Runs one fetch; returns the process's exit code."""

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        source = parse_source(req.source)
    except SourceError as exc:
        print(f"fetch failed: {exc}", file=err, flush=True)
        return 2
    root = req.cache_root
    target = cache.model_dir(root, req.model) / source.file_name
    try:
        root.mkdir(parents=True, exist_ok=True)
        with cache.locked(
            root, req.model, lambda: say(f"waiting: another fetch of {req.model} on this node")
        ):
            if cache.is_complete(root, req.model, req.source, source.file_name):
                cache.touch(root, req.model)
                say(f"cached: {target} (nothing to download)")
                return 0
            done = cache.read_complete(root, req.model)
            if done is not None:
                # Another source (the definition changed): the old weights are not these.
                for path in cache.model_dir(root, req.model).iterdir():
                    if path.name != cache.LOCK:
                        path.unlink(missing_ok=True)
            part = target.with_name(target.name + ".part")

            def reserve(total: int, have: int) -> None:
                evicted = cache.make_room(root, req.model, total - have, req.max_bytes, log=say)
                if evicted:
                    say(f"evicted to make room: {', '.join(evicted)}")

            say(f"fetching {source.text.split('?', 1)[0]} into {target}")
            size = download(
                source,
                part,
                req.rule,
                reserve=reserve,
                on_progress=lambda p: say(progress_line(p)),
                progress_every_s=req.progress_every_s,
            )
            if part.stat().st_size != size:
                raise Corrupt(f"{part.stat().st_size} bytes on disk, the source said {size}")
            if source.sha256 is not None:
                actual = sha256_of(part)
                if actual != source.sha256:
                    part.unlink(missing_ok=True)
                    raise Corrupt(f"sha256 {actual}, the source says {source.sha256}")
            part.replace(target)
            cache.mark_complete(root, req.model, req.source, source.file_name, size, source.sha256)
            say(f"fetched: {target} ({size} bytes)")
            return 0
    except FetchError as exc:
        print(exc.line(), file=err, flush=True)
        return exc.exit_code
