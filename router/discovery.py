"""What the router knows about the fleet: replicas from Consul's health API, model state and
model definitions from Consul KV, each kept current by its own blocking-query loop
(`nomad_driver.blocking.Watch`, the watcher's, over the one Consul client, `nomad_driver.consul`).

Requests read the latest immutable `Snapshot` and never wait on Consul. When Consul goes away
the loops keep retrying with jittered backoff and the router keeps serving from the snapshot it
last read: replicas that were healthy a minute ago are a far better bet than refusing every
request, and the router's own ejection of replicas that fail requests covers the rest. `/healthz`
and `llmgw_router_consul_up` say that it is flying blind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nomad_driver.blocking import Watch
from nomad_driver.consul import Consul, ConsulError, ConsulUnavailable, KVEntry
from nomad_driver.spec import Model, SpecError, decode_models_text, parse_models, problem_line
from nomad_driver.state import CONFIG_MODELS_KEY, STATE_PREFIX, MalformedState, ModelState, parse_state
from router.config import ConsulSettings

log = logging.getLogger("llmgw.router.discovery")

# `ConsulUnavailable` is the shared client's; router modules name it from here, beside the
# snapshot it guards.
__all__ = ["ConsulUnavailable", "Discovery", "Replica", "Snapshot", "parse_health", "parse_states"]


@dataclass(frozen=True, slots=True)
class Replica:
    id: str
    model: str
    host: str
    port: int
    def_hash: str
    # passing | warning | critical, the worst of the instance's checks (node checks included).
    status: str

    @property
    def ready(self) -> bool:
        # Warning counts as not ready: an engine that says it is degraded should not get new
        # work while a passing replica exists, and Consul's own `?passing` reads it the same way.
        return self.status == "passing"

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class Snapshot:
    replicas: Mapping[str, tuple[Replica, ...]] = field(default_factory=dict)
    ready: Mapping[str, tuple[Replica, ...]] = field(default_factory=dict)
    by_id: Mapping[str, Replica] = field(default_factory=dict)
    states: Mapping[str, ModelState] = field(default_factory=dict)
    models: Mapping[str, Model] = field(default_factory=dict)
    # Where the definitions came from, and why the latest text was not used if it was bad.
    models_origin: str = ""
    models_error: str = ""

    def known_models(self) -> set[str]:
        """Defined models, plus any model a replica serves without a definition (an engine
        registered by hand still gets traffic)."""
        return set(self.models) | set(self.replicas)


def parse_health(entries: Any) -> dict[str, tuple[Replica, ...]]:
    """`/v1/health/service/<name>` entries -> replicas by model. Entries without a model or an
    address are skipped with a log line: one bad registration must not hide the others."""
    if not isinstance(entries, list):
        raise ValueError(f"expected a JSON list of service entries, got {type(entries).__name__}")
    by_model: dict[str, list[Replica]] = {}
    for entry in entries:
        try:
            replica = _replica(entry)
        except (TypeError, ValueError, AttributeError) as exc:
            log.warning("skipping malformed llmgw-engine entry %.200r: %s", entry, exc)
            continue
        if replica is not None:
            by_model.setdefault(replica.model, []).append(replica)
    return {model: tuple(sorted(rs, key=lambda r: r.id)) for model, rs in by_model.items()}


def _replica(entry: Mapping[str, Any]) -> Replica | None:
    service = entry.get("Service") or {}
    node = entry.get("Node") or {}
    meta = service.get("Meta") or {}
    model = meta.get("model") or ""
    if not model:
        for tag in service.get("Tags") or ():
            if isinstance(tag, str) and tag.startswith("model="):
                model = tag[len("model=") :]
                break
    if not model:
        log.warning("llmgw-engine instance %s has no model meta or model= tag; ignored", service.get("ID"))
        return None
    # An empty service address means "the node's address", as Consul's own DNS reads it.
    host = service.get("Address") or node.get("Address") or ""
    port = int(service.get("Port") or 0)
    if not host or port <= 0:
        log.warning("llmgw-engine instance %s has no address or port; ignored", service.get("ID"))
        return None
    statuses = {c.get("Status") for c in entry.get("Checks") or () if isinstance(c, dict)}
    if statuses - {"passing", "warning"}:
        status = "critical"
    elif "warning" in statuses:
        status = "warning"
    else:
        status = "passing"
    return Replica(
        id=str(service.get("ID") or f"{host}:{port}"),
        model=str(model),
        host=str(host),
        port=port,
        def_hash=str(meta.get("def_hash") or ""),
        status=status,
    )


def parse_states(entries: Iterable[KVEntry]) -> dict[str, ModelState]:
    """`/v1/kv/llmgw/state/?recurse` -> state by model; a malformed value is logged and read as
    "no state", so the router keeps serving that model rather than refusing it on garbage."""
    states: dict[str, ModelState] = {}
    for entry in entries:
        model = entry.key[len(STATE_PREFIX) :]
        if not entry.key.startswith(STATE_PREFIX) or not model or "/" in model:
            continue
        try:
            states[model] = parse_state(entry.key, entry.value)
        except MalformedState as exc:
            log.warning("%s; treating model %s as having no state", exc, model)
    return states


class Discovery:
    """The three watches and the snapshot they build. Also the router's one Consul writer
    (activity timestamps, requests in flight), since it already holds the client."""

    def __init__(
        self,
        settings: ConsulSettings,
        *,
        models_file: str = "",
        on_change: Callable[[Snapshot, Snapshot], None] | None = None,
    ) -> None:
        self.settings = settings
        self.models_file = models_file
        self.snapshot = Snapshot()
        # A pool smaller than the watcher's: three long polls and the activity writes. The
        # client outwaits each blocking read (its wait plus Consul's jitter), so a healthy watch
        # is never cut by its own timeout.
        self.consul = Consul(
            settings.addr,
            token=settings.token,
            timeout=10.0,
            ssl_context=settings.ssl_context(),
            max_connections=16,
        )
        self.replica_watch: Watch[tuple[dict[str, Any], ...]] = Watch(
            "replicas", self._fetch_health, on_change=self._apply_health, logger=log
        )
        self.state_watch: Watch[tuple[KVEntry, ...]] = Watch(
            "states", self._fetch_states, on_change=self._apply_states, logger=log
        )
        self.models_watch: Watch[KVEntry | None] = Watch(
            "models", self._fetch_models, on_change=self._apply_models, logger=log
        )
        self.watches = {w.name: w for w in (self.replica_watch, self.state_watch, self.models_watch)}
        self._on_change = on_change
        self._waiters: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._file_models: tuple[Mapping[str, Model], str, str] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        for watch in self.watches.values():
            self._tasks.append(asyncio.create_task(watch.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.consul.close()

    # -- what the rest of the router reads ---------------------------------------------------

    @property
    def has_snapshot(self) -> bool:
        return all(w.last_success is not None for w in self.watches.values())

    @property
    def consul_up(self) -> bool:
        return all(w.ok for w in self.watches.values())

    def watch_ages(self) -> list[tuple[str, float | None]]:
        return [(w.name, w.last_success) for w in self.watches.values()]

    def oldest_read_age(self) -> float | None:
        lasts = [w.last_success for w in self.watches.values()]
        if any(last is None for last in lasts):
            return None
        return time.monotonic() - min(last for last in lasts if last is not None)

    async def wait_change(self, model: str, timeout: float) -> None:
        """Until anything in the snapshot that concerns `model` may have changed (its replicas,
        its state, the definitions), `notify(model)` is called, or `timeout` passes. Callers
        look at the snapshot again afterwards; a wake-up for nothing costs them one look."""
        event = self._waiters.get(model)
        if event is None:
            event = self._waiters[model] = asyncio.Event()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel (a client
        # that hung up) that lands as the event fires.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()

    def notify(self, model: str) -> None:
        event = self._waiters.pop(model, None)
        if event is not None:
            event.set()

    async def put_kv(self, key: str, value: str, timeout: float = 5.0) -> None:
        """Raises ConsulUnavailable whatever went wrong: for the router a write Consul refused
        and one it never got are the same, the value is written again at the next interval."""
        try:
            await self.consul.kv_put(key, value, timeout=timeout)
        except ConsulUnavailable:
            raise
        except ConsulError as exc:
            raise ConsulUnavailable(str(exc)) from exc

    # -- the loops: one blocking read each (nomad_driver.blocking.Watch runs them) ------------

    async def _fetch_health(self, index: int) -> tuple[int, tuple[dict[str, Any], ...]]:
        new_index, entries = await self.consul.health_service(
            self.settings.service, index=index, wait_s=self.settings.wait_s
        )
        return new_index, tuple(entries)

    async def _fetch_states(self, index: int) -> tuple[int, tuple[KVEntry, ...]]:
        new_index, entries = await self.consul.kv_get(
            STATE_PREFIX, recurse=True, index=index, wait_s=self.settings.wait_s
        )
        return new_index, tuple(entries)

    async def _fetch_models(self, index: int) -> tuple[int, KVEntry | None]:
        # None: the key does not exist (yet); the index is still valid to block on.
        new_index, entries = await self.consul.kv_get(
            CONFIG_MODELS_KEY, index=index, wait_s=self.settings.wait_s
        )
        return new_index, entries[0] if entries else None

    # -- turning answers into the snapshot ----------------------------------------------------

    def _apply_health(self) -> None:
        replicas = parse_health(list(self.replica_watch.snapshot.data) if self.replica_watch.snapshot else [])
        ready = {m: tuple(r for r in rs if r.ready) for m, rs in replicas.items()}
        ready = {m: rs for m, rs in ready.items() if rs}
        by_id = {r.id: r for rs in replicas.values() for r in rs}
        self._publish(replace(self.snapshot, replicas=replicas, ready=ready, by_id=by_id))

    def _publish(self, snapshot: Snapshot) -> None:
        before, self.snapshot = self.snapshot, snapshot
        if self._on_change is not None:
            self._on_change(before, snapshot)
        # Every waiting request looks again: a replica became ready, the model was parked or
        # found unplaceable, or its definition went away. Consul changes are rare next to
        # requests, so waking all of them is cheaper than working out which.
        waiters, self._waiters = self._waiters, {}
        for event in waiters.values():
            event.set()

    def _apply_states(self) -> None:
        entries = self.state_watch.snapshot.data if self.state_watch.snapshot else ()
        self._publish(replace(self.snapshot, states=parse_states(entries)))

    def _apply_models(self) -> None:
        body = self.models_watch.snapshot.data if self.models_watch.snapshot else None
        if body is None and self.snapshot.models and self.snapshot.models_origin.startswith("consul:"):
            # The key vanished (a Consul that lost its data): keep routing on what was defined
            # rather than answer 404 for every model; the leading watcher writes it back.
            # Removing models is done by applying a file without them, not by deleting the key.
            error = f"consul:{CONFIG_MODELS_KEY} is missing; keeping the {len(self.snapshot.models)} definitions last read"
            if self.snapshot.models_error != error:
                log.warning(error)
            self._publish(replace(self.snapshot, models_error=error))
            return
        if body is None:
            models, origin, error = self._models_from_file()
            self._publish(replace(self.snapshot, models=models, models_origin=origin, models_error=error))
            return
        origin = f"consul:{CONFIG_MODELS_KEY}"
        try:
            text = decode_models_text(body.value, origin) if body.value else ""
            models = parse_models(text, origin=origin).models
        except (SpecError, ValueError) as exc:
            # Keep routing on the definitions that last made sense; a typo in the models file
            # must not make the router forget every model.
            detail = str(exc).replace("\n", "; ")
            log.error("models in %s are not valid, keeping the previous ones: %s", origin, detail)
            # Worded as the watcher words it (problems about the whole file name it already).
            self._publish(replace(self.snapshot, models_error=problem_line(origin, detail)))
            return
        self._publish(replace(self.snapshot, models=models, models_origin=origin, models_error=""))

    def _models_from_file(self) -> tuple[Mapping[str, Model], str, str]:
        if not self.models_file:
            return {}, "", ""
        if self._file_models is None:
            try:
                text = Path(self.models_file).read_text(encoding="utf-8")
                self._file_models = (parse_models(text, origin=self.models_file).models, self.models_file, "")
            except (OSError, SpecError, UnicodeDecodeError) as exc:
                detail = str(exc).replace("\n", "; ")
                log.error("models file %s: %s", self.models_file, detail)
                self._file_models = ({}, self.models_file, f"{self.models_file}: {detail}")
        return self._file_models
