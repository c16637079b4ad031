"""Nomad's HTTP API over the stand-in (`command/agent/*_endpoint.go`): the same paths, methods,
JSON, status codes and plain-text error bodies; reads are blocking queries (see `httpbase`), the
event stream and logs live in `streams`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from devstack.nomad import deployments, namespaces, variables
from devstack.nomad.encode import alloc_stub, job_stub
from devstack.nomad.httpbase import (
    HEARTBEAT_KEY,
    HTTP_ADDR_KEY,
    RPC_ADDR_KEY,
    SERVER_KEY,
    blocking,
    bool_param,
    errors_middleware,
    json_response,
    namespace_param,
    ns_matches,
    object_query,
    only,
    read_body,
    write_response,
)
from devstack.nomad.jobplan import job_plan
from devstack.nomad.nodes import NOMAD_VERSION, node_stub
from devstack.nomad.operator import SchedulerConfigError
from devstack.nomad.server import ApiError, NomadServer
from devstack.nomad.streams import EVENT_HEARTBEAT_S, event_stream, fs_logs

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


# ----- namespaces (command/agent/namespace_endpoint.go) --------------------------------------


async def namespaces_list(request: web.Request) -> web.StreamResponse:
    only(request, "GET")
    store = request.app[SERVER_KEY].store
    prefix = request.query.get("prefix", "")

    def query() -> tuple[Any, int]:
        found = [ns for name, ns in sorted(store.namespaces.items()) if name.startswith(prefix)]
        return found, store.table_index[namespaces.TABLE]

    return await blocking(request, (namespaces.TABLE,), query)


async def namespace_specific(request: web.Request) -> web.StreamResponse:
    """`/v1/namespace` (create, the name in the body) and `/v1/namespace/<name>`."""
    server = request.app[SERVER_KEY]
    name = request.match_info.get("name", "")
    if request.method == "GET" and name:

        def get() -> Any:
            found = server.store.namespaces.get(name)
            if found is None:
                raise ApiError(404, "Namespace not found")
            return found

        query = object_query(server, get, lambda ns: ns["ModifyIndex"], namespaces.TABLE)
        return await blocking(request, (namespaces.TABLE,), query)
    if request.method in ("PUT", "POST"):
        index = server.upsert_namespace(await read_body(request), name)
    elif request.method == "DELETE" and name:
        index = server.delete_namespace(name)
    else:
        raise ApiError(405, "Invalid method")
    # Nomad's handler returns no object for a namespace write: an empty body and the index.
    return web.Response(status=200, headers={"X-Nomad-Index": str(index)})


# ----- nodes ---------------------------------------------------------------------------------


async def nodes(request: web.Request) -> web.StreamResponse:
    only(request, "GET")
    server = request.app[SERVER_KEY]
    store = server.store
    prefix = request.query.get("prefix", "")
    resources = bool_param(request, "resources")
    with_os = bool_param(request, "os")

    def query() -> tuple[Any, int]:
        out = [
            node_stub(n, resources=resources, os=with_os)
            for n in sorted(store.nodes.values(), key=lambda n: n["ID"])
            if n["ID"].startswith(prefix)
        ]
        return out, store.table_index["nodes"]

    return await blocking(request, ("nodes",), query)


async def node(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER_KEY]
    store = server.store
    rest = request.match_info["rest"]
    if rest.endswith("/allocations"):
        only(request, "GET")
        node_id = rest[: -len("/allocations")]

        def query() -> tuple[Any, int]:
            try:
                found = server.node(node_id)
            except ApiError as exc:
                return exc, store.table_index["nodes"]
            allocs = store.allocs_for_node(found["ID"])
            index = max((a["ModifyIndex"] for a in allocs), default=store.table_index["allocs"])
            return [alloc_stub(a) for a in allocs], index

        return await blocking(request, ("allocs", "nodes"), query)
    if rest.endswith("/eligibility"):
        only(request, "PUT", "POST")
        return write_response(
            server.set_eligibility(rest[: -len("/eligibility")], await read_body(request)), request
        )
    if rest.endswith("/drain"):
        only(request, "PUT", "POST")
        return write_response(server.drain(rest[: -len("/drain")], await read_body(request)), request)
    only(request, "GET")
    return await blocking(
        request,
        ("nodes",),
        object_query(server, lambda: server.node(rest), lambda n: n["ModifyIndex"], "nodes"),
    )


async def devstack_node(request: web.Request) -> web.StreamResponse:
    only(request, "PUT", "POST")
    server = request.app[SERVER_KEY]
    return write_response(server.put_node(await read_body(request)), request)


# ----- the rest ------------------------------------------------------------------------------


async def jobs_parse(request: web.Request) -> web.StreamResponse:
    only(request, "PUT", "POST")
    server = request.app[SERVER_KEY]
    return json_response(server.parse_job(await read_body(request)), request)


async def client_metadata(request: web.Request) -> web.StreamResponse:
    """`/v1/client/metadata` (`command/agent/node_meta_endpoint.go`): GET reads, POST applies.
    Nomad serves it from the client agent the request reaches; behind the stand-in's one address
    sit many simulated nodes, so the node must be named."""
    server = request.app[SERVER_KEY]
    node_id = request.query.get("node_id")
    if request.method == "GET":
        return json_response(server.node_meta(node_id or ""), request)
    if request.method == "POST":
        return json_response(server.apply_node_meta(await read_body(request), node_id), request)
    raise ApiError(405, "Invalid method")


async def validate_job(request: web.Request) -> web.StreamResponse:
    only(request, "PUT", "POST")
    server = request.app[SERVER_KEY]
    return json_response(server.validate(await read_body(request)), request)


async def system_gc(request: web.Request) -> web.StreamResponse:
    """`PUT /v1/system/gc` (`nomad system gc`): Nomad answers 200 with a null body."""
    only(request, "PUT", "POST")
    request.app[SERVER_KEY].force_gc()
    return json_response(None, request)


async def scheduler_configuration(request: web.Request) -> web.StreamResponse:
    """`/v1/operator/scheduler/configuration`: GET `{SchedulerConfig, Index, ...}`; PUT/POST a
    whole configuration (`?cas=` to check-and-set) -> `{Updated, Index}`."""
    only(request, "GET", "PUT", "POST")
    server = request.app[SERVER_KEY]
    config = server.scheduler_config
    if request.method == "GET":
        index = server.store.table_index["scheduler_config"]
        return json_response(
            {"SchedulerConfig": config.get(), "Index": index, "LastContact": 0, "KnownLeader": True},
            request,
            index,
        )
    cas: int | None = None
    if "cas" in request.query:
        try:
            cas = int(request.query["cas"])
        except ValueError as exc:
            raise ApiError(400, f"Error parsing cas value: {exc}") from None
    try:
        updated = config.set(await read_body(request), cas, server.store.next_index())
    except SchedulerConfigError as exc:
        raise ApiError(400, str(exc)) from None
    if updated:
        server.store.scheduler_config_changed()
    return write_response({"Updated": updated, "Index": server.store.index}, request)


async def status_leader(request: web.Request) -> web.StreamResponse:
    return json_response(request.app[RPC_ADDR_KEY], request)


async def status_peers(request: web.Request) -> web.StreamResponse:
    return json_response([request.app[RPC_ADDR_KEY]], request)


async def agent_self(request: web.Request) -> web.StreamResponse:
    addr = request.app[HTTP_ADDR_KEY]
    host, _, port = addr.rpartition(":")
    return json_response(
        {
            "config": {
                "Region": "global",
                "Datacenter": "dc1",
                "NodeName": "devstack-nomad",
                "Version": {"Version": NOMAD_VERSION, "VersionPrerelease": "", "VersionMetadata": "devstack"},
                "Server": {"Enabled": True},
                "Client": {"Enabled": True},
            },
            "member": {
                "Name": "devstack-nomad.global",
                "Addr": host,
                "Port": int(port or 0),
                "Tags": {"region": "global", "dc": "dc1", "role": "nomad", "build": NOMAD_VERSION},
                "Status": "alive",
            },
            "stats": {"nomad": {"leader": "true", "server": "true"}},
        },
        request,
    )


def make_app(
    server: NomadServer, http_addr: str, event_heartbeat_s: float = EVENT_HEARTBEAT_S
) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=64 * 1024 * 1024)
    app[SERVER_KEY] = server
    app[HTTP_ADDR_KEY] = http_addr
    app[RPC_ADDR_KEY] = f"{http_addr.rpartition(':')[0]}:4647"
    app[HEARTBEAT_KEY] = event_heartbeat_s
    route = app.router.add_route
    route("*", "/v1/jobs", jobs)
    route("*", "/v1/jobs/parse", jobs_parse)
    route("*", "/v1/client/metadata", client_metadata)
    route("*", "/v1/job/{rest:.+}", job_specific)
    route("*", "/v1/evaluations", evaluations)
    route("*", "/v1/evaluation/{rest:.+}", evaluation)
    route("*", "/v1/allocations", allocations)
    route("*", "/v1/allocation/{rest:.+}", allocation)
    route("*", "/v1/deployments", deployments_list)
    route("*", "/v1/deployment/{rest:.+}", deployment)
    route("*", "/v1/namespaces", namespaces_list)
    route("*", "/v1/namespace", namespace_specific)
    route("*", "/v1/namespace/{name}", namespace_specific)
    route("*", "/v1/nodes", nodes)
    route("*", "/v1/node/{rest:.+}", node)
    route("*", "/v1/validate/job", validate_job)
    route("*", "/v1/system/gc", system_gc)
    route("*", "/v1/operator/scheduler/configuration", scheduler_configuration)
    route("GET", "/v1/status/leader", status_leader)
    route("GET", "/v1/status/peers", status_peers)
    route("GET", "/v1/agent/self", agent_self)
    route("GET", "/v1/event/stream", event_stream)
    route("GET", "/v1/client/fs/logs/{alloc}", fs_logs)
    route("*", "/v1/devstack/node", devstack_node)
    variables.add_routes(app)
    return app
