"""Small helpers the benchmarks share: starting the Nomad stand-in, reading a process's memory
and CPU from /proc, finding processes by their command line. psutil is not a dependency, and
/proc is all that is needed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from devstack import lifetime
from devstack.ports import free_port

REPO = Path(__file__).resolve().parents[1]
LARGE_FLEET = REPO / "devstack" / "nodes" / "large-200.yaml"

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


def mock_job(job_id: str, gpu: bool = True) -> dict[str, Any]:
    """The body of a job registration: one mock_driver task that runs for an hour on 500 MHz and
    1 GiB, with one GPU unless gpu is False."""
    resources: dict[str, Any] = {"CPU": 500, "MemoryMB": 1024}
    if gpu:
        resources["Devices"] = [{"Name": "nvidia/gpu", "Count": 1}]
    return {
        "Job": {
            "ID": job_id,
            "TaskGroups": [
                {
                    "Name": "engine",
                    "Count": 1,
                    "Tasks": [
                        {
                            "Name": "server",
                            "Driver": "mock_driver",
                            "Config": {"run_for": "1h"},
                            "Resources": resources,
                        }
                    ],
                }
            ],
        }
    }


def register_stub_engine(consul_url: str, port: int) -> None:
    """Register the stub engine on 127.0.0.1:port in Consul as model `bench`'s one replica,
    passing at once and then health-checked on /v1/models, as the router expects an engine."""
    httpx.put(
        f"{consul_url}/v1/agent/service/register",
        json={
            "Name": "llmgw-engine",
            "ID": "bench-1",
            "Address": "127.0.0.1",
            "Port": port,
            "Tags": ["model=bench"],
            "Meta": {"model": "bench", "def_hash": "b"},
            "Check": {"HTTP": f"http://127.0.0.1:{port}/v1/models", "Interval": "5s", "Status": "passing"},
        },
    ).raise_for_status()


def start_standin(
    data_dir: Path, fleet: Path = LARGE_FLEET, consul_url: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m devstack.nomad` on a free port, logging to DATA_DIR/standin.log; returns the
    process and its URL once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "devstack.nomad", "--listen", f"127.0.0.1:{port}", "--nodes", str(fleet),
            "--data-dir", str(data_dir / "nomad"), "--log-level", "WARNING"]  # fmt: skip
    if consul_url:
        args += ["--consul", consul_url]
    log = (data_dir / "standin.log").open("wb")
    process = subprocess.Popen(
        args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        preexec_fn=lifetime.die_with_parent,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the stand-in exited; see {data_dir / 'standin.log'}")
        try:
            if httpx.get(f"{url}/v1/status/leader", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    process.kill()
    raise SystemExit("the stand-in did not start within 30s")
