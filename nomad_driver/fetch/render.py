"""The parts of a model's job that bring its weights to the node through `llmgw fetch`.

For a source the fetch handles (one remote file: https, s3, hf; or a file on the node for an
engine whose task cannot see it, `Engine.reads_node_files`), the engine's group gets:

- a host volume `llmgw-weights` (group `volume`, Type host): only nodes whose client declares it
  are feasible, and placement summaries say "missing compatible host volumes" for the others;
- a prestart task `fetch` (lifecycle prestart, not a sidecar): it runs `llmgw fetch` to
  completion before the engine starts, and a fetch that fails fails the start;
- in the fetch task, a template (env = true) that turns the model's Nomad Variable
  (variables.py: `llmgw/sources/<model, . as ~>`) into its environment: AWS_*, HF_TOKEN,
  LLMGW_SOURCE_TOKEN. Only this task sees them; the engine never does;
- the engine reads the weights at `${meta.llmgw_models_dir}/<model>/<file>`.

raw_exec has no filesystem isolation and mounts nothing (drivers/rawexec/driver.go): both tasks
use the host path that the node agent publishes as `llmgw_models_dir`. The `volume_mount`s mount
the same path at the same place for a driver that does mount (docker), so one path serves both.
An affinity (never a constraint) prefers nodes whose `llmgw_models_cached` lists the model, so a
replica lands where the weights already are when it can.
"""

from __future__ import annotations

from typing import Any

from nomad_driver import engines
from nomad_driver.fetch.sources import is_fetched, local_path, parse_source
from nomad_driver.node_meta import (
    ENGINES_DIR_KEY,
    FETCH_MIN_RATE_KEY,
    FETCH_STALL_WINDOW_KEY,
    MODELS_CACHED_KEY,
    MODELS_DIR_KEY,
    MODELS_MAX_KEY,
    interpolated,
)
from nomad_driver.spec import Model
from nomad_driver.variables import source_variable_path
from nomad_driver.weights import Weights, weights_for

FETCH_TASK = "fetch"
HOST_VOLUME = "llmgw-weights"
VOLUME_ALIAS = "weights"
CREDENTIALS_FILE = "secrets/source.env"
# Where `llmgw` is installed on a GPU node: a virtualenv beside the engines.
FETCH_COMMAND = f"{interpolated(ENGINES_DIR_KEY)}/llmgw/bin/llmgw"
CACHED_AFFINITY_WEIGHT = 50
FETCH_CPU_MHZ = 500
FETCH_MEMORY_MIB = 256


def fetched(model: Model) -> bool:
    """Whether llmgw's fetch brings the model's weights to the node."""
    if is_fetched(model.source):
        return True
    return local_path(model.source) is not None and not engines.get(model.profile.engine).reads_node_files


def weights_of(model: Model) -> Weights:
    """Where the engine finds the model's weights: the node's cache for a fetched source, the
    path itself for a file the engine sees where it lies, otherwise what weights.py says (an
    artifact, or a name vLLM resolves itself)."""
    if fetched(model):
        name = parse_source(model.source, env={}).file_name
        return Weights(model_arg=f"{interpolated(MODELS_DIR_KEY)}/{model.name}/{name}", artifact=None)
    path = local_path(model.source)
    return Weights(model_arg=path, artifact=None) if path is not None else weights_for(model.source)


def credentials_template(model: Model) -> dict[str, Any]:
    """Every item of the model's Variable as `KEY=value` in the fetch's environment. Guarded by
    nomadVarExists: a model with a public source needs no Variable, and Nomad would otherwise
    hold the task until one appears."""
    path = source_variable_path(model.name)
    body = (
        f'{{{{ if nomadVarExists "{path}" }}}}'
        f'{{{{ range $k, $v := nomadVar "{path}" }}}}{{{{ $k }}}}={{{{ $v }}}}\n{{{{ end }}}}'
        "{{ end }}"
    )
    return {
        "EmbeddedTmpl": body,
        "DestPath": CREDENTIALS_FILE,
        "Envvars": True,
        # The fetch has finished by the time a credential changes; the next start reads it.
        "ChangeMode": "noop",
        "Splay": 0,
    }


def fetch_task(model: Model) -> dict[str, Any]:
    args = ["fetch", model.source, "--model", model.name, "--cache", interpolated(MODELS_DIR_KEY)]
    args += ["--max-size", interpolated(MODELS_MAX_KEY)]
    args += ["--min-rate", interpolated(FETCH_MIN_RATE_KEY)]
    args += ["--stall-window", interpolated(FETCH_STALL_WINDOW_KEY)]
    return {
        "Name": FETCH_TASK,
        "Driver": "raw_exec",
        "Config": {"command": FETCH_COMMAND, "args": args},
        "Lifecycle": {"Hook": "prestart", "Sidecar": False},
        "Templates": [credentials_template(model)],
        "VolumeMounts": [_mount(read_only=False)],
        "Resources": {"CPU": FETCH_CPU_MHZ, "MemoryMB": FETCH_MEMORY_MIB},
        "KillTimeout": 5_000_000_000,
    }


def _mount(read_only: bool) -> dict[str, Any]:
    return {"Volume": VOLUME_ALIAS, "Destination": interpolated(MODELS_DIR_KEY), "ReadOnly": read_only}


def add_fetch(group: dict[str, Any], model: Model, engine_task: dict[str, Any]) -> None:
    """Give `group` the fetch of the model's weights, when its source is one the fetch handles.
    The engine task stays first in the group's task list."""
    if not fetched(model):
        return
    group["Volumes"] = {
        VOLUME_ALIAS: {"Name": VOLUME_ALIAS, "Type": "host", "Source": HOST_VOLUME, "ReadOnly": False}
    }
    engine_task["VolumeMounts"] = [_mount(read_only=True)]
    group["Affinities"] = [
        *group.get("Affinities", []),
        {
            "LTarget": interpolated(MODELS_CACHED_KEY),
            "RTarget": model.name,
            "Operand": "set_contains",
            "Weight": CACHED_AFFINITY_WEIGHT,
        },
    ]
    group["Tasks"] = [*group["Tasks"], fetch_task(model)]
