"""Everything of llmgw in a Nomad namespace of its own, as docs/operations.md sets it up: with
`NOMAD_NAMESPACE=ml`, `llmgw apply` registers the model jobs in `ml`, the watcher counts, parks
and places them there, the router finds their replicas and activates an on-demand model there,
and nothing lands in `default`. Every call that forgot the namespace would reach `default`, find
no job and fail (or, for a register, put the job where nothing of llmgw looks)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from nomad_driver.cli.app import app
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.router.conftest import StartRouter
from tests.watcher_support import engines_dir, node, read_state, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NAMESPACE = "ml"


def models_yaml(tiny: Path, kev: Path) -> str:
    profile = (
        "profiles:\n  cpu:\n    engine: llama-cpp-python\n    engine_version: 0.3.36\n    gpus: 0\n"
        "    cpu_mhz: 500\n    memory_mib: 512\n    context: 256\nmodels:\n"
    )
    models = {
        "always": (tiny, "{min: 1, max: 1}"),
        "ondemand": (tiny, "{min: 0, max: 1}\n    activation_timeout: 120s"),
        "broken": (kev, "{min: 1, max: 1}"),
    }
    return profile + "".join(
        f"  {name}:\n    source: file://{source}\n    profile: cpu\n    replicas: {replicas}\n"
        for name, (source, replicas) in models.items()
    )


def listed(standin_url: str, collection: str, namespace: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{standin_url}/v1/{collection}", params={"namespace": namespace}, timeout=10)
    assert reply.status_code == 200, reply.text
    return list(reply.json())


def chat(router_url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{router_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=150,
    )


async def test_apply_the_watcher_and_the_router_work_in_the_models_namespace_and_leave_default_alone(
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    make_gguf: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    standin = start_standin(nodes=[node("cpu-0", engines_dir(tmp_path))], clock_speed=20.0)
    created = httpx.post(f"{standin.url}/v1/namespace/{NAMESPACE}", json={"Name": NAMESPACE}, timeout=10)
    assert created.status_code == 200, created.text
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    monkeypatch.setenv("NOMAD_NAMESPACE", NAMESPACE)
    path = tmp_path / "models.yaml"
    path.write_text(models_yaml(make_gguf(), make_gguf("kev")))

    # In a thread: apply runs its own event loop, as it does from a shell.
    applied = await asyncio.to_thread(CliRunner().invoke, app, ["apply", "--auto-approve", str(path)])
    assert applied.exit_code == 0, applied.output
    in_ml = Nomad(standin.url, namespace=NAMESPACE)
    for name in ("always", "ondemand", "broken"):
        job = in_ml.get_job(f"llmgw-{name}")
        assert job is not None and job["Namespace"] == NAMESPACE, name

    consul = Consul(consul_url)
    watcher = Watcher(
        Consul(consul_url),
        Nomad(standin.url),
        WatcherConfig(wait_s=5, lock_delay_s=0.5, tick_s=0.5),
        ident="ns",
    )
    # The router never calls Nomad: the watcher (NOMAD_NAMESPACE from its environment) answers
    # its asks.
    router = start_router(consul_url, activation=True)
    try:
        await watcher.start()
        # A replica placed in `ml` is registered in Consul and served.
        await until(
            lambda: router.app.discovery.snapshot.ready.get("always"), 120, "a ready replica of always"
        )
        answer = await asyncio.to_thread(chat, router.url, "always")
        assert answer.status_code == 200, answer.text

        # The router's ask, answered by the watcher, scales the job in `ml`.
        assert in_ml.get_job("llmgw-ondemand")["TaskGroups"][0]["Count"] == 0  # type: ignore[index]
        answer = await asyncio.to_thread(chat, router.url, "ondemand")
        assert answer.status_code == 200, answer.text
        assert in_ml.get_job("llmgw-ondemand")["TaskGroups"][0]["Count"] == 1  # type: ignore[index]

        # The watcher reads the allocations and the engine's stderr in `ml`, and parks there.
        state = await until(
            lambda: _parked(consul, "broken"), 180, "the watcher to park broken after five failed starts"
        )
        assert "unknown model architecture: 'kev'" in state.last_error
        assert in_ml.get_job("llmgw-broken")["TaskGroups"][0]["Count"] == 0  # type: ignore[index]
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()

    for collection in ("jobs", "allocations", "evaluations", "deployments"):
        assert listed(standin.url, collection, "default") == [], f"{collection} in default"
    assert {j["ID"] for j in listed(standin.url, "jobs", NAMESPACE)} == {
        "llmgw-always",
        "llmgw-ondemand",
        "llmgw-broken",
    }


async def _parked(consul: Consul, model: str) -> Any:
    state = await read_state(consul, model)
    return state if state is not None and state.parked else None
