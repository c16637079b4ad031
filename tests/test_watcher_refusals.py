"""A Nomad refusal that asking again will not change becomes a model condition: stored in the
model's state, shown by `llmgw ctl status`, the admin API and the Consul UI check, counted in a
metric, logged once rather than on every pass, and cleared by the next success. Against the
stand-in, which refuses a scale below the group's scaling minimum with Nomad's own 400."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from devstack.ports import free_port
from nomad_driver.cli.app import app as cli_app
from nomad_driver.spec import parse_models
from nomad_driver.watcher.admin import create_app
from tests.watcher_support import PROFILES, mock_job, read_state, until, watcher_on_standin

pytestmark = pytest.mark.timeout(150)

MODELS = (
    PROFILES
    + """
models:
  stuck:
    source: file:///tmp/stuck.gguf
    profile: cpu
    replicas: {min: 1, max: 2}
    idle_timeout: 1s
"""
)


def register(url: str, job: dict[str, Any]) -> None:
    httpx.post(f"{url}/v1/job/{job['ID']}", json={"Job": job}, timeout=10).raise_for_status()


def job_count(url: str, job_id: str) -> int:
    return int(httpx.get(f"{url}/v1/job/{job_id}", timeout=10).json()["TaskGroups"][0]["Count"])


async def test_a_refused_scale_is_a_model_condition_everywhere_and_clears_on_success(
    consul_url: str, start_standin: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.watcher")
    model = parse_models(MODELS).models["stuck"]
    standin, consul, _, watcher = await watcher_on_standin(
        consul_url, start_standin, MODELS, ident="refused", clock_speed=1.0
    )
    # Someone set the group's scaling minimum to 2 in Nomad: every scale below it is refused.
    job = mock_job(model, 2)
    job["TaskGroups"][0]["Scaling"]["Min"] = 2
    register(standin.url, job)

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(watcher), host="127.0.0.1", port=port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    await watcher.start()
    try:
        state = await until(
            lambda: _refused(consul, "stuck"), 60, "the refusal recorded in llmgw/state/stuck", every=0.2
        )
        refusal = state.last_action_error
        assert refusal is not None
        assert (refusal.action, refusal.status) == ("scale", 400)
        assert "less than scaling policy minimum" in refusal.message
        assert refusal.since > 0

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as admin:
            shown = (await admin.get("/v1/admin/models/stuck")).json()
            assert shown["state"] == "refused"
            assert shown["last_action_error"]["status"] == 400
            assert "Nomad refuses to scale it (HTTP 400)" in shown["reason"]
            metrics = (await admin.get("/metrics")).text
            assert 'llmgw_model_action_refused{model="stuck"} 1.0' in metrics

        _, checks = await consul.health_service("llmgw-model")
        check = next(c for e in checks for c in e["Checks"] if c["ServiceID"] == "llmgw-model-stuck")
        assert check["Status"] == "critical"
        assert "less than scaling policy minimum" in check["Output"]

        env = {"LLMGW_ADMIN_ADDR": f"http://127.0.0.1:{port}", "COLUMNS": "400", "NO_COLOR": "1"}
        status = await asyncio.to_thread(CliRunner().invoke, cli_app, ["ctl", "status", "--check"], env=env)
        assert status.exit_code == 1, status.output
        assert "refused" in status.output and "scaling policy minimum" in status.output

        # Asked again on every pass, but said once: not a warning per pass.
        passes = watcher.passes
        await until(lambda: watcher.passes >= passes + 5, 30, "five more passes")
        said = [r for r in caplog.records if "event=action_refused model=stuck" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert not [r for r in caplog.records if "event=action_failed model=stuck" in r.getMessage()]
        # Stored once: the KV value does not change on every pass either.
        _, entries = await consul.kv_get("llmgw/state/stuck")
        index = entries[0].modify_index
        await until(lambda: watcher.passes >= passes + 8, 30, "three more passes")
        _, entries = await consul.kv_get("llmgw/state/stuck")
        assert entries[0].modify_index == index

        # The operator fixes the job: the next scale succeeds and the condition goes away.
        job["TaskGroups"][0]["Scaling"]["Min"] = 0
        register(standin.url, job)
        await until(lambda: job_count(standin.url, job["ID"]) == 1, 30, "scaled to 1")
        cleared = await until(lambda: _cleared(consul, "stuck"), 30, "the condition cleared", every=0.2)
        assert cleared
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as admin:
            await until(
                lambda: watcher.decisions["stuck"].state.last_action_error is None, 10, "the pass to see it"
            )
            metrics = (await admin.get("/metrics")).text
            assert 'llmgw_model_action_refused{model="stuck"} 0.0' in metrics
            assert (await admin.get("/v1/admin/models/stuck")).json()["last_action_error"] is None
    finally:
        await watcher.stop()
        server.should_exit = True
        await serving
        await watcher.consul.close()
        await consul.close()


async def _refused(consul: Any, model: str) -> Any:
    state = await read_state(consul, model)
    return state if state is not None and state.last_action_error is not None else None


async def _cleared(consul: Any, model: str) -> bool:
    state = await read_state(consul, model)
    return state is not None and state.last_action_error is None
