"""What each engine's task runs, as Nomad's job JSON has it: the driver and its command line
(llama.cpp's `llama-server`, llama-cpp-python's server, vLLM's image), the path its readiness
check asks, and how its GPUs are asked for (`device "nvidia/gpu"` with the profile's memory and
model constraints). `render.py` builds the job around it.
"""

from __future__ import annotations

from typing import Any

from nomad_driver import gpu_check
from nomad_driver.node_meta import ENGINES_DIR_KEY, interpolated
from nomad_driver.spec import Model, Profile
from nomad_driver.weights import Weights

PORT_LABEL = "http"


GPU_DEVICE = "nvidia/gpu"


# vLLM shares tensors between its tensor-parallel workers through /dev/shm; Docker's 64 MiB
# default makes a multi-GPU model die at start-up.
VLLM_SHM_BYTES = 16 * 1024**3


READINESS_PATHS = {
    "llama.cpp": "/health",
    "vllm": "/health",
    # llama_cpp.server has no /health (404); it loads the model before it listens, so any
    # answer from /v1/models means ready.
    "llama-cpp-python": "/v1/models",
}


def readiness_path(engine: str) -> str:
    return READINESS_PATHS[engine]


def engine_task_config(model: Model, weights: Weights) -> tuple[str, dict[str, Any]]:
    """The driver and its config for the model's engine."""
    p = model.profile
    engines = interpolated(ENGINES_DIR_KEY)
    listen = ["--host", "${NOMAD_IP_http}", "--port", "${NOMAD_PORT_http}"]
    config: dict[str, Any]
    # A GPU replica under raw_exec gets its GPUs at run time, from a prologue that also refuses
    # to start when the engine sees fewer than it asked for (gpu_check.py says why the task's
    # `env` cannot do it).

    if p.engine == "llama.cpp":
        # raw_exec, not exec: the engine lives under llmgw_engines_dir (/opt/...), which exec's
        # chroot does not carry, and CUDA needs the host's driver libraries as they are.
        server = f"{engines}/llama.cpp/{p.engine_version}/llama-server"
        args = ["--model", weights.model_arg, *listen, "--ctx-size", str(p.context)]
        args += ["--alias", model.name]
        if p.gpus > 0:
            args += ["-ngl", "999", "--device", gpu_check.cuda_device_names(p.gpus)]
            probe = gpu_check.llama_cpp_probe(server)
            return "raw_exec", gpu_check.checked_command(p.gpus, probe, server, args + p.args)
        config = {"command": server, "args": args + p.args}
        return "raw_exec", config

    if p.engine == "llama-cpp-python":
        args = ["-m", "llama_cpp.server", "--model", weights.model_arg, *listen]
        args += ["--n_ctx", str(p.context), "--model_alias", model.name]
        # Its server otherwise ends a running stream (with [DONE], no error) whenever another
        # request arrives: behind a router that balances several clients, most streams break.
        args += ["--interrupt_requests", "False"]
        if p.gpus > 0:
            args += ["--n_gpu_layers", "-1"]
        if p.chat_format:
            args += ["--chat_format", p.chat_format]
        python = f"{engines}/llama-cpp-python/{p.engine_version}/bin/python"
        if p.gpus > 0:
            probe = gpu_check.llama_cpp_python_probe(python)
            return "raw_exec", gpu_check.checked_command(p.gpus, probe, python, args + p.args)
        config = {"command": python, "args": args + p.args}
        return "raw_exec", config

    # vLLM ships as a container image; the docker driver maps the dynamic port to the same
    # number inside the container, so the engine listens on NOMAD_PORT_http on all interfaces.
    args = ["--model", weights.model_arg, "--served-model-name", model.name]
    args += ["--host", "0.0.0.0", "--port", "${NOMAD_PORT_http}", "--max-model-len", str(p.context)]
    if p.gpus > 1:
        args += ["--tensor-parallel-size", str(p.gpus)]
    config = {
        "image": f"vllm/vllm-openai:{p.engine_version}",
        "ports": [PORT_LABEL],
        "shm_size": VLLM_SHM_BYTES,
        "args": args + p.args,
    }
    return "docker", config


def gpu_devices(p: Profile) -> list[dict[str, Any]]:
    if p.gpus == 0:
        return []
    constraints = []
    if p.gpu_memory_mib > 0:
        # With a unit on the right-hand side Nomad compares unit-aware against the plugin's
        # `memory` attribute (an int in MiB); a bare number would not compare at all.
        constraints.append(
            {"LTarget": "${device.attr.memory}", "RTarget": f"{p.gpu_memory_mib} MiB", "Operand": ">="}
        )
    if p.gpu_models:
        # Exact names as NVML reports them; set_contains_any matches one of several, where a
        # three-part device name could name only one.
        constraints.append(
            {"LTarget": "${device.model}", "RTarget": ",".join(p.gpu_models), "Operand": "set_contains_any"}
        )
    return [{"Name": GPU_DEVICE, "Count": p.gpus, "Constraints": constraints, "Affinities": []}]
