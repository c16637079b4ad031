"""A Nomad refusal that asking again will not change becomes a model condition: stored in the
model's state, shown by `llmgw ctl status`, the admin API and the Consul UI check, counted in a
metric, logged once rather than on every pass, and cleared by the next success. Against the
stand-in, which refuses as Nomad does: a scale below the group's scaling minimum (400), a job in
a node pool no node is in (500, since Nomad's validation carries no status code), any register
while the scheduler configuration rejects registrations (403). A Nomad that is only failing
for now (a proxy's 503 in front of it) is no condition, and is logged once too."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import uvicorn
from aiohttp import ClientSession, web
from typer.testing import CliRunner

from devstack.nomad.operator import ERR_REGISTRATION_DISABLED
from devstack.ports import free_port
from nomad_driver.cli.app import app as cli_app
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad, NomadError, NomadUnavailable
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.acting import is_refusal, nomads_words
from nomad_driver.watcher.admin import create_app
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.watcher_support import PROFILES, mock_job, node, read_state, until, watcher_on_standin

pytestmark = pytest.mark.timeout(240)

MODELS = (
    PROFILES
    + """
models:
  stuck:
    source: file:///tmp/stuck.gguf
    profile: cpu
    # The watcher holds the count it first finds for the scale-down delay (a restart is never
    # a scale-down): a short one, so the scale this file is about is asked for soon.
    replicas: {min: 1, max: 2, scale_down_delay: 1s}
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
    # These engines exit at once, and their starts count: parking after five, which its own
    # tests show, must not win the race with the scale this test is about (it did, now that
    # the watcher asks Nomad again for slots it gave up on, and five failures come sooner).
    watcher.config = dataclasses.replace(watcher.config, max_start_failures=1000)
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
        # The first sight's hold (1 s here) and one step interval pass before the scale down is
        # asked for and refused: about 6 s on a quiet machine, more on a loaded one.
        state = await until(
            lambda: _refused(consul, "stuck"), 120, "the refusal recorded in llmgw/state/stuck", every=0.2
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


POOLED = (
    PROFILES
    + """
  pooled:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 0
    cpu_mhz: 500
    memory_mib: 512
    node_pool: gpus
models:
  pooled:
    source: file:///tmp/pooled.gguf
    profile: pooled
    replicas: {min: 1, max: 1}
"""
)


async def shown_everywhere(consul: Consul, admin_url: str, model: str, action: str, status: int) -> str:
    """The refusal as the admin API, the metric, the Consul UI check and `llmgw ctl status` show
    it; returns Nomad's words as stored."""
    state = await until(lambda: _refused(consul, model), 60, f"the refusal in llmgw/state/{model}", every=0.2)
    refusal = state.last_action_error
    assert (refusal.action, refusal.status) == (action, status)
    assert "\n" not in refusal.message and refusal.since > 0
    async with httpx.AsyncClient(base_url=admin_url) as admin:
        shown = (await admin.get(f"/v1/admin/models/{model}")).json()
        assert shown["state"] == "refused"
        assert f"Nomad refuses to {action} it (HTTP {status})" in shown["reason"]
        assert shown["last_action_error"]["message"] == refusal.message
        assert f'llmgw_model_action_refused{{model="{model}"}} 1.0' in (await admin.get("/metrics")).text
    _, checks = await consul.health_service("llmgw-model")
    check = next(c for e in checks for c in e["Checks"] if c["ServiceID"] == f"llmgw-model-{model}")
    assert check["Status"] == "critical" and refusal.message[:60] in check["Output"]
    env = {"LLMGW_ADMIN_ADDR": admin_url, "COLUMNS": "400", "NO_COLOR": "1"}
    status_cmd = await asyncio.to_thread(CliRunner().invoke, cli_app, ["ctl", "status", "--check"], env=env)
    assert status_cmd.exit_code == 1, status_cmd.output
    assert "refused" in status_cmd.output and refusal.message[:40] in status_cmd.output
    return str(refusal.message)


def said(caplog: pytest.LogCaptureFixture, event: str, model: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"event={event} model={model} " in r.getMessage()]


async def admin_server(watcher: Watcher) -> tuple[uvicorn.Server, asyncio.Task[None], str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(watcher), host="127.0.0.1", port=port, log_level="warning")
    )
    return server, asyncio.create_task(server.serve()), f"http://127.0.0.1:{port}"


async def test_a_park_that_nomad_refuses_is_not_stored_as_parked(
    consul_url: str, start_standin: Callable[..., Any]
) -> None:
    """Parking is a scale to 0; when Nomad refuses it, the replicas keep crash-looping, and
    saying "parked" would hide that. The model shows the refusal and its count, and the park
    is asked again on the next pass."""
    model = parse_models(MODELS).models["stuck"]
    standin, consul, _, watcher = await watcher_on_standin(
        consul_url, start_standin, MODELS, ident="park-refused", clock_speed=1.0
    )
    # Someone set the group's scaling minimum to 2 in Nomad: the scale to 0 is refused.
    job = mock_job(model, 2)
    job["TaskGroups"][0]["Scaling"]["Min"] = 2
    register(standin.url, job)
    # Passes over the marked models only, as in production: the suite's check of skipped passes
    # makes every pass a full one, whose decisions are what stands already.
    watcher._verify_skips = ""
    await watcher.start()
    try:

        async def refused_park() -> Any:
            state = await read_state(consul, "stuck")
            error = state.last_action_error if state is not None else None
            return state if error is not None and error.action == "park" else None

        state = await until(refused_park, 180, "the refused park recorded", every=0.2)
        assert not state.parked
        assert state.consecutive_failures >= 5
        assert "less than scaling policy minimum" in state.last_action_error.message
        # The park is asked again at every pass, and while Nomad answers, the decision is the
        # one being acted on; once answered, what came of it (a pass over this model alone
        # used to leave the decision as it was before acting).
        decision = await until(
            lambda: (
                "Nomad refuses to park it" in watcher.decisions["stuck"].health_output
                and watcher.decisions["stuck"]
            ),
            10,
            "the refusal in the watcher's decision",
            every=0.05,
        )
        assert decision.health == "critical"
        assert job_count(standin.url, model.job_id) == 2
    finally:
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()


async def test_a_job_in_a_node_pool_nomad_does_not_have_is_a_model_condition_until_the_pool_exists(
    consul_url: str, start_standin: Callable[..., Any], caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    """Nomad refuses the register with 500 and its validation's words (no status code comes out
    of its admission checks); asking again changes nothing until someone creates the pool."""
    caplog.set_level(logging.INFO, logger="llmgw.watcher")
    standin, consul, _, watcher = await watcher_on_standin(
        consul_url, start_standin, POOLED, ident="pool", clock_speed=1.0
    )
    server, serving, admin_url = await admin_server(watcher)
    await watcher.start()
    try:
        words = await shown_everywhere(consul, admin_url, "pooled", "register", 500)
        assert 'job "llmgw-pooled" is in nonexistent node pool "gpus"' in words

        passes = watcher.passes
        await until(lambda: watcher.passes >= passes + 5, 30, "five more passes")
        assert len(said(caplog, "action_refused", "pooled")) == 1, said(caplog, "action_refused", "pooled")
        assert said(caplog, "action_failed", "pooled") == []
        assert httpx.get(f"{standin.url}/v1/job/llmgw-pooled", timeout=10).status_code == 404

        # A node joins the pool (creating it): the next register is accepted and the condition goes.
        standin.add_node({**node("gpu-pool-0", tmp_path), "node_pool": "gpus"})
        await until(
            lambda: httpx.get(f"{standin.url}/v1/job/llmgw-pooled", timeout=10).status_code == 200,
            30,
            "the job registered",
        )
        assert await until(lambda: _cleared(consul, "pooled"), 30, "the condition cleared", every=0.2)
        await until(lambda: watcher.decisions["pooled"].state.last_action_error is None, 10, "the pass")
        async with httpx.AsyncClient(base_url=admin_url) as admin:
            assert (await admin.get("/v1/admin/models/pooled")).json()["state"] != "refused"
            assert 'llmgw_model_action_refused{model="pooled"} 0.0' in (await admin.get("/metrics")).text
    finally:
        await watcher.stop()
        server.should_exit = True
        await serving
        await watcher.consul.close()
        await consul.close()


async def test_a_register_refused_with_403_is_a_model_condition_and_clears_when_nomad_accepts(
    consul_url: str, start_standin: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The operator switched Nomad to reject registrations (load shedding,
    `nomad operator scheduler set-config -reject-job-registration=true`): Nomad answers every
    register with 403, as it answers a token without `submit-job`."""
    caplog.set_level(logging.INFO, logger="llmgw.watcher")
    standin, consul, _, watcher = await watcher_on_standin(
        consul_url, start_standin, MODELS, ident="rejected", clock_speed=1.0
    )
    config_url = f"{standin.url}/v1/operator/scheduler/configuration"
    current = httpx.get(config_url, timeout=10).json()["SchedulerConfig"]
    httpx.put(config_url, json={**current, "RejectJobRegistration": True}, timeout=10).raise_for_status()
    server, serving, admin_url = await admin_server(watcher)
    await watcher.start()
    try:
        words = await shown_everywhere(consul, admin_url, "stuck", "register", 403)
        assert words == ERR_REGISTRATION_DISABLED
        passes = watcher.passes
        await until(lambda: watcher.passes >= passes + 5, 30, "five more passes")
        assert len(said(caplog, "action_refused", "stuck")) == 1
        assert said(caplog, "action_failed", "stuck") == []

        httpx.put(config_url, json=current, timeout=10).raise_for_status()
        await until(lambda: _cleared(consul, "stuck"), 30, "the condition cleared", every=0.2)
        assert httpx.get(f"{standin.url}/v1/job/llmgw-stuck", timeout=10).status_code == 200
    finally:
        await watcher.stop()
        server.should_exit = True
        await serving
        await watcher.consul.close()
        await consul.close()


async def test_a_nomad_that_fails_for_now_is_no_condition_and_is_logged_once(
    consul_url: str, start_standin: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy in front of Nomad answers every write with 503 (its backend for writes is down)
    while reads still pass: that says nothing about the model, so nothing is recorded against
    it, and the failure is logged once, not on every pass."""
    caplog.set_level(logging.INFO, logger="llmgw.watcher")
    standin = start_standin(clock_speed=1.0)
    writes_fail = True
    session = ClientSession()

    async def proxy(request: web.Request) -> web.StreamResponse:
        if writes_fail and request.method in ("PUT", "POST") and request.path.startswith("/v1/job"):
            return web.Response(status=503, text="no healthy upstream")
        async with session.request(
            request.method, f"{standin.url}{request.path_qs}", data=await request.read()
        ) as answer:
            keep = {k: v for k, v in answer.headers.items() if k.lower().startswith("x-nomad")}
            return web.Response(
                status=answer.status, body=await answer.read(), headers=keep, content_type=answer.content_type
            )

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", proxy)
    # A watcher's long poll may still be in the proxy when the test ends; the default 60 s
    # shutdown grace would wait it out.
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    consul = Consul(consul_url)
    await consul.kv_put(CONFIG_MODELS_KEY, MODELS)
    config = WatcherConfig(wait_s=10, lock_delay_s=0.5, tick_s=0.5)
    watcher = Watcher(Consul(consul_url), Nomad(f"http://127.0.0.1:{port}"), config, ident="outage")
    await watcher.start()
    try:
        await until(lambda: said(caplog, "action_failed", "stuck"), 60, "the failed register logged")
        passes = watcher.passes
        await until(lambda: watcher.passes >= passes + 5, 60, "five more passes")
        assert len(said(caplog, "action_failed", "stuck")) == 1, said(caplog, "action_failed", "stuck")
        assert said(caplog, "action_refused", "stuck") == []
        state = await read_state(consul, "stuck")
        assert state is None or state.last_action_error is None
        assert "503" in said(caplog, "action_failed", "stuck")[0]

        writes_fail = False
        await until(
            lambda: httpx.get(f"{standin.url}/v1/job/llmgw-stuck", timeout=10).status_code == 200,
            30,
            "the job registered once the proxy passes writes",
        )
    finally:
        await watcher.stop()
        await runner.cleanup()
        await session.close()
        await watcher.consul.close()
        await consul.close()


@pytest.mark.parametrize(
    ("status", "text", "refused"),
    [
        (403, "Permission denied", True),
        (403, ERR_REGISTRATION_DISABLED, True),
        (400, "group count was less than scaling policy minimum: 1 < 2", True),
        (500, '1 error occurred:\n\t* job "llmgw-x" is in nonexistent node pool "gpu"\n\n', True),
        (500, "2 errors occurred:\n\t* Constraint ... \n\t* Task group engine validation failed\n\n", True),
        (500, "rpc error: 1 error occurred:\n\t* Missing task driver\n\n", True),
        (500, "error in job mutator implicit-identities: boom", True),
        (500, "No cluster leader", False),
        (500, "rpc error: EOF", False),
        (502, "1 error occurred: bad gateway's own words", False),
        (503, "no healthy upstream", False),
        (504, "upstream request timeout", False),
        (404, 'job "x" not found', False),
        (409, "conflict", False),
        (429, "rate limited", False),
        (0, "ConnectionError: connection refused", False),
    ],
)
def test_only_a_refusal_that_will_not_heal_is_one(status: int, text: str, refused: bool) -> None:
    where = "nomad POST /v1/job/llmgw-x"
    if 400 <= status < 500:
        exc: NomadError = NomadError(f"{where}: HTTP {status}: {text}", status)
    else:
        exc = NomadUnavailable(f"{where}: HTTP {status}: {text}" if status else f"{where}: {text}", status)
    assert is_refusal(exc) is refused
    if refused:
        assert "\n" not in nomads_words(exc) and not nomads_words(exc).startswith("nomad POST")
