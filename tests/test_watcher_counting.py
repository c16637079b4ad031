"""The failure count end to end: real llama.cpp engines (llama-cpp-python) started by the Nomad
stand-in, a real Consul, watchers that come and go, and Nomad forgetting what it forgets.

A model serves from a tiny GGUF; the model breaks when its weights are replaced by a GGUF of an
architecture llama.cpp does not know ('kev'), in the allocation's copy (what a restart in place
loads) and at the source (what a new allocation copies). The tests count the real failed starts
themselves, from Nomad's allocations polled often enough that nothing drops off between two
looks, and compare with what llmgw stored: parked after exactly five (or the configured number),
never sooner, never later.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from typer.testing import CliRunner

from nomad_driver.cli.app import app
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.render import render_job
from nomad_driver.spec import parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, ModelState
from nomad_driver.watcher.admin import model_status
from nomad_driver.watcher.loop import Watcher, WatcherConfig
from tests.watcher_support import engines_dir, mock_job, models_text, node, read_state, until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

MINUTE_NS = 60 * 1_000_000_000


def all_allocs(nomad: Nomad, job_id: str) -> list[dict[str, Any]]:
    allocs: list[dict[str, Any]] = nomad._json(
        nomad._request("job", job_id, "allocations", params={"all": "true"}), "allocs"
    )
    return allocs


@dataclass
class Observer:
    """Every failed start of a job, as (allocation, Started time, job version): an engine that
    exited without being asked to, told apart by its events, polled every 50 ms so that
    Nomad's ten-event limit never hides one between two looks."""

    nomad: Nomad
    job_id: str
    healthy: set[tuple[str, int]] = field(default_factory=set)
    failures: dict[tuple[str, int], int] = field(default_factory=dict)
    most_events: int = 0  # the longest event list seen: proof that Nomad truncated it

    def look(self) -> None:
        for alloc in all_allocs(self.nomad, self.job_id):
            for state in (alloc.get("TaskStates") or {}).values():
                events = state.get("Events") or []
                self.most_events = max(self.most_events, len(events))
                started, asked = None, False
                for e in events:
                    if e["Type"] == "Started":
                        started, asked = e["Time"], False
                    elif e["Type"] in ("Killing", "Killed"):
                        asked = True
                    elif e["Type"] == "Terminated" and started is not None:
                        key = (alloc["ID"], started)
                        if not asked and key not in self.healthy:
                            self.failures[key] = int(alloc.get("JobVersion") or 0)
                        started = None

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.look)
            await asyncio.sleep(0.05)


@dataclass
class Counting:
    consul_url: str
    standin: Any
    consul: Consul
    nomad: Nomad
    model: str = "m"
    watchers: list[Watcher] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def watcher(self, max_start_failures: int = 5) -> Watcher:
        """A fresh watcher process's worth of state: nothing but Consul and Nomad to go on."""
        config = WatcherConfig(wait_s=10, lock_delay_s=0.1, tick_s=0.5, max_start_failures=max_start_failures)
        w = Watcher(Consul(self.consul_url), Nomad(self.standin.url), config, ident=f"w{len(self.watchers)}")
        self.watchers.append(w)
        await w.start()
        return w

    async def stop(self, w: Watcher) -> None:
        await w.stop()
        await w.consul.close()

    def observe(self, job_id: str) -> Observer:
        obs = Observer(Nomad(self.standin.url), job_id)
        self.tasks.append(asyncio.create_task(obs.run()))
        return obs

    async def state(self) -> ModelState | None:
        return await read_state(self.consul, self.model)

    async def parked(self) -> ModelState | None:
        s = await self.state()
        return s if s is not None and s.parked else None


@pytest.fixture
async def counting(
    consul_url: str, start_standin: Callable[..., Any], tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Counting]]]:
    made: list[Counting] = []

    async def make(text: str) -> Counting:
        standin = start_standin(nodes=[node("cpu-0", engines_dir(tmp_path))], clock_speed=20.0)
        consul = Consul(consul_url)
        await consul.kv_put(CONFIG_MODELS_KEY, text)
        world = Counting(consul_url, standin, consul, Nomad(standin.url))
        made.append(world)
        return world

    try:
        yield make
    finally:
        for world in made:
            for t in world.tasks:
                t.cancel()
            for w in world.watchers:
                with contextlib.suppress(Exception):
                    await world.stop(w)
            await world.consul.close()


def running_alloc(nomad: Nomad, job_id: str) -> dict[str, Any] | None:
    return next((a for a in all_allocs(nomad, job_id) if a["ClientStatus"] == "running"), None)


def last_start(alloc: dict[str, Any]) -> int:
    events = alloc["TaskStates"]["engine"]["Events"]
    return max(int(e["Time"]) for e in events if e["Type"] == "Started")


def break_model(source: Path, kev: Path) -> None:
    """The weights become an architecture llama.cpp does not know. The engine reads its
    file:// source where it lies, so a restart in place loads the broken file."""
    shutil.copyfile(kev, source)


def kill_engine(alloc_id: str) -> None:
    """SIGKILL the allocation's engine process, as a crash would end it."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"NOMAD_ALLOC_ID={alloc_id}".encode() in environ and "llama_cpp" in cmdline:
            os.kill(int(proc.name), signal.SIGKILL)
            return
    raise AssertionError(f"no engine process for allocation {alloc_id}")


async def serving(world: Counting, w: Watcher, job_id: str) -> tuple[dict[str, Any], ModelState]:
    """Once the model serves and the leader has written that start down as the baseline."""
    await until(
        lambda: world.model in w.decisions and w.decisions[world.model].ready == 1,
        120,
        "a ready replica",
        0.3,
    )
    alloc = running_alloc(world.nomad, job_id)
    assert alloc is not None
    started = last_start(alloc)

    async def written() -> ModelState | None:
        s = await world.state()
        return s if s is not None and s.failures_after_ns == started else None

    return alloc, await until(written, 30, "the healthy start stored as the count's baseline")


async def test_watchers_started_after_a_healthy_start_still_know_it_served(
    counting: Callable[..., Awaitable[Counting]], make_gguf: Any
) -> None:
    """Item 1: every watcher is gone while the model breaks, new ones come mid-count; the start
    that served is not a failure, so parking comes after the fifth real failure, not the fourth."""
    good = make_gguf(architecture="llama", name="m.gguf")
    kev = make_gguf(architecture="kev", name="kev.gguf")
    world = await counting(models_text(m=(f"file://{good}", "cpu", 1)))
    job_id = "llmgw-m"
    w1 = await world.watcher()
    alloc, _ = await serving(world, w1, job_id)
    observer = world.observe(job_id)
    observer.healthy.add((alloc["ID"], last_start(alloc)))

    await world.stop(w1)  # no watcher at all from here until the first failure
    break_model(good, kev)
    kill_engine(alloc["ID"])
    await until(lambda: len(observer.failures) >= 1, 90, "the first failure", 0.1)
    w2 = await world.watcher()
    await until(lambda: len(observer.failures) >= 3, 120, "the third failure", 0.1)
    await world.stop(w2)  # and once more, mid-count
    await world.watcher()

    state = await until(world.parked, 150, "m parked", 0.1)
    await asyncio.sleep(1)
    observer.look()
    assert len(observer.failures) == 5, sorted(observer.failures)
    assert state.consecutive_failures == 5
    assert "unknown model architecture: 'kev'" in state.last_error


async def test_more_than_ten_restarts_in_one_allocation_are_each_counted(
    counting: Callable[..., Awaitable[Counting]], make_gguf: Any
) -> None:
    """Item 2: Nomad keeps the newest ten events per task, about three starts' worth; a
    healthy start followed by eleven failures in place is eleven, not three, and no failure
    inherits the healthy start's mark when the list shifts."""
    good = make_gguf(architecture="llama", name="m.gguf")
    kev = make_gguf(architecture="kev", name="kev.gguf")
    text = models_text(m=(f"file://{good}", "cpu", 1))
    world = await counting(text)
    model = parse_models(text).models["m"]
    job = render_job(model)
    # Restarted in place as often as it takes; the watcher keeps this job (same definition).
    job["TaskGroups"][0]["RestartPolicy"] = {
        "Attempts": 30,
        "Interval": 60 * MINUTE_NS,
        "Delay": 1_000_000_000,
        "Mode": "fail",
    }
    world.nomad.register_job(job)
    w = await world.watcher(max_start_failures=11)
    alloc, _ = await serving(world, w, model.job_id)
    observer = world.observe(model.job_id)
    observer.healthy.add((alloc["ID"], last_start(alloc)))

    break_model(good, kev)
    kill_engine(alloc["ID"])
    state = await until(world.parked, 240, "m parked", 0.1)
    await asyncio.sleep(1)
    observer.look()
    assert {a for a, _ in observer.failures} == {alloc["ID"]}
    # One more start may fail in the drain after the scale to 0 (the group's shutdown_delay):
    # Nomad restarts the engine in it; parked, it is not counted.
    assert len(observer.failures) in (11, 12)
    assert observer.most_events == 10  # Nomad did drop the oldest events
    assert state.consecutive_failures == 11


async def test_allocations_garbage_collected_mid_count_still_count(
    counting: Callable[..., Awaitable[Counting]], make_gguf: Any
) -> None:
    """Item 3: `nomad system gc` takes the failed allocations away as soon as they are
    replaced; the model is still parked after its fifth failure."""
    kev = make_gguf(architecture="kev", name="kev.gguf")
    world = await counting(models_text(m=(f"file://{kev}", "cpu", 1)))
    job_id = "llmgw-m"
    observer = world.observe(job_id)
    await world.watcher()
    collected: set[str] = set()

    async def collect_replaced() -> ModelState | None:
        replaced = {a["ID"] for a in all_allocs(world.nomad, job_id) if a.get("NextAllocation")}
        if replaced - collected:
            requests.put(f"{world.standin.url}/v1/system/gc", timeout=10).raise_for_status()
            gone = replaced - {a["ID"] for a in all_allocs(world.nomad, job_id)}
            collected.update(gone)
        return await world.parked()

    state = await until(collect_replaced, 180, "m parked", 0.1)
    assert len(collected) >= 2, "the first two allocations were collected mid-count"
    await asyncio.sleep(1)
    observer.look()
    assert len(observer.failures) == 5, sorted(observer.failures)
    assert state.consecutive_failures == 5


async def test_a_new_definition_mid_count_starts_its_own_count(
    counting: Callable[..., Awaitable[Counting]], make_gguf: Any
) -> None:
    """Item 4: four failures, a new source (broken too): its failures are counted from zero,
    so its first failure is one, not five (which parked it at once)."""
    kev = make_gguf(architecture="kev", name="kev.gguf")
    kev2 = make_gguf(architecture="kev", name="kev2.gguf", seed=1)
    world = await counting(models_text(m=(f"file://{kev}", "cpu", 1)))
    job_id = "llmgw-m"
    observer = world.observe(job_id)
    await world.watcher()

    async def four() -> ModelState | None:
        s = await world.state()
        return s if s is not None and s.consecutive_failures == 4 else None

    await until(four, 150, "four failures", 0.1)
    new_text = models_text(m=(f"file://{kev2}", "cpu", 1))
    new_hash = parse_models(new_text).models["m"].def_hash
    await world.consul.kv_put(CONFIG_MODELS_KEY, new_text)

    def new_version() -> int | None:
        job = world.nomad.get_job(job_id) or {}
        return int(job["Version"]) if (job.get("Meta") or {}).get("llmgw_def_hash") == new_hash else None

    version = await until(new_version, 30, "the new definition registered", 0.1)

    async def recounted() -> ModelState | None:
        s = await world.state()
        return s if s is not None and s.count_def_hash == new_hash else None

    after_change = await until(recounted, 30, "the count moved to the new definition", 0.1)
    assert after_change.consecutive_failures == 0 and not after_change.parked

    # The new definition fails until llmgw parks it. Its replacements inherit the failed
    # allocations' reschedule attempts, so Nomad gives up on it before five; llmgw then asks
    # Nomad to reschedule anyway (given_up.py) and counts on, never leaving it down unparked.
    await until(world.parked, 240, "llmgw to park it", 0.1)
    await asyncio.sleep(2)
    observer.look()
    state = await world.state()
    assert state is not None
    new_failures = [k for k, v in observer.failures.items() if v >= version]
    assert len(observer.failures) - len(new_failures) == 4
    # Its own failures, and only those: five park it.
    assert state.parked and state.parked_def_hash == new_hash
    assert state.consecutive_failures == 5 == len(new_failures), sorted(observer.failures.items())
    # Nomad had given up on a slot on the way, and llmgw asked it to reschedule.
    forced = [
        a
        for a in all_allocs(world.nomad, job_id)
        if (a.get("DesiredTransition") or {}).get("ForceReschedule")
    ]
    assert forced, "Nomad never gave up here; the test no longer shows the rule"


async def test_a_model_may_not_take_the_name_or_the_job_of_something_else(
    counting: Callable[..., Awaitable[Counting]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 8: `router` is refused as a name, and a Nomad job `llmgw-foo` that llmgw did not
    render is never registered over, by apply or by the watcher; the model shows why."""
    text = models_text(foo=("file:///tmp/foo.gguf", "cpu", 1))
    world = await counting(models_text(other=("file:///tmp/other.gguf", "cpu", 0)))
    monkeypatch.setenv("CONSUL_HTTP_ADDR", world.consul_url)
    monkeypatch.setenv("NOMAD_ADDR", world.standin.url)
    runner = CliRunner()

    named = tmp_path / "router.yaml"
    named.write_text(models_text(router=("file:///tmp/r.gguf", "cpu", 1)))
    # In a thread: apply plans first, and plan runs its own event loop.
    refused = await asyncio.to_thread(runner.invoke, app, ["apply", str(named)])
    assert refused.exit_code == 2
    assert "model name 'router' is taken: its Nomad job would be llmgw-router" in refused.output

    # Someone's own job, by chance called llmgw-foo.
    theirs = mock_job(parse_models(text).models["foo"], 1, run_for="1h")
    theirs["Meta"] = {"team": "search"}
    world.nomad.register_job(theirs)
    before = world.nomad.get_job("llmgw-foo")
    assert before is not None
    path = tmp_path / "models.yaml"
    path.write_text(text)
    result = await asyncio.to_thread(runner.invoke, app, ["apply", str(path)])
    assert result.exit_code == 5, result.output
    assert "Nomad job llmgw-foo was not registered by llmgw for model foo" in result.output
    assert "nothing was applied" in result.output
    _, stored = await world.consul.kv_get(CONFIG_MODELS_KEY)
    assert b"foo" not in stored[0].value  # the definitions were not stored either

    # Stored anyway (by hand, or before the job appeared): the watcher leaves the job alone.
    await world.consul.kv_put(CONFIG_MODELS_KEY, text)
    w = await world.watcher()

    async def conflicted() -> ModelState | None:
        s = await read_state(world.consul, "foo")
        return s if s is not None and s.job_conflict else None

    state = await until(conflicted, 30, "the conflict recorded")
    assert "its meta has no llmgw_model" in state.job_conflict
    passes = w.passes
    await until(lambda: w.passes > passes + 5, 30, "more passes")
    after = world.nomad.get_job("llmgw-foo")
    assert after is not None
    assert (after["Version"], after["Meta"], after["TaskGroups"][0]["Count"]) == (
        before["Version"],
        before["Meta"],
        before["TaskGroups"][0]["Count"],
    )
    shown = model_status(w, "foo")
    assert shown["state"] == "conflict" and shown["reason"] == state.job_conflict
    assert w.decisions["foo"].health == "critical"


async def test_a_purged_and_recreated_job_still_parks_after_five_failed_starts(
    counting: Callable[..., Awaitable[Counting]], make_gguf: Any
) -> None:
    """`nomad job stop -purge` (or Nomad's job GC) while a model crash-loops: the watcher
    registers the job again at version 0, below the version its count began at, and the
    failures of the new job still count: parked after five in all."""
    kev_a = make_gguf(architecture="kev", name="kev-a.gguf")
    kev_b = make_gguf(architecture="kev", name="kev-b.gguf")
    world = await counting(models_text(m=(f"file://{kev_a}", "cpu", 1)))
    observer = world.observe("llmgw-m")
    w = await world.watcher()
    await until(lambda: observer.look() or len(observer.failures) >= 1, 120, "a failed start", 0.1)
    # A new definition (still broken): its count begins at the job version that brings it, 1.
    await world.consul.kv_put(CONFIG_MODELS_KEY, models_text(m=(f"file://{kev_b}", "cpu", 1)))

    async def counting_b() -> ModelState | None:
        s = await world.state()
        return s if s is not None and s.count_job_version >= 1 and s.consecutive_failures >= 2 else None

    before = await until(counting_b, 120, "two failures of the new definition", 0.1)
    assert not before.parked
    created = int(world.nomad.get_job("llmgw-m")["CreateIndex"])
    requests.delete(
        f"{world.standin.url}/v1/job/llmgw-m", params={"purge": "true"}, timeout=10
    ).raise_for_status()

    state = await until(world.parked, 240, "m parked", 0.2)
    job = world.nomad.get_job("llmgw-m")
    assert int(job["CreateIndex"]) != created and int(job["Version"]) <= 1
    assert state.consecutive_failures == 5
    assert "unknown model architecture" in state.last_error
    assert w.decisions["m"].state.parked


async def test_a_model_whose_nomad_budgets_ran_out_is_asked_again_and_parked_by_the_count(
    counting: Callable[..., Awaitable[Counting]], make_gguf: Any
) -> None:
    """Nomad's reschedule budget is spent (here: one a day, used by the first failure) before
    the count reaches five: a failed allocation holds the slot and Nomad will not replace it.
    The watcher asks Nomad again (`-force-reschedule`), each replacement is another start, and
    the model is parked on its fifth, with its cause, rather than left down."""
    kev = make_gguf(architecture="kev", name="kev.gguf")
    text = models_text(m=(f"file://{kev}", "cpu", 1))
    world = await counting(text)
    model = parse_models(text).models["m"]
    job = render_job(model)
    job["TaskGroups"][0]["ReschedulePolicy"] = {**job["TaskGroups"][0]["ReschedulePolicy"], "Attempts": 1}
    world.nomad.register_job(job)
    await world.watcher()
    state = await until(world.parked, 240, "m parked", 0.2)
    assert state.consecutive_failures == 5
    assert "unknown model architecture" in state.last_error
    allocs = all_allocs(world.nomad, model.job_id)
    forced = [a for a in allocs if (a.get("DesiredTransition") or {}).get("ForceReschedule")]
    assert forced, "Nomad was never asked again"
