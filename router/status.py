"""What `/v1/models`, `/healthz` and the replica gauge say, computed from the discovery snapshot."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Mapping
from typing import Any

from nomad_driver.redaction import redact
from router import errors
from router.discovery import Discovery, Snapshot
from router.outliers import Outliers


def models_listing(snapshot: Snapshot, activating: Callable[[str], bool]) -> dict[str, Any]:
    """OpenAI's model list, each entry with an `llmgw` object the SDKs pass through untouched."""
    data = [model_entry(name, snapshot, activating(name)) for name in sorted(snapshot.known_models())]
    return {"object": "list", "data": data}


def model_entry(model: str, snapshot: Snapshot, activating: bool) -> dict[str, Any]:
    """One model as OpenAI's `GET /v1/models/{id}` answers it, with the `llmgw` object."""
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "llmgw",
        "llmgw": model_status(model, snapshot, activating),
    }


def model_status(model: str, snapshot: Snapshot, activating: bool) -> dict[str, Any]:
    ready = len(snapshot.ready.get(model, ()))
    total = len(snapshot.replicas.get(model, ()))
    state = snapshot.states.get(model)
    status: dict[str, Any] = {"ready_replicas": ready, "replicas": total, "defined": model in snapshot.models}
    if state is not None and state.parked:
        status.update(
            state="parked",
            reason=errors.parked(model, state.consecutive_failures, state.last_error).message,
            consecutive_failures=state.consecutive_failures,
        )
    elif ready:
        status["state"] = "ready"
    elif activating:
        status["state"] = "activating"
    elif state is not None and state.unplaceable:
        # The watcher's last answer; a request still asks Nomad afresh (docs/router.md).
        status.update(state="unplaceable", reason=redact(state.placement_reason))
    elif total:
        status["state"] = "starting"
    else:
        status["state"] = "idle"
    if state is not None and state.last_error and "reason" not in status:
        status["last_error"] = redact(state.last_error)
    return status


def health(discovery: Discovery, consul_addr: str) -> tuple[int, dict[str, Any]]:
    now = time.monotonic()
    watches = {
        w.name: {
            "ok": w.ok,
            "last_read_age_s": round(now - w.last_success, 3) if w.last_success is not None else None,
            "error": w.error or None,
        }
        for w in discovery.watches.values()
    }
    snapshot = discovery.snapshot
    if not discovery.has_snapshot:
        state, code = "starting", 503
    elif not discovery.consul_up:
        # Still 200: the router serves from its snapshot, and replicas known a minute ago beat
        # a load balancer taking every router out at once because Consul blinked.
        state, code = "degraded", 200
    else:
        state, code = "ok", 200
    body = {
        "status": state,
        "consul": {
            "addr": consul_addr,
            "up": discovery.consul_up,
            "serving_from_snapshot_age_s": discovery.oldest_read_age(),
            "watches": watches,
        },
        "models": len(snapshot.known_models()),
        "ready_replicas": sum(len(rs) for rs in snapshot.ready.values()),
        "models_origin": snapshot.models_origin or None,
        "models_error": redact(snapshot.models_error) or None,
    }
    return code, body


def replica_counts(snapshot: Snapshot, ejected: Collection[Hashable]) -> list[tuple[str, str, int]]:
    rows: list[tuple[str, str, int]] = []
    for model in sorted(snapshot.known_models()):
        replicas = snapshot.replicas.get(model, ())
        ready = sum(1 for r in replicas if r.ready)
        rows.append((model, "ready", ready))
        rows.append((model, "unready", len(replicas) - ready))
        rows.append((model, "ejected", sum(1 for r in replicas if r.key in ejected)))
    return rows


def replica_views(
    snapshot: Snapshot, outliers: Outliers, outstanding: Mapping[Hashable, int], now: float
) -> list[dict[str, Any]]:
    """Every replica this router knows, as it routes to it: Consul's word on it, the requests it
    has from this router, and whether this router keeps it out of rotation (outlier ejection),
    for how much longer and why. Each router ejects on what it saw itself, so routers differ."""
    rows: list[dict[str, Any]] = []
    for model in sorted(snapshot.replicas):
        for replica in snapshot.replicas[model]:
            standing = outliers.standing(replica.key)
            left = standing.until - now if standing is not None else 0.0
            ejected = left > 0
            rows.append(
                {
                    "model": model,
                    "id": replica.id,
                    "node": replica.node,
                    "address": f"{replica.host}:{replica.port}",
                    "status": replica.status,
                    "in_flight": outstanding.get(replica.key, 0),
                    "ejected": ejected,
                    "ejected_for_s": round(left, 1) if ejected else 0.0,
                    "ejection_reason": standing.reason if ejected and standing is not None else None,
                    # Since its last success: the next ejection lasts this many base periods more.
                    "ejections": standing.ejections if standing is not None else 0,
                    "failures_in_a_row": standing.failures if standing is not None else 0,
                }
            )
    return rows
