"""The watcher's admin API and metrics.

Every watcher serves it; only the leader changes anything. A follower answers reads from its
own passes over the same snapshots and, asked to change something, says who leads instead.

Every defined model has every model series, 0 included: the alert for "a model that should run
has nothing ready" can only fire on a series that exists while nothing is ready.
"""

from __future__ import annotations

import gc
import hmac
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nomad_driver import engines
from nomad_driver.admin_api import TOKEN_ENV
from nomad_driver.certs import register_cert_collector
from nomad_driver.consul import ConsulError
from nomad_driver.node_meta import ENGINE_KEY_PREFIX, FABRIC_KEY, models_cached
from nomad_driver.placement import job_fabric
from nomad_driver.redaction import redact
from nomad_driver.summary import fleet_summary, gpu_use, held_devices, node_state
from nomad_driver.watcher.admin_ops import NotLeader, UnknownModel
from nomad_driver.watcher.decisions import ModelView
from nomad_driver.watcher.fetch_progress import FetchProgressCache, fetch_metrics, with_fetch
from nomad_driver.watcher.loop import Watcher
from nomad_driver.watcher.scaling import REASONS


def node_engines(node: Mapping[str, Any]) -> dict[str, list[str]]:
    """Engine name -> versions installed, from the node meta the node agent publishes."""
    meta = node.get("Meta")
    out: dict[str, list[str]] = {}
    if not isinstance(meta, Mapping):
        return out
    for key, value in meta.items():
        if not str(key).startswith(ENGINE_KEY_PREFIX):
            continue
        # A key no known engine maps to is shown with its suffix, so a new engine is visible
        # before llmgw knows it.
        engine = engines.from_meta_key(str(key)) or str(key)[len(ENGINE_KEY_PREFIX) :]
        versions = [v.strip() for v in str(value or "").split(",") if v.strip()]
        if versions:
            out[engine] = sorted(set(versions))
    return out


def engine_installs(nodes: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], int]:
    """(engine, version) -> nodes reporting it, over nodes Nomad calls ready: a down node's
    install places nothing."""
    counts: dict[tuple[str, str], int] = {}
    for node in nodes:
        if node.get("Status") != "ready":
            continue
        for engine, versions in node_engines(node).items():
            for version in versions:
                counts[(engine, version)] = counts.get((engine, version), 0) + 1
    return counts


class WatcherCollector(Collector):
    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        # Running fetches, read (through the bounded cache) by /metrics just before it collects.
        self.fetches: dict[str, list[dict[str, Any]]] = {}

    def collect(self) -> Iterator[Metric]:
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
            "refused": GaugeMetricFamily(
                "llmgw_model_action_refused",
                "1 while Nomad refuses, for good (a 4xx, or a 500 in its validation's words), to register or "
                "scale the model's job.",
                labels=["model"],
            ),
            "in_flight": GaugeMetricFamily(
                "llmgw_model_in_flight_requests",
                "Requests in flight on the model's replicas, summed over the routers.",
                labels=["model"],
            ),
            "gave_up": GaugeMetricFamily(
                "llmgw_model_nomad_gave_up",
                "1 while Nomad will not replace a failed allocation of the model (its reschedule attempts "
                "spent) and llmgw has asked it to reschedule anyway.",
                labels=["model"],
            ),
            "degraded": GaugeMetricFamily(
                "llmgw_model_degraded",
                "1 while some replicas of the model serve and a slot beside them keeps failing (not parked: "
                "a partial failure).",
                labels=["model"],
            ),
            "update_failed": GaugeMetricFamily(
                "llmgw_model_update_failed",
                "1 while a new definition of the model is parked after its start failures and the "
                "previous definition keeps serving (not counted in llmgw_model_parked: it serves).",
                labels=["model"],
            ),
            "short": GaugeMetricFamily(
                "llmgw_model_short",
                "1 while Nomad cannot place the replicas the model's load asks for (its minimum serves).",
                labels=["model"],
            ),
        }
        # One series per reason, every reason at 0 too, so a rule can say how long a model
        # was held at its max without the series appearing and vanishing.
        reasons = GaugeMetricFamily(
            "llmgw_model_desired_reason",
            "1 for the reason the model's desired replicas are what they are, 0 for the others.",
            labels=["model", "reason"],
        )
        for name in sorted(w.models):
            d = w.decisions.get(name)
            v = w.views.get(name)
            gauges["in_flight"].add_metric([name], v.in_flight if v else 0)
            gauges["desired"].add_metric([name], d.desired if d else 0)
            gauges["ready"].add_metric([name], d.ready if d else 0)
            gauges["failures"].add_metric([name], d.state.consecutive_failures if d else 0)
            update_failed = d is not None and d.state.parked and bool(d.state.rollout_from)
            gauges["parked"].add_metric([name], 1 if d and d.state.parked and not update_failed else 0)
            gauges["update_failed"].add_metric([name], 1 if update_failed else 0)
            gauges["unplaceable"].add_metric([name], 1 if d and d.state.unplaceable else 0)
            gauges["refused"].add_metric([name], 1 if d and d.state.last_action_error else 0)
            gauges["short"].add_metric([name], 1 if d and d.state.short else 0)
            gauges["gave_up"].add_metric([name], 1 if d and d.state.nomad_gave_up else 0)
            gauges["degraded"].add_metric([name], 1 if d and d.state.degraded else 0)
            for reason in REASONS:
                reasons.add_metric([name, reason], 1 if d and d.desired_reason == reason else 0)
        yield from gauges.values()
        yield reasons
        yield from fetch_metrics(self.fetches)
        yield shards_running(w)
        leader = GaugeMetricFamily("llmgw_leader", "1 on the watcher that leads.")
        leader.add_metric([], 1 if w.leadership.is_leader else 0)
        yield leader
        changes = CounterMetricFamily("llmgw_leader_changes", "Times this watcher gained or lost leadership.")
        changes.add_metric([], w.leader_changes)
        yield changes

        installs = engine_installs(w.nodes.snapshot.data if w.nodes.snapshot else ())
        family = GaugeMetricFamily(
            "llmgw_engine_installs",
            "Ready Nomad nodes whose meta reports this engine version installed.",
            labels=["engine", "version"],
        )
        for (engine, version), count in sorted(installs.items()):
            family.add_metric([engine, version], count)
        yield family
        available = GaugeMetricFamily(
            "llmgw_model_engine_available",
            "1 if some ready node reports the engine version the model's profile asks for, else 0.",
            labels=["model", "engine", "version"],
        )
        for name in sorted(w.models):
            p = w.models[name].profile
            has = installs.get((p.engine, p.engine_version), 0) > 0
            available.add_metric([name, p.engine, p.engine_version], 1 if has else 0)
        yield available


def shards_running(w: Watcher) -> Metric:
    """One series per multi-node model, at 0 too, labelled with the fabric its job is pinned to
    ("" before it is pinned): a replica short of shards serves nothing."""
    family = GaugeMetricFamily(
        "llmgw_model_replica_shards_running",
        "Shards of the multi-node model's replica that run now (it serves only with all of them).",
        labels=["model", "fabric"],
    )
    for name in sorted(w.models):
        if w.models[name].profile.nodes > 1 and name in w.decisions:
            layout = replica_layout(w, name)
            family.add_metric([name, layout["fabric"]], layout["shards_running"])
    return family


def model_status(w: Watcher, name: str) -> dict[str, Any]:
    """One model as the admin API and `llmgw ctl` show it."""
    d = w.decisions.get(name)
    m = w.models.get(name)
    view = w.views.get(name)
    if d is None or m is None:
        raise UnknownModel(name)
    refused = d.state.last_action_error
    if d.state.job_conflict:
        word = "conflict"  # someone else's Nomad job holds the model's job ID
    elif d.state.parked and d.state.rollout_from:
        word = "update-failed"  # the new definition is parked; the previous one serves
    elif d.state.parked:
        word = "parked"
    elif refused is not None:
        word = "refused"
    elif d.state.rollout_from:
        word = "updating"  # a new definition starting beside the previous one, which serves
    elif d.state.unplaceable:
        word = "unplaceable"
    elif d.state.nomad_gave_up:
        word = "gave-up"  # Nomad will not replace a failed allocation; llmgw asked it again
    elif d.state.degraded:
        word = "degraded"  # serving, while a slot beside the serving replicas keeps failing
    elif d.state.short:
        word = "short"  # serving its minimum; Nomad cannot place what the load asks for
    elif d.ready >= d.desired:
        word = "idle" if d.desired == 0 and d.ready == 0 else "satisfied"
    else:
        word = "starting" if d.starting else "short"
    # Redacted as defence in depth: validation refuses credentials in a source, but engine
    # errors quote what they were given, and this is what `llmgw ctl` and dashboards show.
    return {
        "model": name,
        "state": word,
        "reason": "" if word in ("satisfied", "idle") else redact(d.health_output),
        "job_id": (view.job_id if view is not None and view.job_id else m.job_id),
        # A rollout's previous definition, still running beside the current one ("" if none).
        "previous_job_id": d.state.rollout_from,
        "def_hash": m.def_hash,
        "source": redact(m.source),
        "profile": m.profile_name,
        "replicas_min": m.replicas_min,
        "replicas_max": m.replicas_max,
        "replicas": {
            "min": m.replicas_min,
            "max": m.replicas_max,
            "target_in_flight": m.target_in_flight,
            "scale_down_delay_s": m.scale_down_delay_s,
        },
        "desired": d.desired,
        "desired_reason": d.desired_reason,
        "desired_detail": d.desired_detail,
        "short": d.state.short,
        "short_reason": redact(d.state.short_reason),
        "nomad_gave_up": d.state.nomad_gave_up,
        "degraded": redact(d.state.degraded),
        "ready": d.ready,
        "starting": d.starting,
        "satisfied": d.ready >= d.desired and not d.state.parked,
        "health": d.health,
        "health_output": redact(d.health_output),
        "parked": d.state.parked,
        "consecutive_failures": d.state.consecutive_failures,
        "last_error": redact(d.state.last_error),
        "unplaceable": d.state.unplaceable,
        "placement_reason": redact(d.state.placement_reason),
        "placement_eval": d.state.placement_eval,
        "last_action_error": (
            {**refused.model_dump(), "message": redact(refused.message)} if refused is not None else None
        ),
        "in_flight": view.in_flight if view else 0,
        "in_flight_average": round(_average(view), 2),
        "busy_replicas": view.busy_replicas if view else 0,
        "job_conflict": d.state.job_conflict,
        **replica_layout(w, name),
    }


def _average(view: ModelView | None) -> float:
    if view is None:
        return 0.0
    return float(view.in_flight if view.in_flight_average is None else view.in_flight_average)


def replica_layout(w: Watcher, name: str) -> dict[str, Any]:
    """Where a model's replicas are: `nodes` per replica (its profile's), and for a multi-node
    model the fabric its job is pinned to, the nodes its live replica holds (leader first) and
    how many of its shards run."""
    m = w.models[name]
    view = w.views.get(name)
    out: dict[str, Any] = {"nodes": m.profile.nodes, "fabric": "", "replica_nodes": [], "shards_running": 0}
    if m.profile.nodes <= 1:
        return out
    out["fabric"] = job_fabric(view.job) if view else ""
    for r in w.replicas:
        if r["model"] != name or r["state"] == "failed":
            continue
        out["replica_nodes"] += [r["node"], *(s["node"] for s in r["shards"])]
        out["shards_running"] += sum(1 for s in r["shards"] if s["state"] == "running")
    return out


def nodes_status(w: Watcher) -> list[dict[str, Any]]:
    """Every Nomad node as `GET /v1/admin/nodes` shows it, sorted by name."""
    nodes = [dict(n) for n in (w.nodes.snapshot.data if w.nodes.snapshot else ())]
    held = held_devices(w.allocs.snapshot.data if w.allocs.snapshot else ())
    out = []
    for node in nodes:
        raw_meta = node.get("Meta")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        gpus, _ = gpu_use([node], held)
        out.append(
            {
                "name": str(node.get("Name", "")),
                "id": str(node.get("ID", "")),
                "datacenter": str(node.get("Datacenter", "")),
                "pool": str(node.get("NodePool", "")),
                "class": str(node.get("NodeClass", "")),
                "status": str(node.get("Status", "")),
                "state": node_state(node),
                "eligibility": str(node.get("SchedulingEligibility", "")),
                "draining": node_state(node) == "draining",
                "gpus": gpus,
                "fabric": str(meta.get(FABRIC_KEY) or ""),
                "engines": node_engines(node),
                "models_cached": sorted(models_cached(meta)),
            }
        )
    out.sort(key=lambda n: (n["name"], n["id"]))
    return out


def summary(w: Watcher) -> dict[str, Any]:
    """`GET /v1/admin/summary`: `fleet_summary` over this watcher's latest snapshots."""
    nodes = [dict(n) for n in (w.nodes.snapshot.data if w.nodes.snapshot else ())]
    allocs = [dict(a) for a in (w.allocs.snapshot.data if w.allocs.snapshot else ())]
    # Failed replicas hold no cards and serve nothing; the summary counts what runs.
    replicas = [r for r in w.replicas if r["state"] != "failed"]
    models = {n: model_status(w, n) for n in sorted(w.decisions) if n in w.models}
    return fleet_summary(nodes, allocs, replicas, models, w.clock())


def _leader(w: Watcher) -> dict[str, Any] | None:
    info = w.leadership.leader
    return {"id": info.id, "address": info.address} if info else None


def bearer_matches(header: str, token: str) -> bool:
    """`Authorization: Bearer <token>`, the scheme in any case (RFC 9110 makes it
    case-insensitive, and the router reads it so), the token compared in constant time."""
    scheme, _, given = header.strip().partition(" ")
    matched = hmac.compare_digest(given.strip().encode(), token.encode())
    return scheme.lower() == "bearer" and matched


def create_app(
    watcher: Watcher, *, token: str | None = None, guard_reads: bool = False, docs: bool = False
) -> FastAPI:
    """`token` (default: LLMGW_ADMIN_TOKEN at each request) guards writes, and with
    `guard_reads` also every read that shows sources, addresses or errors: what the watcher
    does when it listens beyond loopback. /healthz and /metrics stay open for probes and
    Prometheus. FastAPI's /docs, /redoc and /openapi.json only with `docs`."""
    app = FastAPI(
        title="llmgw watcher admin API",
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    registry = CollectorRegistry()
    collector = WatcherCollector(watcher)
    registry.register(collector)
    fetches = FetchProgressCache(watcher.nomad)
    register_cert_collector(registry)

    def authorized(request: Request) -> bool:
        expected = token if token is not None else os.environ.get(TOKEN_ENV)
        if not expected:
            return True
        return bearer_matches(request.headers.get("authorization", ""), expected)

    def refused(what: str) -> Response:
        return JSONResponse(
            {"error": f"{what} needs 'Authorization: Bearer <{TOKEN_ENV}>'"},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    if guard_reads:

        @app.middleware("http")
        async def reads_need_the_token(request: Request, call_next: Any) -> Response:
            path = request.url.path
            if path not in ("/healthz", "/metrics") and not authorized(request):
                return refused(f"{request.method} {path}")
            response: Response = await call_next(request)
            return response

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "leader": watcher.leadership.is_leader,
            "passes": watcher.passes,
            "skipped_passes": watcher.skipped_passes,
            "last_pass_cpu_ms": round(watcher.last_pass_cpu_s * 1000, 1),
            # Passes over every model (start, leadership, the 5-minute resync) and their cost.
            "full_passes": watcher.marks.full_passes,
            "last_full_pass_cpu_ms": round(watcher.last_full_pass_cpu_s * 1000, 1),
            "models_reconciled": watcher.marks.model_passes,
            # Work waiting for the next pass: models marked, and whether it reconciles them all.
            "models_marked": len(watcher.marks.models),
            "full_pass_marked": watcher.marks.everything,
            "pass_causes": dict(watcher.pass_causes),
            # The collector's full walks, and what the last pass left frozen out of them
            # (`heap.py`): at 10,000 models each walk of an unfrozen heap is half a second.
            "gc_full_collections": gc.get_stats()[-1]["collections"],
            "gc_frozen_objects": gc.get_freeze_count(),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        collector.fetches = await fetches.of_models(watcher.views)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/admin/models")
    async def models() -> dict[str, Any]:
        running = await fetches.of_models(watcher.views)
        return {
            "is_leader": watcher.leadership.is_leader,
            "leader": _leader(watcher),
            "definitions_problem": redact(watcher.definitions_problem),
            "models": [
                with_fetch(model_status(watcher, n), running.get(n, []))
                for n in sorted(watcher.decisions)
                if n in watcher.models
            ],
        }

    @app.get("/v1/admin/summary")
    async def fleet() -> dict[str, Any]:
        return summary(watcher)

    @app.get("/v1/admin/nodes")
    async def nodes() -> dict[str, Any]:
        snap = watcher.nodes.snapshot
        return {"nodes": nodes_status(watcher), "stale": snap is None or not watcher.nodes.ok}

    @app.get("/v1/admin/replicas")
    async def replicas() -> dict[str, Any]:
        return {"replicas": list(watcher.replicas)}

    @app.get("/v1/admin/models/{model}")
    async def model(model: str) -> Response:
        try:
            status = model_status(watcher, model)
        except UnknownModel:
            return JSONResponse({"error": f"model '{model}' is not defined"}, status_code=404)
        view = watcher.views.get(model)
        running = await fetches.of_models({model: view} if view is not None else {})
        return JSONResponse(with_fetch(status, running.get(model, [])))

    @app.post("/v1/admin/models/{model}/retry")
    async def retry(model: str, request: Request) -> Response:
        if not authorized(request):
            return refused("retry")
        try:
            state = await watcher.retry(model)
        except NotLeader as exc:
            leader = _leader(watcher)
            headers = {"X-Llmgw-Leader": leader["address"]} if leader and leader["address"] else {}
            return JSONResponse({"error": str(exc), "leader": leader}, status_code=409, headers=headers)
        except UnknownModel:
            return JSONResponse({"error": f"model '{model}' is not defined"}, status_code=404)
        except ConsulError as exc:
            return JSONResponse({"error": f"retry of '{model}' failed: {redact(str(exc))}"}, status_code=503)
        # Which watcher did it, so `llmgw ctl retry` can say so after following a follower.
        return JSONResponse(
            {"model": model, "retried": True, "state": state.model_dump(), "leader": _leader(watcher)}
        )

    return app
