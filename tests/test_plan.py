"""`llmgw plan` and the plan `llmgw apply` shows first, against a real Consul and the Nomad
stand-in on the demo's fleet (devstack/nodes/small.yaml): what changes, whether it fits, the
watcher's own words when it does not, exit codes for CI, the JSON shape, and that planning
changes nothing in Nomad."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from typer.testing import CliRunner, Result

from devstack.demo_models import TEMPLATE, effective_models_text
from devstack.fleet import GPU_POOL, effective_nodes
from nomad_driver.cli.app import app
from nomad_driver.config_kv import CONFIG_PREFIX
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from tests.fixtures.nomad import REPO, SMALL_FLEET, StandIn
from tests.standin.api_helpers import mock_job
from tests.watcher_support import read_state, until

pytestmark = pytest.mark.timeout(180)

DEMO_REASON = "no node has 1 x nvidia/gpu with memory >= 94000 MiB: 3 nodes filtered (missing devices)"

# The documented `--json` shape (docs/operating.md): every key, at every level.
TOP_KEYS = {"outcome", "exit_code", "summary", "problems", "models"}
SUMMARY_KEYS = {"added", "changed", "removed", "unchanged", "conflict", "fits_nowhere"}
MODEL_KEYS = {
    "model", "job_id", "change", "fields", "replaces_replicas", "on_demand", "placement", "notes", "surge_from",
    "update",
}  # fmt: skip
FIELD_KEYS = {"field", "old", "new"}
PLACEMENT_KEYS = {"fits", "count", "reason", "candidates", "preempts", "updates", "fabric", "nodes"}
CANDIDATE_KEYS = {"node_class", "gpu_model", "nodes"}


def demo_fleet(tmp_path: Path) -> Path:
    """The dev stack's fleet: small.yaml's GPU nodes in the pool `gpu` the demo models name."""
    return effective_nodes(SMALL_FLEET, tmp_path / "engines", tmp_path / "fleet.yaml", gpu_pool=GPU_POOL)


@pytest.fixture
def cluster(
    consul_url: str, start_standin: Callable[..., StandIn], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> StandIn:
    standin = start_standin(nodes=demo_fleet(tmp_path), consul=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    return standin


def single_node_demo(text: str) -> str:
    """The demo's models without its multi-node one: its job is the watcher's to register
    (pinned to a fabric), and its nodes are not in this fleet."""
    start = text.index("  gemma-3-270m-split:\n")
    end = text.index("\n\n", start) + 2
    return text[:start] + text[end:]


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(single_node_demo(effective_models_text(TEMPLATE.read_text(), tmp_path)))
    return path


def run(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(app, list(args), input=stdin)


def plan_json(path: Path) -> tuple[int, dict[str, Any]]:
    result = run("plan", str(path), "--json")
    return result.exit_code, json.loads(result.stdout)


def by_model(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["model"]: m for m in doc["models"]}


def nomad_indexes(url: str) -> dict[str, str]:
    return {
        p: requests.get(f"{url}/v1/{p}", timeout=10).headers["X-Nomad-Index"]
        for p in ("jobs", "evaluations", "allocations")
    }


def job_definitions(url: str) -> dict[str, int]:
    """The index of each job's last definition change (the list stub has no Version)."""
    jobs = requests.get(f"{url}/v1/jobs", timeout=10).json()
    return {j["ID"]: j["JobModifyIndex"] for j in jobs}


def test_plan_of_the_demo_before_and_after_apply(cluster: StandIn, demo: Path) -> None:
    before = nomad_indexes(cluster.url)
    code, doc = plan_json(demo)
    assert code == 7, doc
    assert nomad_indexes(cluster.url) == before, "planning wrote to Nomad"
    assert doc["outcome"] == "fits nowhere" and doc["exit_code"] == 7
    assert doc["summary"] == {
        "added": 4, "changed": 0, "removed": 0, "unchanged": 0, "conflict": 0, "fits_nowhere": 1
    }  # fmt: skip
    assert doc["problems"] == []
    models = by_model(doc)
    phi = models["phi-4"]["placement"]
    assert (phi["fits"], phi["count"], phi["reason"]) == (False, 1, DEMO_REASON)
    gemma = models["gemma-3-270m"]["placement"]
    assert gemma["fits"] and gemma["count"] == 1 and gemma["updates"] == {"Place": 1}
    # The 4090 and the L4 (24 GB) and the H100 node all have a card with 2000 MiB to spare.
    assert {(c["node_class"], c["gpu_model"]) for c in gemma["candidates"]} == {
        ("rtx4090", "NVIDIA GeForce RTX 4090"),
        ("l4", "NVIDIA L4"),
        ("h100", "NVIDIA H100 80GB HBM3"),
    }
    on_demand = models["gemma-3-270m-on-demand"]
    assert on_demand["on_demand"] and on_demand["placement"]["fits"] and on_demand["placement"]["count"] == 1

    text = run("plan", str(demo))
    assert text.exit_code == 7
    assert f"+ phi-4 (added)\n    FITS NOWHERE: 1 replica: {DEMO_REASON}" in text.stdout
    assert "4 to add, 0 to change, 0 removed, 0 unchanged; 1 fits nowhere" in text.stdout

    # Without a terminal nobody agreed to phi-4 waiting forever: nothing is applied.
    refused = run("apply", str(demo))
    assert refused.exit_code == 7
    assert "phi-4 fits nowhere" in refused.output and "--allow-unplaceable" in refused.output
    assert Nomad(cluster.url).get_job("llmgw-gemma-3-270m") is None
    assert nomad_indexes(cluster.url) == before

    applied = run("apply", "--auto-approve", "--allow-unplaceable", str(demo))
    assert applied.exit_code == 0, applied.output
    assert DEMO_REASON in applied.stdout and "applied 4 models: 4 registered" in applied.stdout

    after = run("plan", str(demo))
    assert after.exit_code == 0, after.output
    assert "0 to add, 0 to change, 0 removed, 4 unchanged; nothing to do" in after.stdout
    code, doc = plan_json(demo)
    assert (code, doc["outcome"]) == (0, "nothing to do")
    assert all(m["change"] == "unchanged" and m["placement"] is None for m in doc["models"])


def test_json_shape_is_the_documented_one(cluster: StandIn, demo: Path) -> None:
    run("apply", "--auto-approve", "--allow-unplaceable", str(demo))
    changed = demo.read_text().replace("gpu_memory_mib: 2000", "gpu_memory_mib: 3000")
    changed = changed.replace("  phi-4:\n", "  phi-4-renamed:\n")
    demo.write_text(changed)
    code, doc = plan_json(demo)
    assert code == 7
    assert set(doc) == TOP_KEYS and set(doc["summary"]) == SUMMARY_KEYS
    for model in doc["models"]:
        assert set(model) == MODEL_KEYS
        for f in model["fields"]:
            assert set(f) == FIELD_KEYS
        if model["placement"] is not None:
            assert set(model["placement"]) == PLACEMENT_KEYS
            assert model["placement"]["fabric"] is None and model["placement"]["nodes"] == 1
            assert all(model["placement"]["updates"].values()), "only counts that are not zero"
            for c in model["placement"]["candidates"]:
                assert set(c) == CANDIDATE_KEYS
    models = by_model(doc)
    assert models["phi-4"]["change"] == "removed"
    assert "nomad job stop llmgw-phi-4" in models["phi-4"]["notes"][0]
    assert models["phi-4-renamed"]["change"] == "added"
    gemma = models["gemma-3-270m"]
    assert gemma["change"] == "changed"
    assert gemma["fields"] == [{"field": "profile.gpu_memory_mib", "old": 2000, "new": 3000}]
    assert gemma["placement"]["fits"]
    # A new definition of the running model rolls out beside its replica (its own job, placed
    # anew: nothing is re-placed); the on-demand copy runs none, so it is replaced in place.
    assert gemma["surge_from"] == "llmgw-gemma-3-270m" and not gemma["replaces_replicas"], gemma
    assert gemma["placement"]["updates"] == {"Place": 1}
    on_demand = models["gemma-3-270m-on-demand"]
    assert not on_demand["replaces_replicas"] and on_demand["surge_from"] == ""
    assert doc["summary"] == {
        "added": 1, "changed": 3, "removed": 1, "unchanged": 0, "conflict": 0, "fits_nowhere": 1
    }  # fmt: skip


async def test_a_profile_that_needs_more_gpu_memory_fits_nowhere_before_and_after_apply(
    consul_url: str, start_standin: Callable[..., StandIn], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nomad_driver.watcher.loop import Watcher, WatcherConfig

    standin = start_standin(nodes=demo_fleet(tmp_path), consul=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", consul_url)
    monkeypatch.setenv("NOMAD_ADDR", standin.url)
    path = tmp_path / "models.yaml"
    text = effective_models_text(TEMPLATE.read_text(), tmp_path)
    only_gemma = text[: text.index("  gemma-3-270m-on-demand:")]
    path.write_text(only_gemma)
    # The CLI runs its own event loop, so from this test's loop it runs in a thread.
    assert (await asyncio.to_thread(run, "apply", str(path))).exit_code == 0, "all fits: applied unasked"
    assert (await asyncio.to_thread(run, "plan", str(path))).exit_code == 0

    path.write_text(only_gemma.replace("gpu_memory_mib: 2000", "gpu_memory_mib: 90000"))
    # Planning writes nothing: no job definition, no evaluation. The jobs' status still follows
    # the first apply's allocations meanwhile (Nomad's setJobStatus), whatever plan does.
    before, before_jobs = nomad_indexes(standin.url), job_definitions(standin.url)
    code, doc = await asyncio.to_thread(plan_json, path)
    assert code == 7 and job_definitions(standin.url) == before_jobs
    assert nomad_indexes(standin.url)["evaluations"] == before["evaluations"]
    (gemma,) = doc["models"]
    assert gemma["fields"] == [{"field": "profile.gpu_memory_mib", "old": 2000, "new": 90000}]
    reason = gemma["placement"]["reason"]
    assert reason == "no node has 1 x nvidia/gpu with memory >= 90000 MiB: 3 nodes filtered (missing devices)"

    assert (await asyncio.to_thread(run, "apply", "--allow-unplaceable", str(path))).exit_code == 0
    consul = Consul(consul_url)
    watcher = Watcher(
        Consul(consul_url),
        Nomad(standin.url),
        WatcherConfig(wait_s=10, lock_delay_s=0.5, tick_s=0.5),
        ident="plan",
    )
    await watcher.start()
    try:
        state = await until(
            lambda: _unplaceable(consul, "gemma-3-270m"),
            timeout=60,
            what="the watcher to name it unplaceable",
        )
        assert state.placement_reason == reason, "the watcher and the plan say it in the same words"
    finally:
        await watcher.stop()
        await consul.close()


async def _unplaceable(consul: Consul, model: str) -> Any:
    state = await read_state(consul, model)
    return state if state is not None and state.unplaceable else None


def test_exit_codes_for_invalid_files_and_unreachable_clusters(
    cluster: StandIn, demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(demo.read_text().replace("profile: one-big-gpu", "profile: gpu9"))
    result = run("plan", str(bad))
    assert result.exit_code == 2 and "models.phi-4.profile" in result.output and "gpu9" in result.output
    code, doc = plan_json(bad)
    assert code == 2 and doc["outcome"] == "invalid file" and "gpu9" in doc["problems"][0]
    assert run("apply", "--auto-approve", str(bad)).exit_code == 2

    fits = demo.read_text()
    fits = fits[: fits.index("  phi-4:")]
    ok = tmp_path / "ok.yaml"
    ok.write_text(fits)
    assert run("plan", str(ok)).exit_code == 6, "changes, all of which fit"

    monkeypatch.setenv("NOMAD_ADDR", "http://127.0.0.1:1")
    code, doc = plan_json(ok)
    assert code == 3 and doc["outcome"] == "unreachable" and "nomad" in doc["problems"][0]
    monkeypatch.setenv("NOMAD_ADDR", cluster.url)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "http://127.0.0.1:1")
    result = run("plan", str(ok))
    assert result.exit_code == 3 and "cannot plan" in result.output
    assert run("apply", "--auto-approve", str(ok)).exit_code == 3


def in_terminal(*args: str, answer: str, timeout: float = 60) -> tuple[int, str]:
    """`llmgw ARGS` with a pseudo-terminal for stdin and stdout, as an operator runs it: waits
    for the question, types `answer`, returns the exit code and everything it printed."""
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nomad_driver.cli", *args],
        stdin=child,
        stdout=child,
        stderr=child,
        cwd=REPO,
        close_fds=True,
    )
    os.close(child)
    out = b""
    answered = False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:  # the child closed the terminal: it has exited
                    break
                if not chunk:
                    break
                out += chunk
                if not answered and b"? [y/N]" in out:
                    os.write(main, answer.encode() + b"\n")
                    answered = True
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)
    return code, out.decode(errors="replace").replace("\r\n", "\n")


def test_apply_in_a_terminal_asks_and_applies_only_on_yes(
    cluster: StandIn, demo: Path, consul_url: str
) -> None:
    code, out = in_terminal("apply", str(demo), answer="n")
    assert code == 5, out
    assert "phi-4 fits nowhere. Apply anyway? [y/N]" in out and "nothing applied" in out
    assert requests.get(f"{consul_url}/v1/kv/{CONFIG_PREFIX}?recurse=true", timeout=5).status_code == 404
    assert Nomad(cluster.url).get_job("llmgw-phi-4") is None
    # Someone read the plan and said yes: the unplaceable model is their call.
    code, out = in_terminal("apply", str(demo), answer="y")
    assert code == 0, out
    assert "applied 4 models: 4 registered" in out
    # --auto-approve does not ask, even in a terminal.
    code, out = in_terminal("apply", "--auto-approve", str(demo), answer="y")
    assert code == 0 and "[y/N]" not in out and "applied 4 models" in out, out


def test_a_job_that_is_not_llmgws_is_a_conflict_that_plan_reports_and_apply_refuses(
    cluster: StandIn, demo: Path, consul_url: str
) -> None:
    # Someone's own service, by chance under the ID the model's job would have.
    theirs = {"Job": {**mock_job("llmgw-kev-0.5b")["Job"], "Meta": {"team": "search"}}}
    requests.post(f"{cluster.url}/v1/jobs", json=theirs, timeout=10).raise_for_status()
    before = nomad_indexes(cluster.url)
    code, doc = plan_json(demo)
    assert (code, doc["outcome"], doc["exit_code"]) == (8, "job conflict", 8), doc
    kev = by_model(doc)["kev-0.5b"]
    assert (kev["change"], kev["placement"]) == ("conflict", None)
    problem = (
        "Nomad job llmgw-kev-0.5b was not registered by llmgw for model kev-0.5b (its meta has no "
        "llmgw_model); llmgw leaves it alone: rename the model or remove that job"
    )
    assert doc["problems"] == [problem] and kev["notes"] == [problem]
    assert doc["summary"]["conflict"] == 1 and doc["summary"]["added"] == 3
    # The others are still planned, so the operator sees everything at once.
    assert by_model(doc)["phi-4"]["placement"]["fits"] is False

    text = run("plan", str(demo))
    assert text.exit_code == 8
    assert f"! kev-0.5b (conflict)\n    problem: {problem}" in text.stdout
    assert "1 job not llmgw's: apply would apply nothing" in text.stdout

    # apply refuses before it asks: nothing anyone could agree to would be applied.
    code, out = in_terminal("apply", str(demo), answer="y")
    assert code == 5 and "[y/N]" not in out and f"{problem}; nothing was applied" in out, out
    assert nomad_indexes(cluster.url) == before
    assert requests.get(f"{consul_url}/v1/kv/{CONFIG_PREFIX}?recurse=true", timeout=5).status_code == 404


def test_apply_in_a_terminal_with_nothing_to_do_asks_nothing(cluster: StandIn, demo: Path) -> None:
    assert run("apply", "--auto-approve", "--allow-unplaceable", str(demo)).exit_code == 0
    before, before_jobs = nomad_indexes(cluster.url), job_definitions(cluster.url)
    code, out = in_terminal("apply", str(demo), answer="y", timeout=60)
    assert code == 0, out
    assert "[y/N]" not in out and "4 unchanged; nothing to do" in out
    assert "applied 4 models: 0 registered, 4 unchanged" in out
    # What apply writes (a job's definition, and the evaluation each register makes) is
    # unchanged. The tables' own indexes are not: the first apply's allocations still start or
    # fail on the client meanwhile, and a job's status follows them (Nomad's setJobStatus writes
    # the jobs table), whatever apply does.
    assert job_definitions(cluster.url) == before_jobs
    assert nomad_indexes(cluster.url)["evaluations"] == before["evaluations"]


ROLLOUT = """
profiles:
  h100s:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: {gpus}
    gpu_models: ["NVIDIA H100 80GB HBM3"]
    cpu_mhz: 1000
    memory_mib: 2048
    node_pool: gpu
models:
  wide:
    source: file:///models/{file}
    profile: h100s
    replicas: {{min: 1, max: 1}}
"""


def test_a_new_definition_of_a_running_model_is_planned_beside_it_or_said_to_wait_for_room(
    cluster: StandIn, tmp_path: Path
) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(ROLLOUT.format(gpus=3, file="v1.gguf"))
    assert run("apply", "--auto-approve", str(path)).exit_code == 0
    first = Nomad(cluster.url).get_job("llmgw-wide")
    assert first is not None and first["TaskGroups"][0]["Count"] == 1

    # Four of the H100 node's seven healthy GPUs are free: the new definition's replica fits beside.
    path.write_text(ROLLOUT.format(gpus=3, file="v2.gguf"))
    code, doc = plan_json(path)
    (wide,) = doc["models"]
    assert code == 6 and wide["change"] == "changed" and wide["surge_from"] == "llmgw-wide", json.dumps(wide)
    assert wide["placement"]["fits"] and not wide["replaces_replicas"], wide
    text = run("plan", str(path)).stdout
    assert (
        "rolls out beside llmgw-wide: 1 replica of the new definition start while its replicas serve" in text
    )
    # apply leaves it to the watcher, which starts it beside the running replica.
    applied = run("apply", "--auto-approve", str(path))
    assert applied.exit_code == 0, applied.output
    assert "1 rolled out by the watcher beside their running replicas (wide)" in applied.stdout
    assert Nomad(cluster.url).get_job("llmgw-wide")["JobModifyIndex"] == first["JobModifyIndex"]
    assert Nomad(cluster.url).get_job("llmgw-wide~b") is None

    # Five GPUs beside the running three: no room for both. Said, with what happens instead.
    path.write_text(ROLLOUT.format(gpus=5, file="v3.gguf"))
    code, doc = plan_json(path)
    (wide,) = doc["models"]
    assert code == 7 and not wide["placement"]["fits"], wide
    text = run("plan", str(path)).stdout
    assert "CANNOT SURGE: no room for 1 replica of the new definition beside those of llmgw-wide: " in text
    assert "the update waits for room while llmgw-wide serves; a profile's `update: rolling`" in text
    # With `update: rolling`, it rolls one replica at a time, and says so.
    path.write_text(
        ROLLOUT.format(gpus=5, file="v3.gguf").replace(
            "node_pool: gpu", "node_pool: gpu\n    update: rolling"
        )
    )
    code, doc = plan_json(path)
    (wide,) = doc["models"]
    assert wide["update"] == "rolling" and wide["surge_from"] == "llmgw-wide", wide
    assert "rolls one replica at a time (`update: rolling`)" in run("plan", str(path)).stdout
    # With `update: replace`, it is planned over the running job, as before.
    path.write_text(
        ROLLOUT.format(gpus=5, file="v3.gguf").replace(
            "node_pool: gpu", "node_pool: gpu\n    update: replace"
        )
    )
    code, doc = plan_json(path)
    (wide,) = doc["models"]
    assert code == 6 and wide["surge_from"] == "" and wide["replaces_replicas"], wide
