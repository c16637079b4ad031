"""How much the router adds, measured side by side in one run on this machine.

    .venv/bin/python bench/router_bench.py [--requests 2000] [--seconds 8] [--clients 64]

Three servers in front of one fixed-answer stub engine (raw ASGI under uvicorn): nothing (the
stub itself), a bare Starlette + aiohttp-client proxy (the floor for a Python proxy), and the
llmgw router (`llmgw router`, discovering the stub through a real Consul dev agent). Each gets
the same load from this process: one keep-alive client for latency, `--clients` concurrent
clients for throughput, streamed requests for time to first byte, and requests for a parked
model for the refusal path. Everything shares the machine's cores, so only the ratios within
one run mean anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from devstack.consul_agent import ConsulAgent  # noqa: E402
from devstack.ports import free_port  # noqa: E402

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

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
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
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
HEADERS = {"Content-Type": "application/json"}
MODELS = """
profiles:
  p: {engine: llama-cpp-python, engine_version: "0.3.36", gpus: 0}
models:
  bench: {source: "file:///bench.gguf", profile: p}
  parked: {source: "file:///parked.gguf", profile: p}
"""


# -- the servers ------------------------------------------------------------------------------


async def stub_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/v1/models":
        payload = b'{"object":"list","data":[]}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        return
    if b'"stream": true' in body:
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


def baseline_app(upstream: str) -> Any:
    """The floor: Starlette in, aiohttp out, no parsing, no choice of replica."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    session: dict[str, aiohttp.ClientSession] = {}

    async def proxy(request: Request) -> Response:
        body = await request.body()
        resp = await session["s"].post(upstream + request.url.path, data=body, headers=HEADERS)
        if resp.content_length is None:

            async def chunks() -> Any:
                async for chunk in resp.content.iter_any():
                    yield chunk
                resp.release()

            return StreamingResponse(chunks(), status_code=resp.status, media_type=resp.content_type)
        data = await resp.read()
        resp.release()
        return Response(data, status_code=resp.status, media_type=resp.content_type)

    async def lifespan(app: Any) -> Any:
        session["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        yield
        await session["s"].close()

    return Starlette(routes=[Route("/v1/chat/completions", proxy, methods=["POST"])], lifespan=lifespan)


def serve(kind: str, port: int, upstream: str) -> None:
    import uvicorn

    app = stub_app if kind == "stub" else baseline_app(upstream)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- the load -----------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency(url: str, body: bytes, n: int, warmup: int = 50, expect: int = 200) -> list[float]:
    timings: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for i in range(n + warmup):
            started = time.perf_counter()
            async with session.post(url, data=body, headers=HEADERS) as resp:
                await resp.read()
                assert resp.status == expect, (url, resp.status, await resp.text())
            if i >= warmup:
                timings.append(time.perf_counter() - started)
    return timings


async def ttfb(url: str, n: int, warmup: int = 50) -> list[float]:
    timings: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for i in range(n + warmup):
            started = time.perf_counter()
            async with session.post(url, data=STREAM_REQUEST, headers=HEADERS) as resp:
                first = await resp.content.readany()
                took = time.perf_counter() - started
                assert resp.status == 200 and first
                await resp.read()
            if i >= warmup:
                timings.append(took)
    return timings


async def throughput(url: str, clients: int, seconds: float) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            async with session.post(url, data=REQUEST, headers=HEADERS) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
        # Warm the connections first.
        await asyncio.gather(*(session.post(url, data=REQUEST, headers=HEADERS) for _ in range(clients)))
        started = time.perf_counter()
        stop_at = started + seconds
        await asyncio.gather(*(worker(session) for _ in range(clients)))
        return done / (time.perf_counter() - started)


# -- the run ------------------------------------------------------------------------------------


def run_loop(coro: Any) -> int:
    # The load generator gets the fastest loop available too, so that its own overhead does
    # not swamp the differences it measures; uvicorn picks uvloop for the servers the same way.
    try:
        import uvloop
    except ImportError:
        return int(asyncio.run(coro))
    return int(uvloop.run(coro))


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--serve", choices=["stub", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.upstream)
        return 0

    procs: list[subprocess.Popen[bytes]] = []
    agent = ConsulAgent().start()
    try:
        stub_port, base_port, router_port = free_port(), free_port(), free_port()
        me = [sys.executable, str(Path(__file__).resolve())]
        procs.append(start([*me, "--serve", "stub", "--port", str(stub_port)]))
        stub = f"http://127.0.0.1:{stub_port}"
        wait_http(f"{stub}/v1/models")
        procs.append(start([*me, "--serve", "baseline", "--port", str(base_port), "--upstream", stub]))
        httpx.put(
            f"{agent.url}/v1/agent/service/register",
            json={
                "Name": "llmgw-engine",
                "ID": "bench-1",
                "Address": "127.0.0.1",
                "Port": stub_port,
                "Tags": ["model=bench"],
                "Meta": {"model": "bench", "def_hash": "b"},
                "Check": {"HTTP": f"{stub}/v1/models", "Interval": "5s", "Status": "passing"},
            },
        ).raise_for_status()
        httpx.put(f"{agent.url}/v1/kv/llmgw/config/models", content=MODELS).raise_for_status()
        httpx.put(f"{agent.url}/v1/kv/llmgw/state/parked", json={"parked": True, "last_error": "bench"})
        procs.append(
            start(
                [
                    sys.executable,
                    "-c",
                    "from nomad_driver.cli import main; main()",
                    "router",
                    "--no-activation",
                    "--listen",
                    f"127.0.0.1:{router_port}",
                    "--log-level",
                    "warning",
                ],
                env={"CONSUL_HTTP_ADDR": agent.url},
            )
        )
        router = f"http://127.0.0.1:{router_port}"
        wait_http(f"{router}/healthz", ok=lambda r: r.status_code == 200 and r.json()["ready_replicas"] == 1)
        wait_http(f"http://127.0.0.1:{base_port}/", ok=lambda r: r.status_code == 404)
        return run_loop(measure(stub, f"http://127.0.0.1:{base_port}", router, args))
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        agent.stop()


async def measure(stub: str, baseline: str, router: str, args: argparse.Namespace) -> int:
    path = "/v1/chat/completions"
    lat = {
        name: await latency(url + path, REQUEST, args.requests)
        for name, url in (("stub", stub), ("baseline", baseline), ("router", router))
    }
    first = {
        name: await ttfb(url + path, args.requests // 4)
        for name, url in (("stub", stub), ("baseline", baseline), ("router", router))
    }
    refusal = await latency(router + path, PARKED_REQUEST, args.requests // 4, expect=503)
    rps = {
        name: await throughput(url + path, args.clients, args.seconds)
        for name, url in (("stub", stub), ("baseline", baseline), ("router", router))
    }

    def ms(v: float) -> str:
        return f"{v * 1000:7.3f}"

    print(f"{'target':10} {'p50 ms':>8} {'p99 ms':>8} {'ttfb p50':>9} {'req/s':>9}")
    for name in ("stub", "baseline", "router"):
        print(
            f"{name:10} {ms(statistics.median(lat[name]))} {ms(pct(lat[name], 0.99))} "
            f"{ms(statistics.median(first[name])):>9} {rps[name]:9.0f}"
        )
    added_p50 = statistics.median(lat["router"]) - statistics.median(lat["stub"])
    added_p99 = pct(lat["router"], 0.99) - pct(lat["stub"], 0.99)
    base_p50 = statistics.median(lat["baseline"]) - statistics.median(lat["stub"])
    ttfb_added = statistics.median(first["router"]) - statistics.median(first["stub"])
    ratio = rps["router"] / rps["baseline"]
    refusal_p99 = pct(refusal, 0.99)
    checks = [
        (
            "router added latency, median",
            f"{added_p50 * 1000:.3f} ms (baseline proxy {base_p50 * 1000:.3f} ms)",
            added_p50 < 0.0005,
        ),
        ("router added latency, p99", f"{added_p99 * 1000:.3f} ms", added_p99 < 0.002),
        (f"req/s at {args.clients} clients vs baseline proxy", f"{ratio:.0%}", ratio >= 0.70),
        ("streaming TTFB added, median", f"{ttfb_added * 1000:.3f} ms", ttfb_added < 0.001),
        ("refusal p99", f"{refusal_p99 * 1000:.3f} ms", refusal_p99 < 0.005),
    ]
    print()
    for what, value, ok in checks:
        print(f"{'ok  ' if ok else 'MISS'} {what}: {value}")
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
