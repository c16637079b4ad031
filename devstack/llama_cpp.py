"""llama.cpp's own programs, built by `make setup`: `llama-server` (the `llama.cpp` engine) and
`ggml-rpc-server` (a shard of a multi-node replica, holding layers for a leader's llama-server).

`make setup` builds both once per machine from the llama.cpp source the llama-cpp-python sdist
vendors and exports their paths as LLMGW_LLAMA_SERVER_BIN and LLMGW_RPC_SERVER_BIN; outside make
the same cache path is assumed. Nodes find an engine as `<llmgw_engines_dir>/llama.cpp/<version>/
llama-server`; `install_llama_cpp` links the built programs there.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devstack.fake_cuda import install_behind
from devstack.llama_engine import LlamaServer, start_logged
from devstack.ports import free_port

ENGINE = "llama.cpp"
# The version the dev fleets advertise (`llmgw_engine_llama_cpp` in devstack/nodes/*.yaml). What
# is installed under it is the llama.cpp that llama-cpp-python 0.3.36 vendors.
VERSION = "b6500"
BUILD = "llama.cpp-0.3.36-x86-64-v3"
PROGRAMS = {"llama-server": "LLMGW_LLAMA_SERVER_BIN", "ggml-rpc-server": "LLMGW_RPC_SERVER_BIN"}


class LlamaCppMissing(RuntimeError):
    """The programs were not built; the message says how to build them."""


def program(name: str) -> Path:
    """The built `llama-server` or `ggml-rpc-server`, from its variable or the cache."""
    env = PROGRAMS[name]
    cache = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
    path = Path(os.environ.get(env) or cache / BUILD / "build" / "bin" / name)
    if not os.access(path, os.X_OK):
        raise LlamaCppMissing(
            f"{name} is not built at {path} ({env}); run 'make setup', which builds llama.cpp's "
            "llama-server and ggml-rpc-server once per machine"
        )
    return path


def install_llama_cpp(engines_dir: Path, version: str = VERSION) -> Path:
    """`engines_dir/llama.cpp/<version>/{llama-server,ggml-rpc-server}`: the built programs,
    behind the simulated node's CUDA view (devstack/fake_cuda.py), which runs the originals
    where they were built, so they find their shared libraries beside them."""
    target = engines_dir / ENGINE / version
    target.mkdir(parents=True, exist_ok=True)
    for name in PROGRAMS:
        install_behind(target / name, program(name))
    return target


def start_llama_cpp_server(
    model_path: str | Path,
    port: int | None = None,
    host: str = "127.0.0.1",
    n_ctx: int = 256,
    rpc: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    log_dir: str | Path | None = None,
    die_with_parent: bool = False,
) -> LlamaServer:
    """llama.cpp's `llama-server` on one GGUF, with its layers on the `rpc` shards when given;
    ready when `/health` answers 200. Returns at once."""
    port = port or free_port(host)
    cmd = [str(program("llama-server")), "--model", str(model_path), "--host", host, "--port", str(port)]
    cmd += ["--ctx-size", str(n_ctx)]
    if rpc:
        cmd += ["--rpc", ",".join(rpc), "-ngl", "999"]
    cmd += list(extra_args)
    proc, out, err = start_logged(cmd, "llama-server", port, log_dir, die_with_parent, "llmgw-llama-cpp-")
    return LlamaServer(
        proc,
        model_path=Path(model_path),
        host=host,
        port=port,
        stdout_path=out,
        stderr_path=err,
        ready_path="/health",
    )


def start_rpc_server(
    port: int | None = None,
    host: str = "127.0.0.1",
    log_dir: str | Path | None = None,
    die_with_parent: bool = False,
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """A `ggml-rpc-server` shard: (process, port, stdout path: where it logs)."""
    port = port or free_port(host)
    cmd = [str(program("ggml-rpc-server")), "--host", host, "--port", str(port)]
    proc, out, _err = start_logged(cmd, "ggml-rpc-server", port, log_dir, die_with_parent, "llmgw-llama-cpp-")
    return proc, port, out


def llama_cpp_node(name: str, engines: Path, **meta: str) -> dict[str, Any]:
    """A stand-in node with llama.cpp b6500 installed under `engines` (and `meta` added)."""
    return {
        "name": name,
        "datacenter": "dc1",
        "cpu_mhz": 16000,
        "cpu_cores": 8,
        "memory_mib": 65536,
        "disk_mb": 100000,
        "attributes": {"driver.raw_exec": "1"},
        "meta": {"llmgw_engines_dir": str(engines), "llmgw_engine_llama_cpp": "b6500", **meta},
        "gpus": [],
    }
