"""Nomad's HTTP API over the stand-in (`command/agent/*_endpoint.go`): the same paths, methods,
JSON, status codes and plain-text error bodies; reads are blocking queries (see `httpbase`), the
event stream and logs live in `streams`. The endpoints are grouped by what they serve
(`http_jobs`, `http_allocations`, `http_nodes`, `http_cluster`, `variables`); this module routes
the paths to them.
"""

from __future__ import annotations

from aiohttp import web

from devstack.nomad import variables
from devstack.nomad.http_allocations import (
    allocation,
    allocations,
    deployment,
    deployments_list,
    evaluation,
    evaluations,
)
from devstack.nomad.http_cluster import (
    agent_self,
    namespace_specific,
    namespaces_list,
    scheduler_configuration,
    status_leader,
    status_peers,
    system_gc,
)
from devstack.nomad.http_jobs import job_specific, jobs, jobs_parse, validate_job
from devstack.nomad.http_nodes import client_metadata, devstack_node, node, nodes
from devstack.nomad.httpbase import HEARTBEAT_KEY, HTTP_ADDR_KEY, RPC_ADDR_KEY, SERVER_KEY, errors_middleware
from devstack.nomad.server import NomadServer
from devstack.nomad.streams import EVENT_HEARTBEAT_S, event_stream, fs_logs


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
