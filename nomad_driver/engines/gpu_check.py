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

The prologue is the same for every raw_exec engine; how an engine lists its devices is its own
(the probe each engine module passes in).
"""

from __future__ import annotations

import re

# The cause's first words: what the watcher keeps as the last error, before any engine line.
FAILED_PREFIX = "llmgw: GPU check failed"
FAILED_PATTERN = re.compile(re.escape(FAILED_PREFIX))

# A device listing prints one line per device as `CUDA<n>: <name> (...)`; each raw_exec
# engine's probe (its module's `gpu_probe`) prints that form.
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
