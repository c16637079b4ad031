"""`llmgw apply` against a real Consul and the Nomad stand-in, and `llmgw ctl retry` against a
watcher's admin API."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from devstack.fleet import effective_nodes
from devstack.ports import free_port
from nomad_driver.cli.app import app
from nomad_driver.cli.apply import apply_file, store_definitions
from nomad_driver.config_kv import CONFIG_PREFIX
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState, state_key
from nomad_driver.watcher.admin import create_app
from nomad_driver.watcher.loop import Watcher, WatcherConfig

pytestmark = pytest.mark.timeout(120)

TEXT = """
profiles:
  cpu:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 0
    cpu_mhz: 500
    memory_mib: 512
models:
  a:
    source: file:///tmp/a.gguf
    profile: cpu
    replicas: {min: 0, max: 2}
"""


def test_apply_stores_the_definitions_and_registers_jobs_once(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    standin = start_standin(consul=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    path = tmp_path / "models.yaml"
    path.write_text(TEXT)
    runner = CliRunner()
    first = runner.invoke(app, ["apply", str(path)])
    assert first.exit_code == 0, first.output
    assert "1 registered" in first.output
    nomad = Nomad(standin.url)
    job = nomad.get_job("llmgw-a")
    assert job is not None and job["Meta"]["llmgw_model"] == "a"

    again = runner.invoke(app, ["apply", str(path)])
    assert again.exit_code == 0 and "1 unchanged" in again.output

    # A router scaled it up; a new source is the watcher's to roll out beside its replicas
    # (docs/operations.md, "Updates and rollbacks"): apply leaves the running job alone.
    nomad.scale("llmgw-a", "engine", 2, "test: a router activated it")
    path.write_text(TEXT.replace("/tmp/a.gguf", "/tmp/a2.gguf"))
    result = apply_file(path)
    assert result.rolled_out == ["a"] and result.registered == []
    assert "a.gguf" in nomad.get_job("llmgw-a")["Meta"]["llmgw_source"]
    # With `update: replace`, apply re-registers it in place and keeps that count.
    path.write_text(
        TEXT.replace("/tmp/a.gguf", "/tmp/a2.gguf").replace(
            "memory_mib: 512", "memory_mib: 512\n    update: replace"
        )
    )
    result = apply_file(path)
    assert result.registered == ["a"]
    job = nomad.get_job("llmgw-a")
    assert job is not None and job["TaskGroups"][0]["Count"] == 2
    assert "a2.gguf" in job["Meta"]["llmgw_source"]

    bad = tmp_path / "bad.yaml"
    bad.write_text(TEXT.replace("profile: cpu", "profile: gpu9"))
    refused = runner.invoke(app, ["apply", str(bad)])
    assert refused.exit_code == 2
    assert "gpu9" in refused.output


def test_apply_leaves_a_multi_node_job_to_the_watcher_which_pins_it(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fabrics = Path(__file__).resolve().parents[1] / "devstack" / "nodes" / "fabrics.yaml"
    standin = start_standin(
        nodes=effective_nodes(fabrics, tmp_path / "engines", tmp_path / "nodes.yaml"), consul=False
    )
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    path = tmp_path / "models.yaml"
    split = TEXT.replace(
        "models:",
        "  split:\n    engine: llama.cpp\n    engine_version: b6500\n"
        "    gpus: 1\n    cpu_mhz: 500\n    memory_mib: 512\n    nodes: 2\nmodels:",
    )
    split += (
        "  wide:\n    source: file:///tmp/wide.gguf\n    profile: split\n    replicas: {min: 1, max: 1}\n"
    )
    path.write_text(split)
    result = CliRunner().invoke(app, ["apply", str(path)])
    assert result.exit_code == 0, result.output
    assert "1 registered, 0 unchanged, 1 left to the watcher to pin to a fabric (wide)" in result.output
    # Never registered without its fabric: Nomad could split one replica over two fabrics.
    assert Nomad(standin.url).get_job("llmgw-wide") is None
    assert Nomad(standin.url).get_job("llmgw-a") is not None


async def test_apply_writes_the_definitions_only_when_they_changed(consul_url: str) -> None:
    consul = Consul(consul_url)
    try:
        assert await store_definitions(consul, TEXT)
        _, entries = await consul.kv_get(CONFIG_PREFIX, recurse=True)
        first = {e.key: e.modify_index for e in entries}
        assert not await store_definitions(consul, TEXT + "# a comment changes no key\n")
        _, entries = await consul.kv_get(CONFIG_PREFIX, recurse=True)
        assert {e.key: e.modify_index for e in entries} == first
        assert await store_definitions(consul, TEXT.replace("max: 2", "max: 3"))
    finally:
        await consul.close()


async def test_ctl_retry_on_a_follower_follows_it_to_the_leader_and_on_the_leader_unparks(
    consul_url: str,
) -> None:
    import uvicorn

    consul = Consul(consul_url)
    await consul.kv_put(CONFIG_MODELS_KEY, TEXT)
    await consul.kv_put(state_key("a"), ModelState(parked=True, consecutive_failures=5).to_kv())
    watchers, servers, tasks = [], [], []
    for ident in ("one", "two"):
        port = free_port()
        w = Watcher(
            Consul(consul_url),
            Nomad("http://127.0.0.1:1", timeout=1),
            WatcherConfig(address=f"http://127.0.0.1:{port}", wait_s=5, lock_delay_s=0.5, tick_s=0.5),
            ident=ident,
        )
        await w.start()
        server = uvicorn.Server(
            uvicorn.Config(create_app(w), host="127.0.0.1", port=port, log_level="warning")
        )
        tasks.append(asyncio.create_task(server.serve()))
        watchers.append(w)
        servers.append(server)
    try:
        for _ in range(200):
            if any(w.leadership.is_leader for w in watchers) and all(w.leadership.leader for w in watchers):
                break
            await asyncio.sleep(0.1)
        leader = next(w for w in watchers if w.leadership.is_leader)
        follower = next(w for w in watchers if not w.leadership.is_leader)

        async def ctl(model: str, w: Watcher) -> tuple[int, str]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "nomad_driver.cli",
                "ctl",
                "retry",
                model,
                "--addr",
                w.config.address,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await proc.communicate()
            return proc.returncode or 0, out.decode()

        # Sent to the follower, it is done by the leader, which the answer names.
        code, output = await ctl("a", follower)
        assert code == 0, output
        assert f"retried by watcher {leader.leadership.me.id} at {leader.config.address}" in output
        code, output = await ctl("a", leader)
        assert code == 0, output
        assert "retried" in output and "does not lead" not in output
        code, _ = await ctl("nope", leader)
        assert code == 4
    finally:
        for s in servers:
            s.should_exit = True
        for t in tasks:
            with contextlib.suppress(Exception):
                await t
        for w in watchers:
            await w.stop()
            await w.consul.close()
        await consul.close()
