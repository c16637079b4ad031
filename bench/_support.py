"""Small helpers the benchmarks share: starting the Nomad stand-in, reading a process's memory
and CPU from /proc, finding processes by their command line. psutil is not a dependency, and
/proc is all that is needed."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import ClientSession, ClientTimeout, web

from devstack import lifetime
from devstack.consul_agent import ConsulAgent
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
    data_dir: Path,
    fleet: Path = LARGE_FLEET,
    consul_url: str | None = None,
    python_args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m devstack.nomad` on a free port, logging to DATA_DIR/standin.log; returns the
    process and its URL once it answers. `python_args` go before `-m devstack.nomad` (a
    profiler: `("-m", "cProfile", "-o", PATH)`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, *python_args, "-m", "devstack.nomad", "--listen", f"127.0.0.1:{port}", "--nodes", str(fleet),
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


class CountingProxy:
    """A reverse proxy in front of Consul (and the stand-in) that counts what the process behind
    it asks: every request by upstream, method and path, and the answers, their bytes as they
    come off the wire (left compressed) and when the last one came in, by upstream and path.
    Runs its own event loop in a thread."""

    def __init__(self, upstreams: dict[str, str]) -> None:
        self.upstreams = upstreams
        self.ports = {name: free_port() for name in upstreams}
        self.calls: Counter[tuple[str, str, str, bool]] = Counter()
        # Answers and their bytes, by upstream and path: what a change costs to read.
        self.answers: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.answered: dict[tuple[str, str], float] = {}  # time.time() of the latest answer
        # Frames with events that came down an event stream, by upstream and topic(s).
        self.frames: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner: web.AppRunner | None = None

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(self) -> CountingProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise SystemExit("the counting proxy did not start")
        return self

    def snapshot(self) -> Counter[tuple[str, str, str, bool]]:
        with self.lock:
            return Counter(self.calls)

    def bytes_snapshot(self) -> Counter[tuple[str, str]]:
        with self.lock:
            return Counter(self.bytes)

    def frames_snapshot(self) -> Counter[tuple[str, str]]:
        with self.lock:
            return Counter(self.frames)

    def answers_of(self, name: str, path: str) -> tuple[int, int, float]:
        """(answers, bytes, time of the latest answer) for one upstream's path."""
        with self.lock:
            key = (name, path)
            return self.answers[key], self.bytes[key], self.answered.get(key, 0.0)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _close(self) -> None:
        # The session first: a blocking read still held upstream fails at once instead of
        # holding the runner's cleanup for its whole wait.
        await self.session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self._ready.set()
        self.loop.run_forever()

    async def _serve(self) -> None:
        # Blocking queries hold a request for up to their wait (and Nomad adds jitter).
        self.session = ClientSession(timeout=ClientTimeout(total=None), auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        for port in self.ports.values():
            site = web.TCPSite(self._runner, "127.0.0.1", port)
            await site.start()
        self._sites = {port: name for name, port in self.ports.items()}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
        name = self._sites.get(port, "")
        blocking = request.query.get("index", "0") not in ("", "0")
        with self.lock:
            self.calls[(name, request.method, request.path, blocking)] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        body = await request.read()
        try:
            async with self.session.request(
                request.method, self.upstreams[name] + request.path_qs, headers=headers, data=body or None
            ) as upstream:
                if request.path == "/v1/event/stream" and upstream.status == 200:
                    return await self._stream(request, upstream, name)
                data = await upstream.read()
                with self.lock:
                    self.answers[(name, request.path)] += 1
                    self.bytes[(name, request.path)] += len(data)
                    self.answered[(name, request.path)] = time.time()
                out = {
                    k: v
                    for k, v in upstream.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")
                }
                return web.Response(status=upstream.status, body=data, headers=out)
        except aiohttp.ClientError as exc:  # the upstream went away (at the end of the run)
            return web.Response(status=502, text=f"counting proxy: {exc}")

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, name: str
    ) -> web.StreamResponse:
        """An event stream, passed on as it comes: its bytes counted per chunk and its frames
        with events (not the `{}` heartbeats) per line, by the topics asked for."""
        key = (name, request.path)
        topics = ",".join(request.query.getall("topic", [])) or "*"
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        partial = b""
        try:
            async for chunk in upstream.content.iter_any():
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                with self.lock:
                    self.bytes[key] += len(chunk)
                    self.answered[key] = time.time()
                    self.frames[(name, topics)] += sum(
                        1 for line in lines if line.strip() not in (b"", b"{}")
                    )
                await response.write(chunk)
        except (aiohttp.ClientError, ConnectionResetError):
            pass  # either side went away
        return response


@dataclass(frozen=True)
class LlmgwStack:
    consul: str
    nomad: str
    router: str


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def llmgw_stack(data_dir: Path, fleet: Path) -> Iterator[LlmgwStack]:
    """A real Consul, the stand-in on `fleet`, and `llmgw watcher` and `llmgw router` as
    processes with their defaults (logs in DATA_DIR), all ended on leaving; yields their URLs
    once the router answers."""
    agent = ConsulAgent(die_with_parent=True).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        standin, nomad = start_standin(data_dir, fleet, agent.url)
        procs.append(standin)
        env = {**os.environ, "CONSUL_HTTP_ADDR": agent.url, "NOMAD_ADDR": nomad}
        admin, router_port = free_port(), free_port()
        for name, argv in (
            ("watcher", ["watcher", "--listen", f"127.0.0.1:{admin}"]),
            ("router", ["router", "--listen", f"127.0.0.1:{router_port}"]),
        ):
            log = (data_dir / f"{name}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "nomad_driver.cli", *argv],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=lifetime.die_with_parent,
                )
            )
        router = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 30
        while not _answers(f"{router}/healthz"):
            if time.monotonic() > deadline:
                raise SystemExit(f"the router did not answer within 30s; see {data_dir / 'router.log'}")
            time.sleep(0.2)
        yield LlmgwStack(agent.url, nomad, router)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        agent.stop()
