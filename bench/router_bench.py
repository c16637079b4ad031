"""How much the router adds, measured side by side in one run on this machine.

    .venv/bin/python bench/router_bench.py [--requests 2000] [--seconds 8] [--clients 64]
        [--no-litellm] [--no-clients-compare] [--no-activation] [--no-failover] [--fleet 1000]

Servers in front of one fixed-answer stub engine (raw ASGI under uvicorn): nothing (the stub
itself), a bare Starlette proxy once per upstream client the router could use (aiohttp, httpx,
httpx2, httpx over an aiohttp transport; the aiohttp one is the floor for a Python proxy), the
llmgw router (`llmgw router`, discovering the stub through a real Consul dev agent), and
LiteLLM's proxy (installed once into its own virtualenv under ~/.cache/llmgw/bench). Each gets
the same load from this process, in rounds with the targets taking turns: one keep-alive client
for latency, `--clients` concurrent clients for throughput, and streamed requests for time to
first byte; the router also gets requests for a parked and an unplaceable model (the latter also
from a second router that asks the Nomad stand-in afresh each time, through the leading watcher,
with `--fleet` more on-demand models defined and their jobs registered), a second replica whose
Consul check is failed under load, to time how long new requests still reach it, and 100
clients waiting for a model that never becomes ready: more requests are refused as overloaded
(timed, taking turns with parked refusals), then the model is parked in Consul and each waiting
client's answer is timed from that write. Everything shares the machine's cores, so each
millisecond target is a quiet machine's, also met within twice the floor measured beside it in
the same run. Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import wrk_check  # noqa: E402
from bench._support import register_stub_engine  # noqa: E402
from devstack.consul_agent import ConsulAgent  # noqa: E402
from devstack.ports import free_port  # noqa: E402
from nomad_driver.config_kv import definition_keys  # noqa: E402
from nomad_driver.config_store import store_keys  # noqa: E402
from nomad_driver.consul import Consul  # noqa: E402

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# Installs made for the bench live here, never in the project's virtualenv: LiteLLM pins its own
# versions of half of our dependencies, and the client comparison needs packages the router
# does not.
CACHE = Path.home() / ".cache" / "llmgw" / "bench"
LITELLM_PIN = "litellm[proxy]==1.108.7"
HTTPX_AIOHTTP_PIN = "httpx-aiohttp==0.2.0"
CLIENTS = ("aiohttp", "httpx", "httpx2", "httpx+aiohttp")

ANSWER = json.dumps(
    {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
EVENT = (
    b'data: {"id":"chatcmpl-stub","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
)
REQUEST = json.dumps(
    {
        "model": "bench",
        "messages": [
            {"role": "system", "content": "You are a terse assistant. " * 4},
            {"role": "user", "content": "Say ok."},
        ],
        "max_tokens": 1,
    }
).encode()
STREAM_REQUEST = json.dumps({**json.loads(REQUEST), "stream": True}).encode()
PARKED_REQUEST = json.dumps({**json.loads(REQUEST), "model": "parked"}).encode()
UNPLACEABLE_REQUEST = json.dumps({**json.loads(REQUEST), "model": "unplaceable"}).encode()
HEADERS = {"Content-Type": "application/json"}
# `bench` runs on vLLM, whose answers the router passes through as they come, like the bare
# proxies it is measured against; on llama-cpp-python or llama.cpp it would ask for a stream and
# assemble each non-streamed answer (router/assemble.py), more work than any proxy does.
MODELS = """
profiles:
  p: {engine: llama-cpp-python, engine_version: "0.3.36", gpus: 0}
  v: {engine: vllm, engine_version: "0.11.0", gpus: 1}
  huge: {engine: llama-cpp-python, engine_version: "0.3.36", gpus: 8, gpu_memory_mib: 80000, memory_mib: 1024}
models:
  bench: {source: "hf://bench/bench", profile: v}
  parked: {source: "file:///parked.gguf", profile: p}
  unplaceable: {source: "file:///unplaceable.gguf", profile: huge}
  huge: {source: "file:///huge.gguf", profile: huge, replicas: {min: 0, max: 1}}
  cold: {source: "file:///cold.gguf", profile: p, replicas: {min: 0, max: 1}, activation_timeout: 10m}
"""
HUGE_REQUEST = json.dumps({**json.loads(REQUEST), "model": "huge"}).encode()
# The fresh attempt's targets (issue 36), at `--fleet` models defined.
ASK_MEDIAN_S = 0.050
ASK_P99_S = 0.100


def fleet_models(n: int) -> str:
    """MODELS and `n` on-demand models beside them, never asked for: the fleet the watcher
    keeps while one model's fresh attempt is timed."""
    return MODELS + "".join(
        f'  idle-{i}: {{source: "file:///idle-{i}.gguf", profile: p, replicas: {{min: 0, max: 1}}}}\n'
        for i in range(n)
    )


async def store_definitions(consul_url: str, text: str) -> None:
    consul = Consul(consul_url)
    try:
        await store_keys(consul, definition_keys(text))
    finally:
        await consul.close()


# Placed on the stand-in, but its engine never becomes ready (the nodes have no engine
# installed): requests for it wait, as for a cold start, until the bench parks it.
COLD_REQUEST = json.dumps({**json.loads(REQUEST), "model": "cold"}).encode()
WAITING_CLIENTS = 100
# Each comparison is measured in this many rounds, the targets taking turns.
ROUNDS = 4
# Its H100 node has one unhealthy GPU of eight, so `huge` fits nowhere and Nomad says why.
STANDIN_NODES = REPO / "devstack" / "nodes" / "small.yaml"
UNPLACEABLE_REASON = "model 'unplaceable' cannot be placed on any node: no node has 8 x nvidia/gpu"


# -- the servers ------------------------------------------------------------------------------

# When the stub last answered a completion (wall clock, comparable across processes on this
# machine) and how many it answered: the failover check reads them from /bench/last.
LAST: dict[str, float] = {"at": 0.0, "count": 0}


async def stub_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] in ("/v1/models", "/bench/last"):
        payload = (
            b'{"object":"list","data":[]}' if scope["path"] == "/v1/models" else json.dumps(LAST).encode()
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        return
    LAST["at"] = time.time()
    LAST["count"] += 1
    # Our own clients write `"stream": true`; the OpenAI SDK inside LiteLLM writes compact JSON.
    if b'"stream": true' in body or b'"stream":true' in body:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(4):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


def baseline_app(upstream: str, client: str) -> Any:
    """The floor: Starlette in, `client` out, no parsing, no choice of replica."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    holder: dict[str, Any] = {}

    async def via_aiohttp(request: Request) -> Response:
        body = await request.body()
        resp = await holder["s"].post(upstream + request.url.path, data=body, headers=HEADERS)
        if resp.content_length is None:

            async def chunks() -> Any:
                async for chunk in resp.content.iter_any():
                    yield chunk
                resp.release()

            return StreamingResponse(chunks(), status_code=resp.status, media_type=resp.content_type)
        data = await resp.read()
        resp.release()
        return Response(data, status_code=resp.status, media_type=resp.content_type)

    async def via_httpx(request: Request) -> Response:
        body = await request.body()
        session = holder["s"]
        req = session.build_request("POST", upstream + request.url.path, content=body, headers=HEADERS)
        resp = await session.send(req, stream=True)
        media_type = resp.headers.get("content-type")
        if "content-length" not in resp.headers:

            async def chunks() -> Any:
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()

            return StreamingResponse(chunks(), status_code=resp.status_code, media_type=media_type)
        data = await resp.aread()
        await resp.aclose()
        return Response(data, status_code=resp.status_code, media_type=media_type)

    def open_session() -> Any:
        # The httpx family keeps its default pool (100 connections, 20 kept alive): measured
        # here, httpx 0.28 with 1,024 kept alive did 143 req/s against 566 with the default,
        # and httpx2 933 against 1,108, so the default is the fair comparison.
        if client == "aiohttp":
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        if client == "httpx":
            return httpx.AsyncClient()
        if client == "httpx2":
            import httpx2

            return httpx2.AsyncClient()
        from httpx_aiohttp import HttpxAiohttpClient

        return HttpxAiohttpClient()

    async def lifespan(app: Any) -> Any:
        holder["s"] = open_session()
        yield
        if client == "aiohttp":
            await holder["s"].close()
        else:
            await holder["s"].aclose()

    handler = via_aiohttp if client == "aiohttp" else via_httpx
    return Starlette(routes=[Route("/v1/chat/completions", handler, methods=["POST"])], lifespan=lifespan)


def serve(kind: str, port: int, upstream: str, client: str) -> None:
    import uvicorn

    app = stub_app if kind == "stub" else baseline_app(upstream, client)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- what the bench installs --------------------------------------------------------------------


def pip_install(python: Path | str, *args: str) -> bool:
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        # pip's own errors are long; the last lines say which requirement failed and why.
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        print(f"pip install {' '.join(args)} failed:\n{tail}", file=sys.stderr)
    return done.returncode == 0


def litellm_venv() -> tuple[Path, str]:
    """LiteLLM's proxy in its own virtualenv, made once; returns its `litellm` and version."""
    venv = CACHE / "litellm-venv"
    exe = venv / "bin" / "litellm"
    python = venv / "bin" / "python"
    if not exe.exists():
        print(f"installing {LITELLM_PIN} into {venv} (once, about a minute)...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # The pin is the version compared against before; if the index no longer has it, the
        # newest is still a fair comparison and the table says which one ran.
        if not pip_install(python, LITELLM_PIN) and not pip_install(python, "litellm[proxy]"):
            raise RuntimeError(f"could not install LiteLLM into {venv}; rerun with --no-litellm")
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return exe, version


def clients_path() -> str:
    """A PYTHONPATH entry with what the client comparison needs beyond the project's venv."""
    target = CACHE / "clients"
    if not (target / "httpx_aiohttp").exists():
        # httpx and aiohttp come from the project's venv; only the transport itself is added.
        pip_install(sys.executable, "--no-deps", "--target", str(target), HTTPX_AIOHTTP_PIN)
    if importlib.util.find_spec("httpx2") is None and not (target / "httpx2").exists():
        pip_install(sys.executable, "--target", str(target), "httpx2")
    return str(target)


def client_available(client: str, path: str) -> bool:
    module = {"aiohttp": "aiohttp", "httpx": "httpx", "httpx2": "httpx2", "httpx+aiohttp": "httpx_aiohttp"}[
        client
    ]
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
    )
    return probe.returncode == 0


# -- the load -----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(url: str, body: bytes, n: int, warmup: int = 50, expect: int = 200) -> list[float]:
    return (await alternating(url, [(body, expect)], n, warmup))[0]


async def asked_directly(nomad: str, job_id: str, n: int, warmup: int = 5) -> list[float]:
    """The Nomad calls of a refused activation, made straight to Nomad: read the job, scale it
    to 1, read the evaluation until it is done, read the job again and scale it back. The time
    of each of `n` such rounds: what the router's refusal costs before its own part."""
    timings: list[float] = []
    scale = f"{nomad}/v1/job/{job_id}/scale"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:

        async def call(method: str, url: str, body: Any = None) -> Any:
            async with session.request(method, url, json=body) as resp:
                resp.raise_for_status()
                return await resp.json()

        for i in range(n + warmup):
            started = time.perf_counter()
            group = (await call("GET", f"{nomad}/v1/job/{job_id}"))["TaskGroups"][0]["Name"]
            reply = await call("POST", scale, {"Count": 1, "Target": {"Group": group}, "Message": "bench"})
            index = 0
            while True:
                query = f"?index={index}&wait=10s" if index else ""
                evaluation = await call("GET", f"{nomad}/v1/evaluation/{reply['EvalID']}{query}")
                if evaluation.get("Status") in ("complete", "failed", "canceled"):
                    break
                index = int(evaluation.get("ModifyIndex") or 0)
            await call("GET", f"{nomad}/v1/job/{job_id}")
            await call("POST", scale, {"Count": 0, "Target": {"Group": group}, "Message": "bench: undo"})
            if i >= warmup:
                timings.append(time.perf_counter() - started)
    return timings


async def alternating(
    url: str, kinds: list[tuple[bytes, int]], n: int, warmup: int = 50
) -> list[list[float]]:
    """`n` requests of each kind (body, expected status), taking turns on one keep-alive
    connection, so that every kind sees the same machine: per kind, the time of each."""
    timings: list[list[float]] = [[] for _ in kinds]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for i in range(n + warmup):
            for kind, (body, expect) in enumerate(kinds):
                started = time.perf_counter()
                async with session.post(url, data=body, headers=HEADERS) as resp:
                    await resp.read()
                    if resp.status != expect:
                        raise RuntimeError(
                            f"{url}: expected {expect}, got {resp.status}: {(await resp.text())[:300]}"
                        )
                if i >= warmup:
                    timings[kind].append(time.perf_counter() - started)
    return timings


@dataclass
class Parking:
    answered_after_park: list[float]
    codes: dict[str, int]
    overloaded: list[float]
    # Parked refusals taking turns with the overloaded ones: the cheapest refusal, on the same
    # machine at the same moment.
    parked: list[float]


async def waiting_metric(router: str, session: aiohttp.ClientSession) -> float:
    async with session.get(f"{router}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith('llmgw_router_waiting_requests{model="cold"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def park_while_waiting(router: str, consul: str, clients: int = WAITING_CLIENTS) -> Parking:
    """`clients` requests wait for `cold`; more are refused as overloaded (timed); then the
    model is parked in Consul, as the watcher does, and each waiting client's answer is timed
    from that write."""
    url = router + "/v1/chat/completions"
    answered: list[float] = []
    codes: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=clients + 8)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=300)
    ) as session:

        async def wait_one() -> None:
            async with session.post(url, data=COLD_REQUEST, headers=HEADERS) as resp:
                error = (await resp.json(content_type=None)).get("error", {})
                answered.append(time.time())
                code = f"{resp.status} {error.get('code')}"
                codes[code] = codes.get(code, 0) + 1

        tasks = [asyncio.create_task(wait_one()) for _ in range(clients)]
        deadline = time.monotonic() + 60
        while await waiting_metric(router, session) < clients:
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                raise RuntimeError(f"{clients} requests for 'cold' did not all wait: {codes}")
            await asyncio.sleep(0.1)
        overloaded, parked = await alternating(
            url, [(COLD_REQUEST, 429), (PARKED_REQUEST, 503)], 1000, warmup=10
        )
        parked_at = time.time()
        async with session.put(
            f"{consul}/v1/kv/llmgw/state/cold",
            json={"parked": True, "consecutive_failures": 5, "last_error": "bench: parked while waiting"},
        ) as resp:
            resp.raise_for_status()
        await asyncio.gather(*tasks)
    return Parking([t - parked_at for t in answered], codes, overloaded, parked)


async def refuses(url: str, body: bytes, code: str, within: float = 0.0) -> None:
    """A 503 is not enough: only the refusal the check is about counts (not, say, Nomad unreachable).
    `within`: seconds to wait for it, while the leading watcher's first passes reach Nomad's word."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.post(url, data=body, headers=HEADERS) as resp:
                error = (await resp.json(content_type=None)).get("error", {})
                if resp.status == 503 and error.get("code") == code:
                    return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{url}: expected a 503 {code}, got {resp.status} {error}")
            await asyncio.sleep(0.5)


async def ttfb(url: str, n: int, warmup: int = 50) -> list[float]:
    timings: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for i in range(n + warmup):
            started = time.perf_counter()
            async with session.post(url, data=STREAM_REQUEST, headers=HEADERS) as resp:
                first = await resp.content.readany()
                took = time.perf_counter() - started
                if resp.status != 200 or not first:
                    raise RuntimeError(f"{url}: stream answered {resp.status} with {first[:300]!r}")
                await resp.read()
            if i >= warmup:
                timings.append(took)
    return timings


async def throughput(url: str, clients: int, seconds: float) -> tuple[float, dict[int, int]]:
    """Successful requests per second, and how many answers were something else, by status."""
    done = 0
    failed: dict[int, int] = {}
    stop_at = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            async with session.post(url, data=REQUEST, headers=HEADERS) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1
                else:
                    failed[resp.status] = failed.get(resp.status, 0) + 1

    async def warm(session: aiohttp.ClientSession) -> None:
        async with session.post(url, data=REQUEST, headers=HEADERS) as resp:
            await resp.read()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        # Every connection is opened before the clock starts.
        await asyncio.gather(*(warm(session) for _ in range(clients)))
        started = time.perf_counter()
        stop_at = started + seconds
        await asyncio.gather(*(worker(session) for _ in range(clients)))
        return done / (time.perf_counter() - started), failed


@dataclass
class Failover:
    before: int = 0
    after: int = 0
    errors: int = 0
    last_after_fail_s: float = 0.0


async def failover(consul: str, router: str, stub2: str, stub2_port: int, clients: int = 8) -> Failover:
    """Load the router while a second replica's check turns critical; when did it last get work?"""
    result = Failover()
    async with aiohttp.ClientSession() as session:
        async with session.put(
            f"{consul}/v1/agent/service/register",
            json={
                "Name": "llmgw-engine",
                "ID": "bench-2",
                "Address": "127.0.0.1",
                "Port": stub2_port,
                "Tags": ["model=bench"],
                "Meta": {"model": "bench", "def_hash": "b"},
                "Check": {"CheckID": "bench-2-ttl", "TTL": "120s", "Status": "passing"},
            },
        ) as resp:
            resp.raise_for_status()
        deadline = time.monotonic() + 15
        while True:
            async with session.get(f"{router}/healthz") as resp:
                if (await resp.json(content_type=None)).get("ready_replicas") == 2:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not see the second replica within 15 s")
            await asyncio.sleep(0.05)

        stop = asyncio.Event()
        counter = iter(range(10**9))

        async def worker() -> None:
            while not stop.is_set():
                # A new conversation each time, so that affinity does not keep work off replica 2.
                body = json.dumps(
                    {"model": "bench", "messages": [{"role": "user", "content": f"request {next(counter)}"}]}
                ).encode()
                async with session.post(f"{router}/v1/chat/completions", data=body, headers=HEADERS) as resp:
                    await resp.read()
                    if resp.status != 200:
                        result.errors += 1

        async def last() -> dict[str, float]:
            async with session.get(f"{stub2}/bench/last") as resp:
                data: dict[str, float] = await resp.json()
                return data

        workers = [asyncio.create_task(worker()) for _ in range(clients)]
        try:
            await asyncio.sleep(1.5)
            # Counted from before the call, so the time Consul takes to take it is included.
            failed_at = time.time()
            async with session.put(f"{consul}/v1/agent/check/fail/bench-2-ttl?note=bench") as resp:
                resp.raise_for_status()
            at_fail = await last()
            await asyncio.sleep(2.5)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        end = await last()
        result.before = int(at_fail["count"])
        result.after = int(end["count"] - at_fail["count"])
        result.last_after_fail_s = end["at"] - failed_at
        async with session.put(f"{consul}/v1/agent/service/deregister/bench-2") as resp:
            resp.raise_for_status()
    return result


# -- the run ------------------------------------------------------------------------------------


def run_loop(coro: Any) -> int:
    # The load generator gets the fastest loop available too, so that its own overhead does
    # not swamp the differences it measures; uvicorn picks uvloop for the servers the same way.
    try:
        import uvloop
    except ImportError:
        return int(asyncio.run(coro))
    return int(uvloop.run(coro))


@dataclass
class Procs:
    logs: Path
    running: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        # A log file, not a pipe: nobody reads a pipe during the run, and a chatty server
        # (LiteLLM) would block on a full one and look slow.
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            args,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own process group, so that stopping it also stops any worker it forked.
            start_new_session=True,
        )
        log.close()
        self.running.append((name, proc))
        return proc

    def tail(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-15:]) if path.exists() else ""

    def stop_all(self) -> None:
        for _, proc in reversed(self.running):
            signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait(5)
            # Anything the leader forked and left behind goes with it.
            signal_group(proc.pid, signal.SIGKILL)
        self.running.clear()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def wait_http(url: str, timeout: float = 30.0, ok: Callable[[httpx.Response], bool] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(url, timeout=1)
            if ok is None or ok(resp):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout:.0f}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--fleet", type=int, default=1000, help="on-demand models defined beside the measured ones"
    )
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--litellm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also measure LiteLLM's proxy ({LITELLM_PIN}, installed once under {CACHE})",
    )
    parser.add_argument(
        "--clients-compare",
        dest="compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure a bare proxy per upstream client (aiohttp, httpx, httpx2, httpx+aiohttp), not just aiohttp",
    )
    parser.add_argument(
        "--failover",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time how long a replica whose check turns critical still gets new requests",
    )
    parser.add_argument(
        "--activation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the unplaceable refusal of a router that asks the Nomad stand-in afresh each time",
    )
    parser.add_argument(
        "--wrk",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compare the router with the aiohttp proxy under wrk (64 connections), if unpacked (make wrk)",
    )
    parser.add_argument(
        "--wrk-only",
        action="store_true",
        help="only the wrk comparison (stub, aiohttp proxy, router), nothing else of the bench",
    )
    parser.add_argument("--serve", choices=["stub", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    parser.add_argument("--client", default="aiohttp", choices=CLIENTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.wrk_only:
        if not wrk_check.available():
            parser.error("wrk is not unpacked; run 'make wrk' first")
        args.litellm = args.compare = args.activation = args.failover = False
    if args.serve:
        serve(args.serve, args.port, args.upstream, args.client)
        return 0

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as tmp:
        procs = Procs(Path(tmp))
        agent = ConsulAgent().start()
        try:
            return run(args, agent, procs, Path(tmp))
        finally:
            procs.stop_all()
            agent.stop()


def run(args: argparse.Namespace, agent: ConsulAgent, procs: Procs, tmp: Path) -> int:
    me = [sys.executable, str(Path(__file__).resolve())]
    stub_port, stub2_port, router_port = free_port(), free_port(), free_port()
    procs.start("stub", [*me, "--serve", "stub", "--port", str(stub_port)])
    stub = f"http://127.0.0.1:{stub_port}"
    wait_http(f"{stub}/v1/models")
    targets: dict[str, str] = {"stub": stub}

    extra_path = clients_path() if args.compare else ""
    for client in CLIENTS if args.compare else ("aiohttp",):
        if not client_available(client, extra_path):
            print(f"skipping the {client} proxy: not importable", file=sys.stderr)
            continue
        port = free_port()
        procs.start(
            f"proxy-{client}",
            [*me, "--serve", "baseline", "--port", str(port), "--upstream", stub, "--client", client],
            env={"PYTHONPATH": extra_path} if extra_path else None,
        )
        targets[f"proxy {client}"] = f"http://127.0.0.1:{port}"

    register_stub_engine(agent.url, stub_port)
    # Stored as `llmgw apply` stores them, one key per model, with the idle fleet beside them.
    asyncio.run(store_definitions(agent.url, fleet_models(args.fleet)))
    httpx.put(
        f"{agent.url}/v1/kv/llmgw/state/parked", json={"parked": True, "last_error": "bench"}
    ).raise_for_status()
    httpx.put(
        f"{agent.url}/v1/kv/llmgw/state/unplaceable",
        json={"unplaceable": True, "placement_reason": UNPLACEABLE_REASON},
    ).raise_for_status()
    procs.start(
        "router",
        [
            sys.executable,
            "-c",
            "from nomad_driver.cli.app import main; main()",
            "router",
            "--no-activation",
            "--listen",
            f"127.0.0.1:{router_port}",
            "--log-level",
            "warning",
        ],
        env={"CONSUL_HTTP_ADDR": agent.url},
    )
    router = f"http://127.0.0.1:{router_port}"
    targets["router"] = router

    litellm_version = ""
    if args.litellm:
        exe, litellm_version = litellm_venv()
        port = free_port()
        config = tmp / "litellm.yaml"
        config.write_text(
            "model_list:\n"
            "  - model_name: bench\n"
            "    litellm_params:\n"
            "      model: openai/bench\n"
            f"      api_base: {stub}/v1\n"
            "      api_key: stub\n"
        )
        procs.start(
            "litellm",
            [
                str(exe),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            env={
                # Offline: the cost map ships with the package, and no key is a deliberate choice.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
                "LITELLM_LOG": "ERROR",
            },
        )
        targets["litellm"] = f"http://127.0.0.1:{port}"

    for name, url in targets.items():
        try:
            if name == "router":
                wait_http(
                    f"{url}/healthz", ok=lambda r: r.status_code == 200 and r.json()["ready_replicas"] == 1
                )
            elif name == "litellm":
                wait_http(f"{url}/health/liveliness", timeout=180)
            elif name != "stub":
                wait_http(f"{url}/", ok=lambda r: r.status_code == 404)
        except RuntimeError:
            print(procs.tail(name.replace(" ", "-")), file=sys.stderr)
            raise

    activating = nomad = ""
    if args.activation:
        activating, nomad = start_activation(procs, tmp, agent.url, args.fleet)

    stub2 = ""
    if args.failover:
        procs.start("stub2", [*me, "--serve", "stub", "--port", str(stub2_port)])
        stub2 = f"http://127.0.0.1:{stub2_port}"
        wait_http(f"{stub2}/v1/models")
    if args.wrk_only:
        return wrk_compare(targets, args.seconds)
    code = run_loop(measure(targets, agent.url, stub2, stub2_port, activating, nomad, litellm_version, args))
    if args.wrk and wrk_check.available():
        code |= wrk_compare(targets, args.seconds)
    return code


# Pass-through throughput under wrk, the router against the bare ASGI + aiohttp proxy (issue 33).
WRK_FLOOR = 0.8


def wrk_compare(targets: dict[str, str], seconds: float) -> int:
    path = "/v1/chat/completions"
    rates: dict[str, float] = {}
    for name in ("stub", "proxy aiohttp", "router"):
        if name in targets:
            rate, bad = wrk_check.requests_per_second(targets[name] + path, REQUEST, seconds=seconds)
            rates[name] = rate
            print(f"wrk -t1 -c64 {name:>14}: {rate:9.0f} req/s" + (f"  ({bad} failed)" if bad else ""))
    if "proxy aiohttp" not in rates or "router" not in rates:
        return 0
    ratio = rates["router"] / rates["proxy aiohttp"]
    print(f"wrk: router / aiohttp proxy = {ratio:.2f} (floor {WRK_FLOOR})")
    return 0 if ratio >= WRK_FLOOR else 1


def start_activation(procs: Procs, tmp: Path, consul: str, fleet: int) -> tuple[str, str]:
    """The Nomad stand-in with `huge`'s job, a watcher on it, and a router with activation on:
    (router, Nomad)."""
    from nomad_driver.render import render_job
    from nomad_driver.spec import parse_models

    nomad_port, router_port = free_port(), free_port()
    procs.start(
        "nomad",
        [
            sys.executable,
            "-m",
            "devstack.nomad",
            "--listen",
            f"127.0.0.1:{nomad_port}",
            "--nodes",
            str(STANDIN_NODES),
            "--data-dir",
            str(tmp / "nomad"),
            "--log-level",
            "warning",
        ],
    )
    nomad = f"http://127.0.0.1:{nomad_port}"
    wait_http(f"{nomad}/v1/status/leader", ok=lambda r: r.status_code == 200)
    models = parse_models(fleet_models(fleet)).models
    for name in ("huge", "cold", *(f"idle-{i}" for i in range(fleet))):
        job = render_job(models[name])
        job["TaskGroups"][0]["Count"] = 0 if name.startswith("idle-") else job["TaskGroups"][0]["Count"]
        httpx.post(f"{nomad}/v1/jobs", json={"Job": job}, timeout=10).raise_for_status()
    # The router asks and the leading watcher scales (the router never calls Nomad), so the
    # refusal measured here includes the watcher's pass and its read of the evaluation.
    procs.start(
        "watcher-activation",
        [
            sys.executable,
            "-c",
            "from nomad_driver.cli.app import main; main()",
            "watcher",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--log-level",
            "warning",
        ],
        env={"CONSUL_HTTP_ADDR": consul, "NOMAD_ADDR": nomad},
    )
    procs.start(
        "router-activation",
        [
            sys.executable,
            "-c",
            "from nomad_driver.cli.app import main; main()",
            "router",
            "--listen",
            f"127.0.0.1:{router_port}",
            "--log-level",
            "warning",
        ],
        # The bound is the waiting clients exactly, so that one more is refused as overloaded.
        env={"CONSUL_HTTP_ADDR": consul, "LLMGW_ROUTER_MAX_WAITING": str(WAITING_CLIENTS)},
    )
    router = f"http://127.0.0.1:{router_port}"
    try:
        wait_http(f"{router}/healthz", ok=lambda r: r.status_code == 200 and r.json()["ready_replicas"] == 1)
        # The watcher has taken the whole fleet in once it wrote a state for each model.
        wait_http(
            f"{consul}/v1/kv/llmgw/state/?keys=true",
            timeout=120,
            ok=lambda r: r.status_code == 200 and len(r.json()) >= fleet,
        )
    except RuntimeError:
        print(procs.tail("router-activation"), file=sys.stderr)
        print(procs.tail("watcher-activation"), file=sys.stderr)
        raise
    return router, nomad


async def measure(
    targets: dict[str, str],
    consul: str,
    stub2: str,
    stub2_port: int,
    activating: str,
    nomad: str,
    litellm_version: str,
    args: argparse.Namespace,
) -> int:
    path = "/v1/chat/completions"
    # In rounds, the targets taking turns: the machine's load drifts over a run, and measured one
    # after another the targets would each get a different machine.
    lat: dict[str, list[float]] = {name: [] for name in targets}
    first: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(ROUNDS):
        for name, url in targets.items():
            lat[name] += await latency(url + path, REQUEST, args.requests // ROUNDS, warmup=10)
        for name, url in targets.items():
            first[name] += await ttfb(url + path, args.requests // 4 // ROUNDS, warmup=10)
    await refuses(targets["router"] + path, PARKED_REQUEST, "model_parked")
    # With activation measured, a watcher leads and writes `unplaceable`'s state from Nomad's
    # evaluation (it fits on no node of the stand-in's fleet), over the one written above.
    await refuses(targets["router"] + path, UNPLACEABLE_REQUEST, "model_unplaceable", within=60)
    parked = await latency(targets["router"] + path, PARKED_REQUEST, args.requests // 4, expect=503)
    unplaceable = await latency(targets["router"] + path, UNPLACEABLE_REQUEST, args.requests // 4, expect=503)
    if activating:
        await refuses(activating + path, HUGE_REQUEST, "model_unplaceable")
    # Each of these is a scale call and an evaluation on the stand-in, so fewer of them; and the
    # same calls made straight to the stand-in, beside them.
    asked: list[float] = []
    direct: list[float] = []
    for _ in range(ROUNDS if activating else 0):
        asked += await latency(
            activating + path, HUGE_REQUEST, args.requests // 8 // ROUNDS, warmup=5, expect=503
        )
        direct += await asked_directly(nomad, "llmgw-huge", args.requests // 8 // ROUNDS)
    parking = await park_while_waiting(activating, consul) if activating else None
    rates: dict[str, list[float]] = {name: [] for name in targets}
    failed: dict[str, dict[int, int]] = {name: {} for name in targets}
    for _ in range(ROUNDS):
        for name, url in targets.items():
            rate, other = await throughput(url + path, args.clients, args.seconds / ROUNDS)
            rates[name].append(rate)
            for status, n in other.items():
                failed[name][status] = failed[name].get(status, 0) + n
    rps = {name: statistics.mean(values) for name, values in rates.items()}
    moved = await failover(consul, targets["router"], stub2, stub2_port) if stub2 else None

    def ms(v: float) -> str:
        return f"{v * 1000:8.3f}"

    stub_p50, stub_p99 = statistics.median(lat["stub"]), pct(lat["stub"], 0.99)
    print(
        f"{'target':20} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'ttfb p50':>8} "
        f"{'req/s':>8} {'router/this':>11}"
    )
    for name in targets:
        p50, p99 = statistics.median(lat[name]), pct(lat[name], 0.99)
        label = f"litellm {litellm_version}" if name == "litellm" else name
        print(
            f"{label:20} {ms(p50)} {ms(p99)} {ms(p50 - stub_p50)} {ms(p99 - stub_p99)} "
            f"{ms(statistics.median(first[name]))} {rps[name]:8.0f} {rps['router'] / rps[name]:10.2f}x"
        )

    def added(name: str) -> tuple[float, float, float]:
        """What `name` adds over the stub: at the median, at p99, and to the median TTFB."""
        return (
            statistics.median(lat[name]) - stub_p50,
            pct(lat[name], 0.99) - stub_p99,
            statistics.median(first[name]) - statistics.median(first["stub"]),
        )

    added_p50, added_p99, ttfb_added = added("router")
    # The targets below are a quiet machine's; on this shared one (two cores, several test suites
    # at once) every process's time stretches with the load, the router's extra work per request
    # (the hang-up listener, the write deadlines, routing) more than a bare proxy's. So each also
    # passes within twice the floor measured beside it in the same rounds: the bare aiohttp
    # proxy for what a proxy adds, and a proxied answer's own p99 for a refusal (one hop less).
    floor_p50, floor_p99, floor_ttfb = added("proxy aiohttp")
    proxied_p99 = pct(lat["proxy aiohttp"], 0.99)

    def against(value: float, quiet: float, floor: float, floor_name: str) -> tuple[str, bool]:
        return (
            f"{value * 1000:.3f} ms (target {quiet * 1000:g} ms, or 2x {floor_name}'s {floor * 1000:.3f} ms)",
            value < quiet or value <= 2 * floor,
        )

    # Each round's router against the proxy measured just before it: the load drifts between rounds.
    ratio = statistics.median(r / p for r, p in zip(rates["router"], rates["proxy aiohttp"], strict=True))
    checks = [
        ("router added latency, median", *against(added_p50, 0.0005, floor_p50, "the bare proxy")),
        ("router added latency, p99", *against(added_p99, 0.002, floor_p99, "the bare proxy")),
        (f"req/s at {args.clients} clients vs bare aiohttp proxy", f"{ratio:.0%}", ratio >= 0.70),
        ("streaming TTFB added, median", *against(ttfb_added, 0.001, floor_ttfb, "the bare proxy")),
        (
            "refusal p99, parked",
            *against(pct(parked, 0.99), 0.005, proxied_p99, "a proxied answer"),
        ),
        (
            "refusal p99, unplaceable",
            *against(pct(unplaceable, 0.99), 0.005, proxied_p99, "a proxied answer"),
        ),
    ]
    if asked:
        # The ask's hops through Consul, the watcher's pass over that one model, and its scale
        # call and evaluation read on the stand-in; the same Nomad calls made directly beside it.
        median, p99 = statistics.median(asked), pct(asked, 0.99)
        checks.append(
            (
                f"fresh attempt refused, unplaceable, {args.fleet} models defined",
                f"median {median * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms (target {ASK_MEDIAN_S * 1000:g} / "
                f"{ASK_P99_S * 1000:g} ms; the Nomad calls made directly: median "
                f"{statistics.median(direct) * 1000:.1f} ms, p99 {pct(direct, 0.99) * 1000:.1f} ms)",
                median <= ASK_MEDIAN_S and p99 <= ASK_P99_S,
            )
        )
    if parking is not None:
        slowest = max(parking.answered_after_park)
        checks.append(
            (
                f"parked to answer, {WAITING_CLIENTS} waiting clients, slowest",
                f"{slowest * 1000:.1f} ms (median {statistics.median(parking.answered_after_park) * 1000:.1f} ms; "
                f"answers {parking.codes})",
                slowest < 1.0 and parking.codes == {"503 model_parked": WAITING_CLIENTS},
            )
        )
        # Against the parked refusal taking turns with it, not a fixed number of milliseconds: on
        # this shared machine the p99 of any request is the machine's (the bare stub's own p99
        # has been 8-10 ms under load). Anything the bound or the waiters cost each refusal (a
        # walk over them, say) would show at every request, so at the median; the tail only has
        # to stay in the parked refusal's class. Profiled, the refusal spends ~35 us in the
        # activator; the rest is the HTTP work any refusal does (docs/dev/benchmarks.md).
        over_p99, parked_p99 = pct(parking.overloaded, 0.99), pct(parking.parked, 0.99)
        over_p50, parked_p50 = statistics.median(parking.overloaded), statistics.median(parking.parked)
        checks.append(
            (
                f"refusal, overloaded, with {WAITING_CLIENTS} waiting, vs a parked refusal taking turns",
                f"p99 {over_p99 * 1000:.3f} vs {parked_p99 * 1000:.3f} ms, median {over_p50 * 1000:.3f} vs "
                f"{parked_p50 * 1000:.3f} ms (target p99 5 ms, or a median within 1.2x and a p99 within 2x)",
                over_p99 < 0.005 or (over_p50 <= 1.2 * parked_p50 and over_p99 <= 2 * parked_p99),
            )
        )
    if "litellm" in rps:
        vs = rps["router"] / rps["litellm"]
        checks.append(
            (f"req/s at {args.clients} clients vs LiteLLM {litellm_version}", f"{vs:.1f}x", vs >= 10)
        )
    if moved is not None:
        checks.append(
            (
                "critical replica's last new request, after its check was failed",
                # Negative: nothing reached it once the call to fail the check was sent.
                f"{moved.last_after_fail_s * 1000:+.1f} ms ({moved.before} requests reached it until Consul "
                f"acknowledged, {moved.after} after; {moved.errors} errors)",
                moved.before > 0 and moved.last_after_fail_s < 1.0 and moved.errors == 0,
            )
        )
    for name, other in failed.items():
        if other:
            print(f"  {name}: answers other than 200 under load (not counted): {other}")
    print()
    for what, value, ok in checks:
        print(f"{'ok  ' if ok else 'MISS'} {what}: {value}")
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
