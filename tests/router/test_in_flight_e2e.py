"""No scale-down under a request, end to end: a real llama.cpp engine placed by the stand-in, the
router, the watcher and a real Consul. A streamed request that outlives the model's
idle_timeout (its engine stalls mid-stream for longer than that) completes, and its replica
stays until the idle clock, started when the request ended, runs out."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.router.conftest import StartRouter
from tests.watcher_support import PROFILES, engines_dir, node, until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

IDLE_S = 2
STALL_S = 10  # well past idle_timeout plus the routers' interval plus a pass or two
EOS_ID = 2  # the tiny GGUF's end of sequence; suppressed so the answer runs to max_tokens


def models_yaml(gguf: Path) -> str:
    return (
        PROFILES
        + f"""
models:
  tiny:
    source: file://{gguf}
    profile: cpu
    replicas: {{min: 0, max: 1}}
    idle_timeout: {IDLE_S}s
    activation_timeout: 400s
"""
    )


def engine_pid(port: int) -> int:
    """The engine process listening on `port`, found by its command line (`--port N`)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"llama_cpp.server" in argv
            and b"--port" in argv
            and argv[argv.index(b"--port") + 1] == b"%d" % port
        ):
            return int(entry)
    raise AssertionError(f"no engine process listening on port {port}")


def job(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/v1/job/llmgw-tiny", timeout=10).json())


def running_allocs(url: str) -> set[str]:
    allocs = httpx.get(f"{url}/v1/job/llmgw-tiny/allocations", timeout=10).json()
    return {a["ID"] for a in allocs if a["ClientStatus"] == "running" and a["DesiredStatus"] == "run"}


def idle_scale_downs(url: str) -> list[dict[str, Any]]:
    status = httpx.get(f"{url}/v1/job/llmgw-tiny/scale", timeout=10).json()
    events = status["TaskGroups"]["engine"]["Events"] or []
    return [e for e in events if e.get("Count") == 0 and "idle" in str(e.get("Message", ""))]


async def test_a_stream_that_outlives_idle_timeout_completes_and_its_replica_stays(
    tmp_path: Path,
    consul_url: str,
    start_standin: Callable[..., Any],
    start_router: StartRouter,
    make_gguf: Callable[..., Path],
) -> None:
    gguf = make_gguf()
    standin = start_standin(nodes=[node("cpu-0", engines_dir(tmp_path))])
    consul = Consul(consul_url)
    await consul.kv_put(CONFIG_MODELS_KEY, models_yaml(gguf))
    config = WatcherConfig(wait_s=10, lock_delay_s=0.5, tick_s=0.5, activity_interval_s=1.0)
    watcher = Watcher(Consul(consul_url), Nomad(standin.url), config, ident="in-flight")
    await watcher.start()
    stopped: int | None = None
    try:
        await until(lambda: watcher.leadership.is_leader, 30, "the watcher to lead")
        await until(
            lambda: httpx.get(f"{standin.url}/v1/job/llmgw-tiny", timeout=5).status_code == 200, 30, "job"
        )
        router = start_router(consul_url, activation=True, activity_interval_s=1.0)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=420)

        # The first request starts the model (activation); then the stream under test.
        first = await asyncio.to_thread(
            client.chat.completions.create,
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
        )
        assert first.choices[0].message.role == "assistant"
        allocs = running_allocs(standin.url)
        assert len(allocs) == 1

        pid = engine_pid(router.app.discovery.snapshot.ready["tiny"][0].port)
        seen_in_flight: list[int] = []
        marks: dict[str, float] = {}

        def stream() -> tuple[int, str | None]:
            nonlocal stopped
            chunks = 0
            finish = None
            response = client.chat.completions.create(
                model="tiny",
                # Byte tokens and a 256-token context: a short prompt leaves room for 150.
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=150,
                stream=True,
                logit_bias={str(EOS_ID): -100},
            )
            for chunk in response:
                chunks += 1
                if chunks == 1:
                    # The engine stalls mid-answer, for longer than the model's idle_timeout.
                    os.kill(pid, signal.SIGSTOP)
                    stopped = pid
                    deadline = time.monotonic() + STALL_S
                    while time.monotonic() < deadline:
                        seen_in_flight.append(watcher.views["tiny"].in_flight)
                        time.sleep(0.5)
                    assert job(standin.url)["TaskGroups"][0]["Count"] == 1
                    os.kill(pid, signal.SIGCONT)
                    stopped = None
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            marks["ended"] = time.time()
            return chunks, finish

        chunks, finish = await asyncio.to_thread(stream)
        assert finish == "length", (chunks, finish)
        assert chunks > 10
        # The watcher saw the request in flight through the stall, summed from the router.
        assert max(seen_in_flight) == 1
        # The replica that served it is the one that was there before: nothing was stopped.
        assert running_allocs(standin.url) == allocs
        assert idle_scale_downs(standin.url) == []

        # Once the request has ended, the idle clock runs from its end: scaled down after
        # idle_timeout, not before.
        await until(lambda: idle_scale_downs(standin.url), 60, "the idle scale-down", every=0.5)
        down_at = idle_scale_downs(standin.url)[0]["Time"] / 1e9
        assert down_at >= marks["ended"] + IDLE_S - 0.5, (down_at, marks["ended"])
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await watcher.stop()
        await watcher.consul.close()
        await consul.close()
