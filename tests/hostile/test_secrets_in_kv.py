"""Issue 13, item 1, what the watcher stores: a parked model's last error is its engine's own
stderr line, and an engine quotes what it was given. It was redacted where it was shown (the
admin API, the router) but stored as it came: in `llmgw/state/<m>`, which every reader of KV
and the Consul UI's check for the model show, and in the scaling event Nomad keeps. Now it is
redacted where it is built, so no copy holds the secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import consul as pyconsul
import httpx
import pytest

from nomad_driver.state import CONFIG_MODELS_KEY, ActionError, ModelState, parse_state, state_key
from tests.hostile.error_engine import HF_TOKEN, SECRET
from tests.watcher_support import wait_for, watcher_processes

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

CREDENTIAL_URL = f"https://user:{SECRET}@models.example/x.gguf"
# What the failing engine prints before it exits: the loader's error, quoting a source and a
# token from its environment, the way an engine's download or load error does.
STDERR_LINE = f"llama_model_load: error loading model: GET {CREDENTIAL_URL}: 403 (HF_TOKEN={HF_TOKEN})"


def secret_free(text: str, where: str) -> None:
    assert SECRET not in text, f"{where}: {text}"
    assert HF_TOKEN not in text, f"{where}: {text}"


def test_a_parked_models_engine_error_is_stored_and_shown_without_its_secret(
    consul_url: str, tmp_path: Path, start_standin: Callable[..., Any]
) -> None:
    # The node's llama-cpp-python is a script that prints the line above and exits 1.
    engines = tmp_path / "engines"
    python = engines / "llama-cpp-python" / "0.3.36" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho 'loading the model' >&2\necho '{STDERR_LINE}' >&2\nexit 1\n")
    python.chmod(0o755)
    weights = tmp_path / "crashy.gguf"
    weights.write_bytes(b"GGUF")
    node = {
        "name": "cpu-0",
        "datacenter": "dc1",
        "cpu_mhz": 16000,
        "cpu_cores": 8,
        "memory_mib": 65536,
        "disk_mb": 100000,
        "attributes": {"driver.raw_exec": "1"},
        "meta": {"llmgw_engines_dir": str(engines), "llmgw_engine_llama_cpp_python": "0.3.36"},
        "gpus": [],
    }
    standin = start_standin(nodes=[node], clock_speed=20.0)
    models = (
        "profiles:\n  cpu: {engine: llama-cpp-python, engine_version: '0.3.36', gpus: 0, "
        "cpu_mhz: 500, memory_mib: 512, context: 256}\n"
        f"models:\n  crashy: {{source: 'file://{weights}', profile: cpu, replicas: {{min: 1, max: 1}}}}\n"
    )
    consul = pyconsul.Consul(host="127.0.0.1", port=int(consul_url.rsplit(":", 1)[1]))
    consul.kv.put(CONFIG_MODELS_KEY, models)
    env = dict(os.environ, CONSUL_HTTP_ADDR=consul_url, NOMAD_ADDR=standin.url)
    env.pop("LLMGW_ADMIN_TOKEN", None)
    with watcher_processes(lambda _port: env, "127.0.0.1", tmp_path, count=1) as procs:
        _, admin = procs[0]

        def parked() -> ModelState | None:
            _, entry = consul.kv.get(state_key("crashy"))
            state = parse_state("k", entry["Value"]) if entry else None
            return state if state is not None and state.parked else None

        wait_for(parked, 180, "crashy parked")
        _, entry = consul.kv.get(state_key("crashy"))
        stored = json.loads(entry["Value"])
        # The engine's own words, the secret masked where it was built.
        assert stored["last_error"].startswith("error loading model: GET https://***@models.example/"), stored
        secret_free(entry["Value"].decode(), "llmgw/state/crashy")

        model = wait_for(
            lambda: httpx.get(f"{admin}/v1/admin/models/crashy", timeout=5).json(), 30, "the admin API"
        )
        assert "error loading model" in model["last_error"]
        secret_free(json.dumps(model), "the admin API")

        ctl = subprocess.run(
            [sys.executable, "-m", "nomad_driver.cli", "ctl", "--addr", admin, "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert ctl.returncode == 0, ctl.stderr
        status = json.loads(ctl.stdout)
        assert "error loading model" in json.dumps(status), ctl.stdout + ctl.stderr
        secret_free(ctl.stdout + ctl.stderr, "llmgw ctl status --json")

        def check_output() -> str:
            checks = httpx.get(f"{consul_url}/v1/health/checks/llmgw-model", timeout=5).json()
            return next((c["Output"] for c in checks if "crashy" in c["ServiceID"] and c["Output"]), "")

        output = wait_for(lambda: "error loading model" in check_output() and check_output(), 30, "the check")
        secret_free(output, "the Consul UI's check for crashy")

        scale = httpx.get(f"{standin.url}/v1/job/llmgw-crashy/scale", timeout=5).json()
        events = json.dumps(scale["TaskGroups"]["engine"]["Events"])
        assert "parked crashy" in events
        secret_free(events, "the job's scaling events in Nomad")
    log = (tmp_path / "watcher-0.log").read_text()
    assert "event=parked" in log
    secret_free(log, "the watcher's log")


def test_what_is_read_back_or_refused_by_nomad_is_redacted_too() -> None:
    # A state an older watcher stored with the secret, read by any reader of KV.
    old = json.dumps({"parked": True, "consecutive_failures": 5, "last_error": STDERR_LINE}).encode()
    state = parse_state(state_key("crashy"), old)
    assert "error loading model" in state.last_error
    secret_free(state.last_error, "a state read back")
    # Nomad's refusal of a register quotes the job it was given: the artifact's source.
    refusal = ActionError(action="register", status=400, message=f"invalid artifact {CREDENTIAL_URL}")
    assert refusal.message == "invalid artifact https://***@models.example/x.gguf"
