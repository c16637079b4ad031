"""Soak under faults: steady OpenAI traffic through the router while parts of the stack fail.

    .venv/bin/python bench/soak.py [--seconds-per-phase 20] [--clients 4] [--timeout 30]
        [--idle-timeout 15] [--phases a,b,...] [--state-dir DIR]

Brings up the dev stack in this process (`devstack.stack.Stack`, as `python -m devstack up
--tiny` does: a Consul dev agent, the Nomad stand-in on devstack/nodes/small.yaml, two watchers
and a router as Nomad jobs) with its own models file: `soak-main` (three replicas of a tiny
generated GGUF served by llama-cpp-python), `soak-on-demand` (min 0, short idle timeout) and
`kev-0.5b` (parked after five failed starts, so there is parked state to lose). Then, phase by
phase, `--clients` clients using the `openai` SDK send small chat completions (max_tokens 8,
every other one streamed) to `soak-main`, while one fault is injected:

- baseline: nothing;
- replica-killed: SIGKILL of one soak-main engine process;
- replica-check-fails: SIGSTOP of one engine for 10 s (its check times out), then SIGCONT;
- scale-to-zero: soak-on-demand is activated by a request, left idle until the watcher scales
  it to zero, then activated again by a request;
- watcher-killed: SIGKILL of the leading watcher; the other must take over;
- consul-restart: the stack's Consul dev agent is restarted on the same ports (it comes back
  empty: no KV, sessions or services); once the watchers have rebuilt the state, one request
  each to kev-0.5b (must be refused as parked) and soak-on-demand (must be served).

Every request has a hard client-side timeout; one that runs past it is *hung*, never waited
on. A failure is *clear* when it is an HTTP error with an OpenAI error body or an SSE error
event; anything else (a reset connection, a stream cut without a finish) is *unclear*. After
each phase the soak waits (bounded) for the stack to recover, then compares `llmgw/state/*`,
`llmgw/config/models` and the admin API's parked flags and failure counts with what they were
before the fault: anything missing or reverted is *state lost*. Exits 1 if any request hung or
any state was lost. Loopback only; every wait has a limit (a run takes about 3.5 minutes
after a minute of start-up here).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._support import arg_after, descends_from, processes, rss_mb  # noqa: E402
from devstack import services  # noqa: E402
from devstack.stack import Stack, UpOptions  # noqa: E402

MAIN = "soak-main"
ON_DEMAND = "soak-on-demand"
PARKED = "kev-0.5b"
REPLICAS = 3

# The router answers a model with no ready replica within its activation window (503
# model_loading then); a short window keeps that answer inside the client's timeout, so a
# request that outlives the timeout is a real hang and not the router waiting as configured.
TEMPLATE = """\
profiles:
  small-gguf:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 1
    gpu_memory_mib: 2000
    cpu_mhz: 500
    memory_mib: 1024
    context: 512
    chat_format: gemma{args}
models:
  soak-main:
    source: file:///DEVSTACK_MODELS/gemma-3-270m-q4_k_m.gguf
    profile: small-gguf
    replicas: {{min: {replicas}, max: {replicas}}}
    activation_timeout: 20s
  soak-on-demand:
    source: file:///DEVSTACK_MODELS/gemma-3-270m-q4_k_m.gguf
    profile: small-gguf
    replicas: {{min: 0, max: 1}}
    idle_timeout: {idle}s
    activation_timeout: 90s
  kev-0.5b:
    source: file:///DEVSTACK_MODELS/kev-0.5b.gguf
    profile: small-gguf
    replicas: {{min: 1, max: 1}}
"""


def say(text: str) -> None:
    print(f"soak {time.strftime('%H:%M:%S')}: {text}", flush=True)


# ----- load ---------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    clear: int = 0
    unclear: int = 0
    hung: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, outcome: str, detail: str) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if detail:
            self.errors[f"{outcome}: {detail}"] += 1


async def one_request(
    client: openai.AsyncOpenAI, model: str, stream: bool, timeout: float
) -> tuple[str, str]:
    """(outcome, detail): outcome is ok, clear, unclear or hung."""
    messages: Any = [{"role": "user", "content": "Say hello."}]
    try:
        async with asyncio.timeout(timeout):
            if stream:
                chunks = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=8, stream=True
                )
                finish = None
                async for chunk in chunks:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if finish is None:
                    return "unclear", "stream ended without a finish_reason"
            else:
                answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=8)
                if not answer.choices:
                    return "unclear", "answer without choices"
        return "ok", ""
    except TimeoutError:
        return "hung", f"no answer within {timeout:.0f}s"
    except openai.APITimeoutError:
        return "hung", "the SDK's own timeout"
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        code = body.get("code") or body.get("type") or ""
        if body.get("message"):
            return "clear", f"HTTP {exc.status_code} {code}"
        return "unclear", f"HTTP {exc.status_code} without an OpenAI error body"
    except openai.APIConnectionError as exc:
        return "unclear", f"connection: {exc.__cause__!r}"[:120]
    except openai.APIError as exc:
        # An SSE error event in a stream that had started.
        body = exc.body if isinstance(exc.body, dict) else {}
        if body.get("message"):
            return "clear", f"SSE error {body.get('code') or ''}"
        return "unclear", f"stream error without a message: {exc}"[:120]
    except Exception as exc:  # anything else is exactly what the soak is looking for
        return "unclear", f"{type(exc).__name__}: {exc}"[:120]


class Load:
    """`clients` loops sending to soak-main; each result counts in the phase it was sent in."""

    def __init__(self, router: str, clients: int, timeout: float) -> None:
        # The SDK's own timeout sits above ours, so the hard limit is always this one.
        self.client = openai.AsyncOpenAI(
            base_url=f"{router}/v1", api_key="soak", max_retries=0, timeout=timeout + 10
        )
        self.clients = clients
        self.timeout = timeout

    async def run(self, tally: Tally, stop: asyncio.Event) -> None:
        async def loop(i: int) -> None:
            n = 0
            while not stop.is_set():
                tally.sent += 1
                outcome, detail = await one_request(self.client, MAIN, (n + i) % 2 == 0, self.timeout)
                tally.add(outcome, detail)
                n += 1
                if outcome != "ok":
                    await asyncio.sleep(0.5)  # a refusal comes back at once; do not spin on it

        await asyncio.gather(*(loop(i) for i in range(self.clients)))


# ----- the stack ----------------------------------------------------------------------------


def kv_tree(consul: str) -> dict[str, bytes]:
    try:
        resp = httpx.get(f"{consul}/v1/kv/llmgw/", params={"recurse": "true"}, timeout=5)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    return {e["Key"]: base64.b64decode(e["Value"] or "") for e in resp.json()}


def admin_models(url: str) -> dict[str, dict[str, Any]]:
    try:
        body = httpx.get(f"{url}/v1/admin/models", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return {str(m.get("model")): m for m in body.get("models", []) if isinstance(m, dict)}


class World:
    """What the soak needs to find in the running stack: watchers, leader, engines, PIDs."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.watcher_urls: set[str] = set(stack.addr.watchers)

    @property
    def consul(self) -> str:
        return self.stack.addr.consul

    def ours(self, pid: int | None) -> bool:
        """Run by this stack's Nomad: other stacks' services can land in this Consul (a
        stand-in whose own Consul died keeps re-registering at that address)."""
        nomad = self.stack.nomad_proc
        return pid is not None and nomad is not None and descends_from(pid, nomad.pid)

    def watchers(self) -> list[str]:
        pids = self.pids("watcher")
        for url in services.passing_instances(self.consul, services.WATCHER_JOB):
            if self.ours(pids.get(url)):
                self.watcher_urls.add(url)
        return sorted(self.watcher_urls)

    def leader(self) -> str:
        for url in self.watchers():
            try:
                if httpx.get(f"{url}/healthz", timeout=2).json().get("leader"):
                    return url
            except (httpx.HTTPError, ValueError):
                continue
        return ""

    def models(self) -> dict[str, dict[str, Any]]:
        leader = self.leader()
        return admin_models(leader) if leader else {}

    def pids(self, verb: str) -> dict[str, int]:
        """`llmgw <verb> --listen ADDR` processes: {http://ADDR: pid}."""
        out = {}
        for pid, argv in processes():
            # `bin/llmgw` is a script: argv is [python, .../bin/llmgw, verb, ...].
            at = next((i for i, a in enumerate(argv[:2]) if a.endswith("/llmgw")), -1)
            if at >= 0 and len(argv) > at + 1 and argv[at + 1] == verb:
                out[f"http://{arg_after(argv, '--listen')}"] = pid
        return out

    def engines(self, model: str) -> list[tuple[int, int]]:
        """(pid, port) of the model's engine processes whose service Consul knows."""
        try:
            entries = httpx.get(f"{self.consul}/v1/health/service/llmgw-engine", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            entries = []
        ports = {
            int(e["Service"]["Port"])
            for e in entries
            if (e["Service"].get("Meta") or {}).get("model") == model
        }
        found = []
        for pid, argv in processes():
            if "llama_cpp.server" in argv:
                port = arg_after(argv, "--port")
                if port.isdigit() and int(port) in ports:
                    found.append((pid, int(port)))
        return sorted(found)

    def rss(self) -> dict[str, float]:
        """Resident MiB of this stack's router and watchers, by listening port."""
        out = {}
        for verb in ("router", "watcher"):
            for url, pid in self.pids(verb).items():
                if self.ours(pid):
                    out[f"{verb} :{url.rsplit(':', 1)[1]}"] = rss_mb(pid)
        return out


@dataclass
class State:
    definitions: bytes | None
    states: dict[str, dict[str, Any]]
    admin: dict[str, dict[str, Any]]


def read_state(world: World) -> State:
    kv = kv_tree(world.consul)
    states = {}
    for key, value in kv.items():
        if key.startswith("llmgw/state/"):
            try:
                states[key.removeprefix("llmgw/state/")] = json.loads(value)
            except ValueError:
                states[key.removeprefix("llmgw/state/")] = {"malformed": value[:80].decode(errors="replace")}
    return State(kv.get("llmgw/config/models"), states, world.models())


def lost(before: State, after: State) -> list[str]:
    """What the fault took away and the stack did not restore."""
    problems = []
    if before.definitions is not None and after.definitions != before.definitions:
        problems.append("llmgw/config/models " + ("missing" if after.definitions is None else "changed"))
    for model, old in before.states.items():
        new = after.states.get(model)
        if new is None:
            problems.append(f"llmgw/state/{model} missing")
            continue
        if old.get("parked") and not new.get("parked"):
            problems.append(f"{model}: no longer parked in KV")
        if old.get("parked") and new.get("consecutive_failures", 0) < old.get("consecutive_failures", 0):
            problems.append(
                f"{model}: failures {old.get('consecutive_failures')} -> {new.get('consecutive_failures')}"
            )
        if old.get("parked") and old.get("last_error") and not new.get("last_error"):
            problems.append(f"{model}: last_error lost")
    for model, old in before.admin.items():
        new = after.admin.get(model)
        if new is None:
            problems.append(f"admin API: {model} missing" if after.admin else "admin API: no leader answers")
            continue
        if old.get("parked") != new.get("parked"):
            problems.append(f"admin API: {model} parked {old.get('parked')} -> {new.get('parked')}")
        if old.get("parked") and new.get("consecutive_failures", 0) < old.get("consecutive_failures", 0):
            problems.append(f"admin API: {model} failures went down while parked")
    return problems


# ----- phases -------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    name: str
    fault: str = ""
    tally: Tally = field(default_factory=Tally)
    lost: list[str] = field(default_factory=list)
    dip: str = ""
    rss_before: dict[str, float] = field(default_factory=dict)
    rss_after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


Fault = Callable[[World, PhaseResult, Tally, "Soak"], Awaitable[None]]


async def no_fault(world: World, result: PhaseResult, tally: Tally, soak: Soak) -> None:
    result.fault = "none"


async def kill_replica(world: World, result: PhaseResult, tally: Tally, soak: Soak) -> None:
    engines = world.engines(MAIN)
    if not engines:
        result.fault = "no soak-main engine found to kill"
        return
    pid, port = engines[0]
    os.kill(pid, signal.SIGKILL)
    result.fault = f"SIGKILL engine pid {pid} (port {port}) of {len(engines)}"


async def stop_replica(world: World, result: PhaseResult, tally: Tally, soak: Soak) -> None:
    engines = world.engines(MAIN)
    if not engines:
        result.fault = "no soak-main engine found to stop"
        return
    pid, port = engines[-1]
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(10)
        critical = [
            e
            for e in httpx.get(f"{world.consul}/v1/health/service/llmgw-engine", timeout=5).json()
            if e["Service"]["Port"] == port and any(c["Status"] != "passing" for c in e["Checks"])
        ]
    finally:
        os.kill(pid, signal.SIGCONT)
    seen = "check critical in Consul" if critical else "check NOT seen failing"
    result.fault = f"SIGSTOP engine pid {pid} (port {port}) 10 s, then SIGCONT ({seen})"


async def restart_consul(world: World, result: PhaseResult, tally: Tally, soak: Soak) -> None:
    consul = world.stack.consul
    assert consul is not None
    started = time.monotonic()
    await asyncio.to_thread(consul.restart)
    result.fault = f"Consul dev agent restarted on {consul.url} (empty) in {time.monotonic() - started:.1f} s"
    # What a client of a model without a ready replica is told once the watchers have rebuilt
    # the state (the activation and refusal paths need the definitions, not only the catalog).
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline and f"llmgw/state/{PARKED}" not in await asyncio.to_thread(
        kv_tree, world.consul
    ):
        await asyncio.sleep(1)
    for model, expected in ((PARKED, "HTTP 503 model_parked"), (ON_DEMAND, "ok")):
        tally.sent += 1
        outcome, detail = await one_request(soak.load.client, model, False, 120.0)
        tally.add(outcome, detail)
        got = detail or outcome
        result.fault += f"; then {model} -> {got}"
        if got != expected:
            result.fault += f" (expected {expected})"


async def kill_leader(world: World, result: PhaseResult, tally: Tally, soak: Soak) -> None:
    leader = world.leader()
    pid = world.pids("watcher").get(leader)
    if not leader or pid is None:
        result.fault = f"no leading watcher process found (leader {leader or 'none'})"
        return
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    result.fault = f"SIGKILL leading watcher {leader} (pid {pid})"
    deadline = killed + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        new = await asyncio.to_thread(world.leader)
        if new and new != leader:
            result.fault += f"; {new} led {time.monotonic() - killed:.1f} s later"
            return
    result.fault += "; no other watcher led within 60 s"


async def scale_to_zero_and_back(world: World, result: PhaseResult, tally: Tally, soak: Soak) -> None:
    notes = []
    timeout = 120.0  # the activation window (90 s) plus a margin; past it the request hung

    async def activate(what: str) -> bool:
        started = time.monotonic()
        tally.sent += 1
        outcome, detail = await one_request(soak.load.client, ON_DEMAND, False, timeout)
        tally.add(outcome, detail)
        notes.append(f"{what}: {outcome} in {time.monotonic() - started:.1f} s")
        return outcome == "ok"

    if not await activate("activation from 0"):
        result.fault = "; ".join(notes)
        return
    started = time.monotonic()
    deadline = started + soak.idle_timeout + 90
    while time.monotonic() < deadline:
        await asyncio.sleep(1)
        m = (await asyncio.to_thread(world.models)).get(ON_DEMAND, {})
        if m.get("desired") == 0 and m.get("ready") == 0:
            notes.append(f"scaled to zero {time.monotonic() - started:.0f} s after its last request")
            break
    else:
        notes.append(f"NOT scaled to zero within {soak.idle_timeout + 90:.0f} s")
    await activate("activation back")
    result.fault = "; ".join(notes)


# Consul's restart comes last: a dev agent comes back without `llmgw/config/models`, and what
# that does to the phases after it would hide what they measure.
PHASES: list[tuple[str, Fault]] = [
    ("baseline", no_fault),
    ("replica-killed", kill_replica),
    ("replica-check-fails", stop_replica),
    ("scale-to-zero", scale_to_zero_and_back),
    ("watcher-killed", kill_leader),
    ("consul-restart", restart_consul),
]


class Soak:
    def __init__(self, world: World, args: argparse.Namespace) -> None:
        self.world = world
        self.load = Load(world.stack.addr.router, args.clients, args.timeout)
        self.seconds = args.seconds_per_phase
        self.recovery = args.recovery
        self.idle_timeout = float(args.idle_timeout)

    def recovered(self, before: State) -> tuple[bool, list[str]]:
        after = read_state(self.world)
        problems = lost(before, after)
        ready = after.admin.get(MAIN, {}).get("ready", 0)
        if ready < REPLICAS:
            problems.append(f"{MAIN} has {ready} of {REPLICAS} replicas ready")
        return not problems, problems

    async def watch_replicas(self, result: PhaseResult, since: float, stop: asyncio.Event) -> None:
        """How far soak-main's ready replicas fell after the fault, and when they were back."""
        lowest, back = REPLICAS, 0.0
        while not stop.is_set():
            ready = (await asyncio.to_thread(self.world.models)).get(MAIN, {}).get("ready")
            if isinstance(ready, int):
                if ready < lowest:
                    lowest, back = ready, 0.0
                elif lowest < REPLICAS and ready >= REPLICAS and not back:
                    back = time.monotonic() - since
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        if lowest == REPLICAS:
            result.dip = "no dip"
        else:
            result.dip = f"{lowest}/{REPLICAS}, " + (f"back {back:.0f} s" if back else "not back")

    async def phase(self, name: str, fault: Fault) -> PhaseResult:
        result = PhaseResult(name)
        before = await asyncio.to_thread(read_state, self.world)
        result.rss_before = self.world.rss()
        say(f"phase {name}: load for {self.seconds:.0f} s, fault after 2 s")
        stop, watching = asyncio.Event(), asyncio.Event()
        started = time.monotonic()
        load = asyncio.create_task(self.load.run(result.tally, stop))
        await asyncio.sleep(2)
        fault_at = time.monotonic()
        monitor = asyncio.create_task(self.watch_replicas(result, fault_at, watching))
        await fault(self.world, result, result.tally, self)
        await asyncio.sleep(max(0.0, started + self.seconds - time.monotonic()))
        stop.set()
        await load
        result.seconds = time.monotonic() - started
        say(f"phase {name}: {result.fault}; waiting for recovery (at most {self.recovery:.0f} s)")
        deadline = time.monotonic() + self.recovery
        problems: list[str] = []
        while True:
            ok, problems = await asyncio.to_thread(self.recovered, before)
            if ok:
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        watching.set()
        await monitor
        # Replicas short after the deadline are slow, not lost; lost state is what counts here.
        result.lost = [p for p in problems if "replicas ready" not in p]
        if problems and not result.lost:
            result.fault += f"; not recovered: {'; '.join(problems)}"
        result.rss_after = self.world.rss()
        t = result.tally
        say(
            f"phase {name}: sent {t.sent}, ok {t.ok}, clear {t.clear}, unclear {t.unclear}, hung {t.hung}, "
            f"replicas {result.dip}, lost {result.lost or 'none'}"
        )
        return result


async def wait_ready(world: World, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    shown = ""
    while time.monotonic() < deadline:
        models = world.models()
        main, od, kev = (models.get(m, {}) for m in (MAIN, ON_DEMAND, PARKED))
        line = (
            f"{MAIN} ready {main.get('ready', 0)}/{REPLICAS}, {ON_DEMAND} {od.get('state', '?')}, "
            f"{PARKED} {'parked' if kev.get('parked') else kev.get('state', '?')}"
        )
        if line != shown:
            say(line)
            shown = line
        if main.get("ready", 0) >= REPLICAS and kev.get("parked") and od.get("state") == "idle":
            return
        await asyncio.sleep(1)
    raise SystemExit(f"the soak's models were not ready within {timeout:.0f}s: {shown}")


def rss_text(rss: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(rss.items())) or "-"


def report(results: list[PhaseResult], args: argparse.Namespace) -> int:
    print()
    print(
        f"Soak under faults: {args.clients} clients, {args.seconds_per_phase:.0f} s per phase, "
        f"client timeout {args.timeout:.0f} s, {os.cpu_count()} CPUs"
    )
    head = (
        f"{'phase':<20} {'sent':>5} {'ok':>5} {'clear':>6} {'unclear':>8} {'hung':>5} {'lost':>5}  "
        "soak-main ready after the fault"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        t = r.tally
        print(
            f"{r.name:<20} {t.sent:>5} {t.ok:>5} {t.clear:>6} {t.unclear:>8} {t.hung:>5} "
            f"{len(r.lost):>5}  {r.dip}"
        )
    print()
    for r in results:
        print(f"{r.name}: {r.fault}")
        for what, n in r.tally.errors.most_common(4):
            print(f"    {n:>4} x {what}")
        for problem in r.lost:
            print(f"    STATE LOST: {problem}")
        print(f"    RSS MB before: {rss_text(r.rss_before)}")
        print(f"    RSS MB after:  {rss_text(r.rss_after)}")
    hung = sum(r.tally.hung for r in results)
    lost_n = sum(len(r.lost) for r in results)
    unclear = sum(r.tally.unclear for r in results)
    print()
    print(f"{'FAIL' if hung else 'ok  '} hung requests: {hung} (must be 0)")
    print(f"{'FAIL' if lost_n else 'ok  '} state lost: {lost_n} (must be 0)")
    print(f"{'note' if unclear else 'ok  '} failures without a clear error: {unclear}")
    return 1 if hung or lost_n else 0


async def run(stack: Stack, args: argparse.Namespace) -> int:
    world = World(stack)
    await wait_ready(world, args.ready_timeout)
    soak = Soak(world, args)
    results = []
    wanted = set(args.phases.split(",")) if args.phases else None
    for name, fault in PHASES:
        if wanted is None or name in wanted:
            results.append(await soak.phase(name, fault))
    await soak.load.client.close()
    return report(results, args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds-per-phase", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=30.0, help="hard client-side timeout per request")
    ap.add_argument("--recovery", type=float, default=60.0, help="seconds to wait for recovery after a phase")
    ap.add_argument("--idle-timeout", type=int, default=15, help="soak-on-demand's idle_timeout in seconds")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument(
        "--phases", default="", help="comma-separated subset of: " + ",".join(n for n, _ in PHASES)
    )
    ap.add_argument("--state-dir", type=Path, default=None, help="keep the stack's files and logs here")
    args = ap.parse_args()

    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="llmgw-soak-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    template = state_dir / "soak-models.yaml"
    template.write_text(TEMPLATE.format(replicas=REPLICAS, idle=args.idle_timeout, args=""))
    stack = Stack(UpOptions(state_dir=state_dir, tiny=True, template=template, tour=False), say=say)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    code = 1
    try:
        stack.up()
        code = asyncio.run(run(stack, args))
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say(f"stopping the stack (files and logs in {state_dir})")
        stack.down()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
