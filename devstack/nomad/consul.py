"""Consul service registration for allocations, and `check_restart`.

Service and check IDs, names, meta and addresses follow `command/agent/consul/service_client.go`
and `client/serviceregistration/`, because llmgw's router finds replicas in the Consul catalog
and must find the stand-in's replicas exactly where it would find a real cluster's. The check
watcher follows `serviceregistration/watcher.go`: Nomad, not Consul, restarts a task whose check
stays unhealthy, once the grace period is over and the check has been unhealthy for
`interval * (limit - 1)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

from devstack.nomad.clock import Clock
from devstack.nomad.taskenv import TaskEnv
from devstack.nomad.taskstate import go_duration

Json = dict[str, Any]

log = logging.getLogger(__name__)

TASK_PREFIX = "_nomad-task-"
CHECK_PREFIX = "_nomad-check-"
# Nomad polls the agent's check statuses once a second (UniversalCheckWatcher.pollFrequency).
POLL_SECONDS = 1.0
# Consul's own checks run on real time whatever the stand-in's clock says, so polling faster
# than this in real time only costs CPU.
MIN_POLL_REAL_SECONDS = 0.2
# Nomad's service client re-syncs with the agent every 30s (periodicInterval).
SYNC_SECONDS = 30.0
MIN_SYNC_REAL_SECONDS = 1.0


def service_id(alloc_id: str, workload: str, service: Json) -> str:
    """`MakeAllocServiceID`; `workload` is the task name, or `group-<group>` for group services."""
    return f"{TASK_PREFIX}{alloc_id}-{workload}-{service.get('Name')}-{service.get('PortLabel') or ''}"


def check_id(svc_id: str, check: Json) -> str:
    """`MakeCheckID`: a hash of the service ID and the check's definition, SHA256 as in 2.0.5."""
    body = json.dumps(check, sort_keys=True, default=str)
    return CHECK_PREFIX + hashlib.sha256((svc_id + body).encode()).hexdigest()


def _port(ports: list[Json], label: str) -> tuple[str, int]:
    """`GetAddress` in host mode: a port label resolves to the host IP and port the scheduler
    assigned; a number is taken as a literal port."""
    for port in ports:
        if port.get("Label") == label:
            return str(port.get("HostIP") or "127.0.0.1"), int(port.get("Value") or 0)
    if label.isdigit():
        return "127.0.0.1", int(label)
    raise ValueError(f"invalid port {label!r}: port label not found")


@dataclass
class CheckRestart:
    """One check with `check_restart`, and who to restart when it stays unhealthy."""

    check_id: str
    check_name: str
    task: str
    grace: float
    time_limit: float
    ignore_warnings: bool
    grace_until: float = 0.0
    unhealthy_since: float | None = None

    def arm(self, now: float) -> None:
        self.grace_until = now + self.grace
        self.unhealthy_since = None


@dataclass
class Registration:
    service_id: str
    body: Json
    watches: list[CheckRestart]


def build_registration(
    alloc: Json,
    workload: str,
    service: Json,
    env: TaskEnv,
    default_task: str | None,
) -> Registration:
    """The agent registration for one Nomad service, interpolated with the workload's env."""
    ports = ((alloc.get("AllocatedResources") or {}).get("Shared") or {}).get("Ports") or []
    svc = dict(service)
    svc["Name"] = env.replace(str(service.get("Name") or ""))
    port_label = env.replace(str(service.get("PortLabel") or ""))
    sid = service_id(str(alloc["ID"]), workload, {"Name": svc["Name"], "PortLabel": port_label})
    address, port = ("127.0.0.1", 0)
    if port_label:
        address, port = _port(ports, port_label)
    if service.get("Address"):
        address = env.replace(str(service["Address"]))
    meta = {str(k): env.replace(str(v)) for k, v in (service.get("Meta") or {}).items()}
    meta["external-source"] = "nomad"
    body: Json = {
        "ID": sid,
        "Name": svc["Name"],
        "Tags": [env.replace(str(t)) for t in service.get("Tags") or []],
        "Address": address,
        "Port": port,
        "Meta": meta,
        "EnableTagOverride": bool(service.get("EnableTagOverride")),
    }
    checks: list[Json] = []
    watches: list[CheckRestart] = []
    for check in service.get("Checks") or []:
        reg, watch = _check_registration(sid, svc, check, env, ports, address, port, default_task)
        checks.append(reg)
        if watch:
            watches.append(watch)
    if checks:
        body["Checks"] = checks
    return Registration(sid, body, watches)


def _check_registration(
    sid: str,
    service: Json,
    check: Json,
    env: TaskEnv,
    ports: list[Json],
    address: str,
    port: int,
    default_task: str | None,
) -> tuple[Json, CheckRestart | None]:
    name = env.replace(str(check.get("Name") or f'service: "{service["Name"]}" check'))
    kind = str(check.get("Type") or "")
    interval_ns = int(check.get("Interval") or 10_000_000_000)
    timeout_ns = int(check.get("Timeout") or 0)
    cid = check_id(sid, check)
    reg: Json = {"CheckID": cid, "Name": name, "Interval": go_duration(interval_ns)}
    if timeout_ns:
        reg["Timeout"] = go_duration(timeout_ns)
    if check.get("InitialStatus"):
        reg["Status"] = check["InitialStatus"]
    for key in ("SuccessBeforePassing", "FailuresBeforeCritical"):
        if check.get(key):
            reg[key] = int(check[key])
    if check.get("PortLabel"):
        address, port = _port(ports, env.replace(str(check["PortLabel"])))
    if kind == "http":
        if not port:
            raise ValueError("http checks require an address")
        protocol = check.get("Protocol") or "http"
        path = env.replace(str(check.get("Path") or ""))
        if path and not path.startswith("/"):
            path = "/" + path
        reg["HTTP"] = f"{protocol}://{address}:{port}{path}"
        if check.get("Method"):
            reg["Method"] = check["Method"]
        if check.get("Header"):
            reg["Header"] = {k: [env.replace(str(v)) for v in vs] for k, vs in check["Header"].items()}
        if check.get("TLSSkipVerify"):
            reg["TLSSkipVerify"] = True
    elif kind == "tcp":
        if not port:
            raise ValueError("tcp checks require an address")
        reg["TCP"] = f"{address}:{port}"
    else:
        raise ValueError(f"check type {kind!r} is not supported by the Nomad stand-in (http, tcp)")
    watch = None
    restart = check.get("CheckRestart") or service.get("CheckRestart")
    if restart and int(restart.get("Limit") or 0) > 0:
        task = check.get("TaskName") or service.get("TaskName") or default_task
        if task:
            # Grace and the deadline run on the stand-in's clock, like every other delay here;
            # Consul runs the check itself on real time, so a sped-up clock restarts after
            # fewer real check runs than Limit would suggest.
            grace = int(restart.get("Grace") if restart.get("Grace") is not None else 1_000_000_000)
            limit = int(restart["Limit"])
            watch = CheckRestart(
                check_id=cid,
                check_name=name,
                task=str(task),
                grace=grace / 1e9,
                time_limit=interval_ns * (limit - 1) / 1e9,
                ignore_warnings=bool(restart.get("IgnoreWarnings")),
            )
    return reg, watch


Restarter = Callable[[str, str], Coroutine[Any, Any, None]]  # (task, reason) -> restart that task


class ServiceRegistry:
    """Registers allocations' services in the local Consul agent, keeps them there, and
    watches their checks for `check_restart`.

    Like Nomad's service client it remembers what should be registered and re-syncs
    periodically, so a Consul agent that restarts (a dev agent comes back empty) gets every
    running replica back without any task restarting.
    """

    def __init__(self, consul_url: str | None, clock: Clock) -> None:
        self.consul_url = consul_url.rstrip("/") if consul_url else None
        self.clock = clock
        self._client: httpx.AsyncClient | None = None
        self._desired: dict[str, Registration] = {}
        # check ID -> (alloc ID, watch, restarter)
        self._watches: dict[str, tuple[str, CheckRestart, Restarter]] = {}
        self._watcher: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        # The agent's check statuses as last read, and each allocation's check IDs then, for
        # allocation health (deployments).
        self._statuses: dict[str, str] = {}
        self._checks_by_alloc: dict[str, list[str]] = {}

    @property
    def enabled(self) -> bool:
        return self.consul_url is not None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {}
            token = os.environ.get("CONSUL_HTTP_TOKEN")
            if token:
                headers["X-Consul-Token"] = token
            # CONSUL_CACERT as the consul CLI reads it, for a Consul that serves HTTPS.
            ca = os.environ.get("CONSUL_CACERT")
            tls: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
            self._client = httpx.AsyncClient(
                base_url=self.consul_url or "", timeout=10.0, headers=headers, verify=tls
            )
        return self._client

    async def register(self, reg: Registration, alloc_id: str, restarter: Restarter) -> None:
        """Register now; if Consul refuses or cannot be reached, the periodic sync retries."""
        if not self.enabled:
            return
        self._desired[reg.service_id] = reg
        await self._put_registration(reg)
        self.watch(reg, alloc_id, restarter)
        if self._syncer is None or self._syncer.done():
            self._syncer = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _put_registration(self, reg: Registration) -> bool:
        try:
            resp = await self._http().put("/v1/agent/service/register", json=reg.body)
        except httpx.HTTPError as exc:
            log.warning("consul: registering %s failed, will retry: %s", reg.service_id, exc)
            return False
        if resp.status_code != 200:
            log.error(
                "consul rejected service %s: HTTP %s %s", reg.service_id, resp.status_code, resp.text.strip()
            )
            return False
        return True

    def watch(self, reg: Registration, alloc_id: str, restarter: Restarter, task: str | None = None) -> None:
        """(Re)start watching the registration's checks (only those restarting `task`, if
        given) with a fresh grace period, as a task's start does in Nomad."""
        if not self.enabled or reg.service_id not in self._desired:
            return
        now = self.clock.now()
        for watch in reg.watches:
            if task is None or watch.task == task:
                watch.arm(now)
                self._watches[watch.check_id] = (alloc_id, watch, restarter)
        if self._watches and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch_loop())

    async def deregister(self, reg: Registration) -> None:
        for watch in reg.watches:
            self._watches.pop(watch.check_id, None)
        if self._desired.pop(reg.service_id, None) is None:
            return
        await self._put_deregistration(reg.service_id)

    async def _put_deregistration(self, service_id: str) -> None:
        try:
            resp = await self._http().put(f"/v1/agent/service/deregister/{service_id}")
            if resp.status_code != 200:
                log.warning("consul: deregistering %s: HTTP %s %s", service_id, resp.status_code, resp.text)
        except httpx.HTTPError as exc:
            log.warning("consul: deregistering %s failed: %s", service_id, exc)

    async def _sync_loop(self) -> None:
        while self._desired:
            await asyncio.sleep(max(MIN_SYNC_REAL_SECONDS, SYNC_SECONDS / self.clock.speed))
            try:
                resp = await self._http().get("/v1/agent/services")
                resp.raise_for_status()
                present = set(resp.json())
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("consul: periodic sync could not list services: %s", exc)
                continue
            for sid, reg in list(self._desired.items()):
                if sid not in present and self._desired.get(sid) is reg:
                    log.info("consul: service %s missing from the agent; registering it again", sid)
                    await self._put_registration(reg)

    async def _watch_loop(self) -> None:
        failed_before = False
        while self._watches:
            await asyncio.sleep(max(MIN_POLL_REAL_SECONDS, POLL_SECONDS / self.clock.speed))
            try:
                resp = await self._http().get("/v1/agent/checks")
                resp.raise_for_status()
                statuses = {cid: c.get("Status", "") for cid, c in resp.json().items()}
                failed_before = False
            except (httpx.HTTPError, ValueError) as exc:
                if not failed_before:
                    log.error("consul: failed to retrieve check statuses: %s", exc)
                failed_before = True
                continue
            self._apply(statuses, self.clock.now())

    def _apply(self, statuses: dict[str, str], now: float) -> None:
        """watcher.go `interval` and `restarter.apply`: one restart per task per poll."""
        restarted: set[tuple[str, str]] = set()
        for cid, (alloc_id, watch, restarter) in list(self._watches.items()):
            key = (alloc_id, watch.task)
            if key in restarted:
                self._watches.pop(cid, None)
                continue
            status = statuses.get(cid)
            if status is None:
                continue
            if status not in ("critical", "warning") or (status == "warning" and watch.ignore_warnings):
                watch.unhealthy_since = None
                continue
            if now < watch.grace_until:
                continue
            if watch.unhealthy_since is None:
                watch.unhealthy_since = now
            if now >= watch.unhealthy_since + watch.time_limit:
                # The check is watched again when the task starts and registers it anew.
                self._watches.pop(cid, None)
                restarted.add(key)
                reason = f'healthcheck: check "{watch.check_name}" unhealthy'
                task = asyncio.get_running_loop().create_task(restarter(watch.task, reason))
                self._restarts.add(task)
                task.add_done_callback(self._restarts.discard)
        for cid, (alloc_id, watch, _) in list(self._watches.items()):
            if (alloc_id, watch.task) in restarted:
                self._watches.pop(cid, None)

    async def refresh_check_statuses(self) -> None:
        """Read the agent's check statuses for `alloc_checks`; a failed read keeps the last."""
        by_alloc: dict[str, list[str]] = {}
        for sid, reg in self._desired.items():
            # Service IDs are `_nomad-task-<alloc UUID>-...`.
            alloc_id = sid[len(TASK_PREFIX) : len(TASK_PREFIX) + 36]
            by_alloc.setdefault(alloc_id, []).extend(str(c["CheckID"]) for c in reg.body.get("Checks") or [])
        try:
            resp = await self._http().get("/v1/agent/checks")
            resp.raise_for_status()
            self._statuses = {cid: c.get("Status", "") for cid, c in resp.json().items()}
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("consul: reading check statuses for allocation health: %s", exc)
        self._checks_by_alloc = by_alloc

    def alloc_checks(self, alloc_id: str) -> tuple[int, list[str]]:
        """(checks registered for the allocation, their statuses), as of the last read."""
        ids = self._checks_by_alloc.get(alloc_id, [])
        return len(ids), [self._statuses.get(cid, "") for cid in ids]

    async def close(self) -> None:
        """Deregister whatever is still registered and stop watching."""
        self._watches.clear()
        for task in (self._watcher, self._syncer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self.enabled:
            for sid in list(self._desired):
                await self._put_deregistration(sid)
        self._desired.clear()
        if self._client is not None:
            await self._client.aclose()
            self._client = None
