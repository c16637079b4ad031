"""vLLM's OpenAI server, from its container image (`vllm/vllm-openai:<version>`) under the
docker driver; it splits one model across nodes over Ray."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nomad_driver.engines.base import Engine, ReplicaTasks, python_module_version
from nomad_driver.engines.job_parts import (
    PORT_LABEL,
    RPC_PORT_LABEL,
    env_template,
    shard_tag,
    shell_word,
    tcp_check,
)

if TYPE_CHECKING:
    from nomad_driver.spec import Model, Profile
    from nomad_driver.weights import Weights

NAME = "vllm"

# vLLM shares tensors between its tensor-parallel workers through /dev/shm; Docker's 64 MiB
# default makes a multi-GPU model die at start-up.
SHM_BYTES = 16 * 1024**3

RAY_PORT_LABEL = "ray"
RAY_HEAD_VAR = "RAY_HEAD_ADDRESS"
RAY_HEAD_SERVICE = "llmgw-ray-head"


def image(version: str) -> str:
    return f"vllm/vllm-openai:{version}"


def _ray_head_lookup(job_id: str) -> dict[str, Any]:
    """`RAY_HEAD_ADDRESS=host:port` of this replica's head; a new head restarts the shard into it."""
    body = (
        f'{RAY_HEAD_VAR}={{{{ range service "{shard_tag(job_id)}.{RAY_HEAD_SERVICE}" }}}}'
        "{{ .Address }}:{{ .Port }}{{ end }}\n"
    )
    return env_template(body, "local/head.env")


class Vllm(Engine):
    name = NAME
    # A conservative share of its continuous batch: it admits far more, but latency climbs first.
    slots = 32
    shards_over = "Ray"
    # It downloads a whole Hugging Face repository itself.
    loads_repositories = True
    reads_node_files = False  # docker
    # Its OpenAI server cancels the handler on disconnect, so its answers pass through
    # untouched.
    answers_assembled = False
    # uvicorn keeps a connection until it has been idle for its `timeout_keep_alive` (5 s).
    keeps_connections = True
    main_program = "bin/python"

    def profile_problems(self, path: str, profile: Profile) -> list[str]:
        if profile.gpus == 0:
            return [f"{path}.gpus: {NAME} needs at least one GPU"]
        return []

    def task(self, model: Model, weights: Weights) -> tuple[str, dict[str, Any]]:
        p = model.profile
        # The docker driver maps the dynamic port to the same number inside the container, so
        # the engine listens on NOMAD_PORT_http on all interfaces.
        args = ["--model", weights.model_arg, "--served-model-name", model.name]
        args += ["--host", "0.0.0.0", "--port", "${NOMAD_PORT_http}", "--max-model-len", str(p.context)]
        if p.gpus > 1:
            args += ["--tensor-parallel-size", str(p.gpus)]
        config = {
            "image": image(p.engine_version),
            "ports": [PORT_LABEL],
            "shm_size": SHM_BYTES,
            "args": args + p.args,
        }
        return "docker", config

    def replica_tasks(self, model: Model, job_id: str, weights: Weights) -> ReplicaTasks:
        # The leader starts Ray's head and then vLLM, which waits until the Ray cluster holds
        # the GPUs of all `nodes` (its placement group) before it loads; each shard finds the
        # head through Consul and joins with its node's GPUs. Pipeline parallelism across the
        # nodes, tensor parallelism within each.
        p = model.profile
        serve = ["vllm", "serve", weights.model_arg, "--served-model-name", model.name, "--host", "0.0.0.0"]
        serve += ["--port", "${NOMAD_PORT_http}", "--max-model-len", str(p.context)]
        serve += ["--tensor-parallel-size", str(p.gpus), "--pipeline-parallel-size", str(p.nodes)]
        serve += ["--distributed-executor-backend", "ray", *p.args]
        head = (
            f"ray start --head --node-ip-address=${{NOMAD_IP_{RAY_PORT_LABEL}}} --port=${{NOMAD_PORT_{RAY_PORT_LABEL}}}"
            " && exec " + " ".join(shell_word(a) for a in serve)
        )
        # Host networking: Ray opens ports of its own between the nodes beyond the one Nomad
        # gives. Ray's head and workers, and vLLM's own processes, run in the same image.
        leader = {
            "Driver": "docker",
            "Config": {
                "image": image(p.engine_version),
                "entrypoint": ["/bin/sh"],
                "args": ["-c", head],
                "network_mode": "host",
                "shm_size": SHM_BYTES,
            },
        }
        join = (
            f'test -n "${RAY_HEAD_VAR}" || {{ echo "waiting for the Ray head in Consul" >&2; exec sleep 2147483647; }}; '
            f"exec ray start --block --address=${RAY_HEAD_VAR} --node-ip-address=${{NOMAD_IP_{RPC_PORT_LABEL}}} "
            f"--node-manager-port=${{NOMAD_PORT_{RPC_PORT_LABEL}}}"
        )
        shard = {
            "Driver": "docker",
            "Config": {
                "image": image(p.engine_version),
                "entrypoint": ["/bin/sh"],
                "args": ["-c", join],
                "network_mode": "host",
                "shm_size": SHM_BYTES,
            },
            "Templates": [_ray_head_lookup(job_id)],
            # The head lookup's Consul identity: without it, on a Consul with ACLs, the lookup
            # is answered empty and the shard waits for ever.
            "Consul": {},
        }
        head_service = {
            "Name": RAY_HEAD_SERVICE,
            "PortLabel": RAY_PORT_LABEL,
            "Tags": [shard_tag(job_id), f"model={model.name}"],
            "Meta": {"model": model.name, "def_hash": model.def_hash, "job": job_id},
            "Checks": [tcp_check("ray head up", RAY_PORT_LABEL)],
        }
        return ReplicaTasks(
            leader=leader,
            shard=shard,
            leader_ports=(RAY_PORT_LABEL,),
            leader_services=(head_service,),
            shard_checks=(tcp_check("shard listening", RPC_PORT_LABEL),),
        )

    def version_command(self, install: Path) -> list[str]:
        return python_module_version(install, "vllm")


ENGINE = Vllm()
