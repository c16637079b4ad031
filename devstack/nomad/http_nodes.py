"""Nodes over the stand-in (`command/agent/node_endpoint.go`, `node_meta_endpoint.go`), and the
stand-in's own `/v1/devstack/node` that puts a simulated node."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from devstack.nomad.answers import ApiError
from devstack.nomad.encode import alloc_stub
from devstack.nomad.httpbase import (
    SERVER_KEY,
    blocking,
    bool_param,
    json_response,
    object_query,
    only,
    read_body,
    write_response,
)
from devstack.nomad.nodes import node_stub

Json = dict[str, Any]


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
