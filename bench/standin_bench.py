"""How fast the Nomad stand-in schedules, measured on this machine in one run.

    .venv/bin/python bench/standin_bench.py [--jobs 1000] [--changes 50]

Starts `python -m devstack.nomad` on the 200-node fleet (devstack/nodes/large-200.yaml, whose
nodes offer mock_driver, so allocations start no process), then through the HTTP API, as
llmgw does:
- registers `--jobs` jobs (one group, count 1; three in four ask for one GPU) one after the
  other and reports registrations per second;
- waits, with blocking queries on /v1/jobs, until every job is running or blocked for lack of
  room, and reports how long that took from the first register;
- `--changes` times writes a node's dynamic metadata while a blocking query on that node waits,
  and reports how long after the write was sent the query answered (median and p99);
- reports the stand-in's resident memory.

Not a test: it prints numbers beside the targets the stand-in is held to and exits 1 if one
is missed, so a regression is visible when it is run by hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._support import mock_job, rss_mb, start_standin  # noqa: E402

FLEET = REPO / "devstack" / "nodes" / "large-200.yaml"
TARGET_ALL_PLACED_S = 60.0
TARGET_WAKE_MS = 50.0
TARGET_RSS_MB = 500.0


def settled(stubs: list[dict[str, Any]], jobs: int) -> tuple[int, int, int]:
    """(running, blocked, neither yet) over the benchmark's jobs."""
    running = blocked = waiting = 0
    for stub in stubs:
        if not stub["ID"].startswith("bench-"):
            continue
        group = ((stub.get("JobSummary") or {}).get("Summary") or {}).get("engine") or {}
        if group.get("Running", 0) >= 1:
            running += 1
        elif group.get("Queued", 0) >= 1 and group.get("Starting", 0) == 0:
            blocked += 1
        else:
            waiting += 1
    waiting += jobs - (running + blocked + waiting)
    return running, blocked, waiting


def wait_settled(http: httpx.Client, jobs: int, timeout: float) -> tuple[int, int]:
    index = 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = http.get("/v1/jobs", params={"index": index, "wait": "5s", "prefix": "bench-"}, timeout=15)
        index = int(response.headers["X-Nomad-Index"])
        running, blocked, waiting = settled(response.json(), jobs)
        if waiting == 0:
            return running, blocked
    raise SystemExit(f"jobs did not settle within {timeout}s")


def wake_latencies(url: str, changes: int) -> list[float]:
    """Seconds from sending a node-metadata write to the answer of a blocking query on that node."""
    http = httpx.Client(base_url=url, timeout=30)
    node_id = next(n["ID"] for n in http.get("/v1/nodes").json() if n["Status"] == "ready")
    out: list[float] = []
    for i in range(changes):
        index = int(http.get(f"/v1/node/{node_id}").headers["X-Nomad-Index"])
        answered: list[float] = []

        def watch(index: int = index, answered: list[float] = answered) -> None:
            with httpx.Client(base_url=url, timeout=30) as watcher:
                watcher.get(f"/v1/node/{node_id}", params={"index": index, "wait": "20s"})
                answered.append(time.perf_counter())

        thread = threading.Thread(target=watch)
        thread.start()
        time.sleep(0.05)  # let the query reach the server and block
        sent = time.perf_counter()
        http.post("/v1/client/metadata", json={"NodeID": node_id, "Meta": {"bench_change": str(i)}})
        thread.join(25)
        if not answered:
            raise SystemExit("a blocking query did not wake after a change")
        out.append(answered[0] - sent)
    http.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=50)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="standin-bench-") as tmp:
        process, url = start_standin(Path(tmp))
        try:
            rss_start = rss_mb(process.pid)
            http = httpx.Client(base_url=url, timeout=30)
            start = time.perf_counter()
            for i in range(args.jobs):
                response = http.put("/v1/jobs", json=mock_job(f"bench-{i:04d}", gpu=i % 4 != 3))
                response.raise_for_status()
            registered_s = time.perf_counter() - start
            running, blocked = wait_settled(http, args.jobs, timeout=300)
            settled_s = time.perf_counter() - start
            evals = http.get("/v1/evaluations").json()
            http.close()
            latencies = wake_latencies(url, args.changes)
            rss_end = rss_mb(process.pid)
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()

    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    rows = [
        ("jobs registered", f"{args.jobs}", ""),
        ("register rate", f"{args.jobs / registered_s:.0f} jobs/s", ""),
        ("all running or blocked after", f"{settled_s:.1f} s", f"< {TARGET_ALL_PLACED_S:.0f} s"),
        ("  running / blocked", f"{running} / {blocked}", ""),
        ("  evaluations", f"{len(evals)}", ""),
        ("blocking query wake, median", f"{statistics.median(ms):.1f} ms", f"< {TARGET_WAKE_MS:.0f} ms"),
        ("blocking query wake, p99", f"{p99:.1f} ms", f"< {TARGET_WAKE_MS:.0f} ms"),
        ("stand-in RSS at start / end", f"{rss_start:.0f} / {rss_end:.0f} MB", f"< {TARGET_RSS_MB:.0f} MB"),
    ]
    print(f"Nomad stand-in, {FLEET.name}, {os.cpu_count()} CPUs")
    for name, value, target in rows:
        print(f"  {name:<32} {value:>16}   {target}")
    failures = []
    if settled_s >= TARGET_ALL_PLACED_S:
        failures.append("placement took too long")
    if p99 >= TARGET_WAKE_MS:
        failures.append("blocking queries wake too slowly")
    if rss_end >= TARGET_RSS_MB:
        failures.append("too much memory")
    for failure in failures:
        print(f"MISSED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
