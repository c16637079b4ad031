"""The watcher's metrics against the Nomad stand-in and a real Consul: the five model gauges of
every defined model (0 included), the engine gauges from node meta, leader changes and
certificate expiry; and parking that names the engine's own error from the first moment
anything shows the model parked."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization

from devstack.prometheus import self_signed_certificate
from nomad_driver.cli import ctl
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.spec import parse_models
from nomad_driver.state import parse_state, state_key
from nomad_driver.watcher.admin import create_app, model_status
from nomad_driver.watcher.loop import Watcher
from tests.watcher_support import engines_dir, mock_job, models_text, node, until, watcher_on_standin

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

MODEL_GAUGES = (
    "llmgw_model_desired_replicas",
    "llmgw_model_ready_replicas",
    "llmgw_model_consecutive_start_failures",
    "llmgw_model_parked",
    "llmgw_model_unplaceable",
    "llmgw_model_short",
)
ARCH_ERROR = "unknown model architecture: 'kev'"


def write_cert(path: Path, days: int) -> float:
    cert, _key = self_signed_certificate("llmgw-test", days)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert.not_valid_after_utc.timestamp()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric, by its labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for match in re.finditer(rf"^{name}(?:\{{(.*?)\}})? (\S+)$", text, re.MULTILINE):
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")))
        out[labels] = float(match.group(2))
    return out


def of_model(text: str, name: str, model: str) -> float | None:
    return samples(text, name).get((("model", model),))


class World:
    def __init__(self, consul: Consul, nomad: Nomad, watcher: Watcher, http: httpx.AsyncClient) -> None:
        self.consul, self.nomad, self.watcher, self.http = consul, nomad, watcher, http

    async def metrics(self) -> str:
        resp = await self.http.get("/metrics")
        assert resp.status_code == 200
        return resp.text


@pytest.fixture
async def world_factory(
    consul_url: str, start_standin: Callable[..., Any]
) -> AsyncIterator[Callable[..., Awaitable[World]]]:
    made: list[World] = []

    async def make(text: str, nodes: Any = None, clock_speed: float = 10.0) -> World:
        _, consul, nomad, watcher = await watcher_on_standin(
            consul_url, start_standin, text, ident="metrics", clock_speed=clock_speed, nodes=nodes
        )
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(watcher)), base_url="http://admin"
        )
        world = World(consul, nomad, watcher, http)
        made.append(world)
        return world

    try:
        yield make
    finally:
        for w in made:
            await w.http.aclose()
            await w.watcher.stop()
            await w.watcher.consul.close()
            await w.consul.close()


PROFILES_EXTRA = """
  ancient:
    engine: llama-cpp-python
    engine_version: 0.0.1
    gpus: 0
    cpu_mhz: 500
    memory_mib: 512
"""


async def test_model_engine_leader_and_certificate_metrics_on_the_small_fleet(
    world_factory: Callable[..., Awaitable[World]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert = tmp_path / "consul.pem"
    expiry = write_cert(cert, days=30)
    monkeypatch.setenv("LLMGW_TLS_CERTS", str(cert))
    text = models_text(
        crash=("file:///tmp/crash.gguf", "cpu", 1),
        big=("file:///tmp/big.gguf", "huge", 1),
        lazy=("file:///tmp/lazy.gguf", "cpu", 0),
        old=("file:///tmp/old.gguf", "ancient", 0),
    )
    text = text.replace("models:\n", PROFILES_EXTRA + "models:\n", 1)
    models = parse_models(text).models
    world = await world_factory(text)
    # Exits 1 after a second of the stand-in's clock, as kev-0.5b did; a mock, so no engine runs.
    world.nomad.register_job(mock_job(models["crash"], 1, run_for="1s", exit_code=1))

    await world.watcher.start()
    # From the pass that loads the definitions on, every defined model has all five gauges.
    await until(lambda: world.watcher.models, 20, "definitions loaded", every=0.02)
    first = await world.metrics()
    for name in MODEL_GAUGES:
        for model in models:
            assert of_model(first, name, model) is not None, f"{name} of {model} missing"
    seen: list[float] = []

    async def crash_parked() -> bool:
        body = await world.metrics()
        failures = of_model(body, "llmgw_model_consecutive_start_failures", "crash")
        if failures is not None and (not seen or seen[-1] != failures):
            seen.append(failures)
        return of_model(body, "llmgw_model_parked", "crash") == 1.0

    await until(crash_parked, 120, "crash parked", every=0.05)
    # Sampled while it failed: the count climbed one start at a time, as the alert expects.
    climbed = [v for v in seen if v > 0]
    assert climbed == sorted(climbed) and {1.0, 2.0, 3.0, 4.0, 5.0} <= set(climbed), seen

    async def settled() -> str | None:
        body = await world.metrics()
        return body if of_model(body, "llmgw_model_unplaceable", "big") == 1.0 else None

    body = await until(settled, 30, "big unplaceable")
    # desired, ready, consecutive start failures, parked, unplaceable, short
    expected = {
        "crash": (0, 0, 5, 1, 0, 0),
        "big": (1, 0, 0, 0, 1, 0),
        "lazy": (0, 0, 0, 0, 0, 0),
        "old": (0, 0, 0, 0, 0, 0),
    }
    for model, values in expected.items():
        got = tuple(of_model(body, name, model) for name in MODEL_GAUGES)
        assert got == values, f"{model}: {dict(zip(MODEL_GAUGES, got, strict=True))}"

    # An on-demand model nobody asked for is satisfied, as `llmgw ctl status` counts it.
    lazy = model_status(world.watcher, "lazy")
    assert lazy["desired"] == 0 and lazy["satisfied"] is True and ctl.model_problem(lazy) is None

    # Engines: every node of the small fleet reports both; the profile at 0.0.1 has no node.
    installs = samples(body, "llmgw_engine_installs")
    assert installs[(("engine", "llama-cpp-python"), ("version", "0.3.36"))] == 3
    assert installs[(("engine", "llama.cpp"), ("version", "b6500"))] == 3
    available = samples(body, "llmgw_model_engine_available")
    for model in ("crash", "big", "lazy"):
        key = (("engine", "llama-cpp-python"), ("model", model), ("version", "0.3.36"))
        assert available[key] == 1, model
    assert available[(("engine", "llama-cpp-python"), ("model", "old"), ("version", "0.0.1"))] == 0

    # One change (it gained the lead); the certificate from LLMGW_TLS_CERTS with its expiry.
    assert samples(body, "llmgw_leader")[()] == 1
    assert samples(body, "llmgw_leader_changes_total")[()] == 1
    assert samples(body, "llmgw_tls_cert_expiry_timestamp_seconds")[(("path", str(cert)),)] == expiry
    await world.watcher.leadership.resign()
    await until(lambda: not world.watcher.leadership.is_leader, 10, "stepped down")
    assert samples(await world.metrics(), "llmgw_leader_changes_total")[()] == 2


async def test_the_first_parked_state_anyone_sees_names_the_engines_error(
    world_factory: Callable[..., Awaitable[World]], make_gguf: Any, tmp_path: Path
) -> None:
    kev = make_gguf(architecture="kev", name="kev")
    text = models_text(kev=(f"file://{kev}", "cpu", 1))
    world = await world_factory(text, nodes=[node("cpu-0", engines_dir(tmp_path))], clock_speed=20.0)
    key = state_key("kev")
    written: list[tuple[bool, str]] = []  # (parked, last_error) of every value written to KV
    shown: list[str] = []  # last_error of every parked answer of the admin API

    async def watch_kv() -> None:
        index = 0
        while True:
            index, entries = await world.consul.kv_get(key, index=index, wait_s=5)
            for e in entries:
                s = parse_state(key, e.value)
                if not written or written[-1] != (s.parked, s.last_error):
                    written.append((s.parked, s.last_error))

    async def watch_admin() -> None:
        while True:
            body = (await world.http.get("/v1/admin/models/kev")).json()
            if body.get("parked"):
                shown.append(body["last_error"])
            await asyncio.sleep(0.02)

    tasks = [asyncio.create_task(watch_kv()), asyncio.create_task(watch_admin())]
    try:
        await world.watcher.start()
        await until(lambda: any(p for p, _ in written), 150, "kev parked in KV", every=0.2)
        await asyncio.sleep(1.5)  # what a wrong first value would be replaced by comes in this time
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    parked = [err for p, err in written if p]
    assert parked and all(ARCH_ERROR in err for err in parked), written
    assert shown and all(ARCH_ERROR in err for err in shown), sorted(set(shown))
    d = world.watcher.decisions["kev"]
    assert ARCH_ERROR in d.health_output
