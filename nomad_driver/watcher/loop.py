"""The watcher: snapshots in, `reconcile` per model, actions out (on the leader only).

Every watcher, leader or not, runs the same passes over the same snapshots, so any of them can
answer the admin API; only the leader's actions reach Nomad and Consul. A pass calls nothing
itself: it reads the latest snapshots in memory, which is what keeps a thousand models under a
second of CPU and an idle minute at a handful of long polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from nomad_driver.blocking import Watch
from nomad_driver.consul import Consul, ConsulError
from nomad_driver.nomad import Nomad
from nomad_driver.placement import PlacementWarnings
from nomad_driver.render import SERVICE_NAME
from nomad_driver.spec import Model
from nomad_driver.state import (
    ModelState,
)
from nomad_driver.watcher.acting import Actor
from nomad_driver.watcher.admin_ops import retry_model
from nomad_driver.watcher.decisions import Decision, ModelView
from nomad_driver.watcher.engine_errors import EngineErrors
from nomad_driver.watcher.evaluations import EvaluationFeed
from nomad_driver.watcher.feeds import AllocationFeed, JobFeed, _Feed
from nomad_driver.watcher.fenced import FencedStates
from nomad_driver.watcher.health import Entry, HealthEntries
from nomad_driver.watcher.heap import HeldHeap
from nomad_driver.watcher.in_flight import (
    INFLIGHT_FORGET_AFTER_S,
    forget_gone_routers,
)
from nomad_driver.watcher.isolation import BrokenModels, broken_decision, reconcile_each
from nomad_driver.watcher.kv_watches import KVWatches
from nomad_driver.watcher.leader import Leadership, LeaseLost
from nomad_driver.watcher.marks import ChangeReader, Marks
from nomad_driver.watcher.quiet import model_quiet_until, record_differences, verify_file
from nomad_driver.watcher.reconcile import DEFAULT_MAX_START_FAILURES
from nomad_driver.watcher.replicas import node_fabrics
from nomad_driver.watcher.scaling import DEFAULT_STEP_INTERVAL_S, DEFAULT_UP_WINDOW_S, LoadHistory
from nomad_driver.watcher.standing import Standing
from nomad_driver.watcher.views import ViewBuilder
from nomad_driver.watcher.watch import (
    JobCache,
    NodeCache,
    engines_fetch,
    jobs_fetch,
    kept_allocation,
    nodes_fetch,
)

log = logging.getLogger("llmgw.watcher")


@dataclass(frozen=True)
class WatcherConfig:
    address: str = "127.0.0.1:4700"
    max_start_failures: int = DEFAULT_MAX_START_FAILURES
    wait_s: float = 60.0
    leader_ttl_s: int = 10
    lock_delay_s: float = 1.0
    # Passes also run on this tick, for idle timeouts that expire with nothing changing.
    tick_s: float = 5.0
    min_pass_interval_s: float = 0.02
    # How long parking waits for the failed engine's stderr before falling back to Nomad's
    # task event; a pass waits this long at most, and only when a model is being parked.
    stderr_wait_s: float = 3.0
    # The routers' activity interval (their `activity_interval_s`), the least grace the idle
    # clock gets when no router publishes a longer one.
    activity_interval_s: float = 5.0
    # Load scaling: in flight is averaged over this window before it asks for replicas, and the
    # count changes at most once per step interval (`watcher/scaling.py`).
    scale_up_window_s: float = DEFAULT_UP_WINDOW_S
    scale_step_interval_s: float = DEFAULT_STEP_INTERVAL_S
    # Freeze what a pass leaves alive out of the collector's full walks (`heap.py`): the
    # process's own choice, made by `llmgw watcher`, not by a program that embeds a watcher.
    freeze_heap: bool = False


class Watcher:
    def __init__(
        self,
        consul: Consul,
        nomad: Nomad,
        config: WatcherConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        ident: str | None = None,
    ) -> None:
        self.consul = consul
        self.nomad = nomad
        self.config = config or WatcherConfig()
        self.clock = clock
        self.leadership = Leadership(
            consul,
            address=self.config.address,
            ident=ident,
            ttl_s=self.config.leader_ttl_s,
            lock_delay_s=self.config.lock_delay_s,
            on_change=self._leader_changed,
        )
        self.health = HealthEntries(consul)
        self.warnings = PlacementWarnings(clock)
        self._routers_checked_at = 0.0
        self._wake, self._routers_wrote = asyncio.Event(), asyncio.Event()
        w = self.config.wait_s
        # `llmgw/`, a blocking read per prefix (`kv_watches.py`).
        self.kv = KVWatches(consul, w, self.wake)
        self.engines: Watch[tuple[dict[str, Any], ...]] = Watch(
            "consul-engines",
            engines_fetch(consul, SERVICE_NAME, w),
            on_change=partial(self.wake, "consul-engines"),
        )
        # Jobs, allocations and evaluations are listed once, then followed by Nomad's event
        # stream (watcher/feeds.py): a change costs what changed, not the whole namespace again.
        self.job_feed = JobFeed(nomad, w, jobs_fetch(nomad, w, JobCache()))
        self.jobs: Watch[Mapping[str, dict[str, Any]]] = Watch(
            "nomad-jobs", self.job_feed.fetch, on_change=partial(self._feed_read, "nomad-jobs", self.job_feed)
        )
        # With resources: the summary counts a GPU as used from the allocation that holds it,
        # whoever's job it is, and so does a multi-node model's room.
        self.alloc_feed = AllocationFeed(nomad, w, kept_allocation)
        self.allocs: Watch[tuple[dict[str, Any], ...]] = Watch(
            "nomad-allocations",
            self.alloc_feed.fetch,
            on_change=partial(self._feed_read, "nomad-allocations", self.alloc_feed),
        )
        self.eval_feed = EvaluationFeed(nomad, w)
        self.evals: Watch[tuple[dict[str, Any], ...]] = Watch(
            "nomad-evaluations",
            self.eval_feed.fetch,
            on_change=partial(self._feed_read, "nomad-evaluations", self.eval_feed),
        )
        # Nodes feed the admin API, the engine metrics and the fabric room of multi-node models
        # (which wait for a first answer), so a change there does not wake a pass and a
        # failing node watch does not stop the leader acting; the next tick's pass reads what
        # a pass uses of them (`_nodes_read`).
        self.nodes: Watch[tuple[dict[str, Any], ...]] = Watch(
            "nomad-nodes", nodes_fetch(nomad, w, NodeCache()), on_change=self._nodes_read
        )
        # The models each pass reconciles (`marks.py`), what each change touched
        # (`readings.py`), and what stands between passes per model (`standing.py`).
        self.marks = Marks()
        self.standing = Standing()
        self.passes = 0
        # Ticks with no model to reconcile: nothing new was read and no model's clock came due.
        self.skipped_passes = 0
        # What brought news since the last pass, and how many passes each cause ran (a pass
        # with none was the tick's, for a deadline), for /healthz and the benchmark.
        self._news_from: set[str] = {"start"}
        self.pass_causes: Counter[str] = Counter()
        self._verify_skips = verify_file()
        self.last_pass_cpu_s = 0.0
        self.last_full_pass_cpu_s = 0.0
        self.heap = HeldHeap(self.config.freeze_heap)
        self._tasks: list[asyncio.Task[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._apply_lock = asyncio.Lock()
        self.leader_changes = 0
        # The engine's own words for a failed start, read once per start.
        self.engine_errors = EngineErrors(nomad, self.config.stderr_wait_s)
        self.broken = BrokenModels()
        # States written under the leader's lock, and the actions that write them.
        self.states = FencedStates(consul, self.leadership)
        # What outlives a pass, and the views made from it and a pass's readings (`views.py`).
        self.memory = ViewBuilder(
            self.states,
            up_window_s=self.config.scale_up_window_s,
            activity_interval_s=self.config.activity_interval_s,
            scale_step_interval_s=self.config.scale_step_interval_s,
        )
        self.changes = ChangeReader(
            self.marks,
            self.memory,
            self.warnings,
            self.kv,
            self.engines,
            {"nomad-jobs": self.jobs, "nomad-allocations": self.allocs, "nomad-evaluations": self.evals},
            self.nodes,
        )
        self.actor = Actor(nomad, self.leadership, self.states, self.engine_errors, clock)

    @property
    def models(self) -> dict[str, Model]:
        return self.memory.definitions.models

    @models.setter
    def models(self, models: dict[str, Model]) -> None:
        self.memory.definitions.models = models

    @property
    def views(self) -> dict[str, ModelView]:
        return self.standing.views

    @property
    def decisions(self) -> dict[str, Decision]:
        return self.standing.decisions

    @property
    def replicas(self) -> list[dict[str, Any]]:
        return self.standing.replicas

    @property
    def definitions_problem(self) -> str:
        return self.memory.definitions.problem

    @property
    def load(self) -> LoadHistory:
        return self.memory.load

    def build_views(self, now: float | None = None, only: set[str] | None = None) -> dict[str, ModelView]:
        return self.memory.build(
            self.clock() if now is None else now,
            self.kv.parts(),
            self.jobs.snapshot.data if self.jobs.snapshot else {},
            self.allocs.snapshot.data if self.allocs.snapshot else None,
            self.evals.snapshot.data if self.evals.snapshot else (),
            self.engines.snapshot.data if self.engines.snapshot else (),
            self.nodes.snapshot.data if self.nodes.snapshot else None,
            jobs_read=self.jobs.snapshot is not None,
            only=only,
            indexes=(self.alloc_feed.indexed, self.eval_feed.indexed),
        )

    # Lifecycle

    def wake(self, cause: str = "wake") -> None:
        self._news_from.add(cause)
        self._wake.set()
        if cause == self.kv.routers.name:
            self._routers_wrote.set()

    def _feed_read(self, name: str, feed: _Feed[Any]) -> None:
        self.changes.feed_read(name, feed)
        self.wake(name)

    def _nodes_read(self) -> None:
        if self.changes.nodes_read():
            self._news_from.add("nomad-nodes")

    def _read_changes(self, now: float) -> bool:
        return self.changes.read(now)

    def _leader_changed(self, leading: bool) -> None:
        self.leader_changes += 1
        # A new leader reads the catalog before correcting it; a deposed one forgets its cache.
        self.health.forget()
        self.states.forget()
        self.marks.all()
        self.wake("leadership")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Two Nomad long polls hold a thread each for their whole wait (the event streams read
        # in threads of their own); leave room for the short calls (scale, register, logs).
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="llmgw-nomad")
        loop.set_default_executor(self._executor)
        for coro in (
            self.leadership.run(),
            *self.kv.runs(),
            self.engines.run(),
            self.jobs.run(),
            self.allocs.run(),
            self.evals.run(),
            self.nodes.run(),
            self._loop(),
        ):
            self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for feed in (self.alloc_feed, self.job_feed, self.eval_feed):
            feed.close()
        await self.leadership.resign()
        self.heap.release()
        if self._executor is not None:
            # Nomad long polls still held in its threads end on their own, within their wait;
            # the event loop need not wait for them to close (it would, for up to that wait,
            # if they stayed its default executor).
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=4))
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def _loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # lands as the event fires, and stop() then waits forever on this task.
            # Until news, a model's moment or a router's record going stale (each read moves that
            # on), or the tick, for what no deadline names (a warning due, a pass left undone).
            due = min(self.marks.next_due(), self.memory.readings.routers_due())
            wait = min(self.config.tick_s, max(0.0, due - self.clock()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            self._wake.clear()
            self._routers_wrote.clear()
            started = time.process_time()
            try:
                if not self._read_changes(self.clock()):
                    await self._quiet_tick()
                    continue
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in one pass must not end the watcher; the next pass starts clean.
                log.exception("event=pass_failed")
            await self._rest(time.process_time() - started)

    async def _rest(self, cpu: float) -> None:
        """After a pass, as long as it computed: on a big fleet something always changed (routers
        write activity every few seconds per model), and this keeps the watcher under half a
        core. Its CPU, not its time: a pass that waited on Nomad (an activation's evaluation)
        must not hold the next ask as long again. Then up to `min_pass_interval_s`, to gather
        a burst of news into one pass, unless a router wrote: an ask waits on the next pass."""
        await asyncio.sleep(cpu)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, self.config.min_pass_interval_s - cpu)):
                await self._routers_wrote.wait()

    # Reading snapshots

    async def _forget_gone_routers(self) -> None:
        now = self.clock()
        if now - self._routers_checked_at < INFLIGHT_FORGET_AFTER_S / 60:
            return
        self._routers_checked_at = now
        await forget_gone_routers(self.consul, self.kv.data(self.kv.routers), now)

    def ready_to_act(self) -> bool:
        """Act only on a complete picture: a watcher that has not yet read Nomad's allocations
        would see no failures and no replicas, and register or scale on that."""
        watches = (*self.kv.watches, self.engines, self.jobs, self.allocs, self.evals)
        return all(w.snapshot is not None and w.ok for w in watches)

    # The pass

    async def run_pass(self) -> None:
        self.pass_causes.update(self._news_from or {"tick"})
        self._news_from = set()
        now = self.clock()
        cpu, full_passes = time.process_time(), self.marks.full_passes
        await self._pass(now)
        self.last_pass_cpu_s = time.process_time() - cpu
        full = self.marks.full_passes != full_passes
        if full:
            self.last_full_pass_cpu_s = self.last_pass_cpu_s
        self.heap.after_pass(full)

    async def _pass(self, now: float) -> bool:
        """One pass over the models marked for it; whether it did all it had to (what it left
        undone is marked again)."""
        self._read_changes(now)
        chosen = self.marks.take(now)
        before = dict(self.decisions) if self._verify_skips and chosen is not None else None
        try:
            complete = await self._reconcile_and_act(now, None if before is not None else chosen)
        finally:
            if before is not None and chosen is not None:
                # The suite's check: every model the marks left out decides what stood.
                skipped = set(before) - chosen
                record_differences(
                    self._verify_skips,
                    {n: before[n] for n in skipped},
                    {n: self.decisions[n] for n in skipped if n in self.decisions},
                )
        if not complete:
            self.marks.give_back(chosen)
        return complete

    async def _reconcile_and_act(self, now: float, chosen: set[str] | None) -> bool:
        views = self.build_views(now, chosen)
        full = chosen is None
        decisions = reconcile_each(views, self.config.max_start_failures, self.decisions, self.broken)
        for name, d in decisions.items():
            decisions[name] = await self.engine_errors.telling(d, views[name])
        # What the load asked for this pass is what a later, lower load must outlast (once
        # Nomad's jobs are read: before, the first sight of each count is still to come).
        jobs_read = self.jobs.snapshot is not None
        for name, d in decisions.items():
            if jobs_read:
                self.load.record(name, views[name].now, d.recommendation)
            view = views[name]
            due = min(
                model_quiet_until(view, d, now), self.load.changes_at(name, view.model.scale_down_delay_s)
            )
            self.marks.due_at(name, due)
        gone = set() if full else {n for n in chosen or () if n not in views}
        if full or gone:
            self.broken.keep_only(self.models)
            self.memory.keep_only_defined()
        self.standing.forget(gone)
        self.standing.merge(views, decisions, full=full)
        self.engine_errors.keep_only(self.standing.parks())
        self.eval_feed.needed = self.standing.evaluations_needed()
        readings = self.memory.readings
        self.standing.update_replicas(
            views,
            readings.engines_by_model,
            readings.allocs_by_job,
            self.clock(),
            node_fabrics(self.nodes.snapshot.data if self.nodes.snapshot else ()),
        )
        self.passes += 1
        self.marks.model_passes += len(views)
        if not self.leadership.is_leader:
            return True
        if not self.ready_to_act():
            return False
        definitions = self.memory.definitions
        if definitions.missing and definitions.raw:
            await definitions.restore(self.consul)
            if definitions.missing:
                return False
        async with self._apply_lock:
            try:
                leading, complete = await self._apply(views, decisions)
                if not leading:
                    return False
            finally:
                self.standing.acted(decisions)
            await self._forget_gone_routers()
            try:
                # Each write within the lease: a Consul that hangs must not hold the pass, and
                # with it the next leader-only step, past the moment this watcher may still act.
                await self.health.sync(
                    {n: Entry(d.health, d.health_output) for n, d in decisions.items()},
                    gone=None if full else gone,
                    within=lambda: max(0.1, self.leadership.lease_left()),
                )
            except (ConsulError, TimeoutError) as exc:
                # What the catalog holds now is unknown: read again and set whole, every model.
                self.health.forget()
                self.marks.all()
                log.warning("event=health_sync_failed error=%r", str(exc) or type(exc).__name__)
                return False
        return complete

    async def _apply(self, views: dict[str, ModelView], decisions: dict[str, Decision]) -> tuple[bool, bool]:
        """Act on each decision, replacing it with what came of it: (still leading, every model
        acted on). Once leadership is lost the rest is left undone."""
        complete = True
        for name, d in decisions.items():
            self.warnings.log_decision(d.model, d.state)
            if not self.leadership.is_leader:
                return False, False
            try:
                decisions[name] = await self.actor.apply_decision(self.models[d.model], d, views[name])
            except LeaseLost as exc:
                log.warning("event=actions_stopped model=%s reason=%r", d.model, str(exc))
                return False, False
            except Exception as exc:  # a Consul write that failed, or worse: this model only
                decisions[name] = broken_decision(views[name], d, self.broken.failed(name, "apply", exc))
                complete = False
            else:
                self.broken.succeeded(name, "apply")
        return True, complete

    @property
    def _quiet_until(self) -> float:
        """Until when a tick with nothing new is skipped (-inf: a model is marked already)."""
        return -math.inf if self.marks.everything or self.marks.models else self.marks.next_due()

    async def _quiet_tick(self) -> None:
        """A tick with no model to reconcile: every decision stands. The suite's check runs a
        pass anyway, to show that none would have changed."""
        if self._verify_skips:
            await self.run_pass()
            return
        self.skipped_passes += 1
        if self.leadership.is_leader and self.ready_to_act():
            async with self._apply_lock:
                await self._forget_gone_routers()

    # Admin operations

    async def retry(self, model: str) -> ModelState:
        """`llmgw ctl retry`: clear the count and unpark; the next pass restores replicas."""
        return await retry_model(self, model)
