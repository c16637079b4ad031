"""What the router knows about the fleet: replicas from Consul's health API, model state and
model definitions from Consul KV, each kept current by its own blocking-query loop.

Requests read the latest immutable `Snapshot` and never wait on Consul. When Consul goes away
the loops keep retrying with jittered backoff and the router keeps serving from the snapshot it
last read: replicas that were healthy a minute ago are a far better bet than refusing every
request, and the router's own ejection of replicas that fail requests covers the rest. `/healthz`
and `llmgw_router_consul_up` say that it is flying blind.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from nomad_driver.blocking import backoff_delay, next_index
from nomad_driver.safeload import json_loads
from nomad_driver.spec import Model, SpecError, parse_models
from nomad_driver.state import CONFIG_MODELS_KEY, STATE_PREFIX, MalformedState, ModelState, parse_state
from router.config import ConsulSettings

log = logging.getLogger("llmgw.router.discovery")

# Consul's docs ask blocking loops to rate-limit rather than sleep; a floor between calls keeps
# a churning catalog from turning the loop into a busy poll while still reacting in tens of ms.
MIN_CALL_INTERVAL_S = 0.05
BACKOFF_CAP_S = 10.0
CONSUL_ANSWER_MAX_BYTES = 256 * 1024 * 1024


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


@dataclass
class WatchStatus:
    name: str
    index: int = 0
    last_success: float | None = None  # monotonic
    ok: bool = False
    error: str = ""
    reads: int = 0


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


def parse_states(entries: Any) -> dict[str, ModelState]:
    """`/v1/kv/llmgw/state/?recurse` -> state by model; a malformed value is logged and read as
    "no state", so the router keeps serving that model rather than refusing it on garbage."""
    if entries is None:
        return {}
    if not isinstance(entries, list):
        raise ValueError(f"expected a JSON list of KV entries, got {type(entries).__name__}")
    states: dict[str, ModelState] = {}
    for entry in entries:
        key = str(entry.get("Key", ""))
        model = key[len(STATE_PREFIX) :]
        if not model or "/" in model:
            continue
        try:
            states[model] = parse_state(key, _kv_value(entry))
        except MalformedState as exc:
            log.warning("%s; treating model %s as having no state", exc, model)
    return states


def _kv_value(entry: Mapping[str, Any]) -> bytes | None:
    value = entry.get("Value")
    if value is None:
        return None
    return base64.b64decode(value)


class ConsulUnavailable(RuntimeError):
    pass


class Discovery:
    """The three watches and the snapshot they build. Also the router's one Consul writer
    (activity timestamps), since it already holds the session and the token."""

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
        self.watches = {name: WatchStatus(name) for name in ("replicas", "states", "models")}
        self._on_change = on_change
        self._waiters: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None
        self._file_models: tuple[Mapping[str, Model], str, str] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        headers = {"X-Consul-Token": self.settings.token} if self.settings.token else {}
        self._http = aiohttp.ClientSession(
            base_url=self.settings.addr,
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=self.settings.ssl_context() or False, limit=16),
            # Longer than the blocking wait plus Consul's jitter (wait/16), so a healthy watch
            # is never cut by its own client.
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=5, sock_read=self.settings.wait_s * 1.2 + 5
            ),
        )
        loops: list[tuple[str, str, dict[str, str], Callable[[Any], None]]] = [
            ("replicas", f"/v1/health/service/{self.settings.service}", {}, self._apply_health),
            ("states", f"/v1/kv/{STATE_PREFIX}", {"recurse": "true"}, self._apply_states),
            ("models", f"/v1/kv/{CONFIG_MODELS_KEY}", {}, self._apply_models),
        ]
        for name, path, params, apply in loops:
            task = asyncio.create_task(self._watch(self.watches[name], path, params, apply))
            self._tasks.append(task)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._http is not None:
            await self._http.close()
            self._http = None

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
        if self._http is None:
            raise ConsulUnavailable("discovery is not started")
        try:
            async with self._http.put(
                f"/v1/kv/{key}", data=value.encode(), timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise ConsulUnavailable(f"PUT {key} at {self.settings.addr}: HTTP {resp.status}: {text}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ConsulUnavailable(
                f"PUT {key} at {self.settings.addr}: {exc or type(exc).__name__}"
            ) from exc

    # -- the loops ----------------------------------------------------------------------------

    async def _watch(
        self, status: WatchStatus, path: str, params: Mapping[str, str], apply: Callable[[Any], None]
    ) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                index_header, body = await self._read(path, {**params, **self._blocking(status)})
                apply(body)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                message = f"{path} at {self.settings.addr}: {exc or type(exc).__name__}"
                if status.ok or message != status.error:
                    log.warning(
                        "consul watch %s failed (serving from the last snapshot): %s", status.name, message
                    )
                status.ok = False
                status.error = message
                # Start over from a plain read: a Consul that restarted has a lower index, and a
                # blocking read with the old one would be held for the whole wait (a minute of
                # stale replicas, found by bench/soak.py).
                status.index = 0
                await asyncio.sleep(backoff_delay(failures, cap=BACKOFF_CAP_S))
                continue
            if not status.ok and status.error:
                log.info("consul watch %s reads again", status.name)
            failures = 0
            status.index = next_index(status.index, index_header)
            status.ok = True
            status.error = ""
            status.reads += 1
            status.last_success = time.monotonic()
            elapsed = time.monotonic() - started
            if elapsed < MIN_CALL_INTERVAL_S:
                await asyncio.sleep(MIN_CALL_INTERVAL_S - elapsed)

    def _blocking(self, status: WatchStatus) -> dict[str, str]:
        if status.index <= 0:
            return {}
        return {"index": str(status.index), "wait": f"{self.settings.wait_s:.0f}s"}

    async def _read(self, path: str, params: Mapping[str, str]) -> tuple[str | None, Any]:
        assert self._http is not None
        async with self._http.get(path, params=params) as resp:
            index = resp.headers.get("X-Consul-Index")
            if resp.status == 404:
                # A KV key or prefix that does not exist yet; the index is still valid to block on.
                return index, None
            if resp.status != 200:
                text = (await resp.text())[:200]
                raise ConsulUnavailable(f"HTTP {resp.status}: {text}")
            # Consul's own answer; the values inside are read by parse_state and parse_models.
            return index, json_loads(await resp.read(), path, max_bytes=CONSUL_ANSWER_MAX_BYTES)

    # -- turning answers into the snapshot ----------------------------------------------------

    def _apply_health(self, body: Any) -> None:
        replicas = parse_health(body if body is not None else [])
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

    def _apply_states(self, body: Any) -> None:
        self._publish(replace(self.snapshot, states=parse_states(body)))

    def _apply_models(self, body: Any) -> None:
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
            raw = _kv_value(body[0]) if isinstance(body, list) and body else None
            text = raw.decode("utf-8") if raw else ""
            models = parse_models(text, origin=origin).models
        except (SpecError, UnicodeDecodeError, ValueError) as exc:
            # Keep routing on the definitions that last made sense; a typo in the models file
            # must not make the router forget every model.
            detail = str(exc).replace("\n", "; ")
            log.error("models in %s are not valid, keeping the previous ones: %s", origin, detail)
            self._publish(replace(self.snapshot, models_error=f"{origin}: {detail}"))
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
