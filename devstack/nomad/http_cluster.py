"""The cluster-wide endpoints over the stand-in: namespaces, forced GC, the scheduler
configuration, status and `/v1/agent/self`."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from devstack.nomad import namespaces
from devstack.nomad.answers import ApiError
from devstack.nomad.httpbase import (
    HTTP_ADDR_KEY,
    RPC_ADDR_KEY,
    SERVER_KEY,
    blocking,
    json_response,
    object_query,
    only,
    read_body,
    write_response,
)
from devstack.nomad.nodes import NOMAD_VERSION
from devstack.nomad.operator import SchedulerConfigError

Json = dict[str, Any]


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
