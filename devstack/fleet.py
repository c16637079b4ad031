"""The simulated fleet as the dev stack runs it: engines installed where the nodes say.

A job for engine `llama-cpp-python` 0.3.36 runs `<llmgw_engines_dir>/llama-cpp-python/0.3.36/
bin/python -m llama_cpp.server`. Here that program runs the python of the virtualenv this
process runs in, by its path inside the venv: a python reached through a link to itself alone
does not find the venv's site-packages (no pyvenv.cfg beside it) and fails to import llama_cpp.

A job for engine `llama.cpp` runs `<llmgw_engines_dir>/llama.cpp/b6500/llama-server` (and
`ggml-rpc-server` for the shards of a multi-node replica): the real programs `make setup` built,
linked in by `devstack.llama_cpp.install_llama_cpp`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from devstack.fake_cuda import install_behind
from devstack.llama_cpp import install_llama_cpp

ENGINE = "llama-cpp-python"
ENGINE_VERSION = "0.3.36"
SMALL_FLEET = Path(__file__).resolve().parent / "nodes" / "small.yaml"
# The small fleet and two nodes of one fabric, entirely free for the demo's two-shard replica.
DEMO_FLEET = Path(__file__).resolve().parent / "nodes" / "demo.yaml"


def install_engines(engines_dir: Path, venv: Path | None = None) -> Path:
    """`engines_dir/llama-cpp-python/0.3.36/bin/python` -> the virtualenv's python, and
    llama.cpp's programs under `engines_dir/llama.cpp/b6500`, each behind the simulated node's
    CUDA view (devstack/fake_cuda.py); returns the llama-cpp-python install."""
    install_llama_cpp(engines_dir)
    return install_llama_cpp_python(engines_dir, venv)


def install_llama_cpp_python(engines_dir: Path, venv: Path | None = None) -> Path:
    """`engines_dir/llama-cpp-python/0.3.36/bin/python`: the virtualenv's python behind the
    simulated node's CUDA view; returns the version directory."""
    install = engines_dir / ENGINE / ENGINE_VERSION
    if install.is_symlink():
        install.unlink()
    (install / "bin").mkdir(parents=True, exist_ok=True)
    # The venv's own bin/python, run by its path inside the venv, so it finds pyvenv.cfg.
    install_behind(install / "bin" / "python", Path(venv or sys.prefix).resolve() / "bin" / "python")
    return install


# The layout the operating guide asks for: GPU nodes in a pool of their own, llmgw's own services
# on a general node outside it.
GPU_POOL = "gpu"
GENERAL_NODE: dict[str, Any] = {
    "name": "general-0",
    "datacenter": "dc1",
    "node_class": "general",
    "cpu_mhz": 16000,
    "cpu_cores": 8,
    "memory_mib": 32768,
    "disk_mb": 200000,
    "attributes": {"driver.raw_exec": "1", "driver.exec": "1"},
    "meta": {"llmgw_fabric": "ethernet"},
    "gpus": [],
}


def effective_nodes(fleet: Path, engines_dir: Path, out: Path, *, gpu_pool: str = "") -> Path:
    """The fleet file with every node's `llmgw_engines_dir` pointing at `engines_dir`; with
    `gpu_pool`, the nodes that have GPUs and name no pool of their own are moved into that pool
    and a general node without GPUs is added in `default`."""
    data: Any = yaml.safe_load(fleet.read_text())
    nodes = data.get("nodes") if isinstance(data, dict) else data
    if not isinstance(nodes, list):
        raise ValueError(f"{fleet}: expected a list of nodes under 'nodes'")
    for node in nodes:
        if isinstance(node, dict):
            node.setdefault("meta", {})["llmgw_engines_dir"] = str(engines_dir.resolve())
            if gpu_pool and node.get("gpus") and node.get("node_pool") in (None, "", "default"):
                node["node_pool"] = gpu_pool
    if gpu_pool:
        nodes.append({**GENERAL_NODE, "meta": dict(GENERAL_NODE["meta"])})
    header = f"# Written by 'python -m devstack up' from {fleet}, with the engines dir of this stack.\n"
    out.write_text(header + yaml.safe_dump({"nodes": nodes}, sort_keys=False))
    return out


def big_gpu_node(engines_dir: Path, name: str = "gpu-h200-0") -> dict[str, Any]:
    """A node whose GPU fits `phi-4` (one card with 143,771 MiB), for `PUT /v1/devstack/node`."""
    return {
        "name": name,
        "datacenter": "dc1",
        "node_pool": GPU_POOL,
        "node_class": "h200",
        "cpu_mhz": 64000,
        "cpu_cores": 32,
        "memory_mib": 524288,
        "disk_mb": 2000000,
        "attributes": {"driver.raw_exec": "1", "driver.exec": "1"},
        "meta": {
            "llmgw_engines_dir": str(engines_dir.resolve()),
            "llmgw_engine_llama_cpp_python": ENGINE_VERSION,
            "llmgw_gpu_class": "h200",
            "llmgw_fabric": "ethernet",
        },
        "gpus": [{"model": "NVIDIA H200", "memory_mib": 143771, "count": 1}],
    }
