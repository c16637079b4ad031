"""The watcher: snapshots in, `reconcile` per model, actions out (on the leader only).

Every watcher, leader or not, runs the same passes over the same snapshots, so any of them can
answer the admin API; only the leader's actions reach Nomad and Consul. A pass calls nothing
itself: it reads the latest snapshots in memory, which is what keeps a thousand models under a
second of CPU and an idle minute at a handful of long polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from math import inf
from typing import Any

from nomad_driver.blocking import Watch
from nomad_driver.consul import Consul, ConsulError, ConsulUnavailable, KVEntry
from nomad_driver.nomad import Nomad
from nomad_driver.placement import PlacementWarnings
from nomad_driver.render import SERVICE_NAME
from nomad_driver.spec import Model
from nomad_driver.state import (
    MalformedState,
    ModelState,
    parse_state,
    state_key,
)
from nomad_driver.watcher.acting import Actor
from nomad_driver.watcher.counting import retried
from nomad_driver.watcher.decisions import Decision, ModelView, Park
from nomad_driver.watcher.engine_errors import EngineErrors
from nomad_driver.watcher.evaluations import EvaluationFeed, jobs_needing_evaluations
from nomad_driver.watcher.feeds import AllocationFeed, JobFeed
from nomad_driver.watcher.fenced import FencedStates
from nomad_driver.watcher.health import Entry, HealthEntries
from nomad_driver.watcher.in_flight import (
    INFLIGHT_FORGET_AFTER_S,
    forget_gone_routers,
    routers_change_at,
)
from nomad_driver.watcher.isolation import BrokenModels, broken_decision, reconcile_each
from nomad_driver.watcher.leader import LeaderInfo, Leadership, LeaseLost
from nomad_driver.watcher.quiet import quiet_until, record_differences, verify_file
from nomad_driver.watcher.reconcile import DEFAULT_MAX_START_FAILURES
from nomad_driver.watcher.replicas import (
    list_replicas,
    node_fabrics,
)
from nomad_driver.watcher.scaling import DEFAULT_STEP_INTERVAL_S, DEFAULT_UP_WINDOW_S, LoadHistory
from nomad_driver.watcher.views import ViewBuilder
from nomad_driver.watcher.watch import (
    JobCache,
    NodeCache,
    engines_fetch,
    jobs_fetch,
    kept_allocation,
    kv_fetch,
    nodes_fetch,
)

log = logging.getLogger("llmgw.watcher")

# A retry whose check-and-set loses reads the key again: only a writer outside llmgw racing it
# three times running is told to try again.
RETRY_WRITE_ATTEMPTS = 3


class NotLeader(Exception):
    def __init__(self, leader: LeaderInfo | None) -> None:
        where = leader.describe() if leader else "no watcher leads right now"
        super().__init__(f"this watcher does not lead; the leader is {where}")
        self.leader = leader


class UnknownModel(KeyError):
    pass


@dataclass(frozen=True)
class WatcherConfig:
    address: str = "127.0.0.1:4700"
    max_start_failures: int = DEFAULT_MAX_START_FAILURES
    wait_s: float = 60.0
    leader_ttl_s: int = 10
    lock_delay_s: float = 1.0
    # Passes also run on this tick, for idle timeouts that expire with nothing changing.
    tick_s: float = 5.0
    min_pass_interval_s: float = 0.2
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
        self._wake = asyncio.Event()
        w = self.config.wait_s
        self.kv: Watch[dict[str, KVEntry]] = Watch(
            "consul-kv", kv_fetch(consul, w), on_change=partial(self.wake, "consul-kv")
        )
        self.engines: Watch[tuple[dict[str, Any], ...]] = Watch(
            "consul-engines",
            engines_fetch(consul, SERVICE_NAME, w),
            on_change=partial(self.wake, "consul-engines"),
        )
        # Jobs, allocations and evaluations are listed once, then followed by Nomad's event
        # stream (watcher/feeds.py): a change costs what changed, not the whole namespace again.
        self.job_feed = JobFeed(nomad, w, jobs_fetch(nomad, w, JobCache()))
        self.jobs: Watch[Mapping[str, dict[str, Any]]] = Watch(
            "nomad-jobs", self.job_feed.fetch, on_change=partial(self.wake, "nomad-jobs")
        )
        # With resources: the summary counts a GPU as used from the allocation that holds it,
        # whoever's job it is, and so does a multi-node model's room.
        self.alloc_feed = AllocationFeed(nomad, w, kept_allocation)
        self.allocs: Watch[tuple[dict[str, Any], ...]] = Watch(
            "nomad-allocations", self.alloc_feed.fetch, on_change=partial(self.wake, "nomad-allocations")
        )
        self.eval_feed = EvaluationFeed(nomad, w)
        self.evals: Watch[tuple[dict[str, Any], ...]] = Watch(
            "nomad-evaluations", self.eval_feed.fetch, on_change=partial(self.wake, "nomad-evaluations")
        )
        # Nodes feed the admin API, the engine metrics and the fabric room of multi-node models
        # (which wait for a first answer), so a change there does not wake a pass and a
        # failing node watch does not stop the leader acting; the next tick's pass reads what
        # a pass uses of them (`_nodes_read`).
        self.nodes: Watch[tuple[dict[str, Any], ...]] = Watch(
            "nomad-nodes", nodes_fetch(nomad, w, NodeCache()), on_change=self._nodes_read
        )
        self._node_fabrics: dict[str, str] | None = None
        self.decisions: dict[str, Decision] = {}
        self.views: dict[str, ModelView] = {}
        self.passes = 0
        # Passes skipped with nothing new to read (`watcher/quiet.py`): anything a watch reads,
        # or a leadership change, is news and wakes a full pass; the tick alone skips one
        # until the clock reaches what the last decisions depend on.
        self.skipped_passes = 0
        self._news = True
        # What brought news since the last pass, and how many passes each cause ran (a pass
        # with none was the tick's, for a deadline), for /healthz and the benchmark.
        self._news_from: set[str] = {"start"}
        self.pass_causes: Counter[str] = Counter()
        self._quiet_until = -inf
        self._verify_skips = verify_file()
        self.last_pass_cpu_s = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._apply_lock = asyncio.Lock()
        self.leader_changes = 0
        # Replicas as of the last pass, and since when each has been in its state.
        self.replicas: list[dict[str, Any]] = []
        self._replica_since: dict[str, tuple[str, float]] = {}
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
        self.actor = Actor(nomad, self.leadership, self.states, self.engine_errors, clock)

    @property
    def models(self) -> dict[str, Model]:
        return self.memory.definitions.models

    @models.setter
    def models(self, models: dict[str, Model]) -> None:
        self.memory.definitions.models = models

    @property
    def definitions_problem(self) -> str:
        return self.memory.definitions.problem

    @property
    def load(self) -> LoadHistory:
        return self.memory.load

    def build_views(self, now: float | None = None) -> dict[str, ModelView]:
        kv = self.kv.snapshot
        return self.memory.build(
            self.clock() if now is None else now,
            kv.data if kv else {},
            kv.index if kv else None,
            self.jobs.snapshot.data if self.jobs.snapshot else {},
            self.allocs.snapshot.data if self.allocs.snapshot else None,
            self.evals.snapshot.data if self.evals.snapshot else (),
            self.engines.snapshot.data if self.engines.snapshot else (),
            self.nodes.snapshot.data if self.nodes.snapshot else None,
            jobs_read=self.jobs.snapshot is not None,
        )

    # Lifecycle

    def wake(self, cause: str = "wake") -> None:
        self._news = True
        self._news_from.add(cause)
        self._wake.set()

    def _nodes_read(self) -> None:
        """A pass reads of the nodes only each one's fabric (the replica list) and, for a
        multi-node model, the room in each fabric; any other node change (another job placed,
        a heartbeat's fields) is not news, or it would cost a pass over every model."""
        fabrics = node_fabrics(self.nodes.snapshot.data if self.nodes.snapshot else ())
        if fabrics != self._node_fabrics or any(m.profile.nodes > 1 for m in self.models.values()):
            self._node_fabrics = fabrics
            self._news = True
            self._news_from.add("nomad-nodes")

    def _leader_changed(self, leading: bool) -> None:
        self.leader_changes += 1
        # A new leader reads the catalog before correcting it; a deposed one forgets its cache.
        self.health.forget()
        self.states.forget()
        self.wake("leadership")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # Two Nomad long polls hold a thread each for their whole wait (the event streams read
        # in threads of their own); leave room for the short calls (scale, register, logs).
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="llmgw-nomad")
        loop.set_default_executor(self._executor)
        for coro in (
            self.leadership.run(),
            self.kv.run(),
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
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.tick_s):
                    await self._wake.wait()
            self._wake.clear()
            started = time.monotonic()
            try:
                if not self._news and self.clock() < self._quiet_until:
                    await self._quiet_tick()
                    continue
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in one pass must not end the watcher; the next pass starts clean.
                log.exception("event=pass_failed")
            # Routers write activity every few seconds per model, so on a big fleet something
            # always changed; resting as long as the pass took keeps the watcher under half a
            # core however busy the KV prefix is.
            await asyncio.sleep(max(self.config.min_pass_interval_s, time.monotonic() - started))

    # Reading snapshots

    async def _forget_gone_routers(self) -> None:
        now = self.clock()
        if now - self._routers_checked_at < INFLIGHT_FORGET_AFTER_S / 60:
            return
        self._routers_checked_at = now
        await forget_gone_routers(self.consul, self.kv.snapshot.data if self.kv.snapshot else {}, now)

    def ready_to_act(self) -> bool:
        """Act only on a complete picture: a watcher that has not yet read Nomad's allocations
        would see no failures and no replicas, and register or scale on that."""
        watches = (self.kv, self.engines, self.jobs, self.allocs, self.evals)
        return all(w.snapshot is not None and w.ok for w in watches)

    # The pass

    async def run_pass(self) -> None:
        # Taken before the snapshots are read: what a watch brings in meanwhile is news still.
        self._news = False
        self.pass_causes.update(self._news_from or {"tick"})
        self._news_from = set()
        self._quiet_until = -inf
        now = self.clock()
        cpu = time.process_time()
        if await self._pass(now):
            self._quiet_until = self._quiet_deadline(now)
        self.last_pass_cpu_s = time.process_time() - cpu

    async def _pass(self, now: float) -> bool:
        """One pass; whether it did all it had to (a pass after one that did not is never
        skipped: what it left undone is asked again)."""
        views = self.build_views(now)
        decisions = reconcile_each(views, self.config.max_start_failures, self.decisions, self.broken)
        self.broken.keep_only(views)
        parks = {
            (a.alloc_id, a.task, a.failures)
            for d in decisions.values()
            for a in d.actions
            if isinstance(a, Park)
        }
        parks |= {
            (s.alloc_id, s.task, s.failures)
            for d in decisions.values()
            if d.degraded is not None
            for s in d.degraded.slots[:1]
        }
        for name, d in decisions.items():
            decisions[name] = await self.engine_errors.telling(d, views[name])
        self.engine_errors.keep_only(parks)
        # What the load asked for this pass is what a later, lower load must outlast (once
        # Nomad's jobs are read: before, the first sight of each count is still to come).
        if self.jobs.snapshot is not None:
            for name, d in decisions.items():
                self.load.record(name, views[name].now, d.recommendation)
        self.memory.keep_only_defined()
        self.views, self.decisions = views, decisions
        self.eval_feed.needed = jobs_needing_evaluations(views.values())
        self.replicas = self._build_replicas(views)
        self.passes += 1
        if not self.leadership.is_leader:
            return True
        if not self.ready_to_act():
            return False
        definitions = self.memory.definitions
        if definitions.missing and definitions.raw:
            await definitions.restore(self.consul)
            if definitions.missing:
                return False
        complete = True
        async with self._apply_lock:
            for name, d in decisions.items():
                self._log_placement(d)
                if not self.leadership.is_leader:
                    return False
                try:
                    decisions[name] = await self.actor.apply_decision(self.models[d.model], d, views[name])
                except LeaseLost as exc:
                    log.warning("event=actions_stopped model=%s reason=%r", d.model, str(exc))
                    return False
                except Exception as exc:  # a Consul write that failed, or worse: this model only
                    why = self.broken.failed(name, "apply", exc)
                    decisions[name] = broken_decision(views[name], d, why)
                    complete = False
                else:
                    self.broken.succeeded(name, "apply")
            await self._forget_gone_routers()
            try:
                # Within the lease: a Consul that hangs must not hold the pass, and with it the
                # next leader-only step, past the moment this watcher may still act.
                async with asyncio.timeout(max(0.1, self.leadership.lease_left())):
                    await self.health.sync(
                        {n: Entry(d.health, d.health_output) for n, d in decisions.items()}
                    )
            except (ConsulError, TimeoutError) as exc:
                self.health.forget()
                log.warning("event=health_sync_failed error=%r", str(exc) or type(exc).__name__)
                return False
        return complete

    def _quiet_deadline(self, now: float) -> float:
        """Until when a pass with nothing new to read would decide what this one did."""
        kv = self.kv.snapshot.data if self.kv.snapshot else {}
        return min(
            [
                quiet_until(self.views, self.decisions, now),
                routers_change_at(kv, now),
                self.warnings.next_due(),
                *(self.load.changes_at(n, v.model.scale_down_delay_s) for n, v in self.views.items()),
            ]
        )

    async def _quiet_tick(self) -> None:
        """A tick with nothing new: the last pass's decisions stand. The load history is told
        they were asked for again now, as a pass would have recorded, so that a lower figure
        after the quiet still has to hold for the scale-down delay."""
        if self._verify_skips:
            before = dict(self.decisions)
            await self.run_pass()
            record_differences(self._verify_skips, before, self.decisions)
            return
        now = self.clock()
        if self.jobs.snapshot is not None:
            for name, d in self.decisions.items():
                self.load.record(name, now, d.recommendation)
        self.skipped_passes += 1
        if self.leadership.is_leader and self.ready_to_act():
            async with self._apply_lock:
                await self._forget_gone_routers()

    def _build_replicas(self, views: Mapping[str, ModelView]) -> list[dict[str, Any]]:
        replicas, self._replica_since = list_replicas(
            views,
            self.engines.snapshot.data if self.engines.snapshot else (),
            self.allocs.snapshot.data if self.allocs.snapshot else (),
            self._replica_since,
            self.clock(),
            node_fabrics(self.nodes.snapshot.data if self.nodes.snapshot else ()),
        )
        return replicas

    def _log_placement(self, d: Decision) -> None:
        if d.state.unplaceable:
            if self.warnings.should_log(d.model, d.state.placement_reason):
                log.warning(
                    "event=unplaceable model=%s eval=%s reason=%r",
                    d.model,
                    d.state.placement_eval,
                    d.state.placement_reason,
                )
        else:
            self.warnings.clear(d.model)

    # Admin operations

    async def retry(self, model: str) -> ModelState:
        """`llmgw ctl retry`: clear the count and unpark; the next pass restores replicas."""
        # Under the pass's lock and from the key as Consul holds it now: a pass's write in
        # flight, or a change the KV snapshot does not show yet, would otherwise fail the
        # check-and-set and tell the operator to try again for nothing.
        async with self._apply_lock:
            for _ in range(RETRY_WRITE_ATTEMPTS):
                if not self.leadership.is_leader:
                    raise NotLeader(self.leadership.leader)
                views = self.build_views()
                if model not in views:
                    raise UnknownModel(model)
                view = await self._with_stored_state(views[model])
                state = retried(view)
                if await self.states.write(model, state, view.state_index):
                    log.info("event=retried model=%s", model)
                    self.wake("retry")
                    return state
        raise ConsulUnavailable(f"could not write {state_key(model)}; try again")

    async def _with_stored_state(self, view: ModelView) -> ModelView:
        key = state_key(view.model.name)
        _, entries = await self.consul.kv_get(key)
        if not entries:
            return dataclasses.replace(view, state=None, state_index=0)
        try:
            state: ModelState | None = parse_state(key, entries[0].value)
        except MalformedState:
            state = None  # replaced whole, as a pass replaces it
        return dataclasses.replace(view, state=state, state_index=entries[0].modify_index)
