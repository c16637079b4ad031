"""Nomad's job endpoints over the stand-in (`command/agent/job_endpoint.go`): `/v1/jobs`,
`/v1/job/:id` and everything under it, `/v1/jobs/parse` and `/v1/validate/job`."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from devstack.nomad import deployments
from devstack.nomad.answers import ApiError
from devstack.nomad.encode import alloc_stub, job_stub
from devstack.nomad.httpbase import (
    SERVER_KEY,
    blocking,
    bool_param,
    json_response,
    namespace_param,
    ns_matches,
    object_query,
    only,
    read_body,
    write_response,
)
from devstack.nomad.jobplan import job_plan
from devstack.nomad.server import NomadServer

Json = dict[str, Any]


# ----- jobs ----------------------------------------------------------------------------------


async def jobs(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER_KEY]
    if request.method in ("PUT", "POST"):
        return write_response(
            server.register(await read_body(request), query_ns=request.query.get("namespace")), request
        )
    if request.method != "GET":
        raise ApiError(405, "Invalid method")
    namespace = namespace_param(request)
    prefix = request.query.get("prefix", "")
    with_meta = bool_param(request, "meta")
    store = server.store

    def query() -> tuple[Any, int]:
        out = [
            job_stub(job, store.job_summaries.get(key), with_meta)
            for key, job in sorted(store.jobs.items())
            if ns_matches(job, namespace) and job["ID"].startswith(prefix)
        ]
        return out, store.max_index(("jobs", "job_summary"))

    return await blocking(request, ("jobs", "job_summary"), query)


async def job_specific(request: web.Request) -> web.StreamResponse:
    """`/v1/job/<id>[/<suffix>]`, dispatched on the suffix as Nomad's JobSpecificRequest does."""
    server = request.app[SERVER_KEY]
    path = request.match_info["rest"]
    namespace = namespace_param(request)
    for suffix, handler in _JOB_SUFFIXES:
        if path.endswith(suffix) and len(path) > len(suffix):
            return await handler(request, server, path[: -len(suffix)], namespace)
    job_id = path
    if request.method == "GET":
        return await blocking(
            request,
            ("jobs",),
            object_query(server, lambda: server.job(namespace, job_id), lambda j: j["ModifyIndex"], "jobs"),
        )
    if request.method in ("PUT", "POST"):
        body = await read_body(request)
        return write_response(
            server.register(body, path_id=job_id, query_ns=request.query.get("namespace")), request
        )
    if request.method == "DELETE":
        purge = bool_param(request, "purge")
        bool_param(request, "global")
        return write_response(server.deregister(namespace, job_id, purge), request)
    raise ApiError(405, "Invalid method")


async def _job_allocations(
    request: web.Request, server: NomadServer, job_id: str, ns: str
) -> web.StreamResponse:
    only(request, "GET")
    show_all = bool_param(request, "all")
    store = server.store

    def query() -> tuple[Any, int]:
        job = store.jobs.get((ns, job_id))
        allocs = store.allocs_for_job(ns, job_id)
        if not show_all and job is not None:
            # Without all=true Nomad lists only allocations of the job as it is now registered
            # (same CreateIndex), not those of an earlier job with the same ID.
            allocs = [a for a in allocs if (a.get("Job") or {}).get("CreateIndex") == job["CreateIndex"]]
        allocs.sort(key=lambda a: a["CreateIndex"], reverse=True)
        return [alloc_stub(a) for a in allocs], store.table_index["allocs"]

    return await blocking(request, ("allocs",), query)


async def _job_evaluations(
    request: web.Request, server: NomadServer, job_id: str, ns: str
) -> web.StreamResponse:
    only(request, "GET")
    store = server.store

    def query() -> tuple[Any, int]:
        evals = sorted(store.evals_for_job(ns, job_id), key=lambda e: e["CreateIndex"], reverse=True)
        return evals, store.table_index["evals"]

    return await blocking(request, ("evals",), query)


async def _job_summary(request: web.Request, server: NomadServer, job_id: str, ns: str) -> web.StreamResponse:
    only(request, "GET")
    store = server.store

    def fetch() -> Json:
        summary = store.job_summaries.get((ns, job_id))
        if summary is None:
            raise ApiError(404, "job not found")
        return summary

    return await blocking(
        request, ("job_summary",), object_query(server, fetch, lambda s: s["ModifyIndex"], "job_summary")
    )


async def _job_scale(request: web.Request, server: NomadServer, job_id: str, ns: str) -> web.StreamResponse:
    if request.method in ("PUT", "POST"):
        return write_response(server.scale(ns, job_id, await read_body(request)), request)
    only(request, "GET")
    store = server.store
    tables = ("jobs", "allocs", "scaling_event")
    return await blocking(
        request,
        tables,
        object_query(
            server, lambda: server.scale_status(ns, job_id), lambda _: store.max_index(tables), "jobs"
        ),
    )


async def _job_evaluate(
    request: web.Request, server: NomadServer, job_id: str, ns: str
) -> web.StreamResponse:
    only(request, "PUT", "POST")
    return write_response(server.evaluate(ns, job_id, await read_body(request)), request)


async def _job_versions(
    request: web.Request, server: NomadServer, job_id: str, ns: str
) -> web.StreamResponse:
    only(request, "GET")
    store = server.store

    def fetch() -> Json:
        versions = store.job_versions.get((ns, job_id))
        if not versions:
            raise ApiError(404, "job versions not found")
        return {"Versions": list(reversed(versions)), "Diffs": None}

    def query() -> tuple[Any, int]:
        try:
            return fetch(), store.table_index["job_versions"]
        except ApiError as exc:
            return exc, store.table_index["job_versions"]

    return await blocking(request, ("job_versions",), query)


async def _job_deployments(
    request: web.Request, server: NomadServer, job_id: str, ns: str
) -> web.StreamResponse:
    """`/v1/job/<id>/deployments`: the job's deployments, newest first."""
    only(request, "GET")
    store = server.store

    def query() -> tuple[Any, int]:
        found = sorted(store.deployments_for_job(ns, job_id), key=lambda d: d["CreateIndex"], reverse=True)
        return found, store.table_index[deployments.TABLE]

    return await blocking(request, (deployments.TABLE,), query)


async def _job_deployment(
    request: web.Request, server: NomadServer, job_id: str, ns: str
) -> web.StreamResponse:
    """`/v1/job/<id>/deployment`: the latest deployment, or null when there is none."""
    only(request, "GET")
    store = server.store

    def query() -> tuple[Any, int]:
        return deployments.latest_for_job(store, ns, job_id), store.table_index[deployments.TABLE]

    return await blocking(request, (deployments.TABLE,), query)


_JOB_SUFFIXES: list[tuple[str, Any]] = [
    ("/deployments", _job_deployments),
    ("/deployment", _job_deployment),
    ("/allocations", _job_allocations),
    ("/evaluations", _job_evaluations),
    ("/summary", _job_summary),
    ("/scale", _job_scale),
    ("/evaluate", _job_evaluate),
    ("/versions", _job_versions),
    ("/plan", job_plan),
]


async def jobs_parse(request: web.Request) -> web.StreamResponse:
    only(request, "PUT", "POST")
    server = request.app[SERVER_KEY]
    return json_response(server.parse_job(await read_body(request)), request)


async def validate_job(request: web.Request) -> web.StreamResponse:
    only(request, "PUT", "POST")
    server = request.app[SERVER_KEY]
    return json_response(server.validate(await read_body(request)), request)
