"""llama-cpp-python's OpenAI server (`python -m llama_cpp.server`): llama.cpp's loader behind a
uvicorn server, installed as a virtualenv under llmgw_engines_dir and run with raw_exec."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nomad_driver.engines import gpu_check
from nomad_driver.engines.base import Engine, python_module_version
from nomad_driver.engines.llama_cpp import LlamaCpp
from nomad_driver.node_meta import ENGINES_DIR_KEY, interpolated

if TYPE_CHECKING:
    from nomad_driver.spec import Model
    from nomad_driver.weights import Weights

NAME = "llama-cpp-python"
PYTHON = "bin/python"

# It has no device listing of its own; its bundled ggml does. ggml's device registry is
# process-wide, so the count is what the engine will see in the same environment.
DEVICE_PROBE = (
    "import ctypes, pathlib, llama_cpp; "
    "lib = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / 'lib' / 'libggml.so')); "
    "lib.ggml_backend_dev_count.restype = ctypes.c_size_t; "
    "lib.ggml_backend_dev_get.restype = ctypes.c_void_p; lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]; "
    "lib.ggml_backend_dev_name.restype = ctypes.c_char_p; lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]; "
    "names = [lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i)).decode() "
    "for i in range(lib.ggml_backend_dev_count())]; "
    "print('\\n'.join(n + ':' for n in names if n.startswith('CUDA')))"
)


def gpu_probe(python: str) -> str:
    return f"{shlex.quote(python)} -c {shlex.quote(DEVICE_PROBE)}"


class LlamaCppPython(Engine):
    name = NAME
    # One request at a time.
    slots = 1
    # llama_cpp.server has no /health (404); it loads the model before it listens, so any
    # answer from /v1/models means ready.
    readiness_path = "/v1/models"
    # It guesses the chat template from the GGUF and guesses wrong for some models (Gemma
    # answers empty strings with its fallback), so the profile can name it.
    takes_chat_format = True
    # It generates a non-streamed completion in a worker thread that never looks at the
    # connection: a client that hangs up after a second still costs the engine its whole
    # answer, and every request behind it waits. Its streams, though, stop at the next token
    # once the connection closes.
    answers_assembled = True
    # uvicorn keeps a connection until it has been idle for its `timeout_keep_alive` (5 s).
    keeps_connections = True
    # Its loader is llama.cpp's, and says why in llama.cpp's words.
    startup_errors = LlamaCpp.startup_errors
    main_program = PYTHON

    def task(self, model: Model, weights: Weights) -> tuple[str, dict[str, Any]]:
        p = model.profile
        listen = ["--host", "${NOMAD_IP_http}", "--port", "${NOMAD_PORT_http}"]
        args = ["-m", "llama_cpp.server", "--model", weights.model_arg, *listen]
        args += ["--n_ctx", str(p.context), "--model_alias", model.name]
        # Its server otherwise ends a running stream (with [DONE], no error) whenever another
        # request arrives: behind a router that balances several clients, most streams break.
        args += ["--interrupt_requests", "False"]
        if p.gpus > 0:
            args += ["--n_gpu_layers", "-1"]
        if p.chat_format:
            args += ["--chat_format", p.chat_format]
        python = f"{interpolated(ENGINES_DIR_KEY)}/{NAME}/{p.engine_version}/{PYTHON}"
        if p.gpus > 0:
            probe = gpu_probe(python)
            return "raw_exec", gpu_check.checked_command(p.gpus, probe, python, args + p.args)
        return "raw_exec", {"command": python, "args": args + p.args}

    def version_command(self, install: Path) -> list[str]:
        return python_module_version(install, "llama_cpp")


ENGINE = LlamaCppPython()
