"""Should the watcher ask Nomad's plan before a scale-up it makes? Measured on the stand-in.

    .venv/bin/python bench/plan_bench.py [--rounds 40] [--background 600]

Starts `python -m devstack.nomad` on the 200-node fleet (devstack/nodes/large-200.yaml), fills
it with `--background` one-GPU jobs so placement has real work, registers two llmgw models
(rendered by llmgw, engine swapped for mock_driver) at 0 replicas: one that fits, one that
asks for more GPU memory than any card has. Then, per round and per model, side by side:
- plan: `POST /v1/job/<id>/plan` of the job at 1 replica, until the answer is read;
- place and wait: the scale call the watcher makes today (`POST /v1/job/<id>/scale` to 1),
  then a blocking read of that evaluation until it is decided: what the watcher learns it from;
- plan first: the plan, then (when it fits) the same scale and wait;
and scales back to 0 after each, waiting for that evaluation too. Prints medians and p90s in
milliseconds and the ratios the decision in docs/design.md rests on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._support import mock_job, start_standin  # noqa: E402
from nomad_driver.render import render_job  # noqa: E402
from nomad_driver.spec import parse_models  # noqa: E402

MODELS = """
profiles:
  small:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 1
    gpu_memory_mib: 2000
    cpu_mhz: 500
    memory_mib: 512
  too-big:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 1
    gpu_memory_mib: 200000
    cpu_mhz: 500
    memory_mib: 512
models:
  fits:
    source: file:///tmp/fits.gguf
    profile: small
    replicas: {min: 0, max: 2}
  nowhere:
    source: file:///tmp/nowhere.gguf
    profile: too-big
    replicas: {min: 0, max: 2}
"""


def model_job(name: str, count: int) -> dict[str, Any]:
    model = parse_models(MODELS).models[name]
    job = render_job(model)
    group = job["TaskGroups"][0]
    # Placement is what is measured; the engine meta constraint would filter every fleet node.
    group["Constraints"] = []
    task = group["Tasks"][0]
    task.update({"Driver": "mock_driver", "Config": {"run_for": "1h"}})
    task.pop("Artifacts", None)
    group["Count"] = count
    return job


def decided(http: httpx.Client, eval_id: str) -> dict[str, Any]:
    """Block on the evaluation until it is no longer pending, as the watcher's watch does."""
    index = 0
    while True:
        resp = http.get(
            f"/v1/evaluation/{eval_id}", params={"index": index, "wait": "10s"} if index else None
        )
        evaluation: dict[str, Any] = resp.json()
        if evaluation["Status"] != "pending":
            return evaluation
        index = int(resp.headers["X-Nomad-Index"])


def scale(http: httpx.Client, job_id: str, count: int) -> dict[str, Any]:
    body = {"Count": count, "Target": {"Group": "engine"}, "Message": "bench"}
    eval_id = http.post(f"/v1/job/{job_id}/scale", json=body).json()["EvalID"]
    return decided(http, eval_id)


def plan(http: httpx.Client, name: str) -> bool:
    answer = http.post(f"/v1/job/llmgw-{name}/plan", json={"Job": model_job(name, 1), "Diff": False}).json()
    return not answer["FailedTGAllocs"]


def ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return f"median {statistics.median(ordered) * 1000:7.2f} ms, p90 {p90 * 1000:7.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--background", type=int, default=600)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="plan-bench-") as tmp:
        process, url = start_standin(Path(tmp))
        try:
            http = httpx.Client(base_url=url, timeout=30)
            for i in range(args.background):
                http.post("/v1/jobs", json=mock_job(f"bg-{i:04d}"))
            for name in ("fits", "nowhere"):
                http.post("/v1/jobs", json={"Job": model_job(name, 0)})
            # Every round sees the same full fleet: no evaluation is left pending.
            deadline = time.monotonic() + 120
            while http.get("/v1/evaluations", params={"status": "pending"}).json():
                if time.monotonic() > deadline:
                    raise SystemExit("the background jobs did not settle within 120s")
                time.sleep(0.2)
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for name in ("fits", "nowhere"):
                    t0 = time.perf_counter()
                    fits = plan(http, name)
                    times.setdefault(f"{name}: plan", []).append(time.perf_counter() - t0)
                    assert fits == (name == "fits"), f"plan of {name} said fits={fits}"

                    t0 = time.perf_counter()
                    evaluation = scale(http, f"llmgw-{name}", 1)
                    times.setdefault(f"{name}: place and wait", []).append(time.perf_counter() - t0)
                    assert bool(evaluation["FailedTGAllocs"]) == (name == "nowhere"), evaluation
                    scale(http, f"llmgw-{name}", 0)

                    t0 = time.perf_counter()
                    if plan(http, name):
                        scale(http, f"llmgw-{name}", 1)
                    times.setdefault(f"{name}: plan first", []).append(time.perf_counter() - t0)
                    scale(http, f"llmgw-{name}", 0)
            http.close()
        finally:
            process.terminate()
            process.wait(10)

    print(f"stand-in, 200 nodes, {args.background} one-GPU jobs placed, {args.rounds} rounds")
    for key, samples in times.items():
        print(f"  {key:<24} {ms(samples)}")
    for name in ("fits", "nowhere"):
        plan_m = statistics.median(times[f"{name}: plan"])
        place_m = statistics.median(times[f"{name}: place and wait"])
        first_m = statistics.median(times[f"{name}: plan first"])
        print(
            f"  {name}: plan / place-and-wait = {plan_m / place_m:.2f}; "
            f"plan-first / place-and-wait = {first_m / place_m:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
