"""What clients see while a serving model's definition changes, rolled out beside it against
replaced in place: failed requests and latency from the moment the new definition is written,
for a good new file and for a broken one.

Real parts throughout: Consul, the Nomad stand-in running real `llama-server` engines (one
slot each), and `llmgw watcher` and `llmgw router` as processes. Two models, one after the
other in the same stack, alike but for their profile's `update`: `rollout` (`surge`, the
default: the new definition starts beside the serving one) and `inplace` (`replace`: registered
over it, all replicas at once). Each has two replicas and is asked one chat every `--every`
seconds by a client that waits for each answer (as issue 34's reproduction did). Two changes:

- `good`: its file is replaced by another good one; measured from the write until only the new
  definition's replicas pass their checks, plus `--settle` seconds;
- `broken`: its file is replaced by one llama.cpp cannot load (an unknown architecture);
  measured for `--broken-seconds` after the write, which covers its five failed starts and the
  parking.

Printed per model and change: requests, failed, p50/p99 and the longest answer, and how long
the model took to serve its new definition (or to be parked). Target: the rollout fails no
request in either change.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench._support import llmgw_stack
from bench.scale_bench import pct, wait
from devstack.gguf_tiny import write_tiny_gguf
from devstack.llama_cpp import install_llama_cpp, llama_cpp_node
from nomad_driver.spec import parse_models

MODES = {"rollout": "surge", "inplace": "replace"}
PROFILE = """
profiles:
  one-slot:
    engine: llama.cpp
    engine_version: b6500
    gpus: 0
    cpu_mhz: 500
    memory_mib: 512
    context: 256
    args: ["--parallel", "1"]
    update: {update}
models:
"""


def models_text(model: str, source: Path) -> str:
    return (
        PROFILE.format(update=MODES[model])
        + f"  {model}:\n    source: file://{source}\n    profile: one-slot\n    replicas: {{min: 2, max: 2}}\n"
    )


def def_hash(model: str, source: Path) -> str:
    return parse_models(models_text(model, source)).models[model].def_hash


@dataclass
class Change:
    model: str
    name: str
    requests: list[tuple[float, float, int]] = field(
        default_factory=list
    )  # since the change, seconds, status
    settled_s: float | None = None  # new definition serving, or the model parked
    outcome: str = ""


class PacedClient:
    """One chat every `every` seconds, each waited for: a steady trickle, as an application's."""

    def __init__(self, url: str, model: str, every: float) -> None:
        self.url, self.model, self.every = url, model, every
        self.log: list[tuple[float, float, int]] = []  # start (monotonic), seconds, status
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    status = http.post(
                        f"{self.url}/v1/chat/completions",
                        json={
                            "model": self.model,
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 8,
                        },
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                took = time.monotonic() - started
                self.log.append((started, took, status))
                self._stop.wait(max(0.0, self.every - took))

    def since(self, t0: float, t1: float) -> list[tuple[float, float, int]]:
        return [(s - t0, d, st) for s, d, st in list(self.log) if t0 <= s < t1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(130)


def serving_hashes(consul: str, model: str) -> list[str]:
    """The definition hash of each of the model's engines passing its check."""
    try:
        entries = httpx.get(
            f"{consul}/v1/health/service/llmgw-engine",
            params={"passing": "1", "tag": f"model={model}"},
            timeout=5,
        ).json()
    except (httpx.HTTPError, ValueError):
        return []
    return [str((e.get("Service") or {}).get("Meta", {}).get("def_hash", "")) for e in entries]


def parked(consul: str, model: str) -> bool:
    try:
        r = httpx.get(f"{consul}/v1/kv/llmgw/state/{model}", params={"raw": "1"}, timeout=5)
        return r.status_code == 200 and bool(r.json().get("parked"))
    except (httpx.HTTPError, ValueError):
        return False


def run_change(
    change: Change, client: PacedClient, consul: str, source: Path, args: argparse.Namespace
) -> None:
    t0 = time.monotonic()
    text = models_text(change.model, source)
    httpx.put(f"{consul}/v1/kv/llmgw/config/models", content=text).raise_for_status()
    if change.name == "good":
        new = def_hash(change.model, source)
        deadline = t0 + args.timeout
        while time.monotonic() < deadline:
            hashes = serving_hashes(consul, change.model)
            if len(hashes) >= 2 and set(hashes) == {new}:
                change.settled_s = time.monotonic() - t0
                change.outcome = "new definition serving"
                break
            time.sleep(0.2)
        change.outcome = change.outcome or f"new definition not serving after {args.timeout:.0f}s"
        time.sleep(args.settle)
    else:
        end = t0 + args.broken_seconds
        while time.monotonic() < end:
            if change.settled_s is None and parked(consul, change.model):
                change.settled_s = time.monotonic() - t0
                change.outcome = "parked"
            time.sleep(0.2)
        change.outcome = change.outcome or "not parked"
    change.requests = client.since(t0, time.monotonic())


def report(changes: list[Change], every: float) -> bool:
    print(f"one chat every {every:.2f}s, waited for; rollout: update surge, inplace: update replace")
    print(
        f"{'model':<8} {'change':<7} {'requests':>8} {'failed':>7} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'settled s':>10}  outcome"
    )
    for c in changes:
        ok = [d for _, d, st in c.requests if st == 200]
        failed = sum(1 for _, _, st in c.requests if st != 200)
        longest = max((d for _, d, _ in c.requests), default=float("nan"))
        settled = f"{c.settled_s:.1f}" if c.settled_s is not None else "-"
        print(
            f"{c.model:<8} {c.name:<7} {len(c.requests):>8} {failed:>7} {pct(ok, 0.5) * 1000:>8.0f} "
            f"{pct(ok, 0.99) * 1000:>8.0f} {longest * 1000:>8.0f} {settled:>10}  {c.outcome}"
        )
    met = all(
        all(st == 200 for _, _, st in c.requests) and c.outcome in ("new definition serving", "parked")
        for c in changes
        if c.model == "rollout"
    )
    verdict = "met" if met else "NOT met"
    print(f"target (the rollout fails no request, serves the good file and parks the broken one): {verdict}")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between the client's chats")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds measured after the new one serves")
    parser.add_argument(
        "--broken-seconds", type=float, default=90.0, help="seconds measured after the broken write"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="longest wait for the new definition")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-update-bench-") as tmp_name:
        tmp = Path(tmp_name)
        engines = tmp / "engines"
        install_llama_cpp(engines)
        first = write_tiny_gguf(tmp / "first.gguf", seed=1)
        second = write_tiny_gguf(tmp / "second.gguf", seed=2)
        broken = write_tiny_gguf(tmp / "broken.gguf", architecture="kev")
        nodes = tmp / "nodes.yaml"
        nodes.write_text(yaml.safe_dump({"nodes": [llama_cpp_node("cpu-0", engines)]}))
        with llmgw_stack(tmp, nodes) as stack:
            changes: list[Change] = []
            for model in MODES:
                text = models_text(model, first)
                httpx.put(f"{stack.consul}/v1/kv/llmgw/config/models", content=text).raise_for_status()
                wait(
                    lambda m=model: len(serving_hashes(stack.consul, m)) >= 2,
                    180,
                    f"{model}'s 2 replicas ready",
                )
                client = PacedClient(stack.router, model, args.every)
                try:
                    time.sleep(5)  # a steady state to begin from
                    mine = [Change(model, "good"), Change(model, "broken")]
                    run_change(mine[0], client, stack.consul, second, args)
                    run_change(mine[1], client, stack.consul, broken, args)
                finally:
                    client.stop()
                changes += mine
                for job_id in (f"llmgw-{model}", f"llmgw-{model}~b"):
                    httpx.delete(f"{stack.nomad}/v1/job/{job_id}", params={"purge": "true"}, timeout=10)
                wait(lambda m=model: not serving_hashes(stack.consul, m), 60, f"{model}'s replicas gone")
            return 0 if report(changes, args.every) else 1


if __name__ == "__main__":
    raise SystemExit(main())
