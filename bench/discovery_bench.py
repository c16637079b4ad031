"""The router's discovery on a large fleet: what one catalog change costs it, and how soon a
replica whose check turned critical leaves its rotation.

    .venv/bin/python bench/discovery_bench.py [--instances 100,1000,5000] [--changes 20]
        [--per-model 5] [--nodes 200] [--gap 0.3]

For each size, on its own Consul dev agent (devstack.consul_agent), `--instances` llmgw-engine
instances are registered with `PUT /v1/catalog/register`, without processes behind them: spread
over `--nodes` node names, `--per-model` instances a model, each with the `model` and `def_hash`
meta the router reads and one passing check. Then a probe process (this file, `--probe`) runs
`router.discovery.Discovery` (on uvloop, as the router's uvicorn does) against that Consul
through a small counting reverse proxy in this process, and prints a JSON line for every
snapshot of the replicas: time.time(), its own CPU (getrusage), its RSS and whether the instance
it was told to watch is in `snapshot.ready[model]`. Once it sees every instance ready,
`--changes` instances, spread over the fleet, have their check flipped to critical, one at a
time, and each is flipped back to passing once the probe has taken it out; every flip is a
catalog change the router reads. Flips are `--gap` seconds apart: the watch loop takes a token
from a bucket of 2 refilled at 10 a second before each read (nomad_driver/blocking.py), so
changes back to back would be paced to one read per 100 ms and measure that pacing, not the
change; 0.3 s lets the bucket refill and measures each change on its own. Per size:

- CPU and bytes per change: the probe's CPU from the moment it was told what to watch to the
  snapshot that shows the flip, and the bytes of discovery's replica reads (the catalog's
  instances, the checks not passing) the proxy passed in that window (as read on the wire: the
  router asks for gzip), medians over both directions;
- critical -> out of rotation: from just before the critical flip's PUT to the probe's snapshot
  without the instance in `ready[model]`, p50 and max. Consul commits the check somewhere inside
  the PUT, so this is an upper bound; it is split into the PUT, the PUT's return to Consul's
  answer at the proxy, and that answer to the snapshot (the proxy's hop, decoding, parsing);
- the probe's RSS before Discovery started and after the run: the router's discovery alone,
  without its HTTP side.

The sizes are printed side by side, with the ratio of the largest to the one before it. Targets:
the cost of one change (CPU and bytes) within 2x from the second largest size to the largest
(1,000 to 5,000 in the full run), and the critical instance out of rotation within 1 s at every
size. A check's change wakes only the read of the checks not passing (router/catalog.py), so
it costs what is failing, not the fleet. Exits 1 if a target is missed, with a MISSED line for
each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._support import CountingProxy, rss_mb  # noqa: E402
from devstack import lifetime  # noqa: E402
from devstack.consul_agent import ConsulAgent, find_consul_binary  # noqa: E402
from router.config import ENGINE_SERVICE  # noqa: E402

# Within this factor from the second largest size measured to the largest.
CHANGE_GROWTH_BUDGET = 2.0
OUT_OF_ROTATION_BUDGET_S = 1.0
# What discovery reads (router/catalog.py): the instances, the checks not passing, and the
# health of an instance whose check cleared, before it is back in rotation.
INSTANCES_PATH = f"/v1/catalog/service/{ENGINE_SERVICE}"
CHECKS_PATH = "/v1/health/state/any"
CONFIRM_PATH = f"/v1/health/service/{ENGINE_SERVICE}"
READ_PATHS = (INSTANCES_PATH, CHECKS_PATH, CONFIRM_PATH)


# ----- the fleet, in Consul's catalog --------------------------------------------------------


def instance(i: int, nodes: int, per_model: int, status: str = "passing") -> dict[str, Any]:
    """One catalog registration of instance `i`: IDs and check names shaped like Nomad's, so an
    answer is about as large as a real fleet's."""
    node = i % nodes
    address = f"10.{node // 250}.{node % 250}.10"
    service_id = f"_nomad-task-{i:08x}-5e1c-4f0b-9a3d-{i:012x}-group-engine-llmgw-engine-http"
    model = f"m{i // per_model}"
    output = "HTTP GET http://engine/health: 200 OK" if status == "passing" else "connection refused"
    return {
        "Node": f"gpu-node-{node:03d}",
        "Address": address,
        # The node is there already after the first registration; a flip changes only the check.
        "SkipNodeUpdate": True,
        "Service": {
            "ID": service_id,
            "Service": ENGINE_SERVICE,
            "Address": address,
            "Port": 20000 + i % 40000,
            "Tags": [f"model={model}"],
            "Meta": {"model": model, "def_hash": f"{(i // per_model) * 2654435761 % 2**64:016x}"},
        },
        "Check": {
            "Node": f"gpu-node-{node:03d}",
            "CheckID": f"_nomad-check-{i:040x}",
            "Name": "engine ready",
            "Status": status,
            "ServiceID": service_id,
            "Output": output,
        },
    }


async def register_all(consul: str, n: int, nodes: int, per_model: int) -> None:
    # Each registration is one Raft write; many at once let the dev agent batch them.
    gate = asyncio.Semaphore(32)
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=consul, timeout=60, limits=limits) as http:

        async def one(i: int) -> None:
            async with gate:
                resp = await http.put("/v1/catalog/register", json=instance(i, nodes, per_model))
                resp.raise_for_status()

        await asyncio.gather(*(one(i) for i in range(n)))


def flip(http: httpx.Client, i: int, nodes: int, per_model: int, status: str) -> None:
    http.put("/v1/catalog/register", json=instance(i, nodes, per_model, status)).raise_for_status()


# ----- the probe: a Discovery in a process of its own ------------------------------------------


def probe_main(consul: str) -> int:
    """Run Discovery against `consul` until stdin closes. Reads `<instance id> <model>` lines
    (what to watch; answered with an `ack` line) and prints a `change` line per replica snapshot."""
    import resource

    import uvloop

    from router.config import ConsulSettings
    from router.discovery import Discovery, Snapshot

    out = threading.Lock()
    watched = ("", "")

    def emit(kind: str, **fields: Any) -> None:
        # CPU is taken first, so that writing the line is charged to the next window, whose
        # baseline (an ack) is taken after it.
        ru = resource.getrusage(resource.RUSAGE_SELF)
        line = {"kind": kind, "t": time.time(), "cpu": ru.ru_utime + ru.ru_stime, **fields}
        line["rss_mb"] = rss_mb(os.getpid())
        with out:
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()

    def on_change(before: Snapshot, after: Snapshot) -> None:
        if after.replicas is before.replicas:
            return  # a state or definitions snapshot: no replica changed
        wid, model = watched
        emit(
            "change",
            replicas=sum(len(rs) for rs in after.replicas.values()),
            ready=sum(len(rs) for rs in after.ready.values()),
            watched=wid,
            watched_ready=any(r.id == wid for r in after.ready.get(model, ())),
        )

    def commands() -> None:
        nonlocal watched
        for line in sys.stdin:
            parts = line.split()
            if len(parts) == 2:
                watched = (parts[0], parts[1])
                emit("ack", watched=parts[0])
        # The bench went away or is done with this size.
        os._exit(0)

    async def run() -> None:
        discovery = Discovery(ConsulSettings(addr=consul, service=ENGINE_SERVICE), on_change=on_change)
        await discovery.start()
        await asyncio.Event().wait()

    threading.Thread(target=commands, daemon=True).start()
    emit("start")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    return 0


class Probe:
    """The probe process as the bench sees it: its lines in a queue, each with what it said."""

    def __init__(self, consul: str, work: Path) -> None:
        self.log = (work / "probe.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--probe", "--consul", consul],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            preexec_fn=lifetime.die_with_parent, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self.lines.put(json.loads(line))

    def wait(self, what: str, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while (left := deadline - time.monotonic()) > 0:
            try:
                last = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if match(last):
                return last
        raise SystemExit(f"probe: {what} not seen within {timeout:.0f}s (last line: {last})")

    def watch(self, service_id: str, model: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{service_id} {model}\n")
        self.proc.stdin.flush()
        return self.wait("the ack", lambda e: e["kind"] == "ack" and e["watched"] == service_id, 30)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ----- one size, and the table -----------------------------------------------------------------


def shows(ready: bool) -> Callable[[dict[str, Any]], bool]:
    """Matches the probe's first snapshot in which the watched instance is (not) ready."""
    return lambda e: e["kind"] == "change" and e["watched_ready"] is ready


def answers(proxy: CountingProxy) -> tuple[int, int, float]:
    """Discovery's replica reads so far: answers, their bytes and when the latest came."""
    got = [proxy.answers_of("consul", path) for path in READ_PATHS]
    return sum(g[0] for g in got), sum(g[1] for g in got), max(g[2] for g in got)


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="discovery-bench-") as tmp:
        work = Path(tmp)
        consul = ConsulAgent(log_dir=work, die_with_parent=True).start()
        proxy: CountingProxy | None = None
        probe: Probe | None = None
        try:
            started = time.monotonic()
            asyncio.run(register_all(consul.url, n, args.nodes, args.per_model))
            print(f"[{n}] registered {n} instances in {time.monotonic() - started:.1f} s on {consul.url}")
            proxy = CountingProxy({"consul": consul.url}).start()
            probe = Probe(proxy.url("consul"), work)
            hello = probe.wait("its start", lambda e: e["kind"] == "start", 60)
            first = probe.wait(f"{n} ready", lambda e: e["kind"] == "change" and e["ready"] == n, 120)
            cpu_ms: list[float] = []
            read_bytes: list[int] = []
            reads: list[int] = []
            out_s: list[float] = []
            back_s: list[float] = []
            # The critical flips' delay in three parts: the PUT (Consul commits the check somewhere
            # inside it), its return to Consul's answer at the proxy, that answer to the snapshot.
            put_s: list[float] = []
            answer_s: list[float] = []
            router_s: list[float] = []
            with httpx.Client(base_url=consul.url, timeout=30) as http:
                for k in range(args.changes):
                    i = k * n // args.changes + (n // args.changes) // 2
                    body = instance(i, args.nodes, args.per_model)
                    service_id, model = body["Service"]["ID"], body["Service"]["Meta"]["model"]
                    for status in ("critical", "passing"):
                        time.sleep(args.gap)
                        ack = probe.watch(service_id, model)
                        reads0, bytes0, _ = answers(proxy)
                        t0 = time.time()
                        flip(http, i, args.nodes, args.per_model, status)
                        t_put = time.time()
                        want = status == "passing"
                        seen = probe.wait(f"{service_id} {status}", shows(want), 30)
                        reads1, bytes1, answered = answers(proxy)
                        cpu_ms.append((seen["cpu"] - ack["cpu"]) * 1000)
                        read_bytes.append(bytes1 - bytes0)
                        reads.append(reads1 - reads0)
                        (back_s if want else out_s).append(seen["t"] - t0)
                        if not want:
                            put_s.append(t_put - t0)
                            answer_s.append(answered - t_put)
                            router_s.append(seen["t"] - answered)
                # Once, outside every window: the JSON the instances' read decodes (at the start,
                # and when instances come or go), whatever the wire carried.
                json_bytes = len(http.get(INSTANCES_PATH, headers={"Accept-Encoding": "identity"}).content)
            return {
                "n": n,
                "models": len({i // args.per_model for i in range(n)}),
                "cpu_ms": statistics.median(cpu_ms),
                "bytes": statistics.median(read_bytes),
                "reads": statistics.median(reads),
                "json_bytes": json_bytes,
                "out_p50": statistics.median(out_s),
                "out_max": max(out_s),
                "back_p50": statistics.median(back_s),
                "put_p50": statistics.median(put_s),
                "answer_p50": statistics.median(answer_s),
                "router_p50": statistics.median(router_s),
                "first_s": first["t"] - hello["t"],
                "first_cpu_ms": (first["cpu"] - hello["cpu"]) * 1000,
                "rss_before": hello["rss_mb"],
                "rss_after": rss_mb(probe.proc.pid),
            }
        finally:
            if probe is not None:
                probe.stop()
            if proxy is not None:
                proxy.stop()
            consul.stop()


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> int:
    big = results[-1]
    prev = results[-2] if len(results) > 1 else None
    ratio_head = f"{big['n']}/{prev['n']}" if prev else ""
    version = subprocess.run([find_consul_binary(), "version"], capture_output=True, text=True).stdout
    print()
    print(
        f"Discovery per catalog change, {version.splitlines()[0] if version else 'Consul'} dev agent, "
        f"{os.cpu_count()} CPUs, {args.changes} checks flipped to critical and back, {args.gap:g} s apart"
    )
    head = f"  {'':<40}" + "".join(f"{r['n']:>10}" for r in results) + f"{ratio_head:>11}   target"
    print(head)

    def row(label: str, key: str, fmt: str, ratio: bool = False, target: str = "") -> None:
        cells = "".join(f"{format(r[key], fmt):>10}" for r in results)
        ratio_cell = f"{big[key] / prev[key]:.1f}x" if ratio and prev and prev[key] else ""
        print(f"  {label:<40}{cells}{ratio_cell:>11}   {target}".rstrip())

    for r in results:
        r["kb"] = r["bytes"] / 1024
        r["json_kb"] = r["json_bytes"] / 1024
        r["out_p50_ms"] = r["out_p50"] * 1000
        r["out_max_ms"] = r["out_max"] * 1000
        r["back_p50_ms"] = r["back_p50"] * 1000
        for part in ("put", "answer", "router"):
            r[f"{part}_p50_ms"] = r[f"{part}_p50"] * 1000
        r["first_ms"] = r["first_s"] * 1000
    growth = f"<= {CHANGE_GROWTH_BUDGET:.0f}x"
    row("models", "models", "d")
    row("Discovery CPU per change, median (ms)", "cpu_ms", ".1f", True, growth)
    row("bytes read per change, median (KB)", "kb", ".1f", True, growth)
    row("  Consul reads per change, median", "reads", ".0f")
    row("  JSON of the instances' read (KB)", "json_kb", ".0f", True)
    row("critical -> out of rotation, p50 (ms)", "out_p50_ms", ".0f", True)
    in_time = f"< {OUT_OF_ROTATION_BUDGET_S * 1000:.0f} ms"
    row("critical -> out of rotation, max (ms)", "out_max_ms", ".0f", True, in_time)
    row("  the PUT that flips it, p50 (ms)", "put_p50_ms", ".0f", True)
    row("  PUT done -> Consul answers, p50 (ms)", "answer_p50_ms", ".0f", True)
    row("  Consul's answer -> snapshot, p50 (ms)", "router_p50_ms", ".1f", True)
    row("passing -> back in rotation, p50 (ms)", "back_p50_ms", ".0f", True)
    row("first full read: wall (ms)", "first_ms", ".0f", True)
    row("first full read: CPU (ms)", "first_cpu_ms", ".0f", True)
    row("probe RSS before Discovery (MB)", "rss_before", ".0f")
    row("probe RSS after the run (MB)", "rss_after", ".0f", True)

    missed = []
    if prev:
        for key, what in (("cpu_ms", "CPU"), ("bytes", "bytes read")):
            growth_x = big[key] / prev[key] if prev[key] else float("inf")
            if growth_x > CHANGE_GROWTH_BUDGET:
                missed.append(
                    f"{what} per change grew {growth_x:.1f}x from {prev['n']} to {big['n']} instances "
                    f"(budget {CHANGE_GROWTH_BUDGET:.0f}x)"
                )
    for r in results:
        if r["out_max"] > OUT_OF_ROTATION_BUDGET_S:
            missed.append(
                f"a critical instance stayed in rotation {r['out_max'] * 1000:.0f} ms at {r['n']} instances "
                f"(budget {OUT_OF_ROTATION_BUDGET_S * 1000:.0f} ms)"
            )
    print()
    for line in missed:
        print(f"MISSED: {line}")
    if not missed:
        print("every target met")
    return 1 if missed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", default="100,1000,5000", help="comma-separated fleet sizes")
    parser.add_argument("--changes", type=int, default=20, help="checks flipped to critical (and back)")
    parser.add_argument("--per-model", type=int, default=5, help="instances a model")
    parser.add_argument("--nodes", type=int, default=200, help="node names the instances spread over")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between two flips")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--consul", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return probe_main(args.consul)
    sizes = sorted(int(s) for s in args.instances.split(",") if s.strip())
    if not sizes or min(sizes) < args.changes:
        parser.error("every size needs at least --changes instances")
    return report([measure(n, args) for n in sizes], args)


if __name__ == "__main__":
    sys.exit(main())
