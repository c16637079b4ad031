"""The GPU check in one go: a rendered GPU replica, started as Nomad would start it, on this
machine's real GPU; then a wrong device list, and a two-shard replica over RPC.

    .venv/bin/python bench/gpu_engine_check.py [--engines DIR] [--skip-build] [--simulated]

1. Builds llama.cpp with CUDA (`make cuda-engines`, the recipe operators use) unless
   `--skip-build`, for this GPU's architecture only.
2. Renders a one-GPU llama.cpp model with llmgw's own `render_job`, and builds its task's
   environment and config with the stand-in's copy of Nomad's client code
   (devstack/nomad/taskenv.py: `client/taskenv/env.go`), with the GPU's real UUID (read through
   NVML, as the node agent reads it) as the allocation's device. Starts the task's command with
   that environment and nothing else of this shell's.
3. Reports the layers llama.cpp put on the GPU, tokens/s, and the node agent's reading of the
   GPU while the engine runs.
4. Starts the same task with a device that is not on the machine: its start must fail at once,
   with llmgw's cause.
5. Starts a two-node replica's shard and leader (both on this GPU) and reports its tokens/s.

`--simulated` runs the same steps on the dev world's CPU engines behind devstack/fake_cuda.py
with a made-up UUID, to check the script itself on a machine without a GPU. Exit status 0 when
every step behaved as it should.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devstack.gguf_tiny import write_tiny_gguf  # noqa: E402
from devstack.nomad.nodes import NODE_GPUS_VAR  # noqa: E402
from devstack.nomad.taskenv import AllocPaths, build_task_env, interpolate  # noqa: E402
from devstack.ports import free_port  # noqa: E402
from nomad_driver.engines.llama_cpp import RPC_SERVERS_VAR  # noqa: E402
from nomad_driver.node_agent.agent import NodeAgent, NodeAgentConfig  # noqa: E402
from nomad_driver.render import render_job  # noqa: E402
from nomad_driver.spec import parse_models  # noqa: E402

MODELS = """
profiles:
  one-gpu: {{engine: llama.cpp, engine_version: b6500, gpus: 1, context: 2048, cpu_mhz: 1000, memory_mib: 4096}}
  split: {{engine: llama.cpp, engine_version: b6500, gpus: 1, nodes: 2, context: 2048, cpu_mhz: 1000, memory_mib: 4096}}
models:
  gpu-check: {{source: "file://{gguf}", profile: one-gpu}}
  gpu-check-split: {{source: "file://{gguf}", profile: split}}
"""
WRONG_UUID = "GPU-00000000-0000-0000-0000-000000000000"


def alloc_for(job: dict[str, Any], group: str, uuid: str, port_label: str, port: int) -> dict[str, Any]:
    """The allocation Nomad's scheduler would make: the device, and one host port."""
    return {
        "ID": os.urandom(16).hex()[:8] + "-0000-0000-0000-000000000000",
        "Name": f"{job['ID']}.{group}[0]",
        "Namespace": "default",
        "TaskGroup": group,
        "Job": job,
        "AllocatedResources": {
            "Tasks": {"engine": {"Devices": [{"Vendor": "nvidia", "Type": "gpu", "DeviceIDs": [uuid]}]}},
            "Shared": {"Ports": [{"Label": port_label, "Value": port, "HostIP": "127.0.0.1"}]},
        },
    }


def start_task(
    job: dict[str, Any],
    group: str,
    uuid: str,
    port_label: str,
    node: dict[str, Any],
    work: Path,
    extra: dict[str, str],
) -> tuple[subprocess.Popen[bytes], Path, int]:
    port = free_port()
    alloc = alloc_for(job, group, uuid, port_label, port)
    paths = AllocPaths(work / alloc["ID"])
    paths.build_shared()
    paths.build_task("engine")
    task = next(g for g in job["TaskGroups"] if g["Name"] == group)["Tasks"][0]
    # The artifact's place: what go-getter would have fetched.
    for artifact in task.get("Artifacts") or []:
        dest = paths.task_dir("engine") / artifact["RelativeDest"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(artifact["GetterSource"].removeprefix("file://"), dest)
    env = build_task_env(alloc, node, paths, task, host_env=False)
    env.env.update(extra)  # a template's env vars (the leader's RPC_SERVERS)
    config = interpolate(task["Config"], env)
    stderr = paths.log("engine", "stderr")
    proc = subprocess.Popen(
        [config["command"], *config["args"]],
        env={"PATH": "/usr/bin:/bin", **env.env, **node.get("_hardware", {})},
        cwd=paths.task_dir("engine"),
        stdout=subprocess.DEVNULL,
        stderr=stderr.open("wb"),
    )
    return proc, stderr, port


def wait_health(proc: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def tokens_per_second(port: int, rounds: int = 5) -> float:
    rates = []
    for _ in range(rounds):
        reply = httpx.post(
            f"http://127.0.0.1:{port}/completion",
            json={"prompt": "Once upon a time", "n_predict": 128, "ignore_eos": True},
            timeout=120,
        ).json()
        rates.append(float(reply["timings"]["predicted_per_second"]))
    return sorted(rates)[len(rates) // 2]


def offloaded(stderr: Path) -> str:
    found = re.findall(r"offloaded (\d+/\d+) layers to GPU", stderr.read_text(errors="replace"))
    return found[-1] if found else "none"


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engines", type=Path, help="engines dir (default: build one with make cuda-engines)"
    )
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument(
        "--simulated", action="store_true", help="CPU engines behind the dev world's CUDA view"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-gpu-check-"))
    report: dict[str, Any] = {}
    ok = True

    agent = NodeAgent(NodeAgentConfig(engines_dir=Path("/nonexistent"), models_dir=Path("/nonexistent")))
    hardware: dict[str, str] = {}
    if args.simulated:
        from devstack.fleet import install_engines

        engines = args.engines or work / "engines"
        install_engines(engines)
        uuid = "GPU-6b5fa173-5fa6-2d38-54fe-d64c1fe4fe10"
        hardware = {NODE_GPUS_VAR: json.dumps([{"uuid": uuid, "name": "simulated", "memory_mib": 24564}])}
    else:
        gpus = agent.inventory().gpus
        if not gpus:
            print("NVML found no GPU: run with --simulated on a machine without one")
            return 2
        uuid = gpus[0].uuid
        engines = args.engines or work / "engines"
        if not args.skip_build:
            cap = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                )
                .stdout.split()[0]
                .replace(".", "")
            )
            started = time.monotonic()
            subprocess.run(
                ["make", "cuda-engines", f"CUDA_ARCHITECTURES={cap}", f"CUDA_ENGINES={engines}"],
                cwd=ROOT,
                check=True,
            )
            report["build_s"] = round(time.monotonic() - started)
    report["gpu"] = uuid

    gguf = write_tiny_gguf(work / "model.gguf", context=2048)
    models = parse_models(MODELS.format(gguf=gguf)).models
    node = {
        "ID": "gpu-check-node",
        "Name": "gpu-check",
        "Datacenter": "dc1",
        "Meta": {"llmgw_engines_dir": str(engines)},
        "Attributes": {},
        "_hardware": hardware,
    }

    # A replica as Nomad starts it.
    job = render_job(models["gpu-check"])
    proc, stderr, port = start_task(job, "engine", uuid, "http", node, work, {})
    try:
        healthy = wait_health(proc, port, 120)
        report["single"] = {"healthy": healthy, "layers_on_gpu": offloaded(stderr)}
        if healthy:
            report["single"]["tokens_per_s"] = round(tokens_per_second(port))
            reading = agent.inventory().gpus or []
            report["single"]["node_agent_gpu_memory_used_mib"] = [g.memory_used_mib for g in reading]
        ok &= healthy and (args.simulated or report["single"]["layers_on_gpu"] not in ("none", ""))
    finally:
        stop(proc)

    # A device the engine cannot see: the start fails at once, saying why.
    proc, stderr, port = start_task(job, "engine", WRONG_UUID, "http", node, work, {})
    try:
        code = proc.wait(60)
    finally:
        stop(proc)
    cause = [ln for ln in stderr.read_text(errors="replace").splitlines() if "GPU check failed" in ln]
    report["wrong_device"] = {"exit": code, "cause": cause[-1] if cause else None}
    ok &= code != 0 and bool(cause)

    # Two nodes' worth on one GPU: the shard, then the leader pointed at it.
    split = render_job(models["gpu-check-split"])
    shard, shard_err, shard_port = start_task(split, "shard", uuid, "rpc", node, work, {})
    leader = None
    try:
        time.sleep(2)
        leader, leader_err, port = start_task(
            split, "engine", uuid, "http", node, work, {RPC_SERVERS_VAR: f"127.0.0.1:{shard_port}"}
        )
        healthy = wait_health(leader, port, 120)
        shard_log = shard_err.read_text(errors="replace")
        report["two_shards"] = {
            "healthy": healthy,
            "layers_on_gpu": offloaded(leader_err),
            "shard_devices": sorted(set(re.findall(r"\bCUDA\d+\b", shard_log))),
        }
        if healthy:
            report["two_shards"]["tokens_per_s"] = round(tokens_per_second(port))
        ok &= healthy
    finally:
        stop(*(p for p in (leader, shard) if p is not None))
    agent.stop()
    print(json.dumps(report, indent=2))
    print("all checks behaved as they should" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
