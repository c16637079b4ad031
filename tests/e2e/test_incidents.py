"""Both incidents, replayed on the dev stack as a user runs it (`python -m devstack up --tiny`).

1. kev-0.5b, a GGUF whose architecture llama.cpp does not know, is started five times and
   parked, and everything an operator looks at says so, with the engine's own error.
2. phi-4 fits on no node: a request is refused at once with Nomad's reason, the warning is
   logged once, and the model is served as soon as a node that fits joins.

The tests share one stack and run in file order: the last two change it (a node is added, then
the stack is stopped).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from devstack import processes
from devstack.fleet import big_gpu_node
from tests.e2e.conftest import DevStack, descendants, wait_until

pytestmark = pytest.mark.slow

KEV = "kev-0.5b"
PHI = "phi-4"
ARCH_ERROR = "unknown model architecture: 'kev'"
# The stand-in runs Nomad's delays 4 times faster: a restart after 15 s / 4, a reschedule after
# 1 min / 4. Watching this long after parking is several of either.
QUIET_S = 25.0
AT_ONCE_S = 10.0


def admin_model(stack: DevStack, model: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{stack.admin}/v1/admin/models/{model}", timeout=10).json()
    return body


def engine_starts(stack: DevStack, model: str) -> int:
    """Times Nomad started the model's engine: `Started` task events over all its allocations."""
    allocs = httpx.get(f"{stack.nomad}/v1/job/llmgw-{model}/allocations", timeout=10).json()
    starts = 0
    for alloc in allocs:
        for state in (alloc.get("TaskStates") or {}).values():
            starts += sum(1 for e in state.get("Events") or [] if e.get("Type") == "Started")
    return starts


def client(stack: DevStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.router}/v1", api_key="e2e", max_retries=0, timeout=120)


def refusal(stack: DevStack, model: str) -> tuple[openai.APIStatusError, float]:
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client(stack).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
    return info.value, time.monotonic() - started


def error_fields(exc: openai.APIStatusError) -> tuple[str, str]:
    body = exc.body if isinstance(exc.body, dict) else {}
    inner = body.get("error") if isinstance(body.get("error"), dict) else body
    assert isinstance(inner, dict), f"error body is not an OpenAI error: {exc.body!r}"
    return str(inner.get("code", "")), str(inner.get("message", ""))


def metric(stack: DevStack, name: str, model: str) -> float | None:
    text = httpx.get(f"{stack.admin}/metrics", timeout=10).text
    match = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else None


def parked_with_engine_error(stack: DevStack) -> dict[str, Any] | None:
    # Parking happens on the fifth failure; the engine's own words follow from its stderr.
    model = admin_model(stack, KEV)
    return model if model.get("parked") and ARCH_ERROR in str(model.get("last_error")) else None


# ----- incident 1: a model that cannot start ---------------------------------------------------


def test_kev_is_started_exactly_five_times_and_then_parked(devstack_tiny: DevStack) -> None:
    stack = devstack_tiny
    wait_until(f"{KEV} parked", lambda: admin_model(stack, KEV).get("parked"))
    # Parking goes through the group's 15 s drain (nomad_driver/draining.py), in which Nomad's
    # restart policy may start the crash-looping engine once more before the kill: not counted
    # (docs/watcher.md), and over once the drain is (QUIET_S is longer).
    assert engine_starts(stack, KEV) in (5, 6)
    time.sleep(QUIET_S)
    settled = engine_starts(stack, KEV)
    assert settled in (5, 6)
    time.sleep(QUIET_S / 5)
    assert engine_starts(stack, KEV) == settled, "a parked model was started again"
    job = httpx.get(f"{stack.nomad}/v1/job/llmgw-{KEV}", timeout=10).json()
    assert job["TaskGroups"][0]["Count"] == 0
    model = admin_model(stack, KEV)
    assert model["consecutive_failures"] == 5
    assert model["state"] == "parked"


def test_parked_model_is_shown_with_its_engine_error_in_status_models_metrics_and_consul(
    devstack_tiny: DevStack,
) -> None:
    stack = devstack_tiny
    wait_until(f"{KEV} parked with the engine's error", lambda: parked_with_engine_error(stack), timeout=60)

    status = stack.llmgw("ctl", "status", "--json")
    assert status.returncode == 0, status.stderr
    row = {m["model"]: m for m in json.loads(status.stdout)["models"]}[KEV]
    assert row["parked"] is True and ARCH_ERROR in row["reason"]

    listed = httpx.get(f"{stack.router}/v1/models", timeout=10).json()["data"]
    entry = {m["id"]: m for m in listed}[KEV]
    assert entry["llmgw"]["state"] == "parked" and ARCH_ERROR in entry["llmgw"]["reason"]

    assert metric(stack, "llmgw_model_parked", KEV) == 1.0
    assert metric(stack, "llmgw_model_parked", "gemma-3-270m") == 0.0

    # The Consul UI shows each model as a service instance with a check that says why.
    health = httpx.get(f"{stack.consul}/v1/health/service/llmgw-model", timeout=10).json()
    checks = {e["Service"]["Meta"]["model"]: e["Checks"] for e in health}
    kev_checks = [c for c in checks[KEV] if c.get("ServiceID")]
    assert [c["Status"] for c in kev_checks] == ["critical"]
    assert ARCH_ERROR in kev_checks[0]["Output"]
    assert all(c["Status"] == "passing" for c in checks["gemma-3-270m"])


def test_fleet_summary_lists_the_parked_and_the_unplaceable_model(devstack_tiny: DevStack) -> None:
    stack = devstack_tiny
    wait_until(f"{KEV} parked with the engine's error", lambda: parked_with_engine_error(stack), timeout=60)
    summary = stack.llmgw("ctl", "summary", "--json")
    assert summary.returncode == 0, summary.stderr
    fleet = json.loads(summary.stdout)
    parked = {p["model"]: p for p in fleet["parked"]}
    assert ARCH_ERROR in parked[KEV]["last_error"] and parked[KEV]["consecutive_failures"] == 5
    unplaceable = {u["model"]: u for u in fleet["unplaceable"]}
    assert "94000 MiB" in unplaceable[PHI]["reason"]


def test_request_for_the_parked_model_is_refused_at_once_with_the_engine_error(
    devstack_tiny: DevStack,
) -> None:
    stack = devstack_tiny
    wait_until(f"{KEV} parked with the engine's error", lambda: parked_with_engine_error(stack), timeout=60)
    before = engine_starts(stack, KEV)
    exc, elapsed = refusal(stack, KEV)
    code, message = error_fields(exc)
    assert exc.status_code == 503 and code == "model_parked"
    assert ARCH_ERROR in message and "llmgw ctl retry kev-0.5b" in message
    assert exc.response.headers.get("x-should-retry") == "false"
    assert "retry-after" not in exc.response.headers
    assert elapsed < AT_ONCE_S
    assert engine_starts(stack, KEV) == before, "a request for a parked model started it"


# ----- incident 2: a model that fits nowhere ---------------------------------------------------


def test_request_for_the_unplaceable_model_is_refused_at_once_with_nomads_reason(
    devstack_tiny: DevStack,
) -> None:
    stack = devstack_tiny
    exc, elapsed = refusal(stack, PHI)
    code, message = error_fields(exc)
    assert exc.status_code == 503 and code == "model_unplaceable"
    assert "94000 MiB" in message and "nvidia/gpu" in message
    assert exc.response.headers.get("x-should-retry") == "false"
    assert elapsed < AT_ONCE_S
    assert admin_model(stack, PHI)["unplaceable"] is True
    assert metric(stack, "llmgw_model_unplaceable", PHI) == 1.0


def watcher_logs(stack: DevStack) -> list[str]:
    """Each watcher's stderr, read through Nomad's log API as `nomad alloc logs` does."""
    allocs = httpx.get(f"{stack.nomad}/v1/job/llmgw-watcher/allocations", timeout=10).json()
    logs = []
    for alloc in allocs:
        resp = httpx.get(
            f"{stack.nomad}/v1/client/fs/logs/{alloc['ID']}",
            params={"task": "watcher", "type": "stderr", "plain": "true", "origin": "start"},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        logs.append(resp.text)
    return logs


def test_unplaceable_warning_is_logged_once(devstack_tiny: DevStack) -> None:
    stack = devstack_tiny
    # Many passes have run since phi-4 was found unplaceable (kev's five failures, the requests
    # above); a few more requests ask Nomad again, with the same answer.
    for _ in range(3):
        refusal(stack, PHI)
    time.sleep(3)
    counts = [log.count(f"event=unplaceable model={PHI} ") for log in watcher_logs(stack)]
    assert len(counts) == 2
    assert max(counts) == 1, f"the placement warning was logged {counts} times (per watcher)"


def test_unplaceable_model_is_served_once_a_node_that_fits_joins(devstack_tiny: DevStack) -> None:
    stack = devstack_tiny
    node = big_gpu_node(Path(stack.info["engines_dir"]))
    resp = httpx.put(f"{stack.nomad}/v1/devstack/node", json=node, timeout=10)
    assert resp.status_code == 200, resp.text
    wait_until(f"{PHI} ready on {node['name']}", lambda: admin_model(stack, PHI).get("ready"), timeout=180)
    reply = client(stack).completions.create(model=PHI, prompt="Hello", max_tokens=4)
    assert reply.choices and reply.model
    model = admin_model(stack, PHI)
    assert model["unplaceable"] is False and model["state"] == "satisfied"
    assert metric(stack, "llmgw_model_unplaceable", PHI) == 0.0


# ----- the demo's other models -----------------------------------------------------------------


def test_on_demand_model_starts_on_its_first_request(devstack_tiny: DevStack) -> None:
    stack = devstack_tiny
    model = "gemma-3-270m-on-demand"
    assert admin_model(stack, model)["state"] == "idle"
    # One request, no client retries: the router starts a replica through Nomad and holds the
    # request until it is ready (its activation window is 2 minutes).
    reply = client(stack).completions.create(model=model, prompt="Once upon a time", max_tokens=4)
    assert reply.choices
    status = admin_model(stack, model)
    assert status["ready"] == 1 and status["desired"] == 1


def test_the_two_shard_model_answers_from_two_nodes_of_one_fabric_shown_as_one_replica(
    devstack_tiny: DevStack,
) -> None:
    stack = devstack_tiny
    model = "gemma-3-270m-split"
    reply = client(stack).completions.create(model=model, prompt="Once upon a time", max_tokens=4)
    assert reply.choices
    # `ctl status` as the tour prints it: the shard and the fabric beside the model.
    status = stack.llmgw("ctl", "status")
    assert status.returncode == 0, status.stderr
    header = next(line for line in status.stdout.splitlines() if "MODEL" in line)
    assert "SHARDS" in header and "FABRIC" in header, status.stdout
    row = next(line for line in status.stdout.splitlines() if f" {model} " in line)
    assert "1/1" in row and "roce-a" in row, status.stdout
    as_json = {m["model"]: m for m in json.loads(stack.llmgw("ctl", "status", "--json").stdout)["models"]}
    split = as_json[model]
    assert (split["fabric"], split["shards_running"], split["ready"]) == ("roce-a", 1, 1)
    assert sorted(split["replica_nodes"]) == ["gpu-a10-0", "gpu-a10-1"]
    # One replica, not two: its shard is listed with it, never as a replica "starting" forever.
    replicas = json.loads(stack.llmgw("ctl", "replicas", "--json").stdout)["replicas"]
    (row_json,) = [r for r in replicas if r["model"] == model]
    assert row_json["state"] == "ready" and row_json["fabric"] == "roce-a"
    assert [s["state"] for s in row_json["shards"]] == ["running"]
    assert {row_json["node"], *(s["node"] for s in row_json["shards"])} == {"gpu-a10-0", "gpu-a10-1"}
    text = httpx.get(f"{stack.admin}/metrics", timeout=10).text
    shards = [line for line in text.splitlines() if line.startswith("llmgw_model_replica_shards_running{")]
    assert shards == [f'llmgw_model_replica_shards_running{{fabric="roce-a",model="{model}"}} 1.0'], shards


# ----- the stack itself ------------------------------------------------------------------------


def test_devstack_down_leaves_no_process_behind(devstack_tiny: DevStack) -> None:
    stack = devstack_tiny
    started = descendants(stack.process.pid)
    for child in stack.state()["children"]:
        started |= set(processes.group_members(int(child["pid"])))
    # Consul, the stand-in, two watchers, a router and the engines of gemma and phi-4 at least.
    assert len(started) >= 7, f"expected the whole stack under devstack up, found {sorted(started)}"
    stack.down()
    assert stack.process.returncode == 0, stack.output_tail()
    survivors = wait_until(
        "every process of the stack gone",
        lambda: not [pid for pid in started if processes.alive(pid)] or None,
        timeout=30,
    )
    assert survivors is True
    assert not (stack.state_dir / "state.json").exists()
