"""The stand-in's client: runs allocations the scheduler placed, as `client/allocrunner/` does.

Each allocation gets an alloc runner and each task a task runner with its own restart tracker.
Every change of a task's state is written back to the store as a client update (ClientStatus,
ClientDescription, TaskStates), so llmgw sees through the HTTP API the same lifecycle a real
client reports: Received, Task Setup, Started, Terminated, Restarting, Not Restarting, Killing,
Killed, and an allocation that ends "failed" when a task exhausts its restart policy.

What the stand-in leaves out, on purpose: lifecycle hooks (prestart/poststart/poststop tasks
start together with the others), log rotation (`<task>.stdout.0` grows), filesystem isolation
(`exec` runs as `raw_exec`), and deployments (`DeploymentStatus` stays as the scheduler wrote it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from devstack.nomad import shutdown_delay
from devstack.nomad import taskstate as ts
from devstack.nomad.artifacts import ArtifactError, TemplateError, fetch_artifact, render_templates
from devstack.nomad.clock import Clock
from devstack.nomad.consul import Registration, ServiceRegistry, build_registration
from devstack.nomad.consul_template import NO_IDENTITY_TOKEN, ConsulLookupError, ServiceWatch
from devstack.nomad.drivers import StartRequest, TaskHandle, sleep_unless, start_task
from devstack.nomad.nodes import simulated_gpus_env
from devstack.nomad.state import StateStore
from devstack.nomad.taskenv import AllocPaths, TaskEnv, build_task_env, find_group, interpolate

Json = dict[str, Any]

log = logging.getLogger(__name__)

# A stand-in that is shutting down does not wait out long kill timeouts: whatever is still
# running after this many real seconds is killed outright.
SHUTDOWN_GRACE_SECONDS = 10.0


class _HookFailure(Exception):
    """A prestart hook failed: `event` goes on the task; `fatal` ends the task without the
    restart policy (a template that cannot render), otherwise `error` feeds the tracker."""

    def __init__(self, event: Json, error: ts.StartError, fatal: bool = False) -> None:
        super().__init__(str(error))
        self.event = event
        self.error = error
        self.fatal = fatal


class TaskRunner:
    def __init__(self, alloc_runner: AllocRunner, task: Json) -> None:
        self.ar = alloc_runner
        self.task = task
        self.name = str(task["Name"])
        self.driver = str(task.get("Driver") or "")
        self.clock = alloc_runner.clock
        job = alloc_runner.job
        policy = task.get("RestartPolicy") or alloc_runner.group.get("RestartPolicy")
        job_type = str(job.get("Type") or "service")
        if not policy:
            policy = ts.DEFAULT_RESTART_POLICY["batch" if job_type == "batch" else "service"]
        self.tracker = ts.RestartTracker(policy, job_type, self.clock.now_ns())
        self.kill_timeout_ns = int(task.get("KillTimeout") or 5 * ts.SECOND)
        self.kill_signal = str(task.get("KillSignal") or "")
        self.state = ts.TaskState()
        self.handle: TaskHandle | None = None
        self.kill_requested = asyncio.Event()
        self.done = asyncio.Event()
        self.env: TaskEnv | None = None
        self.registrations: list[Registration] = []
        self._setup_done = False
        self._artifacts_done = False
        self._service_watch: ServiceWatch | None = None

    # ----- state ----------------------------------------------------------------------------

    def _event(self, type_: str) -> Json:
        return ts.new_event(type_, self.clock.now_ns())

    def emit(self, event: Json) -> None:
        self.state.append_event(event)
        self.ar.task_state_updated(self)

    def update_state(self, state: str, event: Json | None = None) -> None:
        if event is not None:
            self.state.append_event(event)
        self.state.set_state(state, self.clock.now_ns())
        self.ar.task_state_updated(self)

    @property
    def live(self) -> bool:
        return not self.done.is_set()

    # ----- the run loop (task_runner.go Run) ---------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as exc:  # a bug here must not leave the alloc pending forever
            log.exception("task %s of alloc %s failed in the client", self.name, self.ar.alloc_id)
            event = self._event(ts.TASK_SETUP_FAILURE)
            event["SetupError"] = event["Details"]["setup_error"] = f"stand-in client error: {exc}"
            ts.set_fails_task(event)
            self.state.append_event(event)
            if self.handle is not None:
                self.handle.force_kill()
        finally:
            if self._service_watch is not None:
                self._service_watch.stop()
            await self._deregister_services()
            if self.state.state != ts.DEAD:
                self.update_state(ts.DEAD)
            self.done.set()

    async def _run(self) -> None:
        while not self.kill_requested.is_set():
            try:
                await self._prestart()
            except _HookFailure as failure:
                if failure.fatal:
                    self.update_state(ts.DEAD, failure.event)
                    return
                self.emit(failure.event)
                self.tracker.set_start_error(failure.error)
            else:
                if self.kill_requested.is_set():
                    break
                await self._run_driver()

            decision = self.tracker.get_state(self.clock.now_ns())
            if decision.state == ts.TASK_KILLED:
                self.emit(self._event(ts.TASK_KILLED))
                break
            if decision.state == ts.TASK_NOT_RESTARTING:
                event = ts.set_fails_task(
                    ts.set_restart(self._event(ts.TASK_NOT_RESTARTING), None, decision.reason)
                )
                self.update_state(ts.DEAD, event)
                return
            if decision.state == ts.TASK_TERMINATED:
                break
            event = ts.set_restart(self._event(ts.TASK_RESTARTING), decision.delay_ns, decision.reason)
            self.update_state(ts.PENDING, event)
            if await sleep_unless(self.clock, self.kill_requested, decision.delay_ns / 1e9):
                break

    async def _run_driver(self) -> None:
        assert self.env is not None
        paths = self.ar.paths
        request = StartRequest(
            name=self.name,
            config=interpolate(self.task.get("Config") or {}, self.env),
            # Beside Nomad's env, the simulated hardware: what a real process finds through
            # the driver (nodes.py, simulated_gpus_env). Never interpolated, as it is no variable.
            env={**self.env.env, **simulated_gpus_env(self.ar.node)},
            task_dir=paths.task_dir(self.name),
            stdout=paths.log(self.name, "stdout"),
            stderr=paths.log(self.name, "stderr"),
            node_attributes=(self.ar.node or {}).get("Attributes") or {},
        )
        try:
            handle = await start_task(self.driver, request, self.clock)
        except ts.StartError as exc:
            self.emit(ts.set_driver_error(self._event(ts.TASK_DRIVER_FAILURE), str(exc)))
            self.tracker.set_start_error(exc)
            return
        self.handle = handle
        self.update_state(ts.RUNNING, self._event(ts.TASK_STARTED))
        if self.kill_requested.is_set():
            # Killed while the driver was starting: nobody else saw this handle.
            self.tracker.set_killed()
            self.ar.client.spawn(handle.kill(self.kill_timeout_ns, self.kill_signal))
        else:
            await self._register_services()
        result = await handle.wait()
        self.handle = None
        self.emit(
            ts.set_exit(
                self._event(ts.TASK_TERMINATED),
                result.exit_code,
                result.signal,
                result.err,
                result.oom_killed,
            )
        )
        await self._deregister_services()
        self.tracker.set_exit_result(result)

    async def _prestart(self) -> None:
        paths = self.ar.paths
        task_dir = paths.task_dir(self.name)
        if not self._setup_done:
            self.emit(ts.set_message(self._event(ts.TASK_SETUP), ts.TASK_BUILDING_TASK_DIR))
            paths.build_task(self.name)
            for kind in ("stdout", "stderr"):
                paths.log(self.name, kind).touch()
            self._setup_done = True
        env = build_task_env(self.ar.alloc, self.ar.node, paths, self.task)
        artifacts = self.task.get("Artifacts") or []
        if artifacts and not self._artifacts_done:
            self.emit(self._event(ts.TASK_DOWNLOADING_ARTIFACTS))
            for artifact in artifacts:
                try:
                    await asyncio.to_thread(fetch_artifact, artifact, env, task_dir, paths.root)
                except ArtifactError as exc:
                    event = ts.set_download_error(self._event(ts.TASK_ARTIFACT_DOWNLOAD_FAILED), str(exc))
                    # Nomad marks artifact failures recoverable: they count against the policy.
                    raise _HookFailure(event, ts.StartError(str(exc), recoverable=True)) from exc
            self._artifacts_done = True
        templates = self.task.get("Templates") or []
        if templates:
            try:
                services = await self._service_lookups(templates)
                env.env.update(render_templates(templates, env, task_dir, paths.root, services))
            except (TemplateError, OSError) as exc:
                event = ts.set_fails_task(self._event(ts.TASK_KILLING))
                event["DisplayMessage"] = f"Template failed: {exc}"
                raise _HookFailure(event, ts.StartError(str(exc)), fatal=True) from exc
        self.env = env

    async def _service_lookups(self, templates: list[Json]) -> dict[str, list[tuple[str, int]]]:
        """Answers for the templates' Consul `service` lookups, watched from here on so that a
        change restarts the task (a multi-node replica's leader and its shards)."""
        # Only a task (or group) with a `consul` block gets a Consul identity, hence a token;
        # the stand-in's own token stands in for the one Nomad derives from that identity.
        has_identity = self.task.get("Consul") is not None or self.ar.group.get("Consul") is not None
        watch = self._service_watch = ServiceWatch(templates, None if has_identity else NO_IDENTITY_TOKEN)
        if not watch.queries:
            return {}
        registry = self.ar.client.registry
        if not registry.enabled:
            raise TemplateError("template looks up Consul services, but the stand-in runs without Consul")
        try:
            seen = await watch.first(registry._http())
        except httpx.HTTPError as exc:
            raise TemplateError(f"Consul service lookup failed: {exc}") from exc
        except ConsulLookupError as exc:
            raise TemplateError(str(exc)) from exc

        async def restart() -> None:
            await self.restart("template with change_mode restart re-rendered", failure=False)

        watch.start(registry._http(), seen, lambda: self.handle is not None, restart)
        return seen

    # ----- kill and restart (lifecycle.go) -----------------------------------------------------

    async def kill(self, event: Json) -> None:
        if self.done.is_set():
            return
        if self.kill_requested.is_set():
            await self.done.wait()
            return
        self.kill_requested.set()
        self.emit(event)
        handle = self.handle
        if handle is not None:
            await self._deregister_services()
            await shutdown_delay.before_task_kill(self, self.ar.current(), self.ar.skip_shutdown_delay)
            self.tracker.set_killed()
            await handle.kill(self.kill_timeout_ns, self.kill_signal)
        await self.done.wait()

    async def restart(self, reason: str, failure: bool = True) -> None:
        """A failure restart, as check_restart asks for: counts against the restart policy;
        with `failure=False` (a template change) it does not."""
        handle = self.handle
        if handle is None or self.kill_requested.is_set():
            return
        self.emit(ts.set_restart(self._event(ts.TASK_RESTART_SIGNAL), None, reason))
        await self._deregister_services()
        self.tracker.set_restart_triggered(failure=failure)
        await handle.kill(self.kill_timeout_ns, self.kill_signal)

    # ----- services ----------------------------------------------------------------------------

    async def _register_services(self) -> None:
        services = self.task.get("Services") or []
        registry = self.ar.client.registry
        if not services or not registry.enabled or self.env is None:
            self.ar.rewatch_group_checks(self.name)
            return
        for service in services:
            if (service.get("Provider") or "consul") != "consul":
                continue
            try:
                reg = build_registration(self.ar.alloc, self.name, service, self.env, self.name)
                await registry.register(reg, self.ar.alloc_id, self.ar.restart_task)
                self.registrations.append(reg)
            except Exception as exc:
                log.error(
                    "alloc %s task %s: registering service %r: %s",
                    self.ar.alloc_id,
                    self.name,
                    service.get("Name"),
                    exc,
                )
        self.ar.rewatch_group_checks(self.name)

    async def _deregister_services(self) -> None:
        regs, self.registrations = self.registrations, []
        for reg in regs:
            await self.ar.client.registry.deregister(reg)


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
