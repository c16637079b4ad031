"""Evaluations, allocations and deployments over the stand-in
(`command/agent/eval_endpoint.go`, `alloc_endpoint.go`, `deployment_endpoint.go`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from devstack.nomad import deployments
from devstack.nomad.answers import ApiError
from devstack.nomad.encode import alloc_stub
from devstack.nomad.httpbase import (
    SERVER_KEY,
    blocking,
    bool_param,
    namespace_param,
    ns_matches,
    object_query,
    only,
    read_body,
    write_response,
)

Json = dict[str, Any]


# ----- evaluations and allocations -----------------------------------------------------------


async def evaluations(request: web.Request) -> web.StreamResponse:
    only(request, "GET")
    server = request.app[SERVER_KEY]
    store = server.store
    prefix = request.query.get("prefix", "")
    job_filter = request.query.get("job")
    status_filter = request.query.get("status")
    namespace = namespace_param(request)

    def query() -> tuple[Any, int]:
        out = [
            e
            for e in store.evals.values()
            if e["ID"].startswith(prefix)
            and ns_matches(e, namespace)
            and (job_filter is None or e["JobID"] == job_filter)
            and (status_filter is None or e["Status"] == status_filter)
        ]
        out.sort(key=lambda e: e["CreateIndex"], reverse=True)
        return out, store.table_index["evals"]

    return await blocking(request, ("evals",), query)


async def evaluation(request: web.Request) -> web.StreamResponse:
    only(request, "GET")
    server = request.app[SERVER_KEY]
    store = server.store
    rest = request.match_info["rest"]
    if rest.endswith("/allocations"):
        eval_id = rest[: -len("/allocations")]

        def query() -> tuple[Any, int]:
            allocs = [alloc_stub(a) for a in store.allocs.values() if a["EvalID"] == eval_id]
            return allocs, store.table_index["allocs"]

        return await blocking(request, ("allocs",), query)
    eval_id = rest

    def fetch() -> Json:
        found = store.evals.get(eval_id)
        if found is None:
            raise ApiError(404, "eval not found")
        if bool_param(request, "related"):
            related = [
                {
                    k: e[k]
                    for k in (
                        "ID",
                        "Namespace",
                        "JobID",
                        "Status",
                        "TriggeredBy",
                        "CreateIndex",
                        "ModifyIndex",
                    )
                }
                for e in store.evals_for_job(found["Namespace"], found["JobID"])
                if e["ID"] in (found["PreviousEval"], found["NextEval"], found["BlockedEval"])
            ]
            return {**found, "RelatedEvals": related}
        return found

    return await blocking(
        request, ("evals",), object_query(server, fetch, lambda e: e["ModifyIndex"], "evals")
    )


async def allocations(request: web.Request) -> web.StreamResponse:
    only(request, "GET")
    server = request.app[SERVER_KEY]
    store = server.store
    prefix = request.query.get("prefix", "")
    namespace = namespace_param(request)
    resources = bool_param(request, "resources")
    task_states = bool_param(request, "task_states", default=True)
    reverse = bool_param(request, "reverse")

    def query() -> tuple[Any, int]:
        out = []
        for alloc in store.allocs.values():
            if alloc["ID"].startswith(prefix) and ns_matches(alloc, namespace):
                stub = alloc_stub(alloc, resources)
                if not task_states:
                    stub["TaskStates"] = None
                out.append(stub)
        out.sort(key=lambda a: a["CreateIndex"], reverse=reverse)
        return out, store.table_index["allocs"]

    return await blocking(request, ("allocs",), query)


async def allocation(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER_KEY]
    store = server.store
    rest = request.match_info["rest"]
    if rest.endswith("/stop"):
        only(request, "PUT", "POST")
        return write_response(server.stop_alloc(rest[: -len("/stop")]), request)
    only(request, "GET")

    def fetch() -> Json:
        found = store.allocs.get(rest)
        if found is None:
            raise ApiError(404, "alloc not found")
        return found

    return await blocking(
        request, ("allocs",), object_query(server, fetch, lambda a: a["ModifyIndex"], "allocs")
    )


# ----- deployments (command/agent/deployment_endpoint.go) --------------------------------------


async def deployments_list(request: web.Request) -> web.StreamResponse:
    only(request, "GET")
    server = request.app[SERVER_KEY]
    store = server.store
    prefix = request.query.get("prefix", "")
    namespace = namespace_param(request)
    reverse = bool_param(request, "reverse")

    def query() -> tuple[Any, int]:
        out = [
            d for d in store.deployments.values() if d["ID"].startswith(prefix) and ns_matches(d, namespace)
        ]
        out.sort(key=lambda d: d["CreateIndex"], reverse=reverse)
        return out, store.table_index[deployments.TABLE]

    return await blocking(request, (deployments.TABLE,), query)


async def deployment(request: web.Request) -> web.StreamResponse:
    """`/v1/deployment/<id>` and its actions, dispatched on the prefix as Nomad does."""
    server = request.app[SERVER_KEY]
    store = server.store
    rest = request.match_info["rest"]
    action, _, deployment_id = rest.partition("/")
    if action in ("fail", "pause", "promote") and deployment_id:
        only(request, "PUT", "POST")
        body = await read_body(request)
        if action != "fail":
            given = body.get("DeploymentID") if isinstance(body, dict) else None
            if not given:
                raise ApiError(400, "DeploymentID must be specified")
            if given != deployment_id:
                raise ApiError(400, "Deployment ID does not match")
        if action == "fail":
            return write_response(server.fail_deployment(deployment_id), request)
        if action == "pause":
            return write_response(server.pause_deployment(deployment_id, body), request)
        return write_response(server.promote_deployment(deployment_id, body), request)
    if action == "allocations" and deployment_id:
        only(request, "GET")

        def allocs_query() -> tuple[Any, int]:
            found = [alloc_stub(a) for a in store.allocs.values() if a.get("DeploymentID") == deployment_id]
            return found, store.table_index["allocs"]

        return await blocking(request, ("allocs",), allocs_query)
    only(request, "GET")
    return await blocking(
        request,
        (deployments.TABLE,),
        object_query(server, lambda: server.deployment(rest), lambda d: d["ModifyIndex"], deployments.TABLE),
    )
