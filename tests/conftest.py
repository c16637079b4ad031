"""Fixtures for the real parts live in tests/fixtures/, one module per part, so each can grow
without the others: consul.py (a Consul dev agent), engines.py (tiny GGUF files and llama.cpp
servers), nomad.py (the Nomad stand-in).

Every watcher the suite starts, in this process or as `llmgw watcher`, runs the passes it would
skip as quiet anyway and writes down any model whose decision came out different
(`nomad_driver/watcher/quiet.py`); one such line fails the run, whichever test it came from."""

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nomad_driver.logs import LogfmtFormatter
from nomad_driver.watcher.quiet import VERIFY_ENV

pytest_plugins = [
    "tests.fixtures.consul",
    "tests.fixtures.engines",
    "tests.fixtures.llama_cpp",
    "tests.fixtures.nomad",
]

_SKIP_CHECKS = Path(tempfile.mkdtemp(prefix="llmgw-skip-checks-")) / "differences.jsonl"


# Fixtures that start a process of their own: a Consul agent, the stand-in, an engine, a router,
# the dev stack. A test that uses one (directly or through another fixture) is marked
# `external`; `make test-fast` runs the others, which need nothing but Python.
EXTERNAL_FIXTURES = frozenset(
    {
        "consul_agent",
        "make_consul_agent",
        "acl_consul_agent",
        "start_standin",
        "llama_server",
        "llama_cpp_server",
        "llama_cpp_engines",
        "rpc_shard",
        "start_router",
        "stub_engine",
        "start_devstack",
        "devstack_tiny",
        "stack",
        "error_engine",
        "engine",
        "closing_engine",
    }
)


@pytest.fixture(autouse=True)
def _no_log_handler_outlives_its_test() -> Iterator[None]:
    """A command run in-process (`llmgw watcher` through CliRunner) sets the root logger up as
    the process it would be, on a stderr the runner closes when it returns. Left in place, it
    made each later log line of that worker a `--- Logging error ---` traceback in the run's
    output."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in root.handlers[:]:
        if isinstance(handler.formatter, LogfmtFormatter):
            root.removeHandler(handler)
    root.setLevel(level)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(VERIFY_ENV, str(_SKIP_CHECKS))
    config.addinivalue_line(
        "markers", "external: starts a process (Consul, stand-in, engine, router); see conftest"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if EXTERNAL_FIXTURES.intersection(getattr(item, "fixturenames", ())) or item.get_closest_marker(
            "slow"
        ):
            item.add_marker(pytest.mark.external)


def _skip_check_lines() -> list[str]:
    path = Path(os.environ.get(VERIFY_ENV, str(_SKIP_CHECKS)))
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skip_check_lines():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Printed last, after the durations: CI keeps only the tail of the output."""
    found = _skip_check_lines()
    if not found:
        return
    terminalreporter.write_sep(
        "=", f"{len(found)} skippable watcher passes decided otherwise than the pass before"
    )
    for line in found[:20]:
        try:
            d = json.loads(line)
            terminalreporter.write_line(f"{d['model']}: {', '.join(d['differs'])} (during {d['during']})")
        except (ValueError, KeyError, TypeError):
            terminalreporter.write_line(line[:300])
