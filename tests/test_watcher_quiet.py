"""A model's decision stands until its readings or a deadline it depends on move
(`nomad_driver/watcher/quiet.py`, `marks.py`): an idle watcher stops reconciling every model on
every tick, yet a deadline its decisions depend on (an idle timeout running out) still runs a
pass on time, news wakes one at once, and the check the test suite runs every pass under does
catch a deadline that was missed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nomad_driver.blocking import Reading
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.nomad import Nomad
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, activity_key, inflight_key
from nomad_driver.watcher import loop as watcher_loop
from nomad_driver.watcher import quiet
from nomad_driver.watcher.decisions import Decision, ModelView
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from nomad_driver.watcher.reconcile import reconcile
from tests.watcher_support import BARE_CPU_PROFILE, mock_job, models_text, until, watchers_on_standin

pytestmark = pytest.mark.timeout(120)

ON_DEMAND = (
    BARE_CPU_PROFILE
    + """
models:
  od:
    source: file:///tmp/od.gguf
    profile: cpu
    replicas: {min: 0, max: 1}
    idle_timeout: 10s
"""
)
NOW = 1_800_000_000.0


def _settled(model: Any, count: int, **view: Any) -> tuple[ModelView, Decision]:
    """A view of `od` whose job has `count` and whose stored state is what reconcile makes of
    it, as after the pass that wrote it: the view and decision `model_quiet_until` is given."""
    job = render_job(model)
    job["TaskGroups"][0]["Count"] = count
    v = ModelView(model=model, job=job, now=NOW, **view)
    v = dataclasses.replace(v, state=reconcile(v).state, state_index=7)
    return v, reconcile(v)


def test_a_decision_stands_until_the_first_deadline_it_depends_on() -> None:
    model = parse_models(ON_DEMAND, "t").models["od"]
    view, decision = _settled(model, 1, activity=NOW - 4, activity_grace_s=5, load_held=1)
    assert decision.desired == 1 and not decision.actions, decision
    # The idle timeout (10 s) plus the routers' grace (5 s) from the last request.
    assert quiet.model_quiet_until(view, decision, NOW) == NOW - 4 + 10 + 5

    # A count that changed 2 s ago, with a 5 s step interval.
    view, decision = _settled(model, 1, activity=NOW - 1, since_step_s=2, step_interval_s=5, load_held=1)
    assert quiet.model_quiet_until(view, decision, NOW) == NOW + 3

    # Nothing the clock can change: it stands until something is read (or the resync).
    view, decision = _settled(model, 0, activity=NOW - 600, load_held=0)
    assert not decision.actions
    assert quiet.model_quiet_until(view, decision, NOW) == float("inf")

    # Requests in flight, or something to do: the next pass takes it whatever the clock says.
    view, decision = _settled(model, 1, in_flight=2, activity=NOW, load_held=1)
    assert quiet.model_quiet_until(view, decision, NOW) <= NOW
    view, decision = _settled(model, 0, activity=NOW - 1, load_held=0)
    assert decision.actions  # asked for within idle_timeout at count 0: a scale to 1
    assert quiet.model_quiet_until(view, decision, NOW) <= NOW


def _snapshots(w: Watcher, model_text: str, activity: float) -> None:
    """The watcher's readings set by hand: the definitions, the job at count 1 and the last
    request's time, nothing else."""
    model = parse_models(model_text, "t").models["od"]
    job = render_job(model)
    job["TaskGroups"][0]["Count"] = 1
    kv = {
        CONFIG_MODELS_KEY: KVEntry(CONFIG_MODELS_KEY, model_text.encode(), 1),
        activity_key("od"): KVEntry(activity_key("od"), str(activity).encode(), 2),
    }
    w.kv.snapshot = Reading(1, kv, 0.0)
    w.jobs.snapshot = Reading(1, {model.job_id: job}, 0.0)
    for watch in (w.allocs, w.evals, w.engines):
        watch.snapshot = Reading(1, (), 0.0)


def test_the_suites_check_names_a_model_whose_skipped_pass_would_have_decided_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [NOW]
    w = Watcher(
        Consul("http://127.0.0.1:1"), Nomad("http://127.0.0.1:1"), WatcherConfig(), clock=lambda: clock[0]
    )
    _snapshots(w, ON_DEMAND, NOW - 1)
    found = tmp_path / "differences.jsonl"
    w._verify_skips = str(found)

    asyncio.run(w.run_pass())
    assert w.decisions["od"].desired == 1
    # Past the model's own deadline (its idle timeout), it is marked for a pass.
    assert w._read_changes(NOW + 20)

    # A broken deadline (as if the idle timeout were not one) leaves the model unmarked; the
    # check runs the pass anyway and writes down that it scales the model to 0.
    monkeypatch.setattr(watcher_loop, "model_quiet_until", lambda view, d, now: float("inf"))
    asyncio.run(w.run_pass())
    clock[0] = NOW + 20
    assert not w._read_changes(clock[0])
    asyncio.run(w._quiet_tick())
    lines = [json.loads(line) for line in found.read_text().splitlines()]
    assert [line["model"] for line in lines] == ["od"]
    assert "desired=1" in lines[0]["skipped"] and "desired=0" in lines[0]["ran"]
    assert w.decisions["od"].desired == 0


SPLIT = """
profiles:
  split:
    engine: llama.cpp
    engine_version: b6500
    gpus: 0
    nodes: 2
models:
  od:
    source: file:///tmp/od.gguf
    profile: split
    replicas: {min: 0, max: 1}
"""


@pytest.mark.parametrize("text", [ON_DEMAND, SPLIT], ids=["one-node", "multi-node"])
def test_a_node_change_is_news_only_when_a_pass_reads_what_changed(text: str) -> None:
    w = Watcher(Consul("http://127.0.0.1:1"), Nomad("http://127.0.0.1:1"), WatcherConfig())
    _snapshots(w, text, NOW - 1)
    asyncio.run(w.run_pass())
    assert w.models["od"].profile.nodes == (2 if text is SPLIT else 1)

    def nodes_read(*entries: dict[str, Any]) -> bool:
        w.marks.take(NOW)
        w.nodes.snapshot = Reading(1, entries, 0.0)
        w._nodes_read()
        return w.marks.pending(NOW)

    node = {"ID": "n1", "Name": "n1", "Meta": {"llmgw_fabric": "ib-a"}, "ModifyIndex": 5}
    assert nodes_read(node)  # first sight
    # Another job placed on it, say: only a multi-node model's fabric room reads that.
    assert nodes_read({**node, "ModifyIndex": 6}) == (text is SPLIT)
    # Its fabric moved: the replica list shows it for every model.
    assert nodes_read({**node, "Meta": {"llmgw_fabric": "ib-b"}, "ModifyIndex": 7})


async def test_an_idle_watcher_skips_passes_yet_idles_a_model_down_on_time_and_wakes_for_news(
    consul_url: str, start_standin: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real thing, not the suite's check: skipped passes are skipped.
    monkeypatch.delenv(quiet.VERIFY_ENV, raising=False)
    text = (
        models_text(keep=("file:///tmp/keep.gguf", "cpu", 1), od=("file:///tmp/od.gguf", "cpu", 0))
        + "    idle_timeout: 3s\n"
    )
    models = parse_models(text).models
    async with watchers_on_standin(consul_url, start_standin) as start:
        standin, consul, nomad, watcher = await start(text, ident="quiet", clock_speed=1.0)
        assert not watcher._verify_skips

        def count() -> int:
            job = nomad.get_job(models["od"].job_id)
            return int(job["TaskGroups"][0]["Count"]) if job else -1

        nomad.register_job(mock_job(models["keep"], 1, run_for="1h"))
        nomad.register_job(mock_job(models["od"], 1, run_for="1h"))
        # A request to `od` ended just now, as a router says it. Written before the watcher
        # starts: `od` has had no request otherwise, and a first leading pass that read the KV
        # before this write would rightly scale it to 0 at once (the race that made this test
        # fail once in CI, with the model "idled" 0.2 s after the request).
        served = time.time()
        await consul.kv_put(activity_key("od"), str(served))
        await watcher.start()
        await until(lambda: watcher.leadership.is_leader and len(watcher.decisions) == 2, 30, "leading")
        await until(lambda: watcher.views.get("od") and watcher.views["od"].activity == served, 10, "read")
        assert count() == 1
        skipped = watcher.skipped_passes

        # Nothing else changes: the idle timeout (3 s) plus the routers' grace (5 s) runs out
        # with no news at all, and that deadline alone runs the pass that scales it down.
        await until(lambda: count() == 0, 30, "od scaled to 0 when idle", every=0.2)
        idled_after = time.time() - served
        assert 8 <= idled_after < 8 + 6, idled_after
        assert watcher.skipped_passes > skipped, "no pass was skipped while waiting for the deadline"

        # Settled: ticks go by (0.5 s each) and no pass runs, however many models.
        await until(lambda: watcher._quiet_until > time.time(), 20, "a quiet deadline ahead")
        passes, skipped = watcher.passes, watcher.skipped_passes
        await asyncio.sleep(3)
        assert watcher.skipped_passes >= skipped + 3
        assert watcher.passes == passes, "passes ran with nothing new to read"

        # News (a router's record of a waiting request) wakes a full pass at once.
        asked = round(time.time(), 3)
        record = {
            "router": "r1",
            "at": asked,
            "interval_s": 5,
            "models": {"od": {"requests": 1, "asked": asked}},
        }
        await consul.kv_put(inflight_key("r1"), json.dumps(record))
        await until(lambda: watcher.passes > passes, 5, "a pass for the news", every=0.05)
        await until(lambda: count() == 1, 10, "od activated for the waiting request")
        del standin
