"""The stand-in's artifact downloads follow a real client's sandbox (devstack/nomad/getter.py):
a task's own variables never reach the getter, the client's timeouts and size cap stop a
download, and a `file://` source gets the answer Nomad gives. Each failure reads as the task
event Nomad writes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devstack.nomad.artifacts import ArtifactError, fetch_artifact
from devstack.nomad.getter import DEFAULT, GB, MINUTE, parse_artifact_config, sandbox_environment
from devstack.nomad.nodes import NodeSpecError, node_from_spec
from devstack.nomad.server import NomadServer
from devstack.nomad.taskenv import TaskEnv
from devstack.nomad.taskstate import RestartTracker
from tests.fetch.servers import moto_s3, weights_server
from tests.standin.client_helpers import (
    dead,
    events_of,
    make_job,
    new_store,
    raw_exec_task,
    restart_policy,
    running_client,
    start_alloc,
    wait_alloc,
)

WEIGHTS = os.urandom(256 * 1024)
TASK_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "from-the-task", "AWS_SECRET_ACCESS_KEY": "from-the-task"}


def dirs(tmp_path: Path) -> tuple[Path, Path, TaskEnv]:
    alloc_root = tmp_path / "alloc"
    task_dir = alloc_root / "engine"
    # What the task's `env` block and an `env = true` template put in its environment.
    env = TaskEnv({"NOMAD_TASK_DIR": str(task_dir / "local"), **TASK_CREDENTIALS}, {})
    return alloc_root, task_dir, env


def test_client_defaults_are_nomads() -> None:
    assert DEFAULT.http_read_timeout == DEFAULT.s3_timeout == 30 * MINUTE
    assert DEFAULT.http_max_size == 100 * GB
    assert DEFAULT.set_environment_variables == ""
    # params.go deadline(): the largest timeout, 30m at least, plus a minute.
    assert DEFAULT.deadline() == 31 * MINUTE
    longer = parse_artifact_config({"s3_timeout": "2h", "http_max_size": "200GiB"}, "node 'gpu-0'")
    assert longer.deadline() == 121 * MINUTE
    assert longer.http_max_size == 200 * 1024**3
    with pytest.raises(
        ValueError, match=r"node 'gpu-0': artifact\.http_read_timeout: 'soon' is not a duration"
    ):
        parse_artifact_config({"http_read_timeout": "soon"}, "node 'gpu-0'")
    with pytest.raises(NodeSpecError, match=r"artifact: unknown key\(s\) read_timeout"):
        node_from_spec({"name": "gpu-0", "artifact": {"read_timeout": "1h"}})


def test_a_fleet_entrys_artifact_block_is_the_clients_and_not_in_the_node_json(tmp_path: Path) -> None:
    node = node_from_spec({"name": "gpu-0", "artifact": {"http_read_timeout": "2h"}})
    server = NomadServer([node], None, tmp_path)
    stored = node
    assert not any(k.startswith("_") for k in stored)
    assert server._artifact_configs[node["ID"]].http_read_timeout == 2 * 60 * MINUTE


def test_the_getter_sees_a_minimal_environment_and_what_the_client_passes_on(tmp_path: Path) -> None:
    client_env = {"HOME": "/home/nomad", "AWS_PROFILE": "weights", "NOMAD_TOKEN": "agent-secret"}
    config = parse_artifact_config({"set_environment_variables": "AWS_PROFILE, HTTPS_PROXY"}, "n")
    env = sandbox_environment(tmp_path / "engine", config, client_env)
    assert env == {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "TMPDIR": str(tmp_path / "engine" / "tmp"),
        "HOME": "/home/nomad",
        "AWS_PROFILE": "weights",
        "HTTPS_PROXY": "",
    }


def test_an_s3_artifact_never_sees_the_tasks_credentials(tmp_path: Path) -> None:
    alloc_root, task_dir, env = dirs(tmp_path)
    with moto_s3({"models/tiny.gguf": WEIGHTS}) as s3:
        source = f"s3::{s3.endpoint}/{s3.bucket}/models/tiny.gguf"
        artifact = {"GetterSource": source, "RelativeDest": "local/model/tiny.gguf", "GetterMode": "file"}
        with pytest.raises(ArtifactError) as refused:
            fetch_artifact(artifact, env, task_dir, alloc_root, client_env={"HOME": "/root"})
        assert str(refused.value) == (
            f'failed to download artifact "{source}": getter subprocess failed: exit status 1: '
            "failed to download artifact: NoCredentialProviders: no valid providers in chain. Deprecated.\n"
            "\tFor verbose messaging see aws.Config.CredentialsChainVerboseErrors"
        )

        # The client's own credentials, passed on by set_environment_variables, do reach it.
        client_env = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
        config = parse_artifact_config(
            {"set_environment_variables": "AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY"}, "n"
        )
        fetch_artifact(artifact, env, task_dir, alloc_root, config, client_env=client_env)
        assert (task_dir / "local/model/tiny.gguf").read_bytes() == WEIGHTS


def test_a_slow_download_is_stopped_at_http_read_timeout(tmp_path: Path) -> None:
    alloc_root, task_dir, env = dirs(tmp_path)
    config = parse_artifact_config({"http_read_timeout": "1s"}, "n")
    with weights_server({"/tiny.gguf": WEIGHTS}, rate=64 * 1024) as server:
        source = server.url("/tiny.gguf")
        artifact = {"GetterSource": source, "RelativeDest": "local/model/tiny.gguf", "GetterMode": "file"}
        with pytest.raises(ArtifactError) as stopped:
            fetch_artifact(artifact, env, task_dir, alloc_root, config)
    assert str(stopped.value) == (
        f'failed to download artifact "{source}": getter subprocess failed: exit status 1: '
        "failed to download artifact: context deadline exceeded"
    )


def test_an_artifact_over_http_max_size_is_refused(tmp_path: Path) -> None:
    alloc_root, task_dir, env = dirs(tmp_path)
    config = parse_artifact_config({"http_max_size": "100KB"}, "n")
    with weights_server({"/tiny.gguf": WEIGHTS}) as server:
        artifact = {
            "GetterSource": server.url("/tiny.gguf"),
            "RelativeDest": "local/m.gguf",
            "GetterMode": "file",
        }
        with pytest.raises(ArtifactError, match=r"exceeds http_max_size 100000$"):
            fetch_artifact(artifact, env, task_dir, alloc_root, config)
        fetch_artifact(artifact, env, task_dir, alloc_root)
    assert (task_dir / "local/m.gguf").read_bytes() == WEIGHTS


def test_a_file_source_gets_nomads_answer_unless_the_stand_ins_file_getter_is_on(tmp_path: Path) -> None:
    alloc_root, task_dir, env = dirs(tmp_path)
    model = tmp_path / "tiny.gguf"
    model.write_bytes(WEIGHTS)
    for source in (f"file://{model}", str(model)):
        artifact = {"GetterSource": source, "RelativeDest": "local/model/", "GetterMode": "any"}
        with pytest.raises(ArtifactError) as refused:
            fetch_artifact(artifact, env, task_dir, alloc_root)
        assert str(refused.value) == (
            f'failed to download artifact "{source}": getter subprocess failed: exit status 1: '
            "failed to download artifact: download not supported for scheme 'file'"
        )
    config = parse_artifact_config({"file_getter": True}, "n")
    assert (fetch_artifact(artifact, env, task_dir, alloc_root, config) / "tiny.gguf").read_bytes() == WEIGHTS


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[object]:
    store = new_store()
    async with running_client(store, tmp_path / "data", clock_speed=50) as runner:
        yield store, runner


async def test_the_task_event_of_a_download_stopped_by_the_clients_timeout(
    tmp_path: Path, client: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RestartTracker, "jitter", 0.0)
    store, runner = client
    node_id = next(iter(store.nodes))
    runner.artifact_configs[node_id] = parse_artifact_config({"http_read_timeout": "500ms"}, "n")
    with weights_server({"/tiny.gguf": WEIGHTS}, rate=64 * 1024) as server:
        source = server.url("/tiny.gguf")
        task = raw_exec_task(
            "engine",
            "/bin/true",
            [],
            Artifacts=[{"GetterSource": source, "RelativeDest": "local/model/", "GetterMode": "any"}],
            RestartPolicy=restart_policy(attempts=0, mode="fail"),
        )
        alloc_id = start_alloc(store, runner, make_job([task], job_type="batch"))
        alloc = await asyncio.wait_for(wait_alloc(store, alloc_id, dead), 30)
    failed = events_of(alloc, "Failed Artifact Download")
    assert failed and failed[0]["DownloadError"] == (
        f'failed to download artifact "{source}": getter subprocess failed: exit status 1: '
        "failed to download artifact: context deadline exceeded"
    )
