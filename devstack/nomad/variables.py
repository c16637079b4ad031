"""Nomad Variables: `GET /v1/vars`, and `GET|PUT|DELETE /v1/var/<path>` with `cas`.

As hashicorp/nomad does it: command/agent/variable_endpoint.go (the handlers and their texts),
nomad/variables_endpoint.go (`canonicalizeAndValidate`), nomad/structs/variables.go (the path
rule and the JSON of `VariableMetadata` and `VariableDecrypted`) and
nomad/state/state_store_variables.go (check-and-set). The stand-in keeps the items in memory,
unencrypted; locks are left out, as llmgw and its docs use none. The path rule matters most:
a path Nomad refuses (a model name's dot) must be refused here too, or the docs can name one.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from devstack.nomad.answers import ApiError
from devstack.nomad.httpbase import (
    SERVER_KEY,
    blocking,
    json_response,
    namespace_param,
    ns_matches,
    read_body,
)

Json = dict[str, Any]

TABLE = "variables"
VALID_PATH = re.compile(r"[a-zA-Z0-9\-_~/]{1,128}")  # structs.validVariablePath
MAX_SIZE = 64 * 1024  # structs.maxVariableSize
_RPC_CODED = "RPC Error:: "  # structs.errRPCCodedErrorPrefix


def path_error(path: str) -> str | None:
    """`structs.ValidatePath`'s error, or None for a path Nomad accepts."""
    if not path:
        return "variable requires path"
    if not VALID_PATH.fullmatch(path):
        return f'invalid path "{path}"'
    parts = path.split("/")
    if parts[0] != "nomad":
        return None
    if len(parts) == 1:
        return (
            '"nomad" is a reserved top-level directory path, but you may write variables to '
            '"nomad/jobs", "nomad/job-templates", "nomad/sentinel", or below'
        )
    if parts[1] in ("jobs", "sentinel") or (parts[1] == "job-templates" and len(parts) == 3):
        return None
    if parts[1] == "job-templates":
        return (
            '"nomad/job-templates" is a reserved directory path, but you may write variables at the '
            'level below it, for example, "nomad/job-templates/template-name"'
        )
    return (
        'only paths at "nomad/jobs" or "nomad/job-templates" and below are valid paths under the '
        'top-level "nomad" directory'
    )


def _invalid(message: str) -> ApiError:
    # Validate's error is coded twice on its way out (canonicalizeAndValidate, then Apply), and
    # the HTTP layer strips only the outer prefix: operators see one "RPC Error:: 400," left.
    return ApiError(400, f"{_RPC_CODED}400,{message}")


def metadata(var: Json) -> Json:
    return {
        k: var[k] for k in ("Namespace", "Path", "CreateIndex", "CreateTime", "ModifyIndex", "ModifyTime")
    }


class Variables:
    """The variables table, written through the state store so its index moves with the rest."""

    def __init__(self, request: web.Request) -> None:
        self.server = request.app[SERVER_KEY]
        self.store = self.server.store
        self.table = self.store.variables

    def get(self, namespace: str, path: str) -> Json | None:
        return self.table.get((namespace, path))

    def listed(self, namespace: str, prefix: str) -> list[Json]:
        found = [v for (ns, p), v in self.table.items() if ns_matches(v, namespace) and p.startswith(prefix)]
        return [metadata(v) for v in sorted(found, key=lambda v: (v["Namespace"], v["Path"]))]

    def put(self, namespace: str, path: str, items: dict[str, str]) -> Json:
        now = self.server.clock.now_ns()
        index = self.store.next_index()
        old = self.get(namespace, path)
        var = {
            "Namespace": namespace,
            "Path": path,
            "CreateIndex": old["CreateIndex"] if old else index,
            "CreateTime": old["CreateTime"] if old else now,
            "ModifyIndex": index,
            "ModifyTime": now,
            "Items": dict(items),
        }
        self.table[(namespace, path)] = var
        self.store._touch(TABLE)
        return var

    def delete(self, namespace: str, path: str) -> int:
        self.table.pop((namespace, path), None)
        return self.store._touch(TABLE)

    def conflict(self, namespace: str, path: str, cas: int) -> Json | None:
        """`varSetCASTxn`: the variable the caller did not expect (items withheld), or None."""
        existing = self.get(namespace, path)
        if existing is None:
            if cas == 0:
                return None
            return metadata(
                {
                    "Namespace": namespace,
                    "Path": path,
                    **dict.fromkeys(("CreateIndex", "CreateTime", "ModifyIndex", "ModifyTime"), 0),
                }
            )
        return None if existing["ModifyIndex"] == cas else metadata(existing)


def _cas(request: web.Request) -> int | None:
    raw = request.query.get("cas", "")
    if not raw:
        return None
    if not raw.isdigit():
        raise ApiError(400, f'can not parse cas: strconv.ParseUint: parsing "{raw}": invalid syntax')
    return int(raw)


def _items(body: Any) -> tuple[str, dict[str, str]]:
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ApiError(400, "json: cannot unmarshal into Go value of type structs.VariableDecrypted")
    items = body.get("Items") or {}
    if not isinstance(items, dict) or not all(isinstance(v, str) for v in items.values()):
        raise ApiError(400, "json: cannot unmarshal Items into Go struct field of type string")
    return str(body.get("Namespace") or ""), items


async def variables_list(request: web.Request) -> web.StreamResponse:
    if request.method != "GET":
        raise ApiError(405, "Invalid method")
    variables = Variables(request)
    namespace, prefix = namespace_param(request), request.query.get("prefix", "")

    def query() -> tuple[Any, int]:
        return variables.listed(namespace, prefix), variables.store.table_index[TABLE]

    return await blocking(request, (TABLE,), query)


async def variable_specific(request: web.Request) -> web.StreamResponse:
    path = request.match_info["path"]
    if not path:
        raise ApiError(400, "missing variable path")
    variables = Variables(request)
    namespace = namespace_param(request)
    if request.method == "GET":

        def query() -> tuple[Any, int]:
            var = variables.get(namespace, path)
            if var is None:
                return ApiError(404, "variable not found"), variables.store.table_index[TABLE]
            return var, var["ModifyIndex"]

        return await blocking(request, (TABLE,), query)
    if request.method in ("PUT", "POST"):
        body_ns, items = _items(await read_body(request))
        namespace = body_ns or namespace
        if not items:
            raise ApiError(400, "variable missing required Items object")
        return _upsert(request, variables, namespace, path, items)
    if request.method == "DELETE":
        cas = _cas(request)
        if cas is not None:
            conflict = variables.conflict(namespace, path, cas)
            if conflict is not None:
                return _conflict(request, conflict)
        response = web.Response(status=204, headers={"X-Nomad-Index": str(variables.delete(namespace, path))})
        return response
    raise ApiError(400, "Invalid method")  # the handler's default case answers 400, not 405


def _conflict(request: web.Request, conflict: Json) -> web.Response:
    return json_response(conflict, request, conflict["ModifyIndex"], status=409)


def _upsert(
    request: web.Request, variables: Variables, namespace: str, path: str, items: dict[str, str]
) -> web.Response:
    if namespace == "*":
        raise _invalid('can not target wildcard ("*")namespace')
    if sum(len(k) + len(v) for k, v in items.items()) > MAX_SIZE:
        raise _invalid("variables are limited to 64KiB in total size")
    error = path_error(path)
    if error:
        raise _invalid(error)
    cas = _cas(request)
    if cas is not None:
        conflict = variables.conflict(namespace, path, cas)
        if conflict is not None:
            return _conflict(request, conflict)
    var = variables.put(namespace, path, items)
    return json_response(var, request, var["ModifyIndex"])


def add_routes(app: web.Application) -> None:
    app.router.add_route("*", "/v1/vars", variables_list)
    app.router.add_route("*", "/v1/var/{path:.*}", variable_specific)
