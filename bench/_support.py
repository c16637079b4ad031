"""Small helpers the benchmarks share: reading a process's memory and CPU from /proc, finding
processes by their command line. psutil is not a dependency, and /proc is all that is needed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory in MiB, NaN once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used (utime + stime of /proc/PID/stat)."""
    # The command name may hold spaces and parentheses; the fields start after the last ')'.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, argv) of every live process this user can read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if raw and state != "Z":
            yield int(entry.name), raw.decode(errors="replace").rstrip("\0").split("\0")


def arg_after(argv: list[str], flag: str) -> str:
    """The value that follows `flag` in argv, or ""."""
    try:
        return argv[argv.index(flag) + 1]
    except (ValueError, IndexError):
        return ""


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is `pid` or one of its parents (other stacks may run on this machine)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False
