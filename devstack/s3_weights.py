"""`python -m devstack up --s3`: one more model, `tiny-s3`, whose weights are in a local
S3-compatible server that enforces credentials (moto's server mode), so the path private weights
take on a cluster runs here end to end: the model's Nomad Variable holds the access keys, the job's
`fetch` task signs its requests with them and fills the node's weights cache (a host volume per
node, as docs/operating.md has operators declare it), and the engine reads the weights from there.

Off by default: `make demo` stays as it is, and moto costs a process and a few seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from devstack import nomad_agent, processes
from devstack.gguf_tiny import write_tiny_gguf
from devstack.ports import free_port
from nomad_driver.fetch.render import HOST_VOLUME
from nomad_driver.node_meta import MODELS_DIR_KEY
from nomad_driver.spec import job_id_for
from nomad_driver.variables import source_variable_path
from nomad_driver.watcher.rollout import SECOND_JOB_SUFFIX

if TYPE_CHECKING:
    from devstack.stack import Stack

MODEL = "tiny-s3"
PROFILE = "small-gguf"  # the demo's one-GPU llama-cpp-python profile
BUCKET = "llmgw-weights"
KEY = f"{MODEL}/tiny.gguf"
REGION = "us-east-1"
REPO = Path(__file__).resolve().parents[1]
# moto answers this many requests before it enforces IAM: creating the user, its key and its
# policy. Everything after, the fetch included, needs that key.
_SETUP_REQUESTS = 3
_ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


@dataclass(frozen=True)
class S3Weights:
    endpoint: str
    access_key: str
    secret_key: str
    pid: int
    log: Path

    @property
    def source(self) -> str:
        # Path-style against a non-AWS endpoint, as models.md has it for S3-compatible stores.
        return f"s3://{BUCKET}/{KEY}?region={REGION}&endpoint={self.endpoint}"


def set_up(stack: Stack) -> S3Weights:
    """Before Nomad starts: moto with the weights, llmgw beside the engines, a cache per node
    and the model in the models file. The keys go into Nomad once it runs (`put_keys`)."""
    o = stack.options
    if o.nomad == "real" or (o.nomad == "auto" and nomad_agent.find_nomad()):
        # A real agent would need the host volumes in its client config, which the stack does
        # not write.
        raise RuntimeError("--s3 runs with the Nomad stand-in for now")
    s3 = start(stack.models_dir, stack.logs / "moto.log")
    stack._track("moto", s3.pid, s3.log)
    install_llmgw(stack.engines_dir)
    give_nodes_caches(stack.nodes_file, stack.dir / "weights")
    add_model(stack.models_file, s3.source)
    stack.say(f"S3 (moto, credentials enforced) {s3.endpoint}: {MODEL} from {s3.source}")
    return s3


def start(models_dir: Path, log: Path, timeout: float = 30.0) -> S3Weights:
    """moto's S3 in a process of its own, a user whose key may read the bucket, and the tiny GGUF
    uploaded with it."""
    import boto3  # a dev dependency (moto[server]), needed only with --s3

    port = free_port()
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_REQUESTS)}
    argv = [sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"]
    proc = processes.spawn("moto", argv, log, env={**os.environ, **env})
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=1)
            break
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's S3 server did not start on {endpoint}; see {log}") from None
            time.sleep(0.2)
    boot: dict[str, Any] = {"endpoint_url": endpoint, "region_name": REGION}
    iam = boto3.client("iam", aws_access_key_id="boot", aws_secret_access_key="boot", **boot)
    iam.create_user(UserName="llmgw-fetch")
    key = iam.create_access_key(UserName="llmgw-fetch")["AccessKey"]
    iam.put_user_policy(UserName="llmgw-fetch", PolicyName="s3", PolicyDocument=json.dumps(_ALLOW_S3))
    keys = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    s3 = boto3.client("s3", **keys, **boot)
    s3.create_bucket(Bucket=BUCKET)
    weights = write_tiny_gguf(models_dir / "tiny-s3.gguf", seed=3, context=2048)
    s3.upload_file(str(weights), BUCKET, KEY)
    return S3Weights(endpoint, key["AccessKeyId"], key["SecretAccessKey"], proc.pid, log)


def install_llmgw(engines_dir: Path) -> Path:
    """`<engines_dir>/llmgw/bin/llmgw`, where the fetch task runs it (docs/operating.md): this
    checkout's llmgw on this virtualenv's python."""
    script = engines_dir / "llmgw" / "bin" / "llmgw"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m nomad_driver.cli "$@"\n')
    script.chmod(0o755)
    return script


def give_nodes_caches(nodes_file: Path, caches: Path) -> None:
    """Every GPU node gets a weights cache of its own (`caches/<node>`), declared as the host
    volume the fetch needs and published in `llmgw_models_dir`, as the node agent would."""
    data: Any = yaml.safe_load(nodes_file.read_text())
    for node in data["nodes"]:
        if not node.get("gpus"):
            continue
        cache = (caches / str(node["name"])).resolve()
        cache.mkdir(parents=True, exist_ok=True)
        node.setdefault("meta", {})[MODELS_DIR_KEY] = str(cache)
        node["host_volumes"] = {**(node.get("host_volumes") or {}), HOST_VOLUME: {"path": str(cache)}}
    header = "# Written by 'python -m devstack up --s3': the fleet, each GPU node with a weights cache.\n"
    nodes_file.write_text(header + yaml.safe_dump(data, sort_keys=False))


def add_model(models_file: Path, source: str) -> None:
    """`tiny-s3` beside the demo's models, on the demo's one-GPU profile."""
    data: Any = yaml.safe_load(models_file.read_text())
    data.setdefault("models", {})[MODEL] = {
        "source": source,
        "profile": PROFILE,
        "replicas": {"min": 1, "max": 1},
    }
    header = "# Written by 'python -m devstack up --s3': the demo's models and tiny-s3, fetched from S3.\n"
    models_file.write_text(header + yaml.safe_dump(data, sort_keys=False))


def put_keys(nomad_url: str, s3: S3Weights, token: str | None, ca: Path | None) -> None:
    """The model's source Variable (`nomad var put llmgw/sources/tiny-s3 AWS_...`), which only its
    job's fetch task reads."""
    path = source_variable_path(MODEL)
    items = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    headers = {"X-Nomad-Token": token} if token else {}
    resp = httpx.put(
        f"{nomad_url}/v1/var/{path}",
        json={"Path": path, "Items": items},
        headers=headers,
        verify=str(ca) if ca else True,
        timeout=10,
    )
    if resp.status_code != 200:
        raise RuntimeError(f"writing the Variable {path}: {resp.status_code} {resp.text.strip()}")
    if token:
        attach_source_policies(nomad_url, token, ca)


def attach_source_policies(nomad_url: str, token: str, ca: Path | None) -> None:
    """With ACLs on, the fetch's template reads the Variable with its job's workload identity,
    and `llmgw/sources/...` is none of the job's own paths: attach read on it to each of the
    model's two job IDs (`nomad acl policy apply -job`), as docs/models.md has operators do."""
    path = source_variable_path(MODEL)
    rules = f'namespace "default" {{\n  variables {{\n    path "{path}" {{\n      capabilities = ["read"]\n    }}\n  }}\n}}\n'
    first, second = job_id_for(MODEL), job_id_for(MODEL) + SECOND_JOB_SUFFIX
    for name, job in ((f"llmgw-source-{MODEL}", first), (f"llmgw-source-{MODEL}-b", second)):
        resp = httpx.put(
            f"{nomad_url}/v1/acl/policy/{name}",
            json={"Name": name, "Rules": rules, "JobACL": {"Namespace": "default", "JobID": job}},
            headers={"X-Nomad-Token": token},
            verify=str(ca) if ca else True,
            timeout=10,
        )
        if resp.status_code != 200:
            raise RuntimeError(f"writing the ACL policy {name}: {resp.status_code} {resp.text.strip()}")
