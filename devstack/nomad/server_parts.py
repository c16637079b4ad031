"""What every group of the server's write operations reads: the store, the scheduler, the clock
and the rest that `NomadServer` sets up. The groups (`job_writes`, `node_writes`,
`deployment_writes`) are mixins over this, so each reads in one sitting and `NomadServer` stays
the assembly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devstack.nomad import deployments
from devstack.nomad.client import ClientRunner
from devstack.nomad.clock import Clock
from devstack.nomad.events import EventBroker
from devstack.nomad.gc import GarbageCollector
from devstack.nomad.operator import SchedulerConfiguration
from devstack.nomad.scheduler import Scheduler
from devstack.nomad.state import StateStore

Json = dict[str, Any]


class ServerParts:
    clock: Clock
    store: StateStore
    scheduler: Scheduler
    gc: GarbageCollector
    events: EventBroker
    data_dir: Path
    consul_url: str | None
    client: ClientRunner | None
    health: deployments.HealthWatcher | None
    # Dynamic node metadata per node (`/v1/client/metadata`), nulls included, as a client keeps
    # it in its state DB; it survives a node being replaced through /v1/devstack/node.
    dynamic_meta: dict[str, dict[str, str | None]]
    static_meta: dict[str, dict[str, str]]
    scheduler_config: SchedulerConfiguration
