"""llmgw on a Nomad that makes deployments (the stand-in does, as Nomad does): model jobs opt out
with `max_parallel = 0`, so parking, activation and idle scale-down are never refused while other
jobs deploy, and a long load is never failed by a deadline; without the opt-out Nomad would
refuse them. llmgw's own jobs keep their deployments and roll out one instance at a time."""

from __future__ import annotations

import copy
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.services import parse_job, passing_instances, register_job
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad, NomadError
from nomad_driver.spec import parse_models
from nomad_driver.state import activity_key, inflight_key
from nomad_driver.watcher.loop import Watcher
from tests.fixtures.nomad import StandIn
from tests.watcher_support import mock_job, models_text, read_state, terminated, until, watchers_on_standin

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SECOND = 1_000_000_000
MINUTE = 60 * SECOND
REPO = Path(__file__).resolve().parents[1]
BLOCKED = "job scaling blocked due to active deployment"
# Nomad's own clock runs this much faster in the stand-in: its 10-minute progress deadline is
# 30 s here, its 10 s min_healthy_time half a second.
SPEED = 20.0


def deployment(standin_url: str, job_id: str) -> dict[str, Any] | None:
    found: dict[str, Any] | None = httpx.get(f"{standin_url}/v1/job/{job_id}/deployment", timeout=10).json()
    return found


def deploying_job(job_id: str) -> dict[str, Any]:
    """Another tenant's service job whose deployment runs for the whole test: its allocation
    needs half an hour (of Nomad's clock) to count as healthy."""
    return {
        "ID": job_id,
        "Type": "service",
        "TaskGroups": [
            {
                "Name": "g",
                "Count": 1,
                "Update": {
                    "MaxParallel": 1,
                    "MinHealthyTime": 30 * MINUTE,
                    "HealthyDeadline": 60 * MINUTE,
                    "ProgressDeadline": 120 * MINUTE,
                },
                "Tasks": [
                    {
                        "Name": "t",
                        "Driver": "mock_driver",
                        "Config": {"run_for": "2h"},
                        "Resources": {"CPU": 100, "MemoryMB": 64},
                    }
                ],
            }
        ],
    }


class World:
    def __init__(self, standin: Any, consul: Consul, nomad: Nomad, watcher: Watcher) -> None:
        self.standin, self.consul, self.nomad, self.watcher = standin, consul, nomad, watcher

    def others_deploying(self) -> dict[str, Any]:
        """Another job's deployment, running: deployments are in play."""
        self.nomad.register_job(deploying_job("tenant"))
        return self.deployment_running("tenant")

    def deployment_running(self, job_id: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            found = deployment(self.standin.url, job_id)
            return found if found is not None and found["Status"] == "running" else None

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no running deployment for {job_id}")


@pytest.fixture
async def world_factory(
    consul_url: str, start_standin: Callable[..., Any]
) -> AsyncIterator[Callable[..., Awaitable[World]]]:
    async with watchers_on_standin(consul_url, start_standin) as start:

        async def make(text: str) -> World:
            return World(*await start(text, ident="w1", clock_speed=SPEED))

        yield make


async def test_a_crash_looping_model_is_parked_after_five_starts_while_other_jobs_deploy(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    text = models_text(crash=("file:///tmp/crash.gguf", "cpu", 1))
    model = parse_models(text).models["crash"]
    world = await world_factory(text)
    tenant = world.others_deploying()
    world.nomad.register_job(mock_job(model, 1, run_for="1s", exit_code=1))
    await world.watcher.start()

    state = await until(
        lambda: _parked(world, "crash"), 90, "crash parked while another job deploys", every=0.05
    )
    assert state.consecutive_failures == 5
    job = world.nomad.get_job(model.job_id)
    assert job is not None and job["TaskGroups"][0]["Count"] == 0
    # No deployment for the model's job at any version (parking made one more), so nothing
    # could have refused the scale to zero.
    assert job["Version"] >= 1 and deployment(world.standin.url, model.job_id) is None
    assert httpx.get(f"{world.standin.url}/v1/job/{model.job_id}/deployments", timeout=10).json() == []
    still = deployment(world.standin.url, "tenant")
    assert still is not None and still["ID"] == tenant["ID"] and still["Status"] == "running"


async def test_without_the_opt_out_nomad_refuses_to_park_a_crash_looping_model(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    """What the opt-out prevents: the job as it was rendered before (no update block) gets
    Nomad's default strategy, a deployment, and a refusal of the scale that parks it."""
    text = models_text(crash=("file:///tmp/crash.gguf", "cpu", 1))
    model = parse_models(text).models["crash"]
    world = await world_factory(text)
    job = mock_job(model, 1, run_for="1s", exit_code=1)
    del job["TaskGroups"][0]["Update"]
    world.nomad.register_job(job)
    running = world.deployment_running(model.job_id)
    assert running["TaskGroups"]["engine"]["ProgressDeadline"] == 10 * MINUTE
    await until(lambda: terminated(world.nomad, model.job_id) >= 2, 60, "the model failing")
    with pytest.raises(NomadError) as refused:
        world.nomad.scale(model.job_id, "engine", 0, "llmgw: park")
    assert refused.value.status == 400 and BLOCKED in str(refused.value)


async def test_a_model_job_from_before_the_opt_out_is_registered_again_in_place(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    """An upgrade: a job rendered without the update block (Nomad deploys it) is registered
    again by the watcher with max_parallel = 0 and its deployment is cancelled, so scaling is
    not blocked. (Changing only the strategy updates allocations in place: test_deployments.)"""
    text = models_text(old=("file:///tmp/old.gguf", "cpu", 1))
    model = parse_models(text).models["old"]
    world = await world_factory(text)
    job = mock_job(model, 1, run_for="2h")
    del job["TaskGroups"][0]["Update"]
    world.nomad.register_job(job)
    before = world.deployment_running(model.job_id)
    await world.watcher.start()

    def opted_out() -> bool:
        current = world.nomad.get_job(model.job_id) or {}
        return current["TaskGroups"][0]["Update"]["MaxParallel"] == 0

    await until(opted_out, 30, "the job registered again without deployments")
    cancelled = httpx.get(f"{world.standin.url}/v1/deployment/{before['ID']}", timeout=10).json()
    assert (cancelled["Status"], cancelled["StatusDescription"]) == (
        "cancelled",
        "Cancelled due to newer version of job",
    )
    world.nomad.scale(model.job_id, "engine", 2, "llmgw: scaling is not blocked now")


async def test_a_crash_looping_model_job_from_before_the_opt_out_is_still_parked(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    """The upgrade while a model crash-loops inside a deployment: the scale that parks it may be
    refused once, but the job is registered again at count 0 without deployments in the same
    pass, and the next pass parks it."""
    text = models_text(crash=("file:///tmp/crash.gguf", "cpu", 1))
    model = parse_models(text).models["crash"]
    world = await world_factory(text)
    job = mock_job(model, 1, run_for="1s", exit_code=1)
    del job["TaskGroups"][0]["Update"]
    world.nomad.register_job(job)
    world.deployment_running(model.job_id)
    await world.watcher.start()

    state = await until(lambda: _parked(world, "crash"), 90, "crash parked", every=0.05)
    assert state.consecutive_failures >= 5
    current = world.nomad.get_job(model.job_id)
    assert current is not None and current["TaskGroups"][0]["Count"] == 0
    assert current["TaskGroups"][0]["Update"]["MaxParallel"] == 0
    latest = deployment(world.standin.url, model.job_id)
    assert latest is not None and latest["Status"] == "cancelled"


async def test_an_on_demand_model_activates_and_idles_back_to_zero_while_deployments_run(
    world_factory: Callable[..., Awaitable[World]],
) -> None:
    text = models_text(od=("file:///tmp/od.gguf", "cpu", 0)) + "    idle_timeout: 3s\n"
    model = parse_models(text).models["od"]
    world = await world_factory(text)
    tenant = world.others_deploying()
    world.nomad.register_job(mock_job(model, 0, run_for="2h"))
    await world.watcher.start()

    # Activation, as a router asks for it: a waiting request and its ask in the router's
    # in-flight key; the watcher scales and records its attempt.
    asked = round(time.time(), 3)
    waiting = {
        "router": "r1",
        "at": asked,
        "interval_s": 5,
        "models": {"od": {"requests": 1, "asked": asked}},
    }
    await world.consul.kv_put(inflight_key("r1"), json.dumps(waiting))
    state = await until(
        lambda: _attempt_for(world, "od", asked), 20, "the watcher's attempt for the router's ask"
    )
    assert state.attempt.result == "placed" and state.attempt.eval
    await until(lambda: _live(world, model.job_id) == 1, 20, "a replica placed")
    # Served: the request ends and the router says when.
    await world.consul.kv_put(activity_key("od"), str(time.time()))
    done = {"router": "r1", "at": time.time(), "interval_s": 5, "models": {}}
    await world.consul.kv_put(inflight_key("r1"), json.dumps(done))
    assert deployment(world.standin.url, model.job_id) is None

    # No more requests: the watcher scales it back to zero after idle_timeout.
    await until(lambda: _count(world, model.job_id) == 0, 60, "scaled back to zero when idle")
    await until(lambda: _live(world, model.job_id) == 0, 20, "its replica stopped")
    scale = world.nomad._json(world.nomad._request("job", model.job_id, "scale"), "scale")
    messages = [e.get("Message", "") for e in scale["TaskGroups"]["engine"]["Events"] or []]
    assert any("idle for 3s" in m for m in messages), messages
    assert deployment(world.standin.url, model.job_id) is None
    still = deployment(world.standin.url, "tenant")
    assert still is not None and still["ID"] == tenant["ID"] and still["Status"] == "running"


@pytest.mark.parametrize("opted_out", [True, False], ids=["max_parallel-0", "default-strategy"])
def test_a_load_longer_than_the_healthy_deadline_fails_no_deployment(
    opted_out: bool, start_standin: Callable[..., StandIn]
) -> None:
    """A model that loads for longer than the deadlines (shortened to 1 and 2 minutes of Nomad's
    clock, 3 and 6 s here): its readiness check never passes while it loads. Opted out, the
    replica keeps loading and stays scalable; with a deployment, the deployment fails."""
    standin = start_standin(clock_speed=SPEED)
    model = parse_models(models_text(big=("file:///tmp/big.gguf", "cpu", 1))).models["big"]
    job = mock_job(model, 1, run_for="2h")  # runs, never answers its readiness check: loading
    deadlines = {"MinHealthyTime": 10 * SECOND, "HealthyDeadline": MINUTE, "ProgressDeadline": 2 * MINUTE}
    job["TaskGroups"][0]["Update"] = {**job["TaskGroups"][0]["Update"], **deadlines}
    job["TaskGroups"][0]["Migrate"] = {k: v for k, v in deadlines.items() if k != "ProgressDeadline"}
    if not opted_out:
        job["TaskGroups"][0]["Update"]["MaxParallel"] = 1
    register_job(standin.url, job)
    nomad = Nomad(standin.url)

    def allocs() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = nomad._json(
            nomad._request("job", model.job_id, "allocations", params={"all": "true"}), "allocs"
        )
        return found

    started = time.monotonic()
    while time.monotonic() - started < 15:  # 5 minutes of Nomad's clock, past both deadlines
        time.sleep(0.5)
    (alloc,) = allocs()
    assert alloc["ClientStatus"] == "running" and alloc["DesiredStatus"] == "run"
    found = deployment(standin.url, model.job_id)
    if opted_out:
        assert found is None
        assert alloc["DeploymentStatus"]["Healthy"] is False  # what a drain would see; nothing else
        nomad.scale(model.job_id, "engine", 2, "llmgw: more replicas")
        assert nomad.get_job(model.job_id)["TaskGroups"][0]["Count"] == 2  # type: ignore[index]
    else:
        assert found is not None
        assert (found["Status"], found["StatusDescription"]) == ("failed", "Failed due to progress deadline")


def test_llmgws_own_jobs_deploy_and_roll_out_one_watcher_at_a_time(
    start_standin: Callable[..., StandIn], consul_url: str
) -> None:
    """The watchers and router (jobs/local, raw_exec) keep Nomad's deployments: each version is
    rolled out max_parallel at a time, found healthy by its Consul check, and a rollout of the
    watchers never leaves none passing nor the leader lock unheld at the end."""
    from devstack.ports import free_port

    standin = start_standin(clock_speed=SPEED)
    common = {"venv": sys.prefix, "nomad_addr": standin.url, "consul_addr": consul_url}
    watcher, _ = parse_job(standin.url, REPO / "jobs" / "local" / "llmgw-watcher.nomad.hcl", common)
    router, _ = parse_job(
        standin.url,
        REPO / "jobs" / "local" / "llmgw-router.nomad.hcl",
        # The router talks to Consul only.
        {"venv": sys.prefix, "consul_addr": consul_url, "port": free_port()},
    )
    for job in (watcher, router):
        assert job["TaskGroups"][0]["Update"]["MaxParallel"] >= 1  # deployments, on purpose
        register_job(standin.url, job)

    def successful(job_id: str, version: int) -> dict[str, Any] | None:
        found = deployment(standin.url, job_id)
        ok = found is not None and found["Status"] == "successful" and found["JobVersion"] == version
        return found if ok else None

    _wait("the watchers' first deployment", lambda: successful("llmgw-watcher", 0), 120)
    _wait("the router's first deployment", lambda: successful("llmgw-router", 0), 120)

    changed = copy.deepcopy(watcher)
    changed["Meta"] = {**(changed.get("Meta") or {}), "rollout": "2"}
    register_job(standin.url, changed)
    passing_counts: list[int] = []
    deadline = time.monotonic() + 120
    done = None
    while time.monotonic() < deadline:
        passing_counts.append(len(passing_instances(consul_url, "llmgw-watcher")))
        done = successful("llmgw-watcher", 1)
        if done:
            break
        time.sleep(0.1)
    assert done is not None, "the watchers' rollout did not complete"
    assert done["TaskGroups"]["watcher"]["DesiredTotal"] == 2
    assert min(passing_counts) >= 1, passing_counts
    allocs = httpx.get(f"{standin.url}/v1/job/llmgw-watcher/allocations", timeout=10).json()
    live = [a for a in allocs if a["DesiredStatus"] == "run"]
    assert len(live) == 2 and {a["JobVersion"] for a in live} == {1}
    _wait("a watcher leading", lambda: _leader_held(consul_url), 60)


def test_the_shipped_jobs_keep_deployments_a_rollout_can_finish(
    start_standin: Callable[..., StandIn],
) -> None:
    """jobs/*.hcl as Nomad canonicalises them: the services deploy (max_parallel >= 1, health
    from checks, deadlines in order) and the node agent is a system job llmgw never scales."""
    standin = start_standin(consul=False)
    for name in ("llmgw-watcher", "llmgw-router"):
        job, _ = parse_job(standin.url, REPO / "jobs" / f"{name}.nomad.hcl", {})
        for group in job["TaskGroups"]:
            update = group["Update"]
            assert update["MaxParallel"] >= 1 and update["HealthCheck"] == "checks", (name, update)
            assert update["MinHealthyTime"] < update["HealthyDeadline"] < update["ProgressDeadline"]
            assert group["Services"] and all(s["Checks"] for s in group["Services"]), name
    agent, _ = parse_job(standin.url, REPO / "jobs" / "llmgw-node-agent.nomad.hcl", {})
    assert agent["Type"] == "system"


async def _parked(world: World, model: str) -> Any:
    state = await read_state(world.consul, model)
    return state if state is not None and state.parked else None


def _count(world: World, job_id: str) -> int:
    job = world.nomad.get_job(job_id)
    return int(job["TaskGroups"][0]["Count"]) if job else -1


def _live(world: World, job_id: str) -> int:
    allocs = world.nomad._json(world.nomad._request("job", job_id, "allocations"), "allocs")
    return sum(
        1 for a in allocs if a["DesiredStatus"] == "run" and a["ClientStatus"] in ("pending", "running")
    )


def _leader_held(consul_url: str) -> bool:
    reply = httpx.get(f"{consul_url}/v1/kv/llmgw/leader", timeout=10)
    return reply.status_code == 200 and bool(reply.json()[0].get("Session"))


def _wait(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def _attempt_for(world: World, model: str, asked: float) -> Any:
    state = await read_state(world.consul, model)
    return state if state is not None and state.attempt is not None and state.attempt.asked >= asked else None
