"""A test-only engine, `echo`: the whole of what llmgw needs to know about a new model server,
in one file, registered with one call (`engines.register(ENGINE)`).

Its server (`echo_server.py`) answers chat completions with the last user message. An install
is `<llmgw_engines_dir>/echo/<version>/bin/echo-engine`, which `install` writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from nomad_driver.engines.base import Engine
from nomad_driver.node_meta import ENGINES_DIR_KEY, interpolated
from nomad_driver.spec import Model, Profile
from nomad_driver.weights import Weights

NAME = "echo"
PROGRAM = "bin/echo-engine"
SERVER = Path(__file__).resolve().with_name("echo_server.py")


class Echo(Engine):
    name = NAME
    slots = 2
    readiness_path = "/ready"
    main_program = PROGRAM

    def profile_problems(self, path: str, profile: Profile) -> list[str]:
        # It has no GPU code: a GPU asked for would be held and never used.
        return [f"{path}.gpus: {NAME} serves from the CPU; use gpus: 0"] if profile.gpus else []

    def task(self, model: Model, weights: Weights) -> tuple[str, dict[str, Any]]:
        program = f"{interpolated(ENGINES_DIR_KEY)}/{NAME}/{model.profile.engine_version}/{PROGRAM}"
        args = ["--model", weights.model_arg, "--name", model.name]
        args += ["--host", "${NOMAD_IP_http}", "--port", "${NOMAD_PORT_http}", *model.profile.args]
        return "raw_exec", {"command": program, "args": args}

    def version_command(self, install: Path) -> list[str]:
        return [str(install / PROGRAM), "--version"]


ENGINE = Echo()


def install(engines_dir: Path, version: str, *, says: str | None = None) -> Path:
    """An install of `version` that runs the echo server with this interpreter; `says`: the
    version its `--version` claims, for an install that is not what its directory says."""
    root = engines_dir / NAME / version
    (root / "bin").mkdir(parents=True, exist_ok=True)
    program = root / PROGRAM
    program.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --version ] && {{ echo {says or version}; exit 0; }}\n'
        f'exec {sys.executable} {SERVER} "$@"\n'
    )
    program.chmod(0o755)
    return root
