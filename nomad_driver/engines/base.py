"""What llmgw asks of an engine, in one place: each engine module (`llama_cpp.py`, `vllm.py`,
...) answers these for its own server, and `render`, `spec`, the node agent, the watcher and
the router ask the engine instead of naming it.

The defaults are those of an OpenAI-style server that needs nothing special: it answers
`/health` when ready, cannot split a model across nodes, takes no chat format, loads one file,
and the router passes its answers through untouched and opens a connection per request.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nomad_driver.spec import Model, Profile
    from nomad_driver.weights import Weights


@dataclass(frozen=True)
class ReplicaTasks:
    """One replica of a multi-node model as its engine runs it: the leader's task, which serves
    the API, the task of each shard; what the leader's group needs beyond its `http` port and
    `llmgw-engine` service; and the check on the shards' `llmgw-shard` service (none: it is
    there while the shard's process runs)."""

    leader: dict[str, Any]
    shard: dict[str, Any]
    leader_ports: Sequence[str] = ()
    leader_services: Sequence[dict[str, Any]] = ()
    shard_checks: Sequence[dict[str, Any]] = ()


class Engine:
    """One model server. Subclasses set `name` and `slots` and write `task` and
    `version_command`; the rest they override where their server differs."""

    # As profiles name it, and as its install directory under llmgw_engines_dir is called.
    name: str = ""
    # Requests one replica serves at once when the profile does not say: more in flight than
    # this is a queue inside the engine, which load scaling exists to avoid.
    slots: int = 1
    # The path the job's HTTP check asks; answered only once the model is loaded.
    readiness_path: str = "/health"
    # How it splits one model across nodes, in words; None when it cannot.
    shards_over: str | None = None
    # Whether a profile's `chat_format` means anything to it.
    takes_chat_format: bool = False
    # Whether it loads a whole Hugging Face repository or a directory, rather than one file.
    loads_repositories: bool = False
    # Whether its task sees the node's files where they lie: raw_exec has no filesystem
    # isolation (drivers/rawexec/driver.go), so a file:// source is read in place; a docker
    # task sees only what is mounted, so llmgw's fetch copies the file into the cache volume.
    reads_node_files: bool = True
    # Whether the router must ask it for a stream and assemble the client's answer: true for a
    # server that finishes a non-streamed completion whoever still listens (router/assemble.py).
    answers_assembled: bool = False
    # Whether a connection to it may carry another request once an answer is done
    # (router/upstream.py): only where the server itself keeps it open.
    keeps_connections: bool = False
    # The lines of its stderr that say why a start failed, most telling first; the watcher
    # tries them before the lines any engine might write (watcher/parking.py).
    startup_errors: tuple[re.Pattern[str], ...] = ()
    # The program its install's SHA256SUMS must list, relative to its version directory.
    main_program: str = ""

    def profile_problems(self, path: str, profile: Profile) -> list[str]:
        """What in a profile this engine cannot run, each as `path.field: why`."""
        return []

    def target_in_flight(self, profile: Profile) -> int:
        """The requests in flight one replica should carry before another is asked for."""
        return self.slots

    def task(self, model: Model, weights: Weights) -> tuple[str, dict[str, Any]]:
        """The Nomad driver and its config for one replica on one node."""
        raise NotImplementedError

    def replica_tasks(self, model: Model, job_id: str, weights: Weights) -> ReplicaTasks:
        """A replica spread over `model.profile.nodes` nodes; only for an engine with
        `shards_over` (the spec refuses `nodes` > 1 for any other)."""
        raise NotImplementedError(f"{self.name} cannot split a model across nodes")

    def version_command(self, install: Path) -> list[str]:
        """The command that makes an install say its version (node_agent/inventory.py)."""
        raise NotImplementedError

    def version_matches(self, version: str, output: str) -> bool:
        """Whether the version command's output says `version`: by default its last line is it."""
        return output.strip().splitlines()[-1:] == [version] if output.strip() else False


def python_module_version(install: Path, module: str) -> list[str]:
    """The version command of an engine that is a Python package in the install's own venv."""
    return [str(install / "bin" / "python"), "-c", f"import {module}; print({module}.__version__)"]
