"""Fixtures for the real parts live in tests/fixtures/, one module per part, so each can grow
without the others: consul.py (a Consul dev agent), engines.py (tiny GGUF files and llama.cpp
servers), nomad.py (the Nomad stand-in).

Every watcher the suite starts, in this process or as `llmgw watcher`, runs the passes it would
skip as quiet anyway and writes down any model whose decision came out different
(`nomad_driver/watcher/quiet.py`); one such line fails the run, whichever test it came from."""

import os
import tempfile
from pathlib import Path

import pytest

from nomad_driver.watcher.quiet import VERIFY_ENV

pytest_plugins = [
    "tests.fixtures.consul",
    "tests.fixtures.engines",
    "tests.fixtures.llama_cpp",
    "tests.fixtures.nomad",
]

_SKIP_CHECKS = Path(tempfile.mkdtemp(prefix="llmgw-skip-checks-")) / "differences.jsonl"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(VERIFY_ENV, str(_SKIP_CHECKS))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = Path(os.environ.get(VERIFY_ENV, str(_SKIP_CHECKS)))
    found = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    if found:
        print(
            f"\n{len(found)} skippable watcher passes decided otherwise than the pass before (from {path}):"
        )
        print("\n".join(found[:20]))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
