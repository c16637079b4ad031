"""What every stand-in endpoint shares (`command/agent/http.go`): query parsing, Nomad's
response headers and plain-text errors, and blocking queries that wait on the store's tables.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from devstack.nomad.answers import NAMESPACE, ApiError
from devstack.nomad.encode import dumps, dumps_pretty, parse_go_duration
from devstack.nomad.server import NomadServer

Json = dict[str, Any]
log = logging.getLogger("devstack.nomad.http")

DEFAULT_WAIT_S = 300.0  # DefaultBlockingRPCQueryTime
MAX_WAIT_S = 300.0  # MaxBlockingRPCQueryTime
JITTER_FRACTION = 16

SERVER_KEY: web.AppKey[NomadServer] = web.AppKey("nomad_server", NomadServer)
HTTP_ADDR_KEY: web.AppKey[str] = web.AppKey("http_addr", str)
RPC_ADDR_KEY: web.AppKey[str] = web.AppKey("rpc_addr", str)
HEARTBEAT_KEY: web.AppKey[float] = web.AppKey("event_heartbeat_s", float)

# A query returns (body or error, index); an error is returned, not raised, so a blocking read
# of something that does not exist yet keeps waiting for it, as Nomad's blockingRPC does.
Query = Callable[[], tuple[Any, int]]


# ----- parsing -------------------------------------------------------------------------------


def bool_param(request: web.Request, name: str, default: bool = False) -> bool:
    """Go's strconv.ParseBool, which is what Nomad parses these flags with."""
    value = request.query.get(name)
    if value is None or value == "":
        return default
    if value in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if value in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise ApiError(400, f'Failed to parse value of "{name}" ({value}) as a bool: invalid syntax')


def namespace_param(request: web.Request) -> str:
    return request.query.get("namespace") or NAMESPACE


def ns_matches(obj: Json, namespace: str) -> bool:
    return namespace == "*" or obj.get("Namespace") == namespace


async def read_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"Request decode failed: {exc}") from None


def json_response(
    obj: Any, request: web.Request, index: int | None = None, status: int = 200
) -> web.Response:
    body = dumps_pretty(obj) if "pretty" in request.query else dumps(obj)
    headers = {}
    if index is not None:
        headers = {"X-Nomad-Index": str(index), "X-Nomad-KnownLeader": "true", "X-Nomad-LastContact": "0"}
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def write_response(obj: Json, request: web.Request) -> web.Response:
    return web.Response(
        body=dumps_pretty(obj) if "pretty" in request.query else dumps(obj),
        content_type="application/json",
        headers={"X-Nomad-Index": str(obj.get("Index", 0))},
    )


def error_response(code: int, message: str) -> web.Response:
    return web.Response(status=code, text=message, content_type="text/plain")


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return error_response(exc.code, exc.message)
    except web.HTTPMethodNotAllowed:
        return error_response(405, "Invalid method")
    except web.HTTPNotFound:
        return error_response(404, "Invalid URL")
    except web.HTTPException:
        raise
    except Exception as exc:
        # A request the stand-in cannot handle answers 500 with the reason, as Nomad's plain
        # errors do, and leaves the server running for the next one.
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"{type(exc).__name__}: {exc}")


async def blocking(request: web.Request, tables: Iterable[str], query: Query) -> web.Response:
    """Run `query`; with `index`, wait until its index passes it or `wait` runs out."""
    server = request.app[SERVER_KEY]
    store = server.store
    tables = tuple(tables)
    try:
        min_index = int(request.query.get("index", "0") or 0)
    except ValueError:
        raise ApiError(400, "Invalid index") from None
    wait_s = DEFAULT_WAIT_S
    if "wait" in request.query:
        try:
            wait_s = parse_go_duration(request.query["wait"]) / 1e9
        except ValueError:
            raise ApiError(400, "Invalid wait time") from None
        if wait_s <= 0:
            wait_s = DEFAULT_WAIT_S
    wait_s = min(wait_s, MAX_WAIT_S)
    wait_s += random.random() * wait_s / JITTER_FRACTION
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        result, index = query()
        remaining = deadline - loop.time()
        if min_index <= 0 or index > min_index or remaining <= 0:
            break
        await store.wait(tables, store.max_index(tables), remaining)
    index = max(index, 1)
    if isinstance(result, ApiError):
        response = error_response(result.code, result.message)
        response.headers["X-Nomad-Index"] = str(index)
        return response
    return json_response(result, request, index)


def object_query(
    server: NomadServer, fn: Callable[[], Any], index_of: Callable[[Any], int], table: str
) -> Query:
    """A query for one object: its own ModifyIndex, or the table's when it is missing."""

    def query() -> tuple[Any, int]:
        try:
            obj = fn()
        except ApiError as exc:
            return exc, server.store.table_index[table]
        return obj, index_of(obj)

    return query


def only(request: web.Request, *methods: str) -> None:
    if request.method not in methods:
        raise ApiError(405, "Invalid method")
