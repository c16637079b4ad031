"""What the router knows about the fleet: replicas from Consul's catalog and its checks that are
not passing (router/catalog.py), model state and model definitions from Consul KV, each kept
current by its own blocking-query loop (`nomad_driver.blocking.Watch`, the watcher's, over the
one Consul client, `nomad_driver.consul`).

Requests read the latest immutable `Snapshot` and never wait on Consul. When Consul goes away
the loops keep retrying with jittered backoff and the router keeps serving from the snapshot it
last read: replicas that were healthy a minute ago are a far better bet than refusing every
request, and the router's own ejection of replicas that fail requests covers the rest. `/healthz`
and `llmgw_router_consul_up` say that it is flying blind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nomad_driver.blocking import Watch, backoff_delay
from nomad_driver.config_kv import CONFIG_PREFIX, LEGACY_MODELS_KEY, StoredDefinitions, config_entries
from nomad_driver.consul import Consul, ConsulError, ConsulUnavailable, KVEntry
from nomad_driver.spec import Model, SpecError, parse_models
from nomad_driver.state import STATE_PREFIX, MalformedState, ModelState, parse_state, state_key
from router.catalog import Fleet, Key, Replica, health_statuses, parse_instances, parse_not_passing
from router.config import ConsulSettings

log = logging.getLogger("llmgw.router.discovery")

# The checks discovery reads: the engines' and the nodes' own (serfHealth, maintenance) that are
# not passing; a large cluster's other failing services are not the router's to read.
NOT_PASSING = 'Status != "passing" and (ServiceName == "{service}" or ServiceID == "")'
# Past this many instances to confirm, one unfiltered read of the service is cheaper than a
# filter Consul must evaluate term by term.
CONFIRM_FILTER_MAX = 50

# `ConsulUnavailable` is the shared client's; router modules name it from here, beside the
# snapshot it guards.
__all__ = ["ConsulUnavailable", "Discovery", "Key", "Replica", "Snapshot", "parse_states"]


@dataclass(frozen=True)
class InstancesReading:
    entries: tuple[dict[str, Any], ...]  # the catalog's instances of the engine service
    checks_index: int
    checks: tuple[dict[str, Any], ...]  # every check not passing, read right after them


@dataclass(frozen=True)
class ChecksReading:
    checks: tuple[dict[str, Any], ...]  # every check not passing
    # The instances this reading would put back in rotation, and their health read after it
    # (one missing is gone).
    checked: frozenset[Key] = frozenset()
    fresh: Mapping[Key, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    replicas: Mapping[str, tuple[Replica, ...]] = field(default_factory=dict)
    ready: Mapping[str, tuple[Replica, ...]] = field(default_factory=dict)
    by_key: Mapping[Key, Replica] = field(default_factory=dict)
    states: Mapping[str, ModelState] = field(default_factory=dict)
    models: Mapping[str, Model] = field(default_factory=dict)
    # Where the definitions came from, and why the latest text was not used if it was bad.
    models_origin: str = ""
    models_error: str = ""

    def known_models(self) -> set[str]:
        """Defined models, plus any model a replica serves without a definition (an engine
        registered by hand still gets traffic)."""
        return set(self.models) | set(self.replicas)

    def serving(self, model: str) -> tuple[Replica, ...]:
        """The ready replicas new requests go to: those of the model's current definition when
        any is ready (a rollout runs the previous one beside it until then), else all."""
        ready = self.ready.get(model, ())
        definition = self.models.get(model)
        if definition is None or len(ready) < 2:
            return ready
        newest = tuple(r for r in ready if r.def_hash == definition.def_hash)
        return newest or ready


# Each key's last parse, by its ModifyIndex: key -> (index, state or None for malformed).
ParsedStates = dict[str, tuple[int, ModelState | None]]


def parse_states(entries: Iterable[KVEntry], parsed: ParsedStates | None = None) -> dict[str, ModelState]:
    """`/v1/kv/llmgw/state/?recurse` -> state by model; a malformed value is logged and read as
    "no state", so the router keeps serving that model rather than refusing it on garbage.

    With `parsed` (updated in place), a key whose ModifyIndex has not moved is not parsed
    again: each state the leader writes is a read of the whole prefix, and at a thousand models
    parsing every state anew cost each router about 15 ms of CPU per write."""
    states: dict[str, ModelState] = {}
    seen: ParsedStates = {}
    for entry in entries:
        model = entry.key[len(STATE_PREFIX) :]
        if not entry.key.startswith(STATE_PREFIX) or not model or "/" in model:
            continue
        held = parsed.get(entry.key) if parsed is not None else None
        if held is not None and held[0] == entry.modify_index:
            state = held[1]
        else:
            try:
                state = parse_state(entry.key, entry.value)
            except MalformedState as exc:
                log.warning("%s; treating model %s as having no state", exc, model)
                state = None
        seen[entry.key] = (entry.modify_index, state)
        if state is not None:
            states[model] = state
    if parsed is not None:
        parsed.clear()
        parsed.update(seen)
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
        # A pool smaller than the watcher's: four long polls and the activity writes. The
        # client outwaits each blocking read (its wait plus Consul's jitter), so a healthy watch
        # is never cut by its own timeout.
        self.consul = Consul(
            settings.addr,
            token=settings.token,
            timeout=10.0,
            ssl_context=settings.ssl_context(),
            max_connections=16,
        )
        # The instances, each reading with the checks read right after it (so an instance is
        # never taken for passing before its checks are known), and the checks on their own.
        self.replica_watch: Watch[InstancesReading] = Watch(
            "replicas", self._fetch_instances, on_change=self._apply_instances, logger=log
        )
        self.checks_watch: Watch[ChecksReading] = Watch(
            "checks", self._fetch_checks, on_change=self._apply_checks, logger=log
        )
        self.state_watch: Watch[tuple[KVEntry, ...]] = Watch(
            "states", self._fetch_states, on_change=self._apply_states, logger=log
        )
        self.models_watch: Watch[dict[str, KVEntry]] = Watch(
            "models", self._fetch_models, on_change=self._apply_models, logger=log
        )
        self.watches = {
            w.name: w for w in (self.replica_watch, self.checks_watch, self.state_watch, self.models_watch)
        }
        self.fleet = Fleet()
        self._checks_index = 0  # of the checks the fleet shows
        self._on_change = on_change
        self._waiters: dict[str, asyncio.Event] = {}
        self._parsed_states: ParsedStates = {}
        # Blocking reads of one model's state under way (`read_state`): each holds one of the
        # client's connections, which the watches and the writes need too.
        self.state_reads = 0
        self._tasks: list[asyncio.Task[None]] = []
        # Times each watch died and was started again (llmgw_router_watch_restarts_total).
        self.restarts: Counter[str] = Counter()
        self._file_models: tuple[Mapping[str, Model], str, str] | None = None
        self._stored = StoredDefinitions()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        for watch in self.watches.values():
            self._tasks.append(asyncio.create_task(self._supervise(watch)))

    async def _supervise(self, watch: Watch[Any]) -> None:
        """Run a watch for ever. A watch survives Consul's failures on its own; what ends it is
        a bug in applying an answer, and a watch that ended silently froze its part of the
        snapshot while /healthz said ok. So it is logged, shown down, and started again (from
        index 0, so it reads everything afresh)."""
        deaths = 0
        while True:
            try:
                await watch.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                deaths += 1
                self.restarts[watch.name] += 1
                watch.ok = False
                watch.error = f"the watch died and is restarting: {type(exc).__name__}: {exc}"
                log.error(
                    "event=watch_died watch=%s restarts=%d error=%r (serving from the last snapshot)",
                    watch.name,
                    deaths,
                    f"{type(exc).__name__}: {exc}",
                    exc_info=exc,
                )
                # At least a second: long enough to be seen in /healthz, short enough to matter little.
                await asyncio.sleep(1.0 + backoff_delay(deaths))

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

    async def read_state(self, model: str, index: int, wait_s: float) -> tuple[int, ModelState | None]:
        """One read of `llmgw/state/<model>` newer than `index` (0: at once): what a request
        waiting on an activation reads, so that the attempt's answer reaches it as soon as the
        watcher writes it, not behind the states watch's read of every model's state."""
        self.state_reads += 1
        try:
            new_index, entries = await self.consul.kv_get(state_key(model), index=index, wait_s=wait_s)
        finally:
            self.state_reads -= 1
        return new_index, parse_states(entries).get(model)

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

    async def _fetch_instances(self, index: int) -> tuple[int, InstancesReading]:
        # Consul moves this index when instances come or go, and at a change of their checks too.
        new_index, entries = await self.consul.read_list(
            f"/v1/catalog/service/{self.settings.service}", index=index, wait_s=self.settings.wait_s
        )
        checks_index, checks = await self._read_not_passing(0)
        return new_index, InstancesReading(tuple(entries), checks_index, tuple(checks))

    async def _fetch_checks(self, index: int) -> tuple[int, ChecksReading]:
        new_index, checks = await self._read_not_passing(index)
        not_passing = parse_not_passing(checks)
        checked: frozenset[Key] = frozenset()
        fresh: dict[Key, str] = {}
        # Confirm what this reading would put back in rotation; again if a catalog reading
        # brought new instances meanwhile. One that is still unconfirmed keeps its standing.
        for _ in range(3):
            keys = self.fleet.improving(not_passing)
            if keys <= checked:
                break
            checked |= keys
            fresh = await self._read_health(set(checked))
        return new_index, ChecksReading(tuple(checks), checked, fresh)

    async def _read_health(self, keys: set[Key]) -> dict[Key, str]:
        """The current health of these instances, to confirm one is back before routing to it."""
        params = {}
        if len(keys) <= CONFIRM_FILTER_MAX:
            ids = sorted({service_id for _, service_id in keys})
            params["filter"] = " or ".join(f"Service.ID == {json.dumps(i)}" for i in ids)
        _, entries = await self.consul.read_list(f"/v1/health/service/{self.settings.service}", params=params)
        return health_statuses(entries)

    async def _read_not_passing(self, index: int) -> tuple[int, list[dict[str, Any]]]:
        """Every check not passing, the nodes' own included: as long as the trouble, whatever
        the size of the fleet (it wakes at any check's change, and answers only these)."""
        return await self.consul.read_list(
            "/v1/health/state/any",
            index=index,
            wait_s=self.settings.wait_s if index else None,
            params={"filter": NOT_PASSING.format(service=self.settings.service)},
        )

    async def _fetch_states(self, index: int) -> tuple[int, tuple[KVEntry, ...]]:
        new_index, entries = await self.consul.kv_get(
            STATE_PREFIX, recurse=True, index=index, wait_s=self.settings.wait_s
        )
        return new_index, tuple(entries)

    async def _fetch_models(self, index: int) -> tuple[int, dict[str, KVEntry]]:
        # All of `llmgw/config/` in one blocking read: the per-model keys, the profiles, the
        # apply's commit key and the legacy single key (config_kv.py); empty while none exists.
        new_index, entries = await self.consul.kv_get(
            CONFIG_PREFIX, recurse=True, index=index, wait_s=self.settings.wait_s
        )
        return new_index, config_entries(entries)

    # -- turning answers into the snapshot ----------------------------------------------------

    def _apply_instances(self) -> None:
        if self.replica_watch.snapshot is None:
            return
        reading = self.replica_watch.snapshot.data
        if reading.checks_index >= self._checks_index:
            self._checks_index = reading.checks_index
            not_passing = parse_not_passing(reading.checks)
        else:
            # The checks watch has shown newer checks since these were read: an older reading
            # must not put back in rotation an instance that has since failed.
            not_passing = dict(self.fleet.not_passing)
        self.fleet.set_instances(parse_instances(reading.entries), not_passing)
        self._publish_fleet()

    def _apply_checks(self) -> None:
        if self.checks_watch.snapshot is None:
            return
        reading = self.checks_watch.snapshot
        if reading.index < self._checks_index:
            return  # older than the checks the last instances reading brought
        self._checks_index = reading.index
        data = reading.data
        changed = self.fleet.set_not_passing(parse_not_passing(data.checks), data.checked, data.fresh)
        if changed:
            self._publish_fleet()

    def _publish_fleet(self) -> None:
        fleet = self.fleet
        self._publish(replace(self.snapshot, replicas=fleet.replicas, ready=fleet.ready, by_key=fleet.by_key))

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
        self._publish(replace(self.snapshot, states=parse_states(entries, self._parsed_states)))

    def _apply_models(self) -> None:
        entries = self.models_watch.snapshot.data if self.models_watch.snapshot else {}
        stored = self._stored
        stored.read(entries)
        if stored.missing and self.snapshot.models_origin.startswith("consul:"):
            # The keys vanished (a Consul that lost its data): keep routing on what was defined
            # rather than answer 404 for every model; the leading watcher writes them back.
            # Removing models is done by applying a file without them, not by deleting keys.
            error = f"consul:{CONFIG_PREFIX}: the definitions are missing; keeping the {len(self.snapshot.models)} last read"
            if self.snapshot.models_error != error:
                log.warning(error)
            self._publish(replace(self.snapshot, models_error=error))
            return
        if not stored.layout and not stored.problems:
            models, origin, error = self._models_from_file()
            self._publish(replace(self.snapshot, models=models, models_origin=origin, models_error=error))
            return
        # A bad key keeps what last made sense (its model's last good definition, or all of
        # them for a bad profiles key or file); worded as the watcher words it, key first.
        origin = f"consul:{LEGACY_MODELS_KEY if stored.layout == 'legacy key' else CONFIG_PREFIX}"
        if stored.problems:
            log.error("models in %s are not all valid, keeping the previous ones: %s", origin, stored.problem)
        self._publish(
            replace(
                self.snapshot, models=dict(stored.models), models_origin=origin, models_error=stored.problem
            )
        )

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
