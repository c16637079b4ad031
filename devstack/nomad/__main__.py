"""`python -m devstack.nomad --listen HOST:PORT --nodes NODES.yaml --consul URL`: the Nomad
stand-in as one process. It prints one line once it listens and stops every allocation's
processes on SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import ssl
import sys
import tempfile
from pathlib import Path

from aiohttp import web

from devstack.nomad import acl_http
from devstack.nomad.clock import Clock
from devstack.nomad.gc import GCConfig
from devstack.nomad.http import make_app
from devstack.nomad.nodes import NodeSpecError, load_nodes
from devstack.nomad.server import NomadServer
from devstack.nomad.streams import EVENT_HEARTBEAT_S
from nomad_driver.durations import parse_duration
from nomad_driver.logs import configure_logging


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 5m or 1h, got {text!r}") from exc


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devstack.nomad", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:4646", help="HOST:PORT for the HTTP API")
    parser.add_argument("--nodes", required=True, type=Path, help="fleet file (YAML) of simulated nodes")
    parser.add_argument("--consul", default=None, help="Consul HTTP address services are registered in")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="allocation directories (default: a temp dir)"
    )
    parser.add_argument(
        "--clock-speed", type=float, default=1.0, help="run restart/reschedule delays N times faster"
    )
    parser.add_argument(
        "--event-heartbeat", type=float, default=EVENT_HEARTBEAT_S, help="seconds between {} frames"
    )
    # Nomad's server GC settings (`server` block), in the stand-in's clock; `PUT /v1/system/gc`
    # collects at once whatever the rules allow.
    defaults = GCConfig()
    for flag, default, meaning in (
        ("--gc-interval", defaults.interval_s, "how often the garbage collector runs"),
        ("--eval-gc-threshold", defaults.eval_threshold_s, "age before terminal evaluations go"),
        ("--batch-eval-gc-threshold", defaults.batch_eval_threshold_s, "the same for batch jobs"),
        ("--job-gc-threshold", defaults.job_threshold_s, "age before dead, stopped jobs go"),
        ("--node-gc-threshold", defaults.node_threshold_s, "age before down nodes go"),
        ("--deployment-gc-threshold", defaults.deployment_threshold_s, "age before finished deployments go"),
    ):
        parser.add_argument(
            flag, type=_duration, default=default, help=f"{meaning} (e.g. 1h; default {default:g}s)"
        )
    parser.add_argument(
        "--acl-bootstrap-token",
        default=None,
        help="turn Nomad ACLs on, with this secret as the management token (off by default)",
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        help="serve HTTPS with this PEM certificate (Nomad's tls { http = true, cert_file })",
    )
    parser.add_argument("--tls-key", type=Path, default=None, help="the PEM key of --tls-cert")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace, data_dir: Path) -> None:
    host, _, port_text = args.listen.rpartition(":")
    nodes = load_nodes(args.nodes)
    gc = GCConfig(
        interval_s=args.gc_interval,
        eval_threshold_s=args.eval_gc_threshold,
        batch_eval_threshold_s=args.batch_eval_gc_threshold,
        job_threshold_s=args.job_gc_threshold,
        node_threshold_s=args.node_gc_threshold,
        deployment_threshold_s=args.deployment_gc_threshold,
    )
    server = NomadServer(nodes, args.consul, data_dir, Clock(args.clock_speed), gc)
    await server.start()
    app = make_app(server, args.listen, event_heartbeat_s=args.event_heartbeat)
    if args.acl_bootstrap_token:
        acl_http.enable(app, args.acl_bootstrap_token)
    # Open log-follow and event streams and clients' long polls must not hold the exit up: aiohttp
    # waits its grace twice (the site's stop, then the server's), and at 2 s a watcher's open
    # long poll made every exit take 4 s. What is in flight is dropped, as a Nomad agent that
    # exits drops it.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.25)
    await runner.setup()
    tls = None
    if args.tls_cert:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    site = web.TCPSite(runner, host or "127.0.0.1", int(port_text), ssl_context=tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await site.start()
        print(
            f"nomad stand-in listening on {'https' if tls else 'http'}://{args.listen} "
            f"({len(nodes)} nodes, data {data_dir})",
            flush=True,
        )
        await stop.wait()
    finally:
        # Allocations first: their processes and Consul registrations must not outlive us.
        await server.stop()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    configure_logging(args.log_level)
    if not args.listen.rpartition(":")[2].isdigit():
        print(f"--listen: expected HOST:PORT, got {args.listen!r}", file=sys.stderr)
        return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        print("--tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    own_dir = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="devstack-nomad-")) if own_dir else args.data_dir
    try:
        asyncio.run(_serve(args, data_dir))
    except NodeSpecError as exc:
        print(f"--nodes: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"nomad stand-in: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    finally:
        if own_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
