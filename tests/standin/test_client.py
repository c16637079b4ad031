"""The stand-in client running raw_exec tasks as real processes: interpolation, environment,
artifacts, logs, restarts with Nomad's events, kills that leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import sys
import tarfile
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from devstack.nomad.artifacts import ArtifactError, fetch_artifact
from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.getter import parse_artifact_config
from devstack.nomad.state import StateStore
from devstack.nomad.taskenv import TaskEnv
from devstack.nomad.taskstate import RestartTracker
from devstack.processes import alive
from tests.standin.client_helpers import (
    Json,
    all_gone,
    dead,
    event_types,
    events_of,
    make_job,
    new_store,
    raw_exec_task,
    restart_policy,
    running_client,
    start_alloc,
    task_state,
    wait_alloc,
)


@dataclass
class Harness:
    store: StateStore
    client: ClientRunner
    tmp: Path
    updates: list[Json] = field(default_factory=list)

    def run(self, job: Json, **alloc_kw: Any) -> str:
        return start_alloc(self.store, self.client, job, **alloc_kw)

    def script(self, name: str, body: str) -> str:
        path = self.tmp / name
        path.write_text(textwrap.dedent(body))
        return str(path)


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RestartTracker, "jitter", 0.0)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    store = new_store()
    updates: list[Json] = []
    async with running_client(store, tmp_path / "data", clock_speed=50, on_update=updates.append) as client:
        yield Harness(store, client, tmp_path, updates)


REPORT = """
    import json, os, sys
    keys = ["NOMAD_PORT_http", "NOMAD_ADDR_http", "NOMAD_IP_http", "NOMAD_HOST_PORT_http",
            "NOMAD_ALLOC_ID", "NOMAD_ALLOC_INDEX", "NOMAD_ALLOC_DIR", "NOMAD_TASK_DIR",
            "NOMAD_SECRETS_DIR", "NOMAD_JOB_ID", "NOMAD_GROUP_NAME", "NOMAD_TASK_NAME",
            "NOMAD_META_llmgw_model", "NOMAD_META_LLMGW_MODEL", "NOMAD_DC", "NOMAD_REGION",
            "NOMAD_MEMORY_LIMIT", "NVIDIA_VISIBLE_DEVICES", "MODEL_FROM_ENV", "CONSUL_HTTP_TOKEN"]
    print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys},
                      "cwd": os.getcwd()}))
    print("to stderr", file=sys.stderr)
"""


async def test_raw_exec_runs_with_interpolated_args_and_nomad_env(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's own secrets never reach a task.
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "agent-secret")
    script = harness.script("report.py", REPORT)
    task = raw_exec_task(
        "engine",
        sys.executable,
        [
            script,
            "--port",
            "${NOMAD_PORT_http}",
            "--model",
            "${NOMAD_TASK_DIR}/model/tiny.gguf",
            "${meta.rack}",
            "${node.unique.name}",
            "${attr.kernel.name}",
            "${NOMAD_META_llmgw_model}",
            "${NOMAD_ALLOC_INDEX}",
            "${no.such.thing}",
        ],
        Env={"MODEL_FROM_ENV": "${NOMAD_META_llmgw_model}@${node.unique.name}"},
    )
    job = make_job([task], job_type="batch", job_meta={"llmgw_model": "qwen2.5-0.5b"})
    alloc_id = harness.run(job, index=3, ports={"http": 23456}, devices={"engine": ["GPU-aaa", "GPU-bbb"]})
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert alloc["ClientStatus"] == "complete", events_of(alloc, "Terminated")

    stdout = harness.client.log_path(alloc_id, "engine", "stdout")
    assert stdout.name == "engine.stdout.0"
    assert stdout.parent == tmp_alloc(harness, alloc_id) / "alloc" / "logs"
    report = json.loads(stdout.read_text().splitlines()[0])
    task_dir = tmp_alloc(harness, alloc_id) / "engine"
    assert report["argv"] == [
        "--port",
        "23456",
        "--model",
        f"{task_dir}/local/model/tiny.gguf",
        "r42",
        "gpu-node-0",
        "linux",
        "qwen2.5-0.5b",
        "3",
        "${no.such.thing}",
    ]
    env = report["env"]
    assert env["NOMAD_PORT_http"] == "23456"
    assert env["NOMAD_HOST_PORT_http"] == "23456"
    assert env["NOMAD_ADDR_http"] == "127.0.0.1:23456"
    assert env["NOMAD_IP_http"] == "127.0.0.1"
    assert env["NOMAD_ALLOC_ID"] == alloc_id
    assert env["NOMAD_ALLOC_INDEX"] == "3"
    assert env["NOMAD_ALLOC_DIR"] == str(tmp_alloc(harness, alloc_id) / "alloc")
    assert env["NOMAD_TASK_DIR"] == str(task_dir / "local")
    assert env["NOMAD_SECRETS_DIR"] == str(task_dir / "secrets")
    assert env["NOMAD_JOB_ID"] == "llmgw-tiny"
    assert env["NOMAD_GROUP_NAME"] == "engine"
    assert env["NOMAD_TASK_NAME"] == "engine"
    assert env["NOMAD_META_llmgw_model"] == env["NOMAD_META_LLMGW_MODEL"] == "qwen2.5-0.5b"
    assert env["NOMAD_DC"] == "dc1"
    assert env["NOMAD_REGION"] == "global"
    assert env["NOMAD_MEMORY_LIMIT"] == "256"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
    assert env["MODEL_FROM_ENV"] == "qwen2.5-0.5b@gpu-node-0"
    assert env["CONSUL_HTTP_TOKEN"] is None
    assert report["cwd"] == str(task_dir)
    assert harness.client.log_path(alloc_id, "engine", "stderr").read_text() == "to stderr\n"
    for sub in ("alloc/data", "alloc/tmp", "engine/local", "engine/secrets", "engine/tmp"):
        assert (tmp_alloc(harness, alloc_id) / sub).is_dir(), sub


def tmp_alloc(harness: Harness, alloc_id: str) -> Path:
    return harness.tmp / "data" / "alloc" / alloc_id


# A real client has no file getter; the stand-in's own (off by default) lets these tests drive
# the artifact hook with local files instead of a server.
FILE_GETTER = parse_artifact_config({"file_getter": True}, "test")


def with_file_getter(harness: Harness) -> None:
    for node_id in harness.store.nodes:
        harness.client.artifact_configs[node_id] = FILE_GETTER


async def test_file_artifact_is_copied_into_the_task_dir_before_start(harness: Harness) -> None:
    with_file_getter(harness)
    model = harness.tmp / "models" / "tiny.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF-not-really")
    script = harness.script("cat.py", "import sys; print(open(sys.argv[1], 'rb').read().decode())")
    task = raw_exec_task(
        "engine",
        sys.executable,
        [script, "${NOMAD_TASK_DIR}/model/tiny.gguf"],
        Artifacts=[{"GetterSource": f"file://{model}", "RelativeDest": "local/model/", "GetterMode": "any"}],
    )
    alloc_id = harness.run(make_job([task], job_type="batch"))
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert alloc["ClientStatus"] == "complete", events_of(alloc, "Terminated")
    assert "Downloading Artifacts" in event_types(alloc)
    assert events_of(alloc, "Downloading Artifacts")[0]["DisplayMessage"] == "Client is downloading artifacts"
    assert harness.client.log_path(alloc_id, "engine", "stdout").read_text() == "GGUF-not-really\n"


async def test_a_missing_artifact_fails_the_task_after_its_restarts(harness: Harness) -> None:
    with_file_getter(harness)
    missing = harness.tmp / "nowhere" / "tiny.gguf"
    task = raw_exec_task(
        "engine",
        sys.executable,
        ["-c", "pass"],
        Artifacts=[
            {"GetterSource": f"file://{missing}", "RelativeDest": "local/model/", "GetterMode": "any"}
        ],
    )
    job = make_job([task], restart=restart_policy(attempts=1, delay_s=1))
    alloc_id = harness.run(job)
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    failures = events_of(alloc, "Failed Artifact Download")
    assert len(failures) == 2
    message = failures[0]["DisplayMessage"]
    assert message.startswith(f'failed to download artifact "file://{missing}": ')
    assert "no such file or directory" in message
    assert failures[0]["DownloadError"] == message
    assert "Started" not in event_types(alloc)
    assert alloc["ClientStatus"] == "failed"


async def test_crashing_task_restarts_per_policy_and_then_fails(harness: Harness) -> None:
    script = harness.script("crash.py", "import sys; print('crash', file=sys.stderr); sys.exit(3)")
    task = raw_exec_task("engine", sys.executable, [script])
    job = make_job([task], restart=restart_policy(attempts=2, interval_s=1800, delay_s=15))
    alloc_id = harness.run(job)
    alloc = await wait_alloc(harness.store, alloc_id, dead)

    assert alloc["ClientStatus"] == "failed"
    state = task_state(alloc)
    assert state["Failed"] is True and state["Restarts"] == 2
    # Ten events are kept, as a Nomad client keeps them; the newest tell the story.
    assert event_types(alloc) == [
        "Task Setup",
        "Started",
        "Terminated",
        "Restarting",
        "Started",
        "Terminated",
        "Restarting",
        "Started",
        "Terminated",
        "Not Restarting",
    ]
    assert {e["DisplayMessage"] for e in events_of(alloc, "Terminated")} == {"Exit Code: 3"}
    assert {e["DisplayMessage"] for e in events_of(alloc, "Restarting")} == {"Task restarting in 15s"}
    assert events_of(alloc, "Not Restarting")[0]["DisplayMessage"] == (
        'Exceeded allowed attempts 2 in interval 30m0s and mode is "fail"'
    )
    # Every run wrote to the same log, as logmon appends to the task's current file.
    assert harness.client.log_path(alloc_id, "engine", "stderr").read_text() == "crash\n" * 3


async def test_a_missing_binary_is_a_driver_failure_that_is_not_retried(harness: Harness) -> None:
    task = raw_exec_task("engine", "llama-server-that-is-not-installed", ["--port", "${NOMAD_PORT_http}"])
    alloc_id = harness.run(make_job([task]), ports={"http": 23457})
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    failure = events_of(alloc, "Driver Failure")[0]
    assert "file llama-server-that-is-not-installed not found under path" in failure["DisplayMessage"]
    assert events_of(alloc, "Not Restarting")[0]["DisplayMessage"] == "Error was unrecoverable"
    assert alloc["ClientStatus"] == "failed"


SPAWNER = """
    import os, signal, subprocess, sys, time
    # A test run started in the background (nohup, `&`) ignores SIGINT, and children inherit
    # that: take Python's own handler back so the kill signal ends this task as it would anywhere.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.path.join(os.environ["NOMAD_ALLOC_DIR"], "data", "pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(3600)
"""


async def read_pids(harness: Harness, alloc_id: str) -> list[int]:
    path = tmp_alloc(harness, alloc_id) / "alloc" / "data" / "pids"
    for _ in range(200):
        if path.exists() and path.read_text().strip():
            return [int(p) for p in path.read_text().split()]
        await asyncio.sleep(0.05)
    raise AssertionError(f"the task never wrote {path}")


async def test_stop_kills_the_whole_process_tree_and_completes_the_alloc(harness: Harness) -> None:
    task = raw_exec_task("engine", sys.executable, [harness.script("spawn.py", SPAWNER)])
    # The harness clock runs 50x: Nomad's default 5 s kill timeout would be 0.1 s of real time,
    # tight on a loaded machine. 5 real seconds here.
    task["KillTimeout"] = 250 * 1_000_000_000
    alloc_id = harness.run(make_job([task]))
    await wait_alloc(harness.store, alloc_id, lambda a: a["ClientStatus"] == "running")
    pids = await read_pids(harness, alloc_id)
    assert all(alive(p) for p in pids)

    harness.store.upsert_alloc(dict(harness.store.allocs[alloc_id], DesiredStatus="stop"))
    harness.client.stop_alloc(alloc_id)
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert alloc["ClientStatus"] == "complete"
    assert event_types(alloc)[-3:] == ["Killing", "Terminated", "Killed"]
    # Killed by Nomad's default kill signal, SIGINT, reported as the executor does: 128+2.
    terminated = events_of(alloc, "Terminated")[-1]
    assert terminated["DisplayMessage"] == "Exit Code: 130, Signal: 2"
    assert await all_gone(pids), "the task's child outlived it"


async def test_kill_timeout_ends_in_sigkill_for_a_task_that_ignores_the_signal(harness: Harness) -> None:
    stubborn = """
        import signal, time, os
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        open(os.path.join(os.environ["NOMAD_ALLOC_DIR"], "data", "pids"), "w").write(str(os.getpid()))
        time.sleep(3600)
    """
    task = raw_exec_task("engine", sys.executable, [harness.script("stubborn.py", stubborn)])
    alloc_id = harness.run(make_job([task]))
    await wait_alloc(harness.store, alloc_id, lambda a: a["ClientStatus"] == "running")
    pids = await read_pids(harness, alloc_id)
    harness.client.stop_alloc(alloc_id)
    alloc = await wait_alloc(harness.store, alloc_id, dead, timeout=20)
    assert events_of(alloc, "Terminated")[-1]["DisplayMessage"] == "Exit Code: 137, Signal: 9"
    assert await all_gone(pids)


async def test_shutdown_leaves_no_process_behind(tmp_path: Path) -> None:
    store = new_store()
    client = ClientRunner(store, Clock(speed=50), tmp_path / "data", None)
    harness = Harness(store, client, tmp_path)
    task = raw_exec_task("engine", sys.executable, [harness.script("spawn.py", SPAWNER)])
    alloc_id = harness.run(make_job([task]))
    try:
        await wait_alloc(store, alloc_id, lambda a: a["ClientStatus"] == "running")
        pids = await read_pids(harness, alloc_id)
    finally:
        await client.shutdown()
    assert await all_gone(pids)


async def test_env_template_is_rendered_into_the_task_environment(harness: Harness) -> None:
    template = {
        "EmbeddedTmpl": 'ENGINE_PORT={{ env "NOMAD_PORT_http" }}\n# a comment\nMODE=serve\n',
        "DestPath": "secrets/engine.env",
        "Envvars": True,
    }
    task = raw_exec_task(
        "engine",
        sys.executable,
        ["-c", "import os; print(os.environ['ENGINE_PORT'], os.environ['MODE'])"],
        Templates=[template],
    )
    alloc_id = harness.run(make_job([task], job_type="batch"), ports={"http": 24001})
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert alloc["ClientStatus"] == "complete", events_of(alloc, "Terminated")
    assert harness.client.log_path(alloc_id, "engine", "stdout").read_text() == "24001 serve\n"
    rendered = tmp_alloc(harness, alloc_id) / "engine" / "secrets" / "engine.env"
    assert rendered.read_text().startswith("ENGINE_PORT=24001\n")


async def test_exec_driver_runs_like_raw_exec(harness: Harness) -> None:
    task = raw_exec_task("engine", sys.executable, ["-c", "print('exec ok')"])
    task["Driver"] = "exec"
    alloc_id = harness.run(make_job([task], job_type="batch"))
    alloc = await wait_alloc(harness.store, alloc_id, dead)
    assert alloc["ClientStatus"] == "complete"
    assert harness.client.log_path(alloc_id, "engine", "stdout").read_text() == "exec ok\n"


def test_artifact_modes_follow_go_getter(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "weights").mkdir(parents=True)
    (src / "weights" / "a.bin").write_text("a")
    (src / "config.json").write_text("{}")
    archive = tmp_path / "bundle.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(src / "config.json", arcname="inner/config.json")
    alloc_root = tmp_path / "alloc"
    task_dir = alloc_root / "engine"
    env = TaskEnv({"NOMAD_TASK_DIR": str(task_dir / "local")}, {})

    def fetch(source: Path, dest: str, mode: str) -> Path:
        return fetch_artifact(
            {"GetterSource": f"file://{source}", "RelativeDest": dest, "GetterMode": mode},
            env,
            task_dir,
            alloc_root,
            FILE_GETTER,
        )

    assert fetch(src / "config.json", "local/exact.json", "file").read_text() == "{}"
    assert (fetch(src / "config.json", "local/any/", "any") / "config.json").read_text() == "{}"
    assert (fetch(src / "weights", "local/w", "dir") / "a.bin").read_text() == "a"
    assert (fetch(archive, "local/unpacked", "any") / "inner" / "config.json").read_text() == "{}"
    with pytest.raises(ArtifactError, match="artifact destination path escapes alloc directory"):
        fetch(src / "config.json", "../../outside", "any")
    with pytest.raises(ArtifactError, match=r"download not supported for scheme 'ftp'"):
        fetch_artifact({"GetterSource": "ftp://example.invalid/m.gguf"}, env, task_dir, alloc_root)
