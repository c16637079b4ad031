"""The part of consul-template a multi-node replica's leader needs: `service` lookups, and a
restart of the task when their answer changes (`change_mode = "restart"`).

Supported, and nothing more (anything else fails the task, as the plain renderer does):
`{{ range service "TAG.NAME" }}...{{ end }}` and `{{ range $i, $s := service "TAG.NAME" }}...
{{ end }}`, inside which `{{ .Address }}`, `{{ .Port }}`, `{{ $s.Address }}`, `{{ $s.Port }}` and
`{{ if $i }}...{{ end }}`. As consul-template does, a lookup lists the passing instances only, by
the service name and, when given, a tag (`TAG.NAME`: the tag is everything before the last dot).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

Instance = tuple[str, int]  # address, port

_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_RANGE = re.compile(r'^range\s+(?:\$(\w+)\s*,\s*\$(\w+)\s*:=\s*)?service\s+"([^"]+)"$')
_IF = re.compile(r"^if\s+\$(\w+)$")
_LOOKUP = re.compile(r'service\s+"([^"]+)"')


class ServiceTemplateError(Exception):
    pass


def lookups(text: str) -> list[str]:
    """The `service` queries a template makes, in order, each once."""
    seen: list[str] = []
    for query in _LOOKUP.findall(text):
        if query not in seen:
            seen.append(query)
    return seen


def split_query(query: str) -> tuple[str, str]:
    """`job=x.y.llmgw-shard` -> (`llmgw-shard`, `job=x.y`); a name has no dots."""
    tag, _, name = query.rpartition(".")
    return name, tag


def _tokens(text: str) -> list[tuple[str, str]]:
    """("text", ...) and ("action", ...) in order."""
    out: list[tuple[str, str]] = []
    pos = 0
    for m in _ACTION.finditer(text):
        out.append(("text", text[pos : m.start()]))
        out.append(("action", m.group(1).strip()))
        pos = m.end()
    out.append(("text", text[pos:]))
    return out


def render_services(text: str, answers: Mapping[str, Sequence[Instance]], env: Mapping[str, str]) -> str:
    """The template rendered with `answers` for its lookups; `{{ env "NAME" }}` from `env`."""
    tokens = _tokens(text)
    out, rest = _render(tokens, 0, answers, env, {})
    if rest != len(tokens):
        raise ServiceTemplateError("template has an {{ end }} without a block")
    return out


def _skip_block(tokens: list[tuple[str, str]], pos: int) -> int:
    depth = 1
    while pos < len(tokens):
        kind, value = tokens[pos]
        pos += 1
        if kind == "action":
            if value == "end":
                depth -= 1
                if depth == 0:
                    return pos
            elif value.startswith(("range ", "if ")):
                depth += 1
    raise ServiceTemplateError("template block has no {{ end }}")


def _render(
    tokens: list[tuple[str, str]],
    pos: int,
    answers: Mapping[str, Sequence[Instance]],
    env: Mapping[str, str],
    scope: dict[str, Any],
) -> tuple[str, int]:
    """Render from `pos` up to the matching `{{ end }}` (or the end); returns (text, position
    after that end)."""
    out: list[str] = []
    while pos < len(tokens):
        kind, value = tokens[pos]
        pos += 1
        if kind == "text":
            out.append(value)
            continue
        if value == "end":
            return "".join(out), pos
        ranged = _RANGE.match(value)
        cond = _IF.match(value)
        env_match = re.match(r'^env\s+"([^"]+)"$', value)
        if ranged:
            idx_var, item_var, query = ranged.groups()
            end = _skip_block(tokens, pos)
            for i, item in enumerate(answers.get(query, ())):
                inner = dict(scope)
                inner["."] = item
                if idx_var:
                    inner["$" + idx_var] = i
                if item_var:
                    inner["$" + item_var] = item
                text, _ = _render(tokens, pos, answers, env, inner)
                out.append(text)
            pos = end
        elif cond:
            name = "$" + cond.group(1)
            if name not in scope:
                raise ServiceTemplateError(f"template variable {name} is not defined")
            end = _skip_block(tokens, pos)
            if scope[name]:
                text, _ = _render(tokens, pos, answers, env, scope)
                out.append(text)
            pos = end
        elif env_match:
            out.append(env.get(env_match.group(1), ""))
        else:
            field = re.match(r"^(\.|\$\w+)\.?(Address|Port)$", value)
            instance = scope.get(field.group(1)) if field else None
            if field is None or instance is None:
                raise ServiceTemplateError(
                    f"template action {{{{ {value} }}}} is not supported by the Nomad stand-in "
                    "(only env, and range over service with .Address and .Port)"
                )
            out.append(instance[0] if field.group(2) == "Address" else str(instance[1]))
    return "".join(out), pos


# What the template hook hands consul-template for a task without a Consul identity
# (client/allocrunner/taskrunner/template_hook.go), so it never falls back to the agent's token.
NO_IDENTITY_TOKEN = "invalid-token"


class ConsulLookupError(Exception):
    """Consul refused a lookup; the text is consul-template's (dependency, then the API error)."""


async def resolve(
    client: httpx.AsyncClient, queries: Sequence[str], token: str | None = None
) -> dict[str, list[Instance]]:
    """Each query's passing instances from Consul's health endpoint, sorted as consul-template
    sorts them (by node, then service ID: here address and port), so an unchanged set renders
    the same text and restarts nothing. `token` replaces the client's own when given."""
    answers: dict[str, list[Instance]] = {}
    headers = {"X-Consul-Token": token} if token is not None else {}
    for query in queries:
        name, tag = split_query(query)
        params: dict[str, Any] = {"passing": "1"}
        if tag:
            params["tag"] = tag
        resp = await client.get(f"/v1/health/service/{name}", params=params, headers=headers)
        if resp.status_code != 200:
            raise ConsulLookupError(
                f"health.service({query}|passing): Unexpected response code: "
                f"{resp.status_code} ({resp.text.strip()})"
            )
        found = []
        for entry in resp.json() or []:
            service = entry.get("Service") or {}
            address = service.get("Address") or (entry.get("Node") or {}).get("Address") or ""
            found.append((str(address), int(service.get("Port") or 0)))
        answers[query] = sorted(found)
    return answers


POLL_REAL_SECONDS = 0.5


class ServiceWatch:
    """A task's `service` lookups, watched while it runs: when an answer changes and one of its
    templates says `change_mode = "restart"`, the task is restarted (not as a failure: Nomad
    does not count template restarts against the restart policy) and renders afresh."""

    def __init__(self, templates: Sequence[Mapping[str, Any]], token: str | None = None) -> None:
        self.token = token
        self.queries: list[str] = []
        for tmpl in templates:
            for query in lookups(str(tmpl.get("EmbeddedTmpl") or "")):
                if query not in self.queries:
                    self.queries.append(query)
        self.restarts = any(
            lookups(str(t.get("EmbeddedTmpl") or "")) and (t.get("ChangeMode") or "restart") == "restart"
            for t in templates
        )
        self._task: Any = None

    async def first(self, client: httpx.AsyncClient) -> dict[str, list[Instance]]:
        return await resolve(client, self.queries, self.token) if self.queries else {}

    def start(
        self,
        client: httpx.AsyncClient,
        seen: dict[str, list[Instance]],
        running: Any,
        restart: Any,
    ) -> None:
        """Poll Consul; `restart()` (a coroutine function) once the answers differ from `seen`
        while `running()` says the task runs."""
        self.stop()
        if not (self.queries and self.restarts):
            return

        async def loop() -> None:
            while True:
                await asyncio.sleep(POLL_REAL_SECONDS)
                try:
                    now = await resolve(client, self.queries, self.token)
                except (httpx.HTTPError, ConsulLookupError):
                    continue
                if now != seen and running():
                    await restart()
                    return

        self._task = asyncio.get_running_loop().create_task(loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
