"""The stand-in client against a real Consul agent: service registration with Nomad's IDs and
checks, deregistration, check_restart, and a real llama.cpp engine served through raw_exec."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import consul as pyconsul
import httpx
import pytest

from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.state import StateStore
from devstack.ports import free_port
from tests.fixtures.engines import MakeGguf, require_llama_cpp
from tests.standin.client_helpers import (
    SECOND,
    Json,
    add_alloc,
    events_of,
    make_alloc,
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
    consul: pyconsul.Consul

    def run(self, job: Json, **alloc_kw: Any) -> str:
        return start_alloc(self.store, self.client, job, **alloc_kw)


@pytest.fixture
async def harness(tmp_path: Path, consul: pyconsul.Consul, consul_url: str) -> AsyncIterator[Harness]:
    store = new_store()
    async with running_client(store, tmp_path / "data", clock_speed=10, consul_url=consul_url) as client:
        yield Harness(store, client, consul)


async def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = await asyncio.to_thread(check)
        if last:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not reached in {timeout}s (last: {last!r})")


def passing(consul: pyconsul.Consul, name: str) -> list[Json]:
    _, nodes = consul.health.service(name, passing=True)
    return list(nodes)


async def deregistered(consul: pyconsul.Consul, alloc_id: str) -> None:
    """The alloc's services leave the agent; they go as the client finishes the alloc, a moment
    after its final status is reported, as on a real client."""
    await eventually(
        lambda: not [sid for sid in consul.agent.services() if alloc_id in sid],
        timeout=10,
        what=f"services of alloc {alloc_id} deregistered",
    )


def http_check(path: str = "/", name: str = "ready", interval_s: float = 1, **extra: Any) -> Json:
    check = {
        "Name": name,
        "Type": "http",
        "Path": path,
        "Interval": int(interval_s * SECOND),
        "Timeout": 2 * SECOND,
    }
    check.update(extra)
    return check


async def test_services_register_with_nomad_ids_and_checks_and_go_away_on_stop(harness: Harness) -> None:
    port = free_port()
    task = raw_exec_task(
        "web",
        sys.executable,
        ["-m", "http.server", "${NOMAD_PORT_http}", "--bind", "127.0.0.1"],
        Services=[
            {
                "Name": "tiny-web",
                "PortLabel": "http",
                "Tags": ["model=tiny", "alloc=${NOMAD_SHORT_ALLOC_ID}"],
                "Meta": {"model": "tiny"},
                "Checks": [http_check("/", Header={"X-Probe": ["nomad"]}, Method="GET")],
            }
        ],
    )
    group_service = {
        "Name": "llmgw-engine",
        "PortLabel": "http",
        "Tags": ["model=tiny"],
        "Meta": {"model": "tiny", "def_hash": "abc123"},
        "Checks": [{"Name": "tcp", "Type": "tcp", "Interval": SECOND, "Timeout": SECOND}],
    }
    job = make_job([task], group_services=[group_service])
    alloc_id = harness.run(job, ports={"http": port})

    web = await eventually(lambda: passing(harness.consul, "tiny-web"), what="tiny-web passing")
    engine = await eventually(lambda: passing(harness.consul, "llmgw-engine"), what="llmgw-engine passing")

    svc = web[0]["Service"]
    assert svc["ID"] == f"_nomad-task-{alloc_id}-web-tiny-web-http"
    assert svc["Address"] == "127.0.0.1" and svc["Port"] == port
    assert svc["Tags"] == ["model=tiny", f"alloc={alloc_id[:8]}"]
    assert svc["Meta"] == {"model": "tiny", "external-source": "nomad"}
    (check,) = [c for c in web[0]["Checks"] if c["ServiceID"] == svc["ID"]]
    assert check["Name"] == "ready"
    assert check["CheckID"].startswith("_nomad-check-")
    assert check["Status"] == "passing"

    group = engine[0]["Service"]
    assert group["ID"] == f"_nomad-task-{alloc_id}-group-engine-llmgw-engine-http"
    assert group["Meta"] == {"model": "tiny", "def_hash": "abc123", "external-source": "nomad"}
    assert group["Port"] == port

    harness.store.upsert_alloc(dict(harness.store.allocs[alloc_id], DesiredStatus="stop"))
    harness.client.stop_alloc(alloc_id)
    alloc = await wait_alloc(harness.store, alloc_id, lambda a: task_state(a, "web").get("State") == "dead")
    assert alloc["ClientStatus"] == "complete"
    await deregistered(harness.consul, alloc_id)


async def test_check_restart_restarts_a_task_whose_check_stays_critical(harness: Harness) -> None:
    # The task runs but never listens on its port, so its check never passes.
    port = free_port()
    task = raw_exec_task(
        "engine",
        sys.executable,
        ["-c", "import time; time.sleep(3600)"],
        Services=[
            {
                "Name": "deaf-engine",
                "PortLabel": "http",
                "Checks": [
                    http_check(
                        "/health",
                        name="alive",
                        CheckRestart={"Limit": 2, "Grace": SECOND, "IgnoreWarnings": False},
                    )
                ],
            }
        ],
    )
    job = make_job([task], restart=restart_policy(attempts=1, delay_s=1))
    alloc_id = harness.run(job, ports={"http": port})
    alloc = await wait_alloc(
        harness.store, alloc_id, lambda a: task_state(a).get("State") == "dead", timeout=60
    )
    signaled = events_of(alloc, "Restart Signaled")
    assert signaled, alloc["TaskStates"]
    assert signaled[0]["DisplayMessage"] == 'healthcheck: check "alive" unhealthy'
    assert signaled[0]["RestartReason"] == 'healthcheck: check "alive" unhealthy'
    # A health-check restart is a failure: it counts against the policy until the task fails.
    state = task_state(alloc)
    assert state["Restarts"] == 1
    assert state["Failed"] is True
    assert alloc["ClientStatus"] == "failed"
    assert events_of(alloc, "Not Restarting")[0]["DisplayMessage"] == (
        'Exceeded allowed attempts 1 in interval 30m0s and mode is "fail"'
    )
    await deregistered(harness.consul, alloc_id)


def llama_job(model: Path) -> Json:
    task = raw_exec_task(
        "engine",
        sys.executable,
        [
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "${NOMAD_PORT_http}",
            "--n_ctx",
            "256",
        ],
    )
    service = {
        "Name": "llmgw-engine",
        "PortLabel": "http",
        "Tags": ["model=tiny"],
        "Meta": {"model": "tiny"},
        "Checks": [http_check("/v1/models", name="engine ready", interval_s=1)],
    }
    return make_job([task], group_services=[service], restart=restart_policy(attempts=0))


@pytest.mark.slow
async def test_llama_cpp_job_serves_and_its_consul_check_passes(
    harness: Harness, make_gguf: MakeGguf
) -> None:
    require_llama_cpp()
    port = free_port()
    alloc_id = harness.run(llama_job(make_gguf("llama")), ports={"http": port})
    healthy = await eventually(
        lambda: passing(harness.consul, "llmgw-engine"), timeout=120, what="llama.cpp engine passing"
    )
    assert healthy[0]["Service"]["Port"] == port
    alloc = harness.store.allocs[alloc_id]
    assert alloc["ClientStatus"] == "running"
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"]


@pytest.mark.slow
async def test_kev_model_fails_with_llama_cpp_s_own_error(harness: Harness, make_gguf: MakeGguf) -> None:
    require_llama_cpp()
    alloc_id = harness.run(llama_job(make_gguf("kev")), ports={"http": free_port()})
    alloc = await wait_alloc(
        harness.store, alloc_id, lambda a: task_state(a).get("State") == "dead", timeout=120
    )
    assert alloc["ClientStatus"] == "failed"
    terminated = events_of(alloc, "Terminated")
    assert terminated and terminated[0]["ExitCode"] == 1
    assert terminated[0]["DisplayMessage"] == "Exit Code: 1"
    stderr = harness.client.log_path(alloc_id, "engine", "stderr").read_text()
    assert "unknown model architecture: 'kev'" in stderr
    await deregistered(harness.consul, alloc_id)


async def test_the_process_of_a_registered_task_is_gone_after_shutdown(
    tmp_path: Path, consul: pyconsul.Consul, consul_url: str
) -> None:
    store = new_store()
    client = ClientRunner(store, Clock(speed=10), tmp_path / "data", consul_url)
    port = free_port()
    task = raw_exec_task(
        "engine",
        sys.executable,
        ["-m", "http.server", "${NOMAD_PORT_http}", "--bind", "127.0.0.1"],
        Services=[{"Name": "short-lived", "PortLabel": "http", "Checks": [http_check("/")]}],
    )
    alloc_id = add_alloc(store, make_alloc(make_job([task]), ports={"http": port}))
    client.start_alloc(alloc_id)
    try:
        await eventually(lambda: passing(consul, "short-lived"), what="short-lived passing")
    finally:
        await client.shutdown()
    services = await asyncio.to_thread(consul.agent.services)
    assert not [sid for sid in services if alloc_id in sid]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2)


async def test_services_come_back_after_the_consul_agent_restarts(
    tmp_path: Path, make_consul_agent: Callable[[], Any]
) -> None:
    # A dev agent forgets every service when it restarts; the client re-syncs like Nomad's.
    agent = make_consul_agent()
    consul = pyconsul.Consul(host=agent.host, port=agent.http_port)
    store = new_store()
    client = ClientRunner(store, Clock(speed=10), tmp_path / "data", agent.url)
    port = free_port()
    task = raw_exec_task(
        "engine",
        sys.executable,
        ["-m", "http.server", "${NOMAD_PORT_http}", "--bind", "127.0.0.1"],
        Services=[{"Name": "survivor", "PortLabel": "http", "Checks": [http_check("/")]}],
    )
    alloc_id = add_alloc(store, make_alloc(make_job([task]), ports={"http": port}))
    client.start_alloc(alloc_id)
    try:
        await eventually(lambda: passing(consul, "survivor"), what="survivor passing")
        await asyncio.to_thread(agent.restart)
        assert not passing(consul, "survivor")
        back = await eventually(lambda: passing(consul, "survivor"), timeout=60, what="survivor back")
        assert back[0]["Service"]["ID"] == f"_nomad-task-{alloc_id}-engine-survivor-http"
        assert store.allocs[alloc_id]["ClientStatus"] == "running"
        assert task_state(store.allocs[alloc_id])["Restarts"] == 0
    finally:
        await client.shutdown()


async def test_group_check_restart_restarts_the_group_s_task_each_time_it_stays_critical(
    harness: Harness,
) -> None:
    task = raw_exec_task("engine", sys.executable, ["-c", "import time; time.sleep(3600)"])
    service = {
        "Name": "deaf-group",
        "PortLabel": "http",
        "Checks": [
            http_check(
                "/v1/models",
                name="engine ready",
                CheckRestart={"Limit": 3, "Grace": 2 * SECOND, "IgnoreWarnings": True},
            )
        ],
    }
    job = make_job([task], group_services=[service], restart=restart_policy(attempts=1, delay_s=1))
    alloc_id = harness.run(job, ports={"http": free_port()})
    alloc = await wait_alloc(
        harness.store, alloc_id, lambda a: task_state(a).get("State") == "dead", timeout=60
    )
    # Watched again after the restart, so the second stretch of critical checks fails the task.
    signaled = events_of(alloc, "Restart Signaled")
    assert [e["DisplayMessage"] for e in signaled] == ['healthcheck: check "engine ready" unhealthy'] * 2
    assert alloc["ClientStatus"] == "failed"
    assert task_state(alloc)["Restarts"] == 1


async def test_shutdown_delay_leaves_consul_first_and_kills_the_task_after_it(harness: Harness) -> None:
    # The group's delay (groupservice_hook.go), then the task's own (task_runner.go handleKill);
    # the harness's clock runs 10x, so 30 s + 10 s of Nomad time is about 4 s here.
    task = raw_exec_task(
        "web",
        sys.executable,
        ["-m", "http.server", "${NOMAD_PORT_http}", "--bind", "127.0.0.1"],
        ShutdownDelay=10 * SECOND,
    )
    service = {"Name": "llmgw-engine", "PortLabel": "http", "Tags": ["model=tiny"], "Meta": {"model": "tiny"}}
    job = make_job([task], group_services=[service])
    job["TaskGroups"][0]["ShutdownDelay"] = 30 * SECOND
    port = free_port()
    alloc_id = harness.run(job, ports={"http": port})
    await eventually(lambda: passing(harness.consul, "llmgw-engine"), what="the service registered")
    await eventually(lambda: httpx.get(f"http://127.0.0.1:{port}/").status_code == 200, what="web serving")

    harness.store.upsert_alloc(dict(harness.store.allocs[alloc_id], DesiredStatus="stop"))
    stopped = asyncio.get_running_loop().time()
    harness.client.stop_alloc(alloc_id)
    await deregistered(harness.consul, alloc_id)
    # Out of Consul, still serving: what a router's requests in flight need.
    assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
    assert not events_of(harness.store.allocs[alloc_id], "Killing", "web")

    alloc = await wait_alloc(harness.store, alloc_id, lambda a: task_state(a, "web").get("State") == "dead")
    assert asyncio.get_running_loop().time() - stopped >= 3.5
    types = [e["Type"] for e in task_state(alloc, "web")["Events"]]
    assert types.index("Killing") < types.index("Waiting for shutdown delay") < types.index("Killed")
    (waiting,) = events_of(alloc, "Waiting for shutdown delay", "web")
    assert waiting["DisplayMessage"] == "Waiting for shutdown_delay of 10s before killing the task."
