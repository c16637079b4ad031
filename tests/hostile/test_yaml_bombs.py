"""Issue 13, item 5: YAML alias bombs. A 791-byte "billion laughs" hung `render` and `apply`;
the 691-byte 7-level one in `llmgw/config/models` blocked the router ~11.6 s each time its
blocking query returned."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from nomad_driver.cli.app import app as cli_app
from nomad_driver.state import CONFIG_MODELS_KEY
from tests.hostile.conftest import Bystander, GuardedRouter, alpha_replica
from tests.router.conftest import StartStub, put_kv, wait_until

pytestmark = pytest.mark.timeout(120)


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
        time.sleep(0.5)
    bystander.assert_served(max_latency_s=1.5)
    assert httpx.get(f"{router.url}/healthz", timeout=10).json()["status"] == "ok"
