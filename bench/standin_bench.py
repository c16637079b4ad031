"""How fast the Nomad stand-in schedules, measured on this machine in one run.

    .venv/bin/python bench/standin_bench.py [--jobs 1000] [--changes 50]
    .venv/bin/python bench/standin_bench.py --register 1000,10000 [--profile DIR]

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

`--register` measures what holding many jobs costs, with the jobs `bench/watcher_bench.py`
registers (llmgw's rendered jobs, engine task swapped for a mock_driver one, in model order):
for each size, on its own stand-in, the time to register them all and to have the last one
running, the time each successive 1,000 took, and the stand-in's RSS and CPU. The sizes are
printed side by side with the ratio of the largest's time per 1,000 to the smallest's: a
stand-in whose cost per registration is flat prints about 1x. `--profile DIR` runs each
stand-in under cProfile and leaves `DIR/standin-N.prof`.

Not a test: it prints numbers beside the targets the stand-in is held to and exits 1 if one
is missed, so a regression is visible when it is run by hand.
"""

from __future__ import annotations

import argparse
import os
import signal
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

from bench._support import cpu_seconds, mock_job, rss_mb, start_standin  # noqa: E402

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


def register(n: int, profile: Path | None) -> dict[str, Any]:
    """Register `n` watcher-bench jobs on a fresh stand-in; time them by the thousand."""
    from bench.watcher_bench import mock_job as llmgw_job
    from bench.watcher_bench import models_text
    from nomad_driver.spec import parse_models

    models = list(parse_models(models_text(n), "bench").models.values())
    jobs = [llmgw_job(m, {"run_for": "100h"}) for m in models]  # built before the clock starts
    python_args: tuple[str, ...] = ()
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        python_args = ("-m", "cProfile", "-o", str(profile / f"standin-{n}.prof"))
    with tempfile.TemporaryDirectory(prefix="standin-bench-") as tmp:
        process, url = start_standin(Path(tmp), FLEET, python_args=python_args)
        try:
            rss_start, cpu_start = rss_mb(process.pid), cpu_seconds(process.pid)
            chunks: list[float] = []
            with httpx.Client(base_url=url, timeout=60) as http:
                start = last = time.perf_counter()
                for i, job in enumerate(jobs, 1):
                    http.put("/v1/jobs", json={"Job": job}).raise_for_status()
                    if i % 1000 == 0 or i == n:
                        now = time.perf_counter()
                        chunks.append((now - last) * 1000 / (i - 1000 * len(chunks)))
                        last = now
                registered_s = time.perf_counter() - start
                # Evaluations are placed in the order they came; the last job running means
                # the scheduler has caught up with every registration.
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:
                    allocs = http.get(f"/v1/job/{jobs[-1]['ID']}/allocations").json()
                    if any(a["ClientStatus"] == "running" for a in allocs):
                        break
                    time.sleep(0.2)
                placed_s = time.perf_counter() - start
                running = sum(
                    1
                    for stub in http.get("/v1/jobs", params={"prefix": "llmgw-"}, timeout=120).json()
                    if (stub["JobSummary"]["Summary"].get("engine") or {}).get("Running", 0) >= 1
                )
            rss_end, cpu_end = rss_mb(process.pid), cpu_seconds(process.pid)
        finally:
            process.send_signal(signal.SIGINT)  # cProfile writes its file on a clean exit
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
    return {
        "n": n,
        "registered_s": registered_s,
        "placed_s": placed_s,
        "chunks": chunks,
        "running": running,
        "rss": (rss_start, rss_end),
        "cpu_s": cpu_end - cpu_start,
    }


def register_report(results: list[dict[str, Any]]) -> int:
    first, last = results[0], results[-1]
    print(f"Nomad stand-in holding llmgw jobs, {FLEET.name}, {os.cpu_count()} CPUs")
    header = "".join(f"{r['n']:>12,}" for r in results)
    growth = f"{last['n']:,} / {first['n']:,}" if len(results) > 1 else ""
    print(f"  {'jobs':<40}{header}   {growth}")

    def row(name: str, values: list[float], fmt: str, ratio: bool = False) -> None:
        cells = "".join(f"{v:>12{fmt}}" for v in values)
        tail = f"{values[-1] / values[0]:>8.1f}x" if ratio and len(values) > 1 and values[0] else ""
        print(f"  {name:<40}{cells}   {tail}")

    row("registered, s", [r["registered_s"] for r in results], ".1f")
    row("  per 1,000, s", [r["registered_s"] * 1000 / r["n"] for r in results], ".2f", ratio=True)
    row("  first 1,000, s", [r["chunks"][0] for r in results], ".2f")
    row("  last 1,000, s", [r["chunks"][-1] for r in results], ".2f")
    row("last job running after, s", [r["placed_s"] for r in results], ".1f")
    row("  per 1,000, s", [r["placed_s"] * 1000 / r["n"] for r in results], ".2f", ratio=True)
    row("running at the end", [r["running"] for r in results], ".0f")
    row("stand-in CPU, s", [r["cpu_s"] for r in results], ".1f")
    row("  per 1,000, s", [r["cpu_s"] * 1000 / r["n"] for r in results], ".2f", ratio=True)
    row("  share of a core while registering", [r["cpu_s"] / r["placed_s"] for r in results], ".0%")
    row("stand-in RSS at start, MB", [r["rss"][0] for r in results], ".0f")
    row("stand-in RSS at the end, MB", [r["rss"][1] for r in results], ".0f")
    for r in results:
        per = " ".join(f"{c:.1f}" for c in r["chunks"])
        print(f"  [{r['n']:,}] each 1,000 in turn, s: {per}")
    return 0 if all(r["running"] == r["n"] for r in results) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--register", default="", help="sizes, comma-separated: time holding llmgw jobs")
    parser.add_argument("--profile", type=Path, default=None, help="--register: cProfile files here")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.register:
        sizes = [int(n) for n in args.register.split(",") if n.strip()]
        return register_report([register(n, args.profile) for n in sizes])

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
