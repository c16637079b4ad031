"""How a raw_exec engine is handed the GPUs Nomad allocated it, and refuses to start without them.

Nomad's nvidia device plugin hands an allocation its GPUs as `NVIDIA_VISIBLE_DEVICES` (the GPU
UUIDs), which only the NVIDIA container runtime reads; a raw_exec process sees its GPUs through
`CUDA_VISIBLE_DEVICES`. That variable cannot be written in the task's `env`: Nomad interpolates
`env` before it adds the device hook's variables (`client/taskenv/env.go`, `buildEnv`), and leaves
an unknown `${...}` as literal text, so the engine would get the text `${NVIDIA_VISIBLE_DEVICES}`,
see no GPU, and serve from the CPU while its health check passes. So the task starts under a
short /bin/sh prologue that reads the device list from its own environment at run time, exports
it as `CUDA_VISIBLE_DEVICES`, asks the engine itself how many CUDA devices it sees, and exits
with a cause that names both counts and the list when it sees fewer than it asked for. The
watcher counts that exit as a failed start like any other and parks on it after five.
"""

from __future__ import annotations

import re
import shlex

# The cause's first words: what the watcher keeps as the last error, before any engine line.
FAILED_PREFIX = "llmgw: GPU check failed"
FAILED_PATTERN = re.compile(re.escape(FAILED_PREFIX))

# A device listing prints one line per device as `CUDA<n>: <name> (...)`; llama.cpp's
# `--list-devices` does so, and the Python probe below prints the same form.
_LISTED_DEVICE = "^ *CUDA[0-9][0-9]*:"

# POSIX sh, written without `${` anywhere: Nomad would interpolate a `${NAME}` in the task's
# args before the shell ever saw it. Arguments: the GPUs asked for, then the probe command line
# (shell words). The device variable is unset when the node's device plugin gave nothing, which
# is said as such rather than as an empty list.
_PROLOGUE = (
    "llmgw_want=$1; llmgw_probe=$2; shift 2; "
    'if env | grep -q "^NVIDIA_VISIBLE_DEVICES="; then llmgw_given="\\"$NVIDIA_VISIBLE_DEVICES\\""; '
    'else llmgw_given="nothing (NVIDIA_VISIBLE_DEVICES is not set)"; fi; '
    'export CUDA_VISIBLE_DEVICES="$NVIDIA_VISIBLE_DEVICES"; '
    'llmgw_list=$(eval "$llmgw_probe" 2>&1); llmgw_rc=$?; '
    f"llmgw_seen=$(printf '%s\\n' \"$llmgw_list\" | grep -c '{_LISTED_DEVICE}'); "
    'if [ "$llmgw_seen" -lt "$llmgw_want" ]; then '
    'llmgw_why=""; if [ "$llmgw_rc" -ne 0 ]; then llmgw_why=" (its device listing exited $llmgw_rc)"; fi; '
    f'echo "{FAILED_PREFIX}: asked for $llmgw_want GPU(s), the engine sees $llmgw_seen$llmgw_why; '
    'Nomad gave $llmgw_given as CUDA_VISIBLE_DEVICES" >&2; exit 1; fi; '
    'echo "llmgw: GPU check passed: the engine sees $llmgw_seen GPU(s) of $llmgw_given" >&2; '
)

# The name the shell reports as $0 in its own messages.
SCRIPT_NAME = "llmgw-gpu-check"

# llama-cpp-python has no device listing of its own; its bundled ggml does. ggml's device
# registry is process-wide, so the count is what the engine will see in the same environment.
LLAMA_CPP_PYTHON_PROBE = (
    "import ctypes, pathlib, llama_cpp; "
    "lib = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / 'lib' / 'libggml.so')); "
    "lib.ggml_backend_dev_count.restype = ctypes.c_size_t; "
    "lib.ggml_backend_dev_get.restype = ctypes.c_void_p; lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]; "
    "lib.ggml_backend_dev_name.restype = ctypes.c_char_p; lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]; "
    "names = [lib.ggml_backend_dev_name(lib.ggml_backend_dev_get(i)).decode() "
    "for i in range(lib.ggml_backend_dev_count())]; "
    "print('\\n'.join(n + ':' for n in names if n.startswith('CUDA')))"
)


def llama_cpp_probe(llama_server: str) -> str:
    """llama.cpp's own listing of the devices it can use (`(none)` when CUDA sees none)."""
    return f"{shlex.quote(llama_server)} --list-devices"


def llama_cpp_python_probe(python: str) -> str:
    return f"{shlex.quote(python)} -c {shlex.quote(LLAMA_CPP_PYTHON_PROBE)}"


def cuda_device_names(gpus: int) -> str:
    """`CUDA0,CUDA1,...`: llama.cpp's `--device` list for the first `gpus` devices it sees. With
    it, an engine that sees fewer exits ("invalid device") instead of falling back to the CPU."""
    return ",".join(f"CUDA{i}" for i in range(gpus))


def checked_command(gpus: int, probe: str, command: str, args: list[str]) -> dict[str, object]:
    """A raw_exec config that runs `command args` only once the engine sees `gpus` GPUs."""
    return {
        "command": "/bin/sh",
        "args": ["-c", _PROLOGUE + 'exec "$@"', SCRIPT_NAME, str(gpus), probe, command, *args],
    }


def checked_script(gpus: int, probe: str, script: str) -> list[str]:
    """/bin/sh args that run `script` (shell text) only once the engine sees `gpus` GPUs."""
    return ["-c", _PROLOGUE + script, SCRIPT_NAME, str(gpus), probe]


def engine_command(config: dict[str, object]) -> tuple[str, list[str]]:
    """The engine's own command and args inside a checked config (as rendered, uninterpolated)."""
    args = [str(a) for a in config.get("args") or []]  # type: ignore[attr-defined]
    if config.get("command") == "/bin/sh" and args[2:3] == [SCRIPT_NAME] and len(args) > 5:
        return args[5], args[6:]
    return str(config.get("command")), args
