"""CUDA's view of a simulated GPU node, in front of the dev world's CPU-built engines.

On a real node the CUDA runtime enumerates the node's GPUs, keeps those that
`CUDA_VISIBLE_DEVICES` names, and a llama.cpp built with CUDA lists them as CUDA0, CUDA1, ...;
when it sees none it logs `failed to initialize CUDA: no CUDA-capable device is detected` and
serves from the CPU, healthy (seen on an H200: ../shared/reference/verified-here.md). The dev
world's engines are CPU builds on simulated GPU nodes, so the dev stack installs them behind
this program, which plays the CUDA build's part from the node's GPUs:

- `llama-server --list-devices` prints the visible devices as llama.cpp does, `(none)` if none;
- `llama-server --device CUDA<n>,...` and `ggml-rpc-server --device ...` exit 1 with llama.cpp's
  own words when a named device is not visible, and are otherwise dropped (a CPU build refuses
  them) before the real program runs;
- the llama-cpp-python probe of `nomad_driver.engines.llama_cpp_python` prints the visible devices;
- asked for GPU layers while seeing none, it logs CUDA's line and runs on the CPU anyway, as
  the real build does.

The node's GPUs come from `LLMGW_DEVSTACK_NODE_GPUS`, which the stand-in's raw_exec driver sets
(devstack/nomad/drivers.py: the simulated hardware; real Nomad sets no such variable). Without
it the machine has no GPU. Everything else passes straight through to the real program, same
process (exec), same environment.

    python devstack/fake_cuda.py REAL_PROGRAM [ARGS...]   (what `install_behind` writes)
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from nomad_driver.engines.llama_cpp_python import DEVICE_PROBE

NODE_GPUS_VAR = "LLMGW_DEVSTACK_NODE_GPUS"
NO_DEVICE = "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected"


def node_gpus(environ: dict[str, str]) -> list[dict[str, object]]:
    """The node's GPUs as its driver knows them: [{"uuid", "name", "memory_mib"}, ...]."""
    raw = environ.get(NODE_GPUS_VAR)
    if not raw:
        return []
    try:
        gpus = json.loads(raw)
    except ValueError:
        return []
    return [g for g in gpus if isinstance(g, dict) and isinstance(g.get("uuid"), str)]


def visible(gpus: list[dict[str, object]], cuda_visible_devices: str | None) -> list[dict[str, object]]:
    """CUDA's rule: unset means every GPU; otherwise the comma-separated entries in order, each
    an index or a (prefix of a) GPU UUID, stopping at the first entry that names no GPU, or one
    already listed. An empty value hides them all."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[dict[str, object]] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        match: dict[str, object] | None = None
        if entry.isdigit():
            if int(entry) < len(gpus):
                match = gpus[int(entry)]
        elif entry.startswith("GPU-"):
            found = [g for g in gpus if str(g["uuid"]).startswith(entry)]
            match = found[0] if len(found) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


def _device_line(index: int, gpu: dict[str, object]) -> str:
    mib = gpu.get("memory_mib") or 0
    return f"  CUDA{index}: {gpu.get('name')} ({mib} MiB, {mib} MiB free)"


def _take_option(args: list[str], names: Sequence[str]) -> tuple[list[str], str | None]:
    """`args` without the option `names` and its value, and that value (or None)."""
    out: list[str] = []
    value: str | None = None
    i = 0
    while i < len(args):
        if args[i] in names and i + 1 < len(args):
            value = args[i + 1]
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out, value


def _asks_for_gpu_layers(args: Sequence[str]) -> bool:
    for i, arg in enumerate(args[:-1]):
        if arg in ("-ngl", "--n-gpu-layers", "--gpu-layers", "--n_gpu_layers"):
            return args[i + 1] not in ("0",)
    return False


def run(program: str, args: list[str], environ: dict[str, str]) -> int:
    seen = visible(node_gpus(environ), environ.get("CUDA_VISIBLE_DEVICES"))
    name = os.path.basename(program)
    if name == "llama-server" and "--list-devices" in args:
        print("Available devices:")
        print("\n".join(_device_line(i, g) for i, g in enumerate(seen)) or "  (none)")
        return 0
    if name == "python" and args == ["-c", DEVICE_PROBE]:
        print("\n".join(f"CUDA{i}:" for i in range(len(seen))))
        return 0
    if name in ("llama-server", "ggml-rpc-server"):
        names = ("--device", "-dev") if name == "llama-server" else ("--device", "-d")
        args, devices = _take_option(args, names)
        for device in (devices or "").split(","):
            if devices is None or device == "none":
                break
            index = device[4:] if device.startswith("CUDA") else ""
            if not (index.isdigit() and int(index) < len(seen)):
                if not seen:
                    print(NO_DEVICE, file=sys.stderr)
                if name == "llama-server":
                    print(
                        f'error while handling argument "--device": invalid device: {device}', file=sys.stderr
                    )
                else:
                    print(f"error: unknown device: {device}", file=sys.stderr)
                return 1
    if seen and (_asks_for_gpu_layers(args) or name == "ggml-rpc-server"):
        print(f"ggml_cuda_init: found {len(seen)} CUDA devices:", file=sys.stderr)
        for i, gpu in enumerate(seen):
            print(f"  Device {i}: {gpu.get('name')}, {gpu.get('uuid')}", file=sys.stderr)
    elif _asks_for_gpu_layers(args):
        print(NO_DEVICE, file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os.execv(program, [program, *args])
    return 127  # not reached: execv replaces this process


def install_behind(path: Path, real: Path) -> None:
    """Writes `path` as a program that runs `real` behind this CUDA view. By the script's path,
    not as a module: engines start from their task directory, where `devstack` is no package."""
    if path.is_symlink() or path.exists():
        path.unlink()
    here = Path(__file__).resolve()
    path.write_text(
        "#!/bin/sh\n# The dev world's CUDA view in front of the real program (devstack/fake_cuda.py).\n"
        f'exec {shlex.quote(sys.executable)} {shlex.quote(str(here))} {shlex.quote(str(real))} "$@"\n'
    )
    path.chmod(0o755)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:], dict(os.environ)))
