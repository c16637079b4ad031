"""Scaling by load under a step: the same step load, in one run, against a model that scales
(min 1, max 4), one fixed at its minimum (1) and one fixed at its maximum (4).

Real parts throughout: Consul, the Nomad stand-in running real `llama-server` engines with one
slot each (`--parallel 1`), and `llmgw watcher` and `llmgw router` as processes with their
default windows (6 s up, one step per 5 s); the scaled model's scale-down delay is cut to 10 s
so that the run stays short. Load: `--base` clients for a while, `--step` clients for a fifth
of the run, then `--base` again; each client sends one chat after another.

Printed per model: time from the step to the first extra replica asked for (the job's count)
and ready (passing in Consul), p50/p99 of requests started during the step, failures, and
replica-seconds (running allocations integrated over the run). Targets: asked within 5 s,
p99 during the step at most 1.5x the fixed maximum's, replica-seconds at most 60% of the fixed
maximum's.
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
from devstack.gguf_tiny import write_tiny_gguf
from devstack.llama_cpp import install_llama_cpp, llama_cpp_node

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
models:
"""


@dataclass
class Phase:
    name: str
    replicas: str
    requests: list[tuple[float, float, int]] = field(default_factory=list)  # start, seconds, status
    asked_s: float | None = None
    ready_s: float | None = None
    replica_seconds: float = 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Clients:
    """Threads sending chats one after another; `set(n)` changes how many are active."""

    def __init__(self, url: str, model: str, most: int, phase: Phase) -> None:
        self.url, self.model, self.phase = url, model, phase
        self.active = 0
        self._stop = False
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(most)]
        for t in self._threads:
            t.start()

    def set(self, n: int) -> None:
        self.active = n

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop:
                if index >= self.active:
                    time.sleep(0.02)
                    continue
                started = time.monotonic()
                try:
                    status = http.post(
                        f"{self.url}/v1/chat/completions",
                        json={
                            "model": self.model,
                            "messages": [{"role": "user", "content": "tell me a story"}],
                            "max_tokens": 48,
                        },
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                self.phase.requests.append((started, time.monotonic() - started, status))

    def stop(self) -> None:
        self._stop = True
        for t in self._threads:
            t.join(130)


def count(nomad: str, job: str) -> int:
    try:
        return int(httpx.get(f"{nomad}/v1/job/{job}", timeout=5).json()["TaskGroups"][0]["Count"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def running(nomad: str, job: str) -> int:
    try:
        allocs = httpx.get(f"{nomad}/v1/job/{job}/allocations", timeout=5).json()
    except httpx.HTTPError:
        return 0
    return sum(1 for a in allocs if a.get("ClientStatus") == "running" and a.get("DesiredStatus") == "run")


def passing(consul: str, model: str) -> int:
    try:
        entries = httpx.get(
            f"{consul}/v1/health/service/llmgw-engine",
            params={"passing": "1", "tag": f"model={model}"},
            timeout=5,
        ).json()
    except httpx.HTTPError:
        return 0
    return len(entries)


def wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def run_phase(
    phase: Phase, args: argparse.Namespace, consul: str, nomad: str, router: str, gguf: Path
) -> None:
    models_text = PROFILE + f"  {phase.name}:\n    source: file://{gguf}\n    profile: one-slot\n"
    models_text += f"    replicas: {phase.replicas}\n"
    httpx.put(f"{consul}/v1/kv/llmgw/config/models", content=models_text).raise_for_status()
    job = f"llmgw-{phase.name}"
    base_count = yaml.safe_load(phase.replicas)["min"]
    wait(
        lambda: passing(consul, phase.name) >= base_count, 120, f"{phase.name}'s {base_count} replicas ready"
    )
    clients = Clients(router, phase.name, args.step, phase)
    total = args.seconds
    base, peak = total * 0.2, total * 0.2
    start = time.monotonic()
    clients.set(args.base)
    step_at = start + base
    last = start
    try:
        while (now := time.monotonic()) < start + total:
            phase.replica_seconds += running(nomad, job) * (now - last)
            last = now
            if now >= step_at and clients.active != args.step and now < step_at + peak:
                clients.set(args.step)
            if now >= step_at + peak and clients.active != args.base:
                clients.set(args.base)
            if now >= step_at:
                if phase.asked_s is None and count(nomad, job) > base_count:
                    phase.asked_s = now - step_at
                if phase.ready_s is None and passing(consul, phase.name) > base_count:
                    phase.ready_s = now - step_at
            time.sleep(0.25)
    finally:
        clients.stop()
    phase.requests = [(s - step_at, d, st) for s, d, st in phase.requests]
    httpx.delete(f"{nomad}/v1/job/{job}", params={"purge": "true"}, timeout=10)
    wait(lambda: passing(consul, phase.name) == 0, 60, f"{phase.name}'s replicas gone")


def report(phases: list[Phase], peak: float) -> int:
    fixed_max = phases[-1]
    during = {p.name: [d for s, d, st in p.requests if 0 <= s < peak and st == 200] for p in phases}
    p99_max = pct(during[fixed_max.name], 0.99)
    print(f"{'model':<12} {'asked s':>8} {'ready s':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99/max':>8} "
          f"{'failed':>7} {'replica-s':>10} {'vs max':>7}")  # fmt: skip
    for p in phases:
        lat = during[p.name]
        failed = sum(1 for _, _, st in p.requests if st != 200)
        asked = f"{p.asked_s:.1f}" if p.asked_s is not None else "-"
        ready = f"{p.ready_s:.1f}" if p.ready_s is not None else "-"
        print(
            f"{p.name:<12} {asked:>8} {ready:>8} {pct(lat, 0.5) * 1000:>8.0f} {pct(lat, 0.99) * 1000:>8.0f} "
            f"{pct(lat, 0.99) / p99_max:>8.2f} {failed:>7} {p.replica_seconds:>10.0f} "
            f"{p.replica_seconds / fixed_max.replica_seconds:>7.2f}"
        )
    scaled = phases[0]
    ok = (
        scaled.asked_s is not None
        and scaled.asked_s < 5
        and pct(during[scaled.name], 0.99) <= 1.5 * p99_max
        and scaled.replica_seconds <= 0.6 * fixed_max.replica_seconds
    )
    print(
        "targets (asked < 5 s, p99 <= 1.5x fixed max, replica-seconds <= 60% of fixed max): "
        + ("met" if ok else "NOT met")
    )
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=75.0, help="each model's run; the step is a fifth of it"
    )
    parser.add_argument("--base", type=int, default=1, help="clients before and after the step")
    parser.add_argument("--step", type=int, default=4, help="clients during the step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-scale-bench-") as tmp_name:
        tmp = Path(tmp_name)
        engines = tmp / "engines"
        install_llama_cpp(engines)
        gguf = write_tiny_gguf(tmp / "tiny.gguf")
        nodes = tmp / "nodes.yaml"
        nodes.write_text(yaml.safe_dump({"nodes": [llama_cpp_node("cpu-0", engines)]}))
        with llmgw_stack(tmp, nodes) as stack:
            phases = [
                Phase("scaled", "{min: 1, max: 4, scale_down_delay: 10s}"),
                Phase("fixed-min", "{min: 1, max: 1}"),
                Phase("fixed-max", "{min: 4, max: 4}"),
            ]
            for phase in phases:
                run_phase(phase, args, stack.consul, stack.nomad, stack.router, gguf)
            print(
                f"step: {args.base} -> {args.step} clients for {args.seconds * 0.2:.0f}s of {args.seconds:.0f}s"
            )
            return report(phases, args.seconds * 0.2)


if __name__ == "__main__":
    raise SystemExit(main())
