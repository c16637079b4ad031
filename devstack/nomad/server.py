"""The stand-in's server: the store, the scheduler, the client and the event broker on one loop,
and the write operations the HTTP layer calls (register, deregister, scale, node updates).

Each operation is what Nomad's RPC endpoint does (`nomad/job_endpoint.go`, `node_endpoint.go`):
check the request, write in one batch (one index), create the evaluation, hand it to the
scheduler. Errors are `ApiError`s carrying Nomad's status code and message text. The operations
live in one mixin per kind (`job_writes.py`, `node_writes.py`, `deployment_writes.py`); this
module assembles them with the parts they share.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from devstack.nomad import deployments, namespaces
from devstack.nomad.acl import AclState
from devstack.nomad.answers import NAMESPACE, ApiError
from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.deployment_writes import DeploymentWrites
from devstack.nomad.events import EventBroker
from devstack.nomad.gc import Collected, GarbageCollector, GCConfig
from devstack.nomad.getter import NODE_CONFIG_KEY
from devstack.nomad.job_writes import JobWrites
from devstack.nomad.node_writes import NodeWrites
from devstack.nomad.operator import SchedulerConfiguration
from devstack.nomad.scheduler import Scheduler
from devstack.nomad.server_parts import Json
from devstack.nomad.state import StateStore


class NomadServer(JobWrites, NodeWrites, DeploymentWrites):
    def __init__(
        self,
        nodes: list[Json],
        consul_url: str | None,
        data_dir: Path,
        clock: Clock | None = None,
        gc: GCConfig | None = None,
    ) -> None:
        self.clock = clock or Clock()
        self.store = StateStore()
        self.scheduler = Scheduler(self.store, self.clock)
        self.gc = GarbageCollector(self.store, self.clock, gc)
        self.events = EventBroker(self.store)
        self.data_dir = data_dir
        self.consul_url = consul_url
        # A node's client `artifact` block travels with its fleet entry; it is the client's, so it
        # leaves the node's JSON here and goes to the client in start().
        self._artifact_configs = {str(n["ID"]): n.pop(NODE_CONFIG_KEY) for n in nodes if NODE_CONFIG_KEY in n}
        self._initial_nodes = nodes
        self.client: ClientRunner | None = None
        self.acl: AclState | None = None  # set by acl_http.enable
        self.health: deployments.HealthWatcher | None = None
        # Dynamic node metadata per node (`/v1/client/metadata`), nulls included, as a client
        # keeps it in its state DB; it survives a node being replaced through /v1/devstack/node.
        self.dynamic_meta: dict[str, dict[str, str | None]] = {}
        self.static_meta: dict[str, dict[str, str]] = {n["ID"]: dict(n.get("Meta") or {}) for n in nodes}
        self.scheduler_config = SchedulerConfiguration()
        # Nomad's state store creates `default` at index 1 (`namespaceInit`).
        self.store.namespaces[NAMESPACE] = namespaces.namespace(
            NAMESPACE, namespaces.DEFAULT_DESCRIPTION, CreateIndex=1, ModifyIndex=1
        )

    async def start(self) -> None:
        self.events.start()
        with self.store.batch():
            for node in self._initial_nodes:
                self.store.upsert_node(copy.deepcopy(node))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.client = ClientRunner(
            self.store,
            self.clock,
            self.data_dir,
            self.consul_url,
            on_alloc_update=self.scheduler.on_alloc_update,
        )
        self.client.artifact_configs.update(self._artifact_configs)
        self.client.acl = self.acl
        self.scheduler.client = self.client
        registry = self.client.registry
        self.health = deployments.HealthWatcher(
            self.store,
            self.clock,
            self.deployment_eval,
            registry.alloc_checks if registry.enabled else None,
            registry.refresh_check_statuses if registry.enabled else None,
        )
        self.scheduler.health = self.health
        self.scheduler.start()
        self.gc.start()
        self.health.start()

    async def stop(self) -> None:
        """Stop scheduling, then every allocation's processes, then the event stream."""
        await self.gc.stop()
        await self.scheduler.stop()
        if self.health is not None:
            await self.health.stop()
        if self.client is not None:
            await self.client.shutdown()
        await self.events.stop()

    def force_gc(self) -> Collected:
        """`PUT /v1/system/gc`: collect everything the GC rules allow, whatever its age."""
        return self.gc.collect(forced=True)

    # ----- namespaces ----------------------------------------------------------------------

    def upsert_namespace(self, body: Any, path_name: str) -> int:
        try:
            return namespaces.upsert(self.store, body, path_name)
        except namespaces.NamespaceError as exc:
            raise ApiError(exc.code, exc.message) from None

    def delete_namespace(self, name: str) -> int:
        try:
            return namespaces.delete(self.store, name)
        except namespaces.NamespaceError as exc:
            raise ApiError(exc.code, exc.message) from None

    # ----- client --------------------------------------------------------------------------

    def log_path(self, alloc_id: str, task: str, kind: str) -> Path:
        if self.client is None:
            raise ApiError(500, "client not started")
        return self.client.log_path(alloc_id, task, kind)
