"""A task runner, as `client/allocrunner/taskrunner/` has one per task: the prestart hooks
(task dir, artifacts, templates), the driver, the restart tracker, the services and the kill,
with every change of the task's state handed to the allocation it runs in.

It reads its allocation through `TaskHost` (the alloc runner in `client.py` is one), so the
two modules import one way only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import httpx

from devstack.nomad import shutdown_delay
from devstack.nomad import taskstate as ts
from devstack.nomad.acl import AclState, Claim
from devstack.nomad.artifacts import ArtifactError, TemplateError, fetch_artifact, render_templates
from devstack.nomad.clock import Clock
from devstack.nomad.consul import Registration, ServiceRegistry, build_registration
from devstack.nomad.consul_template import NO_IDENTITY_TOKEN, ConsulLookupError, ServiceWatch
from devstack.nomad.drivers import StartRequest, TaskHandle, sleep_unless, start_task
from devstack.nomad.getter import DEFAULT as DEFAULT_ARTIFACT_CONFIG
from devstack.nomad.getter import ArtifactConfig
from devstack.nomad.nodes import simulated_gpus_env
from devstack.nomad.nomad_var_template import VarDenied
from devstack.nomad.taskenv import AllocPaths, TaskEnv, build_task_env, interpolate

Json = dict[str, Any]

log = logging.getLogger(__name__)


class RunsServices(Protocol):
    """What a task asks of the client: the Consul registry and a place to run a coroutine."""

    @property
    def registry(self) -> ServiceRegistry: ...
    @property
    def variables(self) -> dict[tuple[str, str], Json]: ...
    @property
    def artifact_configs(self) -> dict[str, ArtifactConfig]: ...
    @property
    def acl(self) -> AclState | None: ...

    def spawn(self, coro: Any) -> None: ...


class TaskHost(Protocol):
    """What a task runner reads of the allocation it runs in, and tells it."""

    @property
    def client(self) -> RunsServices: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def alloc(self) -> Json: ...
    @property
    def alloc_id(self) -> str: ...
    @property
    def job(self) -> Json: ...
    @property
    def group(self) -> Json: ...
    @property
    def node(self) -> Json | None: ...
    @property
    def paths(self) -> AllocPaths: ...
    @property
    def skip_shutdown_delay(self) -> asyncio.Event: ...

    def current(self) -> Json: ...

    async def restart_task(self, task: str, reason: str) -> None: ...

    def rewatch_group_checks(self, task: str) -> None: ...

    def task_state_updated(self, tr: TaskRunner) -> None: ...

    async def wait_for_prestart(self, tr: TaskRunner) -> None: ...


class _HookFailure(Exception):
    """A prestart hook failed: `event` goes on the task; `fatal` ends the task without the
    restart policy (a template that cannot render), otherwise `error` feeds the tracker."""

    def __init__(self, event: Json, error: ts.StartError, fatal: bool = False) -> None:
        super().__init__(str(error))
        self.event = event
        self.error = error
        self.fatal = fatal


class TaskRunner:
    def __init__(self, alloc_runner: TaskHost, task: Json) -> None:
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
        self.lifecycle: Json = task.get("Lifecycle") or {}
        self.tracker = ts.RestartTracker(policy, job_type, self.clock.now_ns(), lifecycle=self.lifecycle)
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

    @property
    def is_prestart(self) -> bool:
        return self.lifecycle.get("Hook") == "prestart"

    async def _run(self) -> None:
        if not self.is_prestart:
            # Main tasks wait for the prestart tasks (tasklifecycle/coordinator.go); a kill while
            # they wait (a prestart task failed, or the alloc stopped) ends them unstarted.
            await self.ar.wait_for_prestart(self)
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
        missing = self._missing_host_volumes()
        if missing:
            # volume_hook.go validateHostVolumes: a node that lost a volume since placement.
            event = ts.set_fails_task(self._event(ts.TASK_SETUP_FAILURE))
            event["SetupError"] = event["Details"]["setup_error"] = (
                f"host volume validation error: {'; '.join(f'missing {m}' for m in missing)}"
            )
            raise _HookFailure(event, ts.StartError(event["SetupError"]), fatal=True)
        artifacts = self.task.get("Artifacts") or []
        if artifacts and not self._artifacts_done:
            self.emit(self._event(ts.TASK_DOWNLOADING_ARTIFACTS))
            node_id = str((self.ar.node or {}).get("ID") or "")
            config = self.ar.client.artifact_configs.get(node_id, DEFAULT_ARTIFACT_CONFIG)
            for artifact in artifacts:
                try:
                    await asyncio.to_thread(fetch_artifact, artifact, env, task_dir, paths.root, config)
                except ArtifactError as exc:
                    event = ts.set_download_error(self._event(ts.TASK_ARTIFACT_DOWNLOAD_FAILED), str(exc))
                    # Nomad marks artifact failures recoverable: they count against the policy.
                    raise _HookFailure(event, ts.StartError(str(exc), recoverable=True)) from exc
            self._artifacts_done = True
        templates = self.task.get("Templates") or []
        if templates:
            try:
                services = await self._service_lookups(templates)
                env.env.update(
                    render_templates(templates, env, task_dir, paths.root, services, self._variable)
                )
            except (TemplateError, OSError) as exc:
                event = ts.set_fails_task(self._event(ts.TASK_KILLING))
                event["DisplayMessage"] = f"Template failed: {exc}"
                raise _HookFailure(event, ts.StartError(str(exc)), fatal=True) from exc
        self.env = env

    def _missing_host_volumes(self) -> list[str]:
        """Host volumes the group asks for that the node does not declare. raw_exec (and every
        driver here) mounts nothing: a raw_exec task has no filesystem isolation and reads the
        host path itself (drivers/rawexec/driver.go: FSIsolationNone), so a task's
        `volume_mount` needs no more than the volume being there."""
        declared = (self.ar.node or {}).get("HostVolumes") or {}
        asked = (self.ar.group.get("Volumes") or {}).values()
        return [
            str(v.get("Source"))
            for v in asked
            if (v.get("Type") or "host") == "host" and v.get("Source") not in declared
        ]

    def _variable(self, path: str) -> dict[str, str] | None:
        """A Nomad Variable of the job's namespace, as a template reads it: with ACLs on, through
        the task's workload identity (acl.py), refused with VarDenied where it may not read."""
        namespace = str(self.ar.job.get("Namespace") or "default")
        acl = self.ar.client.acl
        if acl is not None:
            # The identity names the job's ID (a periodic or dispatched child's parent's; llmgw
            # has neither), the group and the task.
            job_id = str(self.ar.job.get("ParentID") or self.ar.job.get("ID") or "")
            claim = Claim(namespace, job_id, str(self.ar.group.get("Name") or ""), self.name)
            if not acl.workload_acl(claim).allow_variable(namespace, path, "read", claim):
                raise VarDenied(path, namespace)
        var = self.ar.client.variables.get((namespace, path))
        return dict(var.get("Items") or {}) if var is not None else None

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
