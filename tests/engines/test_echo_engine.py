"""A new engine is one module and its registration: the test-only `echo` engine
(tests/engines/echo_engine.py), registered here, is validated by the spec, rendered into a job,
verified on a node by the node agent, and placed and run by the Nomad stand-in, where it turns
ready in Consul through its own readiness path and answers the openai SDK. Nothing else in
llmgw changed for it."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nomad_driver import engines
from nomad_driver.engines.base import Engine
from nomad_driver.node_agent.agent import Inventory, NodeAgentConfig, build_meta
from nomad_driver.node_agent.inventory import EngineScanner
from nomad_driver.node_meta import engine_meta_key
from nomad_driver.render import render_job
from nomad_driver.spec import Model, SpecError, parse_models
from tests.engines import echo_engine

VERSION = "1.0"


@pytest.fixture
def echo() -> Iterator[Engine]:
    engines.register(echo_engine.ENGINE)
    try:
        yield echo_engine.ENGINE
    finally:
        del engines.ENGINES[echo_engine.NAME]


def models_text(weights: Path, *, gpus: int = 0, nodes: int = 1) -> str:
    return textwrap.dedent(
        f"""
        profiles:
          cpu:
            engine: echo
            engine_version: "{VERSION}"
            gpus: {gpus}
            nodes: {nodes}
            memory_mib: 64
        models:
          echo-tiny:
            source: file://{weights}
            profile: cpu
        """
    )


def echo_model(weights: Path) -> Model:
    (model,) = parse_models(models_text(weights)).models.values()
    return model


def test_an_engine_nobody_registered_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as refused:
        parse_models(models_text(tmp_path / "w.bin"))
    assert refused.value.problems == [
        "profiles.cpu.engine: expected one of 'llama.cpp', 'vllm' or 'llama-cpp-python', got 'echo'"
    ]


def test_a_registered_engine_has_its_own_rules_and_defaults(echo: Engine, tmp_path: Path) -> None:
    assert echo_model(tmp_path / "w.bin").target_in_flight == echo.slots
    with pytest.raises(SpecError) as refused:
        parse_models(models_text(tmp_path / "w.bin", gpus=1, nodes=2))
    assert refused.value.problems == [
        "profiles.cpu.gpus: echo serves from the CPU; use gpus: 0",
        "profiles.cpu.nodes: echo cannot split a model across nodes; use engine llama.cpp or vllm "
        "for nodes: 2, or nodes: 1",
    ]


def test_a_registered_engine_renders_its_own_task_and_readiness_check(echo: Engine, tmp_path: Path) -> None:
    job = render_job(echo_model(tmp_path / "w.bin"))
    (group,) = job["TaskGroups"]
    (task,) = group["Tasks"]
    assert task["Driver"] == "raw_exec"
    assert task["Config"]["command"] == "${meta.llmgw_engines_dir}/echo/1.0/bin/echo-engine"
    assert task["Config"]["args"][:4] == ["--model", str(tmp_path / "w.bin"), "--name", "echo-tiny"]
    assert group["Services"][0]["Checks"][0]["Path"] == "/ready"
    assert group["Constraints"] == [
        {"LTarget": "${meta.llmgw_engine_echo}", "RTarget": VERSION, "Operand": "set_contains"}
    ]


def test_the_node_agent_advertises_only_the_installs_that_say_their_version(
    echo: Engine, tmp_path: Path
) -> None:
    engines_dir = tmp_path / "engines"
    echo_engine.install(engines_dir, VERSION)
    echo_engine.install(engines_dir, "2.0", says="1.9")
    installs = EngineScanner(engines_dir).scan()
    assert [(i.engine, i.version) for i in installs] == [("echo", VERSION)]
    meta = build_meta(
        Inventory(gpus=None, engines=installs, models=[]), NodeAgentConfig(engines_dir=engines_dir)
    )
    assert meta[engine_meta_key("echo")] == VERSION


def _ready_instance(consul_url: str, model: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = httpx.get(
            f"{consul_url}/v1/health/service/llmgw-engine",
            params={"passing": "1", "tag": f"model={model}"},
            timeout=5,
        )
        if reply.status_code == 200 and reply.json():
            return reply.json()[0]["Service"]
        time.sleep(0.2)
    raise AssertionError(f"no passing llmgw-engine instance of {model} within {timeout}s")


@pytest.mark.timeout(120)
def test_an_echo_model_is_placed_run_and_answers_on_the_stand_in(
    echo: Engine, tmp_path: Path, consul_url: str, start_standin: Callable[..., Any]
) -> None:
    engines_dir = tmp_path / "engines"
    echo_engine.install(engines_dir, VERSION)
    installs = EngineScanner(engines_dir).scan()
    meta = build_meta(
        Inventory(gpus=None, engines=installs, models=[]), NodeAgentConfig(engines_dir=engines_dir)
    )
    node = {
        "name": "cpu-0",
        "datacenter": "dc1",
        "cpu_mhz": 8000,
        "cpu_cores": 4,
        "memory_mib": 8192,
        "disk_mb": 10000,
        "attributes": {"driver.raw_exec": "1"},
        "meta": meta,
        "gpus": [],
    }
    standin = start_standin(nodes=[node])
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"echo")
    reply = httpx.post(f"{standin.url}/v1/jobs", json={"Job": render_job(echo_model(weights))}, timeout=10)
    assert reply.status_code == 200, reply.text

    service = _ready_instance(consul_url, "echo-tiny", timeout=60)
    client = openai.OpenAI(
        base_url=f"http://{service['Address']}:{service['Port']}/v1",
        api_key="none",
        max_retries=0,
        timeout=10,
    )
    answer = client.chat.completions.create(
        model="echo-tiny", messages=[{"role": "user", "content": "hello"}]
    )
    assert answer.choices[0].message.content == "hello"
