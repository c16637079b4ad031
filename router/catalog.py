"""The replicas the router may use: the engine service's instances from Consul's catalog, each
given the status of its checks from Consul's list of checks that are not passing.

Two reads instead of one `/v1/health/service` because a blocking read of one service's health
wakes at every change of any of its checks and answers every instance again: at 5,000 instances
one check turning critical cost the router 300 kB and a quarter of a second of CPU
(bench/discovery_bench.py). The catalog answers no checks (though Consul moves its index at a
check's change too, so it wakes then), and the list of checks not passing is as long as the trouble; a change of checks rebuilds only the
models whose instances it touched. An instance counts as passing when no check of its own and
no check of its node is in that list, as Consul's `?passing` reads it.

A check that leaves the list has either passed or gone away with its instance (a task that
stopped is deregistered, checks and all), and the catalog's own answer may come a moment later.
So a change that would put an instance back in rotation is taken only from a fresh read of that
instance's health (`/v1/health/service` filtered to it): an engine that stopped is never routed
to in between.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger("llmgw.router.discovery")

# (node name, service ID); a node's own checks (serfHealth, maintenance) have the service ID "".
Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Replica:
    id: str  # the ServiceID: unique on its node only
    model: str
    host: str
    port: int
    def_hash: str
    # passing | warning | critical, the worst of the instance's checks (node checks included).
    status: str
    node: str = ""

    @property
    def key(self) -> Key:
        # Consul lets two nodes register the same ServiceID (engines registered by hand), so the
        # ID alone would let one model's requests reach the other's engine.
        return (self.node, self.id)

    @property
    def name(self) -> str:
        """How logs and answers name the replica: the ServiceID, with its node when it has one."""
        return f"{self.id}@{self.node}" if self.node else self.id

    @property
    def ready(self) -> bool:
        # Warning counts as not ready: an engine that says it is degraded should not get new
        # work while a passing replica exists, and Consul's own `?passing` reads it the same way.
        return self.status == "passing"

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def parse_instances(entries: Iterable[Any]) -> dict[Key, Replica]:
    """`/v1/catalog/service/<name>` entries -> each instance as a replica whose checks all pass.
    Entries without a model or an address are skipped with a log line: one bad registration
    must not hide the others."""
    out: dict[Key, Replica] = {}
    for entry in entries:
        try:
            replica = _instance(entry)
        except (TypeError, ValueError, AttributeError) as exc:
            log.warning("skipping malformed llmgw-engine entry %.200r: %s", entry, exc)
            continue
        if replica is not None:
            out[replica.key] = replica
    return out


def _instance(entry: Mapping[str, Any]) -> Replica | None:
    meta = entry.get("ServiceMeta") or {}
    model = meta.get("model") or ""
    if not model:
        for tag in entry.get("ServiceTags") or ():
            if isinstance(tag, str) and tag.startswith("model="):
                model = tag[len("model=") :]
                break
    if not model:
        log.warning(
            "llmgw-engine instance %s has no model meta or model= tag; ignored", entry.get("ServiceID")
        )
        return None
    # An empty service address means "the node's address", as Consul's own DNS reads it.
    host = entry.get("ServiceAddress") or entry.get("Address") or ""
    port = int(entry.get("ServicePort") or 0)
    if not host or port <= 0:
        log.warning("llmgw-engine instance %s has no address or port; ignored", entry.get("ServiceID"))
        return None
    return Replica(
        id=str(entry.get("ServiceID") or f"{host}:{port}"),
        model=str(model),
        host=str(host),
        port=port,
        def_hash=str(meta.get("def_hash") or ""),
        status="passing",
        node=str(entry.get("Node") or ""),
    )


def parse_not_passing(checks: Iterable[Any]) -> dict[Key, str]:
    """`/v1/health/state/any?filter=Status != "passing"` -> the worst status by instance (or by
    node, for a node's own checks): warning, or critical for anything else (maintenance)."""
    out: dict[Key, str] = {}
    for check in checks:
        if not isinstance(check, dict):
            continue
        status = check.get("Status")
        if status == "passing":
            continue
        key = (str(check.get("Node") or ""), str(check.get("ServiceID") or ""))
        if status == "warning":
            out.setdefault(key, "warning")
        else:
            out[key] = "critical"
    return out


_RANK = {None: 0, "passing": 0, "warning": 1, "critical": 2}


def worst(statuses: Iterable[str | None]) -> str:
    found = {s for s in statuses if s not in (None, "passing")}
    if found - {"warning"}:
        return "critical"
    return "warning" if found else "passing"


def health_statuses(entries: Iterable[Any]) -> dict[Key, str]:
    """`/v1/health/service/<name>` entries -> each instance's worst check, node checks included."""
    out: dict[Key, str] = {}
    for entry in entries:
        node, service = entry.get("Node"), entry.get("Service")
        if not isinstance(node, dict) or not isinstance(service, dict):
            continue
        checks = [c.get("Status") for c in entry.get("Checks") or () if isinstance(c, dict)]
        out[(str(node.get("Node") or ""), str(service.get("ID") or ""))] = worst(checks)
    return out


def status_of(key: Key, not_passing: Mapping[Key, str]) -> str:
    found = {not_passing.get(key), not_passing.get((key[0], ""))} - {None}
    if found - {"warning"}:
        return "critical"
    return "warning" if found else "passing"


@dataclass
class Fleet:
    """Replicas by model, the ready ones by model and every one by (node, ServiceID), kept from the instances
    and the checks not passing. Each change gives new mappings (a snapshot never changes once
    published), copied shallowly, with only the touched models rebuilt."""

    instances: dict[Key, Replica] = field(default_factory=dict)
    not_passing: dict[Key, str] = field(default_factory=dict)
    replicas: dict[str, tuple[Replica, ...]] = field(default_factory=dict)
    ready: dict[str, tuple[Replica, ...]] = field(default_factory=dict)
    by_key: dict[Key, Replica] = field(default_factory=dict)
    _model_keys: dict[str, list[Key]] = field(default_factory=dict)
    _node_keys: dict[str, list[Key]] = field(default_factory=dict)

    def set_instances(self, instances: dict[Key, Replica], not_passing: dict[Key, str]) -> None:
        """A new catalog reading, with the checks read right after it: everything is rebuilt."""
        self.instances, self.not_passing = instances, not_passing
        self._model_keys, self._node_keys = {}, {}
        for key, replica in instances.items():
            self._model_keys.setdefault(replica.model, []).append(key)
            self._node_keys.setdefault(key[0], []).append(key)
        self.replicas, self.ready, self.by_key = {}, {}, {}
        for model in self._model_keys:
            self._rebuild(model)

    def improving(self, not_passing: Mapping[Key, str]) -> set[Key]:
        """The instances a new reading of the checks would put in better standing: their own
        check or their node's left the list, or went from critical to warning."""
        keys = {k for k, old in self.not_passing.items() if _RANK[not_passing.get(k)] < _RANK[old]}
        out: set[Key] = set()
        for node, service_id in keys:
            if service_id:
                out.add((node, service_id))
            else:
                out.update(self._node_keys.get(node, ()))
        # Only instances whose standing as a whole improves (a node check that clears does not
        # help an instance whose own check still fails).
        return {
            k
            for k in out & self.instances.keys()
            if _RANK[status_of(k, not_passing)] < _RANK[status_of(k, self.not_passing)]
        }

    def set_not_passing(
        self,
        not_passing: dict[Key, str],
        checked: Iterable[Key] = (),
        fresh: Mapping[Key, str] | None = None,
    ) -> bool:
        """A new reading of the checks; whether any replica changed. `checked` are instances
        `improving` named and `fresh` their health read after it: one missing from it is gone,
        one still failing keeps its status. An instance this reading would improve that was not
        checked keeps the standing it had, until a reading that checks it."""
        fresh = fresh or {}
        checked = set(checked)
        not_passing = dict(not_passing)
        for key in self.improving(not_passing) - checked:
            not_passing[key] = worst((not_passing.get(key), status_of(key, self.not_passing)))
        gone: set[Key] = set()
        for key in checked:
            if key not in fresh:
                gone.add(key)
            elif fresh[key] != "passing":
                not_passing[key] = worst((not_passing.get(key), fresh[key]))
        changed = {
            k
            for k in self.not_passing.keys() | not_passing.keys()
            if self.not_passing.get(k) != not_passing.get(k)
        }
        self.not_passing = not_passing
        touched: set[str] = set()
        for node, service_id in changed | gone:
            keys = [(node, service_id)] if service_id else self._node_keys.get(node, [])
            touched.update(self.instances[k].model for k in keys if k in self.instances)
        if not touched:
            return False
        self.replicas, self.ready, self.by_key = dict(self.replicas), dict(self.ready), dict(self.by_key)
        for key in gone & self.instances.keys():
            replica = self.instances.pop(key)
            self._model_keys[replica.model].remove(key)
            self._node_keys[key[0]].remove(key)
            self.by_key.pop(key, None)
        for model in touched:
            self._rebuild(model)
        return True

    def _rebuild(self, model: str) -> None:
        if not self._model_keys.get(model):
            self._model_keys.pop(model, None)
            self.replicas.pop(model, None)
            self.ready.pop(model, None)
            return
        members = sorted(
            (
                replace(self.instances[k], status=status_of(k, self.not_passing))
                for k in self._model_keys[model]
            ),
            key=lambda r: r.key,
        )
        self.replicas[model] = tuple(members)
        ready = tuple(r for r in members if r.ready)
        if ready:
            self.ready[model] = ready
        else:
            self.ready.pop(model, None)
        for r in members:
            self.by_key[r.key] = r
