"""Prefix affinity against least-outstanding and round robin, on real llama.cpp engines.

Three `llama-server` replicas of one model behind the router, one routing policy at a time
(fresh engines for each, so no policy inherits another's caches), the same workload each time:
multi-turn conversations that share a few long system prompts, one of them hot (a skewed mix).
What is compared is what the engines report themselves: prompt tokens they had to process
(`timings.prompt_n`, the part of the prompt not found in their cache), time to first token,
completions per second, and how the requests spread over the replicas.

    python bench/affinity_bench.py [--conversations 24] [--turns 4] [--concurrency 6]

Exits 1 when a target of the issue is missed: affinity processes at most half the prompt tokens
of round robin, with a median TTFT at least 1.5x lower; no replica above 1.5x the mean load; p99
TTFT within 1.2x of least-outstanding's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import uvicorn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from devstack.consul_agent import ConsulAgent  # noqa: E402
from devstack.gguf_tiny import write_tiny_gguf  # noqa: E402
from devstack.llama_cpp import start_llama_cpp_server  # noqa: E402
from devstack.llama_engine import LlamaServer  # noqa: E402
from devstack.ports import free_port  # noqa: E402
from router.app import RouterApp  # noqa: E402
from router.config import ConsulSettings, RouterConfig  # noqa: E402
from router.server import uvicorn_config  # noqa: E402

MODEL = "bench"
POLICIES = ("affinity", "least-outstanding", "round-robin")
REPLICAS = 3
# Four slots of 8192 tokens each per engine: room for a few conversations side by side, as a
# real engine has, so a cache miss is the router's doing, not a slot's.
SLOTS = 4
CONTEXT = SLOTS * 8192
ANSWER_TOKENS = 8
# The tiny model's vocabulary is bytes; banning end-of-text (2) makes every answer exactly
# ANSWER_TOKENS long, so a replica's predicted tokens count its requests.
NO_EOS = {"2": -100}
# The share of conversations opening with each system prompt: one hot prefix, two cooler ones.
SYSTEM_MIX = (0.6, 0.3, 0.1)


def system_prompt(index: int) -> str:
    rng = random.Random(index)
    words = ["policy", "replica", "answer", "cluster", "token", "fabric", "model", "engine", "cache"]
    return f"You are assistant number {index}. " + " ".join(rng.choice(words) for _ in range(120))


def document(name: str) -> str:
    """What a conversation is about (a pasted file, a retrieved passage): its own long prefix
    after the shared system prompt, which only the replica that saw it has cached."""
    rng = random.Random(f"doc-{name}")
    return f"Here is {name}'s document. " + " ".join(str(rng.randrange(10**6)) for _ in range(280))


@dataclass
class Result:
    policy: str
    processed: int = 0
    cached: int = 0
    ttft: list[float] = field(default_factory=list)
    seconds: float = 0.0
    per_replica: list[int] = field(default_factory=list)
    failures: int = 0
    # Turns served by another replica than the conversation's previous turn.
    moved: int = 0

    @property
    def requests(self) -> int:
        return len(self.ttft)

    def p(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def spread(self) -> float:
        mean = statistics.mean(self.per_replica)
        return max(self.per_replica) / mean if mean else 0.0


def register(consul_url: str, engine: LlamaServer, index: int) -> None:
    httpx.put(
        f"{consul_url}/v1/agent/service/register",
        json={
            "Name": "llmgw-engine",
            "ID": f"{MODEL}-{index}",
            "Address": "127.0.0.1",
            "Port": engine.port,
            "Tags": [f"model={MODEL}"],
            "Meta": {"model": MODEL, "def_hash": "b"},
            "Check": {"HTTP": f"{engine.url}/health", "Interval": "5s", "Status": "passing"},
        },
    ).raise_for_status()


def predicted_tokens(engine: LlamaServer) -> int:
    for line in httpx.get(f"{engine.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return int(float(line.split()[1]))
    raise SystemExit(f"no llamacpp:tokens_predicted_total in {engine.url}/metrics")


class Router:
    def __init__(self, consul_url: str, policy: str) -> None:
        port = free_port()
        config = replace(
            RouterConfig(port=port, consul=ConsulSettings(addr=consul_url, wait_s=10.0)), policy=policy
        )
        self.app = RouterApp(config, activation=False)
        self.server = uvicorn.Server(uvicorn_config(self.app, config, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while len(self.app.discovery.snapshot.ready.get(MODEL, ())) < REPLICAS:
            if time.monotonic() > deadline:
                raise SystemExit("the router did not see every replica within 30 s")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


async def converse(
    client: httpx.AsyncClient, url: str, system: str, name: str, turns: int, result: Result
) -> None:
    messages = [{"role": "system", "content": system}]
    rng = random.Random(name)
    previous = ""
    for turn in range(turns):
        question = f"{name} asks question {turn}: " + " ".join(str(rng.randrange(10**6)) for _ in range(12))
        if turn == 0:
            question = document(name) + "\n" + question
        messages.append({"role": "user", "content": question})
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": ANSWER_TOKENS,
            "stream": True,
            "logit_bias": NO_EOS,
            "temperature": 0,
        }
        started = time.monotonic()
        first: float | None = None
        answer = ""
        timings: dict[str, int] = {}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                result.failures += 1
                await resp.aread()
                return
            replica = resp.headers.get("x-llmgw-replica", "")
            result.moved += bool(previous) and replica != previous
            previous = replica
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = httpx.Response(200, content=line[6:]).json()
                for choice in event.get("choices", ()):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        first = first or time.monotonic()
                        answer += content
                timings = event.get("timings", timings)
        result.ttft.append((first or time.monotonic()) - started)
        result.processed += int(timings.get("prompt_n", 0))
        result.cached += int(timings.get("cache_n", 0))
        messages.append({"role": "assistant", "content": answer})


async def workload(url: str, conversations: int, turns: int, concurrency: int, result: Result) -> None:
    rng = random.Random(7)
    systems = [system_prompt(i) for i in range(len(SYSTEM_MIX))]
    picks = rng.choices(range(len(SYSTEM_MIX)), weights=SYSTEM_MIX, k=conversations)
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> None:
        async with gate:
            await converse(client, url, systems[picks[index]], f"user{index}", turns, result)

    async with httpx.AsyncClient(timeout=300) as client:
        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(conversations)))
        result.seconds = time.monotonic() - started


def run_policy(policy: str, consul_url: str, gguf: Path, work: Path, args: argparse.Namespace) -> Result:
    engines = [
        start_llama_cpp_server(
            gguf,
            n_ctx=CONTEXT,
            extra_args=["--parallel", str(SLOTS), "--metrics", "--threads", "1"],
            log_dir=work,
            die_with_parent=True,
        )
        for _ in range(REPLICAS)
    ]
    router: Router | None = None
    try:
        for index, engine in enumerate(engines):
            engine.wait_ready(60)
            register(consul_url, engine, index)
        router = Router(consul_url, policy)
        result = Result(policy)
        asyncio.run(workload(router.url, args.conversations, args.turns, args.concurrency, result))
        result.per_replica = [predicted_tokens(engine) // ANSWER_TOKENS for engine in engines]
        print(f"  {policy}: {result.requests} completions in {result.seconds:.1f} s", flush=True)
        return result
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-affinity-") as tmp:
        work = Path(tmp)
        gguf = write_tiny_gguf(work / "tiny.gguf", context=CONTEXT)
        with ConsulAgent(log_dir=work, die_with_parent=True).start() as consul:
            print(
                f"{REPLICAS} llama-server replicas x {SLOTS} slots; {args.conversations} conversations x "
                f"{args.turns} turns, {args.concurrency} at a time; system prompts mixed {SYSTEM_MIX}",
                flush=True,
            )
            results = {p: run_policy(p, consul.url, gguf, work, args) for p in POLICIES}
    return report(results)


def report(results: dict[str, Result]) -> int:
    rr, lo, aff = results["round-robin"], results["least-outstanding"], results["affinity"]
    print()
    print(f"{'policy':<18} {'processed':>10} {'cached':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'compl/s':>8} "
          f"{'max/mean load':>13} {'per replica':>14} {'moved':>5} {'failed':>6}")  # fmt: skip
    for r in (aff, lo, rr):
        print(
            f"{r.policy:<18} {r.processed:>10} {r.cached:>9} {r.p(0.5) * 1000:>7.0f}ms {r.p(0.99) * 1000:>7.0f}ms "
            f"{r.requests / r.seconds:>8.2f} {r.spread:>13.2f} {r.per_replica!s:>14} {r.moved:>5} {r.failures:>6}"
        )
    checks = [
        ("processed prompt tokens, round robin / affinity", rr.processed / max(1, aff.processed), ">=", 2.0),
        ("median TTFT, round robin / affinity", rr.p(0.5) / aff.p(0.5), ">=", 1.5),
        ("busiest replica / mean load, affinity", aff.spread, "<=", 1.5),
        ("p99 TTFT, affinity / least-outstanding", aff.p(0.99) / lo.p(0.99), "<=", 1.2),
        ("failed requests, all policies", float(aff.failures + lo.failures + rr.failures), "<=", 0.0),
    ]
    print()
    missed = 0
    for name, value, op, target in checks:
        ok = value >= target if op == ">=" else value <= target
        missed += not ok
        print(f"{'ok  ' if ok else 'MISS'} {name}: {value:.2f} (target {op} {target})")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
