"""llama.cpp's own server, `llama-server`: a native program under llmgw_engines_dir, run with
raw_exec, that can split one model over `ggml-rpc-server` shards on other nodes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nomad_driver.engines import gpu_check
from nomad_driver.engines.base import Engine, ReplicaTasks
from nomad_driver.engines.job_parts import SHARD_SERVICE, env_template, shard_tag, shell_word
from nomad_driver.node_meta import ENGINES_DIR_KEY, interpolated

if TYPE_CHECKING:
    from nomad_driver.spec import Model, Profile
    from nomad_driver.weights import Weights

NAME = "llama.cpp"
SERVER = "llama-server"
RPC_SERVER = "ggml-rpc-server"
RPC_SERVERS_VAR = "RPC_SERVERS"


def gpu_probe(server: str) -> str:
    """llama.cpp's own listing of the devices it can use (`(none)` when CUDA sees none)."""
    return f"{shlex.quote(server)} --list-devices"


def cuda_device_names(gpus: int) -> str:
    """`CUDA0,CUDA1,...`: llama.cpp's `--device` list for the first `gpus` devices it sees. With
    it, an engine that sees fewer exits ("invalid device") instead of falling back to the CPU."""
    return ",".join(f"CUDA{i}" for i in range(gpus))


def parallel_slots(args: list[str]) -> int | None:
    """llama-server's `--parallel N` (`-np N`, `--parallel=N`) in a profile's args, if set."""
    for i, arg in enumerate(args):
        value = None
        if arg in ("--parallel", "-np") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--parallel="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _shard_lookup(job_id: str) -> str:
    # consul-template's `service "TAG.NAME"`: passing instances only, so a shard that fails its
    # check leaves the list and the leader is restarted without it. A llama.cpp shard has no
    # check: ggml-rpc-server serves one client at a time and its accept queue holds two, so
    # while the leader is connected a TCP check's connections queue up unanswered and the check
    # fails within two intervals, which would restart the leader every minute. Its service is
    # there while its process runs (Nomad registers it at the start and removes it at the exit),
    # which is the set the leader needs.
    return f'service "{shard_tag(job_id)}.{SHARD_SERVICE}"'


def _rpc_servers_template(job_id: str) -> dict[str, Any]:
    """`RPC_SERVERS=host:port,...` of this replica's shards. `restart` on change: the
    leader's llama-server holds its shards' connections for life, so a new set means a new
    start (and a vanished shard kills it anyway)."""
    body = (
        f"{RPC_SERVERS_VAR}={{{{ range $i, $s := {_shard_lookup(job_id)} }}}}"
        "{{ if $i }},{{ end }}{{ $s.Address }}:{{ $s.Port }}{{ end }}\n"
    )
    return env_template(body, "local/shards.env")


# How long the leader waits for a listed shard to accept a connection, in half seconds.
SHARD_LISTEN_TRIES = 240


def _wait_for_shards(workers: int, var: str, command: str) -> list[str]:
    """A shell that starts the leader only once the template lists all `workers` shards, and
    otherwise waits, listening on nothing, so its check fails and no half replica serves: when
    the last shard registers, the template changes and Nomad restarts it into the real start.
    A shard is listed from its task's start, before ggml-rpc-server listens (CUDA's start alone
    takes seconds), and llama-server aborts on a shard that refuses it, a failed start of a
    replica that was only coming up; so each is first tried with a bare connection, which
    ggml-rpc-server drops as a client that said nothing (bash's /dev/tcp: sh has none; without
    bash, or after two minutes, llama-server starts anyway and says what it found)."""
    probe = (
        f'if command -v bash >/dev/null 2>&1; then for s in $(printf %s "${var}" | tr , " "); do '
        'h=$(printf %s "$s" | cut -d: -f1); p=$(printf %s "$s" | cut -d: -f2); i=0; '
        'until bash -c \'exec 3<>/dev/tcp/$1/$2\' probe "$h" "$p" 2>/dev/null; do '
        f'if [ "$i" -ge {SHARD_LISTEN_TRIES} ]; then break; fi; '
        'if [ "$i" -eq 0 ]; then echo "waiting for shard $s to accept connections" >&2; fi; '
        "i=$((i+1)); sleep 0.5; done; done; fi; "
    )
    script = (
        f'n=$(printf %s "${var}" | tr , "\n" | grep -c .); '
        f'if [ "$n" -lt {workers} ]; then '
        f'echo "waiting for {workers} shard(s), $n registered and healthy" >&2; exec sleep 2147483647; fi; '
        f"{probe}exec {command}"
    )
    return ["-c", script]


class LlamaCpp(Engine):
    name = NAME
    # llama-server's default `--parallel` (4 since it sizes slots itself).
    slots = 4
    shards_over = f"RPC ({RPC_SERVER} on the shards)"
    # llama-server does look at the connection while it waits for a non-streamed result, but
    # only when a one-second wait for results times out (server_response_reader::next in
    # tools/server/server-queue.cpp), and every result of any other request (another slot's
    # stream, a /slots or /metrics read) wakes that wait first: on an engine with anything else
    # going on, a non-streamed answer whose client left runs to its end (measured: 20 s and
    # counting at 700 tokens/s while /slots was read five times a second; cancelled within a
    # second once nothing else happened). Its streams check the connection at every token.
    answers_assembled = True
    # After every streamed answer it closes the connection at once, although the answer's head
    # said `Keep-Alive: timeout=5, max=100` (its chunked content provider returns false after
    # `sink.done()`, which cpp-httplib 0.58 takes as a failed write and ends the connection;
    # measured: the close arrives 0.02 ms after the answer's last byte). A request written on
    # that connection in between, which a burst does, is read and dropped by the closing
    # server: lost, and not to be sent again (3 of 14 load-scaling runs, before). The router
    # asks it for a stream even for a non-streamed completion (answers_assembled), so nearly
    # every connection to it would end so: it gets a connection per request.
    keeps_connections = False
    # The loader's own words, a few lines above a traceback's generic last line.
    startup_errors = (
        # The file itself, with the path and errno: a file:// source missing on this node.
        re.compile(r"failed to open GGUF file", re.I),
        re.compile(r"unknown model architecture", re.I),
        re.compile(r"error loading model", re.I),
    )
    main_program = SERVER

    def target_in_flight(self, profile: Profile) -> int:
        return parallel_slots(profile.args) or self.slots

    def task(self, model: Model, weights: Weights) -> tuple[str, dict[str, Any]]:
        p = model.profile
        # raw_exec, not exec: the engine lives under llmgw_engines_dir (/opt/...), which exec's
        # chroot does not carry, and CUDA needs the host's driver libraries as they are.
        server = f"{interpolated(ENGINES_DIR_KEY)}/{NAME}/{p.engine_version}/{SERVER}"
        listen = ["--host", "${NOMAD_IP_http}", "--port", "${NOMAD_PORT_http}"]
        args = ["--model", weights.model_arg, *listen, "--ctx-size", str(p.context)]
        args += ["--alias", model.name]
        if p.gpus > 0:
            args += ["-ngl", "999", "--device", cuda_device_names(p.gpus)]
            probe = gpu_probe(server)
            return "raw_exec", gpu_check.checked_command(p.gpus, probe, server, args + p.args)
        return "raw_exec", {"command": server, "args": args + p.args}

    def replica_tasks(self, model: Model, job_id: str, weights: Weights) -> ReplicaTasks:
        p = model.profile
        workers = p.nodes - 1
        binary = f"{interpolated(ENGINES_DIR_KEY)}/{NAME}/{p.engine_version}"
        # Leader and shards alike get their GPUs at run time and refuse to start without them.
        probe = gpu_probe(f"{binary}/{SERVER}")
        devices = ["--device", cuda_device_names(p.gpus)] if p.gpus > 0 else []
        leader_args = [
            "--model",
            weights.model_arg,
            "--host",
            "${NOMAD_IP_http}",
            "--port",
            "${NOMAD_PORT_http}",
        ]
        leader_args += [
            "--ctx-size",
            str(p.context),
            "--alias",
            model.name,
            "--rpc",
            f"${{{RPC_SERVERS_VAR}}}",
        ]
        # Every layer goes to a device, local GPUs and the shards' alike; without it llama.cpp
        # keeps the model on the leader's CPU and the shards hold nothing.
        leader_args += ["-ngl", "999", *devices, *p.args]
        command = " ".join(shell_word(a) for a in [f"{binary}/{SERVER}", *leader_args])
        wait_args = _wait_for_shards(workers, RPC_SERVERS_VAR, command)
        if p.gpus > 0:
            wait_args = gpu_check.checked_script(p.gpus, probe, wait_args[1])
        leader: dict[str, Any] = {
            "Driver": "raw_exec",
            "Config": {"command": "/bin/sh", "args": wait_args},
            "Templates": [_rpc_servers_template(job_id)],
            # Without it the task has no Consul identity, and on a Consul with ACLs its lookup
            # of the shards is answered empty: the leader would wait for ever.
            "Consul": {},
        }
        shard_command = f"{binary}/{RPC_SERVER}"
        shard_args = ["--host", "${NOMAD_IP_rpc}", "--port", "${NOMAD_PORT_rpc}", *devices]
        shard_config: dict[str, Any] = {"command": shard_command, "args": shard_args}
        if p.gpus > 0:
            shard_config = gpu_check.checked_command(p.gpus, probe, shard_command, shard_args)
        # No check on the shards' service (_shard_lookup says why).
        return ReplicaTasks(leader=leader, shard={"Driver": "raw_exec", "Config": shard_config})

    def version_command(self, install: Path) -> list[str]:
        return [str(install / SERVER), "--version"]

    def version_matches(self, version: str, output: str) -> bool:
        # The server prints its build number ("version: 6500 (...)"), which is what its `b6500`
        # release tags are named after.
        build = version.lstrip("b")
        return re.search(rf"\bversion:\s*{re.escape(build)}\b", output) is not None


ENGINE = LlamaCpp()
