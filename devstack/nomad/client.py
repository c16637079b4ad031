"""The stand-in's client: runs allocations the scheduler placed, as `client/allocrunner/` does.

Each allocation gets an alloc runner and each task a task runner (`task_runner.py`) with its own
restart tracker.
Every change of a task's state is written back to the store as a client update (ClientStatus,
ClientDescription, TaskStates), so llmgw sees through the HTTP API the same lifecycle a real
client reports: Received, Task Setup, Started, Terminated, Restarting, Not Restarting, Killing,
Killed, and an allocation that ends "failed" when a task exhausts its restart policy.

Lifecycle: main tasks start once every prestart task has completed (or, a sidecar, is running),
as client/allocrunner/tasklifecycle/coordinator.go orders them; a prestart task that fails takes
the allocation down with it. Poststart and poststop tasks start with the main tasks.

What the stand-in leaves out, on purpose: log rotation (`<task>.stdout.0` grows), filesystem isolation
(`exec` runs as `raw_exec`), and deployments (`DeploymentStatus` stays as the scheduler wrote it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from devstack.nomad import shutdown_delay
from devstack.nomad import taskstate as ts
from devstack.nomad.acl import AclState
from devstack.nomad.clock import Clock
from devstack.nomad.consul import Registration, ServiceRegistry, build_registration
from devstack.nomad.getter import ArtifactConfig
from devstack.nomad.state import StateStore
from devstack.nomad.task_runner import TaskRunner
from devstack.nomad.taskenv import AllocPaths, build_task_env, find_group

Json = dict[str, Any]

log = logging.getLogger(__name__)

# A stand-in that is shutting down does not wait out long kill timeouts: whatever is still
# running after this many real seconds is killed outright.
SHUTDOWN_GRACE_SECONDS = 10.0


class AllocRunner:
    def __init__(self, client: ClientRunner, alloc: Json) -> None:
        self.client = client
        self.clock = client.clock
        self.alloc = alloc
        self.alloc_id = str(alloc["ID"])
        self.job: Json = alloc.get("Job") or {}
        self.group = find_group(self.job, str(alloc.get("TaskGroup") or ""))
        self.node = client.store.nodes.get(str(alloc.get("NodeID") or ""))
        self.paths = AllocPaths(client.alloc_root / self.alloc_id)
        self.tasks = {str(t["Name"]): TaskRunner(self, t) for t in self.group.get("Tasks") or []}
        self.group_registrations: list[Registration] = []
        self.finished = asyncio.Event()
        # Nomad's shutdownDelayCtx; the stand-in sets it when it shuts down, so that it exits
        # within its grace period.
        self.skip_shutdown_delay = asyncio.Event()
        self._sibling_failed = False
        self._prestart_done = asyncio.Event()
        self._check_prestart()

    def _check_prestart(self) -> None:
        for tr in self.tasks.values():
            if not tr.is_prestart:
                continue
            sidecar_up = bool(tr.lifecycle.get("Sidecar")) and tr.state.state == ts.RUNNING
            completed = tr.state.state == ts.DEAD and not tr.state.failed
            if not (sidecar_up or completed):
                return
        self._prestart_done.set()

    async def wait_for_prestart(self, tr: TaskRunner) -> None:
        if self._prestart_done.is_set():
            return
        done = asyncio.ensure_future(self._prestart_done.wait())
        killed = asyncio.ensure_future(tr.kill_requested.wait())
        try:
            await asyncio.wait({done, killed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            killed.cancel()

    async def run(self) -> None:
        try:
            for tr in self.tasks.values():
                tr.state.append_event(tr._event(ts.TASK_RECEIVED))
            self.client.mark_dirty(self)
            self.paths.build_shared()
            await self._register_group_services()
            await asyncio.gather(*(tr.run() for tr in self.tasks.values()))
        finally:
            await self._deregister_group_services()
            self.finished.set()

    def task_state_updated(self, tr: TaskRunner) -> None:
        self.client.mark_dirty(self)
        if tr.is_prestart and not self._prestart_done.is_set():
            self._check_prestart()
        # A failed task takes its siblings down with it (alloc_runner handleTaskStateUpdates).
        if tr.state.state == ts.DEAD and tr.state.failed and not self._sibling_failed:
            self._sibling_failed = True
            for other in self.tasks.values():
                if other is not tr and other.live:
                    event = ts.set_failed_sibling(other._event(ts.TASK_SIBLING_FAILED), tr.name)
                    self.client.spawn(other.kill(event))

    async def stop(self) -> None:
        await self._deregister_group_services()
        if not shutdown_delay.ignored(self.current()):
            await shutdown_delay.wait(
                self.clock, shutdown_delay.delay_ns(self.group), self.skip_shutdown_delay
            )
        kills = []
        for tr in self.tasks.values():
            event = ts.set_kill_timeout(tr._event(ts.TASK_KILLING), tr.kill_timeout_ns)
            kills.append(tr.kill(event))
        await asyncio.gather(*kills)
        await self.finished.wait()

    def current(self) -> Json:
        """The allocation as the store has it now (a stop may have set DesiredTransition)."""
        return self.client.store.allocs.get(self.alloc_id) or self.alloc

    async def restart_task(self, task: str, reason: str) -> None:
        tr = self.tasks.get(task)
        if tr is not None:
            await tr.restart(reason)

    def rewatch_group_checks(self, task: str) -> None:
        for reg in self.group_registrations:
            self.client.registry.watch(reg, self.alloc_id, self.restart_task, task)

    async def _register_group_services(self) -> None:
        services = self.group.get("Services") or []
        registry = self.client.registry
        if not services or not registry.enabled:
            return
        env = build_task_env(self.alloc, self.node, self.paths, None, host_env=False)
        # A group check restarts the task it names; with one task there is no doubt which.
        only_task = next(iter(self.tasks)) if len(self.tasks) == 1 else None
        workload = f"group-{self.group.get('Name')}"
        for service in services:
            if (service.get("Provider") or "consul") != "consul":
                continue
            try:
                reg = build_registration(self.alloc, workload, service, env, only_task)
                await registry.register(reg, self.alloc_id, self.restart_task)
                self.group_registrations.append(reg)
            except Exception as exc:
                log.error(
                    "alloc %s: registering group service %r: %s", self.alloc_id, service.get("Name"), exc
                )

    async def _deregister_group_services(self) -> None:
        regs, self.group_registrations = self.group_registrations, []
        for reg in regs:
            await self.client.registry.deregister(reg)


class ClientRunner:
    """Runs allocations on behalf of every simulated node; see the module docstring."""

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        data_dir: Path,
        consul_url: str | None,
        on_alloc_update: Callable[[Json], None] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.data_dir = Path(data_dir)
        self.alloc_root = self.data_dir / "alloc"
        self.registry = ServiceRegistry(consul_url, clock)
        # Nomad Variables by (namespace, path), the store's own table: what templates read.
        self.variables: dict[tuple[str, str], Json] = store.variables
        # Each node's client `artifact` block (getter.py), by node ID; a node without one has
        # Nomad's defaults.
        self.artifact_configs: dict[str, ArtifactConfig] = {}
        # The ACL tables once ACLs are on (acl_http.enable): templates read Variables through
        # each task's workload identity.
        self.acl: AclState | None = None
        self.on_alloc_update = on_alloc_update
        self.runners: dict[str, AllocRunner] = {}
        self._finished: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dirty: dict[str, AllocRunner] = {}
        self._flush_scheduled = False
        self._shutting_down = False

    # ----- the contract ------------------------------------------------------------------------

    def start_alloc(self, alloc_id: str) -> None:
        if self._shutting_down or alloc_id in self.runners or alloc_id in self._finished:
            return
        alloc = self.store.allocs.get(alloc_id)
        if alloc is None or alloc.get("DesiredStatus") != "run":
            log.warning("start_alloc(%s): not in the store with DesiredStatus run; ignored", alloc_id)
            return
        try:
            runner = AllocRunner(self, alloc)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("alloc %s cannot run: %s", alloc_id, exc)
            self._write_status(alloc_id, "failed", f"Failed to start allocation: {exc}")
            return
        self.runners[alloc_id] = runner
        self.spawn(self._run_alloc(runner))

    async def _run_alloc(self, runner: AllocRunner) -> None:
        try:
            await runner.run()
        finally:
            # A finished runner holds nothing; forgetting it keeps a long-lived stand-in small.
            self.runners.pop(runner.alloc_id, None)
            self._finished.add(runner.alloc_id)

    def stop_alloc(self, alloc_id: str) -> None:
        runner = self.runners.get(alloc_id)
        if runner is None:
            alloc = self.store.allocs.get(alloc_id)
            if alloc is not None and alloc.get("ClientStatus") in ("pending", "running"):
                # Stopped before it ever ran here: nothing to kill.
                self._write_status(alloc_id, "complete", "All tasks have completed")
            return
        self.spawn(runner.stop())

    def log_path(self, alloc_id: str, task: str, kind: str) -> Path:
        if kind not in ("stdout", "stderr"):
            raise ValueError(f"log kind must be 'stdout' or 'stderr', got {kind!r}")
        return AllocPaths(self.alloc_root / alloc_id).log(task, kind)

    async def shutdown(self) -> None:
        """Kill every task and deregister every service; the store is left as it was."""
        self._shutting_down = True
        runners = list(self.runners.values())
        for runner in runners:
            runner.skip_shutdown_delay.set()
        stops = asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)
        try:
            await asyncio.wait_for(stops, SHUTDOWN_GRACE_SECONDS)
        except TimeoutError:
            log.warning("shutdown: tasks still running after %.0fs; killing them", SHUTDOWN_GRACE_SECONDS)
            for runner in runners:
                for tr in runner.tasks.values():
                    if tr.handle is not None:
                        tr.handle.force_kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(r.finished.wait() for r in runners)), SHUTDOWN_GRACE_SECONDS
                )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.registry.close()

    # ----- plumbing ----------------------------------------------------------------------------

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("client task failed", exc_info=task.exception())

    def mark_dirty(self, runner: AllocRunner) -> None:
        """Changes made in one turn of the loop go out as one client update, as Nomad batches
        its client's alloc updates; a thousand mock tasks starting together cost one commit."""
        self._dirty[runner.alloc_id] = runner
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, {}
        if self._shutting_down:
            return
        updated: list[Json] = []
        with self._batch():
            for alloc_id, runner in dirty.items():
                stored = self.store.allocs.get(alloc_id)
                if stored is None:
                    continue
                status, description = ts.client_status({n: t.state for n, t in runner.tasks.items()})
                new = dict(stored)
                new["TaskStates"] = {n: t.state.to_json() for n, t in runner.tasks.items()}
                new["ClientStatus"] = status
                new["ClientDescription"] = description
                new["ModifyTime"] = self.clock.now_ns()
                self.store.upsert_alloc(new)
                updated.append(new)
        self._notify(updated)

    def _write_status(self, alloc_id: str, status: str, description: str) -> None:
        stored = self.store.allocs.get(alloc_id)
        if stored is None or self._shutting_down:
            return
        new = dict(stored, ClientStatus=status, ClientDescription=description, ModifyTime=self.clock.now_ns())
        self.store.upsert_alloc(new)
        self._notify([new])

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        # Inside a caller's batch the writes simply join it.
        if getattr(self.store, "_pending", None) is not None:
            yield
            return
        with self.store.batch():
            yield

    def _notify(self, allocs: list[Json]) -> None:
        if self.on_alloc_update is None:
            return
        for alloc in allocs:
            try:
                self.on_alloc_update(alloc)
            except Exception:
                log.exception("on_alloc_update failed for alloc %s", alloc.get("ID"))
