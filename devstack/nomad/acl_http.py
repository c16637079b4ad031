"""Nomad ACLs over HTTP: the `/v1/acl/...` endpoints, and the check every other request passes.

The token comes as command/agent/http.go `parseToken` reads it: `X-Nomad-Token` (trimmed), else
`Authorization: Bearer <token>`; there is no `?token=`. An unknown token answers 403 "ACL token
not found", a token without the capability 403 "Permission denied" (`errCodeFromHandler`).

The capability each endpoint needs is in ENDPOINTS below, each taken from the RPC handler that
the HTTP endpoint calls in hashicorp/nomad 2.0.6-dev (commit aa026cc):
- nomad/job_endpoint.go: Job.List `list-jobs`; GetJob, Allocations, Evaluations, Deployments,
  LatestDeployment, Summary, GetJobVersions, Validate `read-job`; Register `submit-job` or
  `register-job`; Deregister `submit-job`, `purge-job` or `deregister-job`; Plan `submit-job`
  or `plan-job`; Evaluate `submit-job` or `evaluate-job`; Scale `scale-job` or `submit-job`;
  ScaleStatus `read-job-scaling` or `read-job`; Dispatch `dispatch-job`; periodic.go Force
  `submit-job` or `force-periodic-job`.
- command/agent/job_endpoint.go `JobsParseRequest`: `parse-job` or `submit-job`.
- nomad/alloc_endpoint.go, eval_endpoint.go, deployment_endpoint.go (reads): `read-job`;
  Alloc.Stop `alloc-lifecycle`; Deployment.Fail/Pause/Promote `submit-job` or
  `fail-`/`pause-`/`promote-deployment`.
- nomad/node_endpoint.go: List and GetNode `AllowNodeRead`, drain and eligibility
  `AllowNodeWrite`; nomad/client_meta_endpoint.go: Read `AllowNodeRead`, Apply `AllowNodeWrite`.
- client/fs_endpoint.go `logs`: `read-fs` or `read-logs` in the allocation's namespace.
- nomad/event_endpoint.go `validateNsOp`: Job/Allocation/Evaluation/Deployment/Service and
  CSIPlugin topics `read-job`, HostVolume `host-volume-read`, CSIVolume `csi-read-volume`, Node
  `AllowNodeRead`, Operator `AllowOperatorRead`; Variable and any other (and `*`) management
  here (Nomad allows Variable with any variables rule, which the stand-in cannot express).
- nomad/operator_endpoint.go: scheduler configuration `AllowOperatorRead`/`Write`;
  nomad/system_endpoint.go GC, namespace writes, and the ACL writes: management.
- command/agent/agent_endpoint.go `/v1/agent/self`: `AllowAgentRead`; `/v1/status/*`: none.
Variables need a `variables` rule, which the stand-in's policies cannot express yet: management.
An endpoint not listed needs a management token, so a stand-in gap never grants more than Nomad.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from aiohttp import web

from devstack.nomad.acl import (
    ACL,
    ERR_PERMISSION_DENIED,
    ERR_TOKEN_NOT_FOUND,
    AclState,
    PolicyError,
)
from devstack.nomad.answers import ApiError
from devstack.nomad.httpbase import SERVER_KEY, json_response, namespace_param, read_body

Json = dict[str, Any]
ACL_KEY: web.AppKey[AclState] = web.AppKey("acl_state", AclState)
TOKEN_KEY = "devstack_acl_token"

Check = Callable[[ACL, web.Request], bool]
READ = ("GET", "HEAD")


def ns(*caps: str) -> Check:
    return lambda acl, request: acl.allow_ns_op(namespace_param(request), *caps)


def block(name: str, level: str) -> Check:
    return lambda acl, _request: acl.allow(name, level)


def anyone(_acl: ACL, _request: web.Request) -> bool:
    return True


def management(acl: ACL, _request: web.Request) -> bool:
    return acl.management


def _logs(acl: ACL, request: web.Request) -> bool:
    alloc = request.app[SERVER_KEY].store.allocs.get(request.match_info.get("alloc", ""))
    namespace = alloc["Namespace"] if alloc else namespace_param(request)
    return acl.allow_ns_op(namespace, "read-fs", "read-logs")


_EVENT_NS_TOPICS = {
    "Job": "read-job",
    "Allocation": "read-job",
    "Evaluation": "read-job",
    "Deployment": "read-job",
    "Service": "read-job",
    "CSIPlugin": "read-job",
    "HostVolume": "host-volume-read",
    "CSIVolume": "csi-read-volume",
}


def _events(acl: ACL, request: web.Request) -> bool:
    topics = {t.split(":", 1)[0] for t in request.query.getall("topic", [])} or {"*"}
    for topic in topics:
        if topic in _EVENT_NS_TOPICS:
            ok = acl.allow_ns_op(namespace_param(request), _EVENT_NS_TOPICS[topic])
        elif topic == "Node":
            ok = acl.allow("node", "read")
        elif topic == "Operator":
            ok = acl.allow("operator", "read")
        else:
            ok = acl.management
        if not ok:
            return False
    return True


_JOB = r"/v1/job/[^/]+"
# (methods or None for any, path pattern, check); the first match decides.
ENDPOINTS: list[tuple[tuple[str, ...] | None, re.Pattern[str], Check]] = [
    (None, re.compile(p), c)
    for p, c in [
        (r"/v1/status/(leader|peers)", anyone),
        (r"/v1/devstack/.*", anyone),  # the stand-in's own test controls
        (r"/v1/acl/token/self", anyone),
        (r"/v1/jobs/parse", ns("parse-job", "submit-job")),
        (r"/v1/agent/self", block("agent", "read")),
        (r"/v1/event/stream", _events),
        (r"/v1/client/fs/logs/.+", _logs),
        (r"/v1/namespaces", anyone),  # Nomad filters the list by token; the stand-in does not
    ]
] + [
    (READ, re.compile(r"/v1/jobs"), ns("list-jobs")),
    (None, re.compile(r"/v1/jobs"), ns("submit-job", "register-job")),
    (READ, re.compile(_JOB + r"/scale"), ns("read-job-scaling", "read-job")),
    (None, re.compile(_JOB + r"/scale"), ns("scale-job", "submit-job")),
    (None, re.compile(_JOB + r"/dispatch"), ns("dispatch-job")),
    (None, re.compile(_JOB + r"/plan"), ns("submit-job", "plan-job")),
    (None, re.compile(_JOB + r"/evaluate"), ns("submit-job", "evaluate-job")),
    (None, re.compile(_JOB + r"/periodic/force"), ns("submit-job", "force-periodic-job")),
    (READ, re.compile(_JOB + r"(/.*)?"), ns("read-job")),
    (("DELETE",), re.compile(_JOB), ns("submit-job", "purge-job", "deregister-job")),
    (("PUT", "POST"), re.compile(_JOB), ns("submit-job", "register-job")),
    (None, re.compile(r"/v1/validate/job"), ns("read-job")),
    (None, re.compile(r"/v1/allocation/[^/]+/stop"), ns("alloc-lifecycle")),
    (READ, re.compile(r"/v1/(allocations|allocation/.+)"), ns("read-job")),
    (READ, re.compile(r"/v1/(evaluations|evaluation/.+)"), ns("read-job")),
    (READ, re.compile(r"/v1/(deployments|deployment/.+)"), ns("read-job")),
    (None, re.compile(r"/v1/deployment/fail/.+"), ns("submit-job", "fail-deployment")),
    (None, re.compile(r"/v1/deployment/pause/.+"), ns("submit-job", "pause-deployment")),
    (None, re.compile(r"/v1/deployment/promote/.+"), ns("submit-job", "promote-deployment")),
    (READ, re.compile(r"/v1/(nodes|node/.+)"), block("node", "read")),
    (None, re.compile(r"/v1/node/.+"), block("node", "write")),
    (READ, re.compile(r"/v1/client/metadata"), block("node", "read")),
    (None, re.compile(r"/v1/client/metadata"), block("node", "write")),
    (READ, re.compile(r"/v1/operator/scheduler/configuration"), block("operator", "read")),
    (None, re.compile(r"/v1/operator/scheduler/configuration"), block("operator", "write")),
    (READ, re.compile(r"/v1/namespace/.+"), lambda acl, r: acl.allow_namespace(r.match_info.get("name", ""))),
]


def required(request: web.Request) -> Check:
    for methods, pattern, check in ENDPOINTS:
        if (methods is None or request.method in methods) and pattern.fullmatch(request.path):
            return check
    return management


def request_token(request: web.Request) -> str:
    """command/agent/http.go `parseToken`."""
    token = request.headers.get("X-Nomad-Token", "").strip()
    if token:
        return token
    parts = request.headers.get("Authorization", "").split(" ")
    if len(parts) > 1 and parts[0].lower() == "bearer":
        return " ".join(parts[1:]).strip().split(" ")[0].strip()
    return ""


@web.middleware
async def acl_middleware(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    state = request.app[ACL_KEY]
    try:
        token, acl = state.resolve(request_token(request))
    except LookupError:
        raise ApiError(403, ERR_TOKEN_NOT_FOUND) from None
    if not required(request)(acl, request):
        raise ApiError(403, ERR_PERMISSION_DENIED)
    request[TOKEN_KEY] = token
    response: web.StreamResponse = await handler(request)
    return response


# ----- /v1/acl/... (command/agent/acl_endpoint.go) ----------------------------------------------


def _indexed(index: int) -> web.Response:
    return web.Response(headers={"X-Nomad-Index": str(index)})


async def acl_policies(request: web.Request) -> web.StreamResponse:
    state = request.app[ACL_KEY]
    stubs = [
        {k: v for k, v in p.items() if k not in ("Rules", "RulesJSON")}
        for _, p in sorted(state.policies.items())
    ]
    return json_response(stubs, request, max([p["ModifyIndex"] for p in stubs], default=1))


async def acl_policy(request: web.Request) -> web.StreamResponse:
    state = request.app[ACL_KEY]
    name = request.match_info["name"]
    if request.method in READ:
        policy = state.policies.get(name)
        if policy is None:
            raise ApiError(404, "ACL policy not found")
        return json_response(policy, request, policy["ModifyIndex"])
    if request.method in ("PUT", "POST"):
        body = await read_body(request) or {}
        if body.get("Name") and body["Name"] != name:
            raise ApiError(400, "ACL policy name does not match request path")
        try:
            index = state.upsert_policy({**body, "Name": name})
        except PolicyError as exc:
            raise ApiError(400, str(exc)) from None
        return _indexed(index)
    if request.method == "DELETE":
        return _indexed(state.delete_policy(name))
    raise ApiError(405, "Invalid method")


async def acl_token_create(request: web.Request) -> web.StreamResponse:
    if request.method not in ("PUT", "POST"):
        raise ApiError(405, "Invalid method")
    state = request.app[ACL_KEY]
    body = await read_body(request) or {}
    if body.get("AccessorID"):
        raise ApiError(400, "Token cannot be updated through this endpoint")
    try:
        token = state.create_token(body)
    except PolicyError as exc:
        raise ApiError(400, str(exc)) from None
    return json_response(token, request, token["ModifyIndex"])


async def acl_token_self(request: web.Request) -> web.StreamResponse:
    token = request.get(TOKEN_KEY)
    if token is None:  # the anonymous identity has no token: aclTokenSelf's 404
        raise ApiError(404, ERR_TOKEN_NOT_FOUND)
    return json_response(token, request, token["ModifyIndex"])


def enable(app: web.Application, bootstrap_secret: str) -> None:
    """Turn ACLs on: `bootstrap_secret` is the management token, as `nomad acl bootstrap` gives."""
    app[ACL_KEY] = state = AclState(app[SERVER_KEY].store, bootstrap_secret)
    server = app[SERVER_KEY]
    server.acl = state
    if server.client is not None:
        server.client.acl = state
    app.middlewares.append(acl_middleware)  # inside errors_middleware, which renders its 403s
    app.router.add_route("*", "/v1/acl/policies", acl_policies)
    app.router.add_route("*", "/v1/acl/policy/{name}", acl_policy)
    app.router.add_route("*", "/v1/acl/token", acl_token_create)
    app.router.add_route("GET", "/v1/acl/token/self", acl_token_self)
