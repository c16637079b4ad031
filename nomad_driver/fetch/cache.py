"""The node's weights cache: one directory per model in the `llmgw-weights` host volume.

    <root>/<model>/<file>          the verified weights the engine reads
    <root>/<model>/<file>.part     an unfinished download; the next fetch resumes it
    <root>/<model>/.complete       written last, after verification: source, file, size, sha256.
                                   Its mtime is the model's last use (every fetch touches it)
    <root>/<model>/.lock           flock held by the fetch working on the model

The same `<root>/<model>/` layout is what the node agent lists as `llmgw_models_cached`.

Two allocations of one model on one node never download it twice: the second fetch waits on
the lock and then finds `.complete`. Eviction removes whole models, least recently used first,
and never one in use, which on this node means any of:
- a fetch holds its lock (it is being downloaded or checked);
- a process's command line names a file in its directory (a running engine: raw_exec engines
  and containers alike show their `--model` path in /proc);
- it was fetched within `IN_USE_GRACE_S` (the engine of the allocation that fetched it may not
  have started yet).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from nomad_driver.fetch.errors import NoSpace

COMPLETE = ".complete"
LOCK = ".lock"
IN_USE_GRACE_S = 600.0


@dataclass(frozen=True)
class Entry:
    model: str
    path: Path
    size: int
    last_used: float


def model_dir(root: Path, model: str) -> Path:
    return root / model


def read_complete(root: Path, model: str) -> dict[str, object] | None:
    try:
        data = json.loads((model_dir(root, model) / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(root: Path, model: str, source: str, file_name: str) -> bool:
    """The weights are there, from this source, at the size that was verified."""
    done = read_complete(root, model)
    if not done or done.get("source") != source or done.get("file") != file_name:
        return False
    try:
        return (model_dir(root, model) / file_name).stat().st_size == done.get("size")
    except OSError:
        return False


def mark_complete(root: Path, model: str, source: str, file_name: str, size: int, sha256: str | None) -> None:
    record = {"source": source, "file": file_name, "size": size, "sha256": sha256}
    path = model_dir(root, model) / COMPLETE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def touch(root: Path, model: str) -> None:
    with contextlib.suppress(OSError):
        os.utime(model_dir(root, model) / COMPLETE)


@contextlib.contextmanager
def locked(root: Path, model: str, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold the model's lock; `on_wait` is called once if another fetch holds it first."""
    directory = model_dir(root, model)
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / LOCK).open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _lock_held(directory: Path) -> bool:
    try:
        with (directory / LOCK).open("a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def process_command_lines() -> Iterator[str]:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            yield (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _dir_size(directory: Path) -> int:
    total = 0
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


def entries(root: Path) -> list[Entry]:
    out: list[Entry] = []
    if not root.is_dir():
        return out
    for directory in root.iterdir():
        if not directory.is_dir():
            continue
        try:
            last_used = (directory / COMPLETE).stat().st_mtime
        except OSError:
            last_used = directory.stat().st_mtime
        out.append(Entry(directory.name, directory, _dir_size(directory), last_used))
    return out


def in_use(entry: Entry, command_lines: Iterable[str], now: float) -> bool:
    if now - entry.last_used < IN_USE_GRACE_S:
        return True
    if _lock_held(entry.path):
        return True
    prefix = f"{entry.path}/"
    return any(prefix in line for line in command_lines)


def make_room(
    root: Path,
    keep: str,
    needed: int,
    max_bytes: int | None,
    *,
    command_lines: Callable[[], Iterable[str]] = process_command_lines,
    now: Callable[[], float] = time.time,
    log: Callable[[str], None] = lambda line: None,
) -> list[str]:
    """Evict least recently used models, never `keep` and never one in use, until `needed`
    more bytes fit under `max_bytes` and on the disk. Returns the models evicted; raises
    NoSpace when they cannot."""
    evicted: list[str] = []
    all_entries = entries(root)
    lines = list(command_lines())
    candidates = sorted(
        (e for e in all_entries if e.model != keep and not in_use(e, lines, now())),
        key=lambda e: e.last_used,
    )
    used = sum(e.size for e in all_entries)

    def short() -> int:
        over_bound = used + needed - max_bytes if max_bytes is not None else 0
        over_disk = needed - shutil.disk_usage(root).free
        return max(over_bound, over_disk)

    if short() > sum(e.size for e in candidates):
        # Evicting everything evictable would not be enough: evict nothing for nothing.
        candidates = []
    while short() > 0:
        if not candidates:
            bound = f"the cache bound of {max_bytes} bytes" if max_bytes is not None else "the disk"
            raise NoSpace(
                f"{needed} more bytes do not fit in {bound} at {root}, and every other model there is in use"
            )
        victim = candidates.pop(0)
        shutil.rmtree(victim.path, ignore_errors=True)
        used -= victim.size
        evicted.append(victim.model)
        log(f"evicted {victim.model} ({victim.size} bytes, unused since {time.ctime(victim.last_used)})")
    return evicted
