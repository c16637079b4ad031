"""A deployment's statuses and the questions the state store asks of one (`nomad/structs/
deployment.go`), apart from `deployments.py` so that the store, which keeps deployments, and the
deployments module, which reads the store, import one way only."""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]

TABLE = "deployment"

# nomad/structs/deployment.go
RUNNING = "running"
PAUSED = "paused"
FAILED = "failed"
SUCCESSFUL = "successful"
CANCELLED = "cancelled"
ACTIVE = (RUNNING, PAUSED, "blocked", "unblocking", "initializing", "pending")


def is_active(deployment: Json | None) -> bool:
    return deployment is not None and deployment["Status"] in ACTIVE


def has_health(alloc: Json | None) -> bool:
    return bool(alloc) and ((alloc or {}).get("DeploymentStatus") or {}).get("Healthy") is not None
