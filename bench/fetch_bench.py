"""A model's first start against its second on one node, with llmgw's fetch: how long until the
engine runs, and how many bytes the source sent each time.

    .venv/bin/python bench/fetch_bench.py [--size-mb 256] [--rate-mb 100]

Starts an HTTPS source that wants a bearer token and serves `--size-mb` of weights at most at
`--rate-mb` MB/s (0: as fast as it goes), and the Nomad stand-in's client (in this process) with
one node that declares the `llmgw-weights` host volume and has llmgw installed beside its
engines. It puts the token in the model's Variable, runs an allocation of the model's rendered
job (its engine swapped for a process that reads the weights and waits: the prestart fetch runs
first, as on Nomad), times it to a running engine, stops it, and runs a second one: that start
finds the weights in the cache.

Not a test: it prints the two starts side by side, and exits 1 if the second downloaded anything.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._support import REPO
from devstack.agent_tls import write_agent_certificates
from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.nodes import node_from_spec
from devstack.nomad.state import StateStore
from nomad_driver.fetch.render import HOST_VOLUME, weights_of
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.variables import source_variable_path

TOKEN = "bench-token"
BLOCK = os.urandom(1024 * 1024)
ENGINE = "import sys, time; open(sys.argv[1], 'rb').read(); print('loaded', flush=True); time.sleep(3600)"


class Source:
    def __init__(self, size: int, rate: float, tls_dir: Path) -> None:
        self.size, self.rate, self.sent = size, rate, 0
        tls = write_agent_certificates(tls_dir, "weights.bench")
        self.ca = tls.ca
        source = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = int((self.headers.get("Range") or "bytes=0-")[6:].split("-")[0] or 0)
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{source.size - 1}/{source.size}")
                self.send_header("Content-Length", str(source.size - start))
                self.end_headers()
                began, sent = time.monotonic(), 0
                for offset in range(start, source.size, len(BLOCK)):
                    chunk = BLOCK[: min(len(BLOCK), source.size - offset)]
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    source.sent += len(chunk)
                    if source.rate:
                        ahead = sent / source.rate - (time.monotonic() - began)
                        if ahead > 0:
                            time.sleep(ahead)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls.cert, tls.key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server.server_address[1]}/models/bench.gguf"


def install_llmgw(tmp: Path, ca: Path) -> tuple[Path, Path]:
    """(engines dir with `llmgw/bin/llmgw`, the weights cache) of the one node."""
    engines, cache = tmp / "engines", tmp / "weights"
    script = engines / "llmgw" / "bin" / "llmgw"
    script.parent.mkdir(parents=True)
    cache.mkdir()
    script.write_text(
        f'#!/bin/sh\nSSL_CERT_FILE={ca} PYTHONPATH={REPO} exec {sys.executable} -m nomad_driver.cli "$@"\n'
    )
    script.chmod(0o755)
    return engines, cache


def node(engines: Path, cache: Path) -> dict[str, Any]:
    return node_from_spec(
        {
            "name": "gpu-0",
            "attributes": {"driver.raw_exec": "1"},
            "meta": {
                "llmgw_engines_dir": str(engines),
                "llmgw_engine_llama_cpp_python": "0.3.36",
                "llmgw_models_dir": str(cache),
            },
            "host_volumes": {HOST_VOLUME: {"path": str(cache)}},
        }
    )


def allocation(job: dict[str, Any], node_json: dict[str, Any]) -> dict[str, Any]:
    """The allocation the scheduler would place on the one node (what the client reads of it)."""
    return {
        "ID": str(uuid.uuid4()),
        "Namespace": "default",
        "Name": f"{job['ID']}.engine[0]",
        "NodeID": node_json["ID"],
        "NodeName": node_json["Name"],
        "JobID": job["ID"],
        "Job": job,
        "TaskGroup": "engine",
        "DesiredStatus": "run",
        "ClientStatus": "pending",
        "AllocatedResources": {"Tasks": {}, "Shared": {"Ports": [], "Networks": None}},
    }


async def one_start(
    store: StateStore, client: ClientRunner, job: dict[str, Any], source: Source
) -> tuple[float, int]:
    before = source.sent
    began = time.monotonic()
    alloc = allocation(job, next(iter(store.nodes.values())))
    store.upsert_alloc(alloc)
    client.start_alloc(alloc["ID"])
    while ((store.allocs[alloc["ID"]].get("TaskStates") or {}).get("engine") or {}).get("State") != "running":
        if store.allocs[alloc["ID"]].get("ClientStatus") == "failed" or time.monotonic() - began > 600:
            raise SystemExit(f"the start failed: {store.allocs[alloc['ID']].get('TaskStates')}")
        await asyncio.sleep(0.05)
    took = time.monotonic() - began
    client.stop_alloc(alloc["ID"])
    return took, source.sent - before


async def run(args: argparse.Namespace, tmp: Path) -> tuple[tuple[float, int], tuple[float, int]]:
    source = Source(args.size_mb * 1024 * 1024, args.rate_mb * 1e6, tmp / "tls")
    engines, cache = install_llmgw(tmp, source.ca)
    store = StateStore()
    store.upsert_node(node(engines, cache))
    text = (
        "profiles:\n  cpu: {engine: llama-cpp-python, engine_version: 0.3.36, gpus: 0}\n"
        f"models:\n  bench: {{source: '{source.url}', profile: cpu}}\n"
    )
    model = parse_models(text).models["bench"]
    path = source_variable_path(model.name)
    store.variables[("default", path)] = {
        "Namespace": "default",
        "Path": path,
        "Items": {"LLMGW_SOURCE_TOKEN": TOKEN},
    }
    job = render_job(model)
    engine = job["TaskGroups"][0]["Tasks"][0]
    engine["Config"] = {"command": sys.executable, "args": ["-c", ENGINE, weights_of(model).model_arg]}
    client = ClientRunner(store, Clock(), tmp / "data", None)
    try:
        first = await one_start(store, client, job, source)
        second = await one_start(store, client, job, source)
    finally:
        await client.shutdown()
    return first, second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rate-mb", type=float, default=100.0, help="0: as fast as it goes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fetch-bench-") as raw:
        first, second = asyncio.run(run(args, Path(raw)))
    print(f"weights: {args.size_mb} MiB over HTTPS, source capped at {args.rate_mb or 'no'} MB/s")
    print(f"{'start':<8} {'to engine running':>18} {'bytes from source':>18}")
    for name, (took, sent) in (("first", first), ("second", second)):
        print(f"{name:<8} {took:>16.2f} s {sent:>18}")
    return 0 if second[1] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
