"""What the router's connection limits cost, measured side by side in one run on this machine.

    .venv/bin/python bench/connection_limits_bench.py [--requests 2000] [--rounds 3] [--clients 64]

Two routers in front of one stub engine, discovering it through a real Consul dev agent: the
router as `llmgw router` serves it (router/server.py: httptools with the head, deadline and
connection guards), and the same router under plain uvicorn with httptools. Rounds alternate
between them so that the machine's other work falls on both alike. Prints latency (one
keep-alive client) and req/s (`--clients` keep-alive clients), and the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._support import register_stub_engine  # noqa: E402
from bench.router_bench import REQUEST, Procs, latency, pct, throughput, wait_http  # noqa: E402
from devstack.consul_agent import ConsulAgent  # noqa: E402
from devstack.ports import free_port  # noqa: E402

# The router under uvicorn's own httptools protocol, with the settings `llmgw router` uses.
UNGUARDED = """
import sys, uvicorn
from router.app import RouterApp
from router.server import build_config
config = build_config(listen=sys.argv[1])
uvicorn.run(RouterApp(config, activation=False), host=config.host, port=config.port, http="httptools",
            lifespan="on", log_level="warning", log_config=None, access_log=False, timeout_keep_alive=75)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        procs = Procs(Path(tmp))
        agent = ConsulAgent().start()
        try:
            return run(args, agent, procs)
        finally:
            procs.stop_all()
            agent.stop()


def run(args: argparse.Namespace, agent: ConsulAgent, procs: Procs) -> int:
    stub_port = free_port()
    procs.start(
        "stub",
        [
            sys.executable,
            str(REPO / "bench" / "router_bench.py"),
            "--serve",
            "stub",
            "--port",
            str(stub_port),
        ],
    )
    stub = f"http://127.0.0.1:{stub_port}"
    wait_http(f"{stub}/v1/models")
    register_stub_engine(agent.url, stub_port)
    env = {"CONSUL_HTTP_ADDR": agent.url}
    targets: dict[str, str] = {}
    for name, command in (
        ("guarded", ["-c", "from nomad_driver.cli.app import main; main()", "router", "--no-activation"]),
        ("plain", ["-c", UNGUARDED]),
    ):
        port = free_port()
        listen = f"127.0.0.1:{port}"
        extra = ["--listen", listen, "--log-level", "warning"] if name == "guarded" else [listen]
        procs.start(name, [sys.executable, *command, *extra], env=env)
        targets[name] = f"http://127.0.0.1:{port}"
        wait_http(f"{targets[name]}/healthz", ok=lambda r: r.json().get("ready_replicas") == 1)

    p50: dict[str, list[float]] = {n: [] for n in targets}
    p99: dict[str, list[float]] = {n: [] for n in targets}
    rps: dict[str, list[float]] = {n: [] for n in targets}
    for _ in range(args.rounds):
        for name, url in targets.items():
            timings = run_loop(_latency(url + "/v1/chat/completions", args.requests))
            p50[name].append(timings[0])
            p99[name].append(timings[1])
            rps[name].append(run_loop(_throughput(url + "/v1/chat/completions", args.clients, args.seconds)))
    print(f"{'router':10} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}   (median of {args.rounds} rounds)")
    for name in targets:
        print(
            f"{name:10} {statistics.median(p50[name]) * 1000:8.3f} {statistics.median(p99[name]) * 1000:8.3f}"
            f" {statistics.median(rps[name]):8.0f}"
        )
    diff = (statistics.median(p50["guarded"]) - statistics.median(p50["plain"])) * 1000
    ratio = statistics.median(rps["guarded"]) / statistics.median(rps["plain"])
    print(f"guards add {diff:+.3f} ms at the median; req/s {ratio:.0%} of plain")
    return 0


async def _latency(url: str, n: int) -> tuple[float, float]:
    timings = await latency(url, REQUEST, n)
    return pct(timings, 0.5), pct(timings, 0.99)


async def _throughput(url: str, clients: int, seconds: float) -> float:
    rate, _ = await throughput(url, clients, seconds)
    return rate


def run_loop(coro: Any) -> Any:
    # uvloop for the load generator too, as bench/router_bench.py does.
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
