"""Templates that read Nomad Variables, as consul-template's Nomad functions render them for a
task (Nomad's client/allocrunner/taskrunner/template/template.go hands them the task's
workload identity; hashicorp/consul-template dependency/nomad_var_get.go, nomad_var_list.go
and funcs.go `nomadVarExistsFunc`).

The subset llmgw renders and no more, each piece failing loudly when something else is asked:

    {{ if nomadVarExists "PATH" }} ... {{ end }}
    {{ with nomadVar "PATH" }} ... {{ .KEY }} ... {{ end }}
    {{ range $k, $v := nomadVar "PATH" }}{{ $k }}={{ $v }}{{ end }}
    {{ env "NAME" }}

`{{-` and `-}}` trim the whitespace beside them, as Go's text/template does. A `nomadVar` of a
Variable that does not exist would make Nomad wait for it; the stand-in cannot wait in a
prestart hook, so it fails the template with a message that says so (llmgw guards its lookups
with `nomadVarExists`).

With ACLs on, the lookup checks the task's workload identity (acl.py `workload_acl`): a Variable
it may not read fails the template as Nomad's does since hashicorp/nomad#27269 (api/variables.go
no longer turns a 403 into "not found", so consul-template's query errors, `nomadVarExists`'s
too, and after the client's `nomad_retry` the template hook kills the task with "Template
failed: nomad.var.get(PATH@NAMESPACE.global): Unexpected response code: 403 (Permission
denied)"). The stand-in fails at once instead of retrying first.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_IF_EXISTS = re.compile(r'^if\s+nomadVarExists\s+"([^"]+)"$')
_WITH_VAR = re.compile(r'^with\s+nomadVar\s+"([^"]+)"$')
_RANGE_VAR = re.compile(r'^range\s+\$(\w+),\s*\$(\w+)\s*:=\s*nomadVar\s+"([^"]+)"$')
_ENV = re.compile(r'^env\s+"([^"]+)"$')
_FIELD = re.compile(r"^\.(\w+)$")
_LOCAL = re.compile(r"^\$(\w+)$")

Lookup = Callable[[str], dict[str, str] | None]


class VarTemplateError(Exception):
    pass


class VarDenied(Exception):
    """The lookup's answer for a Variable the task's identity may not read."""

    def __init__(self, path: str, namespace: str) -> None:
        super().__init__(path)
        self.path, self.namespace = path, namespace

    def template_error(self, blocking: bool) -> VarTemplateError:
        # consul-template names its dependency nomad.var.get (nomadVarExists) or nomad.var.block.
        query = "block" if blocking else "get"
        return VarTemplateError(
            f"nomad.var.{query}({self.path}@{self.namespace}.global): Unexpected response code: 403 (Permission denied)"
        )


def uses_nomad_vars(text: str) -> bool:
    return "nomadVar" in text


@dataclass
class _Node:
    kind: str  # "text", "action", "if", "with", "range", "root"
    arg: tuple[str, ...] = ()
    children: list[_Node] = field(default_factory=list)


def _parse(text: str) -> _Node:
    root = _Node("root")
    stack = [root]
    pos = 0
    pieces: list[tuple[str, str]] = []
    for m in _ACTION.finditer(text):
        before = text[pos : m.start()]
        if m.group(1):
            before = before.rstrip()
        if pieces and pieces[-1][0] == "trim-next":
            pieces.pop()
            before = before.lstrip()
        pieces.append(("text", before))
        pieces.append(("action", m.group(2)))
        if m.group(3):
            pieces.append(("trim-next", ""))
        pos = m.end()
    rest = text[pos:]
    if pieces and pieces[-1][0] == "trim-next":
        pieces.pop()
        rest = rest.lstrip()
    pieces.append(("text", rest))
    for kind, body in pieces:
        if kind == "text":
            if body:
                stack[-1].children.append(_Node("text", (body,)))
            continue
        if m_if := _IF_EXISTS.match(body):
            node = _Node("if", (m_if.group(1),))
        elif m_with := _WITH_VAR.match(body):
            node = _Node("with", (m_with.group(1),))
        elif m_range := _RANGE_VAR.match(body):
            node = _Node("range", (m_range.group(1), m_range.group(2), m_range.group(3)))
        elif body == "end":
            if len(stack) == 1:
                raise VarTemplateError("template: unexpected {{ end }}")
            stack.pop()
            continue
        else:
            stack[-1].children.append(_Node("action", (body,)))
            continue
        stack[-1].children.append(node)
        stack.append(node)
    if len(stack) != 1:
        raise VarTemplateError("template: unexpected EOF (a block without {{ end }})")
    return root


def render_nomad_vars(text: str, lookup: Lookup, env: dict[str, str]) -> str:
    out: list[str] = []

    def need(path: str) -> dict[str, str]:
        try:
            items = lookup(path)
        except VarDenied as denied:
            raise denied.template_error(blocking=True) from None
        if items is None:
            raise VarTemplateError(
                f'nomadVar "{path}": no such Variable; Nomad would wait for it, the stand-in does not '
                "(guard the lookup with nomadVarExists)"
            )
        return items

    def walk(node: _Node, dot: dict[str, str] | None, scope: dict[str, str]) -> None:
        for child in node.children:
            if child.kind == "text":
                out.append(child.arg[0])
            elif child.kind == "if":
                try:
                    found = lookup(child.arg[0])
                except VarDenied as denied:
                    raise denied.template_error(blocking=False) from None
                if found is not None:
                    walk(child, dot, scope)
            elif child.kind == "with":
                items = need(child.arg[0])
                if items:
                    walk(child, items, scope)
            elif child.kind == "range":
                key_name, value_name, path = child.arg
                for key, value in sorted(need(path).items()):
                    walk(child, dot, {**scope, key_name: key, value_name: value})
            else:
                out.append(_action(child.arg[0], dot, scope, env))

    walk(_parse(text), None, {})
    return "".join(out)


def _action(body: str, dot: dict[str, str] | None, scope: dict[str, str], env: dict[str, str]) -> str:
    if m := _ENV.match(body):
        return env.get(m.group(1), "")
    if (m := _FIELD.match(body)) and dot is not None:
        return dot.get(m.group(1), "<no value>")
    if (m := _LOCAL.match(body)) and m.group(1) in scope:
        return scope[m.group(1)]
    raise VarTemplateError(
        f"template action {{{{ {body} }}}} is not supported by the Nomad stand-in's Variable templates"
    )
