"""Issue 13, item 5: YAML alias bombs. A 791-byte "billion laughs" hung `render` and `apply`;
the 691-byte 7-level one in `llmgw/config/models` blocked the router ~11.6 s each time its
blocking query returned. A watcher reading one must keep reconciling, and say why it ignores it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from nomad_driver.cli.app import app as cli_app
from nomad_driver.state import CONFIG_MODELS_KEY
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica
from tests.router.conftest import StartStub, put_kv, wait_until
from tests.watcher_support import CRASH_AND_IDLE_MODELS, until, watcher_on_standin

pytestmark = pytest.mark.timeout(180)


def billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("verb", ["render", "apply"])
def test_the_cli_refuses_a_billion_laughs_at_once(tmp_path: Path, verb: str) -> None:
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    assert len(bomb.read_bytes()) < 1000
    args = ["render", str(bomb), "--check"] if verb == "render" else ["apply", str(bomb)]
    started = time.monotonic()
    result = CliRunner().invoke(cli_app, args)
    assert time.monotonic() - started < 5
    assert result.exit_code == 2, result.output
    assert "this looks like an alias bomb" in result.output


def test_a_bomb_in_consul_does_not_stall_the_router(
    consul_url: str, stub_engine: StartStub, guarded_router: GuardedRouter
) -> None:
    alpha_replica(consul_url, stub_engine)
    router = guarded_router(consul_url)
    router.wait_ready("alpha", 1)
    with Bystander(router.url) as bystander:
        for _ in range(3):
            put_kv(consul_url, CONFIG_MODELS_KEY, billion_laughs(7))
            time.sleep(0.3)
            put_kv(consul_url, CONFIG_MODELS_KEY, billion_laughs(8))
        wait_until(
            lambda: "alias bomb" in router.app.discovery.snapshot.models_error, 10, "the bomb reported"
        )
        bystander.wait_served()
    bystander.assert_served(max_latency_s=1.5)
    assert httpx.get(f"{router.url}/healthz", timeout=10).json()["status"] == "ok"


async def test_a_bomb_in_consul_keeps_the_watcher_reconciling_and_is_reported(
    consul_url: str, start_standin: Callable[..., Any]
) -> None:
    _standin, consul, _nomad, watcher = await watcher_on_standin(
        consul_url, start_standin, CRASH_AND_IDLE_MODELS, ident="w", clock_speed=20.0
    )
    await watcher.start()
    try:
        await until(lambda: {"crash", "idle"} <= set(watcher.decisions), 30, "a first pass")
        await consul.kv_put(CONFIG_MODELS_KEY, billion_laughs(8))
        started = time.monotonic()
        await until(lambda: "alias bomb" in watcher.definitions_problem, 20, "the bomb reported", every=0.02)
        reported_s = time.monotonic() - started
        # Refused, not expanded: the passes go on with the last good definitions.
        passes = watcher.passes
        await until(lambda: watcher.passes >= passes + 3, 30, "more passes")
        assert {"crash", "idle"} == set(watcher.models)
        assert {"crash", "idle"} <= set(watcher.decisions)
        assert reported_s < 10, reported_s
        await consul.kv_put(CONFIG_MODELS_KEY, CRASH_AND_IDLE_MODELS)
        await until(lambda: not watcher.definitions_problem, 30, "the problem cleared")
    finally:
        await watcher.stop()
        await consul.close()
