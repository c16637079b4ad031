"""The watcher's admin API and metrics.

Every watcher serves it; only the leader changes anything. A follower answers reads from its
own passes over the same snapshots and, asked to change something, says who leads instead.

Every defined model has every model series, 0 included: the alert for "a model that should run
has nothing ready" can only fire on a series that exists while nothing is ready.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nomad_driver.consul import ConsulError
from nomad_driver.watcher import NotLeader, UnknownModel, Watcher

TOKEN_ENV = "LLMGW_ADMIN_TOKEN"


class WatcherCollector(Collector):
    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def collect(self) -> Iterator[GaugeMetricFamily]:
        w = self.watcher
        gauges = {
            "desired": GaugeMetricFamily(
                "llmgw_model_desired_replicas", "Replicas the model should have now.", labels=["model"]
            ),
            "ready": GaugeMetricFamily(
                "llmgw_model_ready_replicas", "Replicas passing their readiness check.", labels=["model"]
            ),
            "failures": GaugeMetricFamily(
                "llmgw_model_consecutive_start_failures",
                "Start failures since the last healthy start.",
                labels=["model"],
            ),
            "parked": GaugeMetricFamily(
                "llmgw_model_parked",
                "1 while the model is parked after repeated start failures.",
                labels=["model"],
            ),
            "unplaceable": GaugeMetricFamily(
                "llmgw_model_unplaceable", "1 while Nomad cannot place the model anywhere.", labels=["model"]
            ),
        }
        for name in sorted(w.models):
            d = w.decisions.get(name)
            gauges["desired"].add_metric([name], d.desired if d else 0)
            gauges["ready"].add_metric([name], d.ready if d else 0)
            gauges["failures"].add_metric([name], d.state.consecutive_failures if d else 0)
            gauges["parked"].add_metric([name], 1 if d and d.state.parked else 0)
            gauges["unplaceable"].add_metric([name], 1 if d and d.state.unplaceable else 0)
        yield from gauges.values()
        leader = GaugeMetricFamily("llmgw_leader", "1 on the watcher that leads.")
        leader.add_metric([], 1 if w.leadership.is_leader else 0)
        yield leader


def model_status(w: Watcher, name: str) -> dict[str, Any]:
    """One model as the admin API and `llmgw ctl` show it."""
    d = w.decisions.get(name)
    m = w.models.get(name)
    if d is None or m is None:
        raise UnknownModel(name)
    if d.state.parked:
        word = "parked"
    elif d.state.unplaceable:
        word = "unplaceable"
    elif d.ready >= d.desired:
        word = "idle" if d.desired == 0 and d.ready == 0 else "satisfied"
    else:
        word = "starting" if d.starting else "short"
    return {
        "model": name,
        "state": word,
        "reason": "" if word in ("satisfied", "idle") else d.health_output,
        "job_id": m.job_id,
        "def_hash": m.def_hash,
        "source": m.source,
        "profile": m.profile_name,
        "replicas": {"min": m.replicas_min, "max": m.replicas_max},
        "desired": d.desired,
        "ready": d.ready,
        "starting": d.starting,
        "satisfied": d.ready >= d.desired and not d.state.parked,
        "health": d.health,
        "health_output": d.health_output,
        "parked": d.state.parked,
        "consecutive_failures": d.state.consecutive_failures,
        "last_error": d.state.last_error,
        "unplaceable": d.state.unplaceable,
        "placement_reason": d.state.placement_reason,
        "placement_eval": d.state.placement_eval,
    }


def _leader(w: Watcher) -> dict[str, Any] | None:
    info = w.leadership.leader
    return {"id": info.id, "address": info.address} if info else None


def create_app(watcher: Watcher) -> FastAPI:
    app = FastAPI(title="llmgw watcher admin API")
    registry = CollectorRegistry()
    registry.register(WatcherCollector(watcher))

    def authorized(request: Request) -> bool:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "leader": watcher.leadership.is_leader, "passes": watcher.passes}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/admin/models")
    async def models() -> dict[str, Any]:
        return {
            "is_leader": watcher.leadership.is_leader,
            "leader": _leader(watcher),
            "definitions_problem": watcher.definitions_problem,
            "models": [model_status(watcher, n) for n in sorted(watcher.decisions) if n in watcher.models],
        }

    @app.get("/v1/admin/models/{model}")
    async def model(model: str) -> Response:
        try:
            return JSONResponse(model_status(watcher, model))
        except UnknownModel:
            return JSONResponse({"error": f"model '{model}' is not defined"}, status_code=404)

    @app.post("/v1/admin/models/{model}/retry")
    async def retry(model: str, request: Request) -> Response:
        if not authorized(request):
            return JSONResponse(
                {"error": f"retry needs 'Authorization: Bearer <{TOKEN_ENV}>'"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            state = await watcher.retry(model)
        except NotLeader as exc:
            leader = _leader(watcher)
            headers = {"X-Llmgw-Leader": leader["address"]} if leader and leader["address"] else {}
            return JSONResponse({"error": str(exc), "leader": leader}, status_code=409, headers=headers)
        except UnknownModel:
            return JSONResponse({"error": f"model '{model}' is not defined"}, status_code=404)
        except ConsulError as exc:
            return JSONResponse({"error": f"retry of '{model}' failed: {exc}"}, status_code=503)
        return JSONResponse({"model": model, "retried": True, "state": state.model_dump()})

    return app
