"""Finding the Consul and Nomad calls in llmgw's code, for tests/test_terraform.py: the calls
spelled out in a function (python-nomad requesters, API path strings), and, for each `llmgw`
verb, every call reachable from the function that implements it.

Reachability is traced through the source, not imported: from a verb's function, every function
or class of nomad_driver/ and router/ it names is followed (a class with all its methods), and
every method of the Nomad and Consul clients it names (`nomad.get_job`, `consul.kv_put`) adds the
calls that method makes. Conservative on purpose: a name that is only passed along still counts,
so a verb is never credited with fewer calls than it can make.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nomad_driver", "router")
# The two clients whose methods are followed by name wherever they are called.
CLIENTS = (("nomad_driver.nomad", "Nomad"), ("nomad_driver.consul", "Consul"))
# Consul's KV methods, whose first argument is the key: a constant there names the key called.
KV_METHODS = frozenset({"kv_get", "kv_put", "kv_delete"})

# First path segments of Consul's and Nomad's APIs; the router's OpenAI paths (/v1/chat/...,
# /v1/models) and the admin API (/v1/admin/...) are not among them.
API_ROOTS = frozenset(
    [
        "kv",
        "txn",
        "session",
        "health",
        "catalog",
        "agent",
        "acl",
        "status",
        "event",
        "coordinate",
        "query",
        "operator",
        "job",
        "jobs",
        "allocation",
        "allocations",
        "evaluation",
        "evaluations",
        "node",
        "nodes",
        "client",
        "scaling",
        "var",
        "vars",
        "deployment",
        "deployments",
        "search",
        "services",
    ]
)
METHODS = frozenset({"GET", "PUT", "POST", "DELETE"})
# python-nomad requesters whose URL is not their attribute name.
PYNOMAD_PATHS = {
    "client.stream_logs": "client/fs/logs",
    "client.stream_file": "client/fs/stream",
    "client.cat": "client/fs/cat",
    "client.ls": "client/fs/ls",
    "client.stat": "client/fs/stat",
    "client.read_at": "client/fs/readat",
    "event.stream": "event/stream",
}


class ScanError(AssertionError):
    """The scanner met code it does not understand; the test must be taught, not skip it."""


@dataclass(frozen=True)
class ApiCall:
    method: str | None  # None where the scanner cannot tell
    path: str  # with <x> for each part only known at run time
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where} {self.method or '?'} {self.path}"


def _path_of(node: ast.expr) -> str | None:
    """The URL path a string or f-string literal spells, with `<x>` for each interpolation."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "<x>"
            for v in node.values
        )
    return None


def _pynomad_path(args: list[ast.expr]) -> str | None:
    """`_request("job", job_id, "scale", ...)` or `blocking_list("jobs", ...)` -> /v1/job/<x>/scale."""
    endpoint = _path_of(args[0]) if args else None
    if endpoint is None or "<x>" in endpoint:
        return None
    if "." in endpoint and endpoint not in PYNOMAD_PATHS:
        raise ScanError(f"python-nomad requester {endpoint!r}: add its URL to PYNOMAD_PATHS")
    parts = [PYNOMAD_PATHS.get(endpoint, endpoint)]
    parts += [p if (p := _path_of(a)) is not None and "<x>" not in p else "<x>" for a in args[1:]]
    return "/v1/" + "/".join(parts)


def _call_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def api_calls_in(tree: ast.AST, path: Path) -> Iterator[ApiCall]:
    """Each Consul or Nomad call spelled out under `tree`: python-nomad requesters, and every
    string that starts with an API path, wherever it sits (a call's argument, or a table of
    watched endpoints)."""
    rel = path.relative_to(ROOT)
    method_of: dict[int, str | None] = {}  # id(path literal) -> the method its call uses
    inside_fstring: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside_fstring.update(id(v) for v in node.values)
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, list(node.args)
        name = _call_name(func)
        if name == "to_thread" and args and isinstance(args[0], ast.Attribute):
            # asyncio.to_thread(nomad.blocking_list, "nodes", ...): the call is the first argument.
            name, args = args[0].attr, args[1:]
        if name in ("_request", "request_json", "blocking_list") or name.endswith("_list_fetch"):
            # nomad_list_fetch(nomad, "allocations", wait_s) names the collection it lists.
            url = _pynomad_path(args[1:2] if name.endswith("_list_fetch") else args)
            if url is not None:
                method = next(
                    (
                        str(k.value.value).upper()
                        for k in node.keywords
                        if k.arg == "method" and isinstance(k.value, ast.Constant)
                    ),
                    "GET",
                )
                yield ApiCall(method, url, f"{rel}:{node.lineno}")
            continue
        for i, arg in enumerate(node.args):
            before = [
                a.value for a in node.args[:i] if isinstance(a, ast.Constant) and isinstance(a.value, str)
            ]
            verb = next((b.upper() for b in before if b.upper() in METHODS), None)
            method_of[id(arg)] = verb or (name.upper() if name.upper() in METHODS else None)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant | ast.JoinedStr) or id(node) in inside_fstring:
            continue
        url = _path_of(node)
        if url is None or not url.startswith("/v1/") or url[4:].split("/")[0].split("?")[0] not in API_ROOTS:
            continue
        yield ApiCall(method_of.get(id(node)), url, f"{rel}:{node.lineno}")


# --- Tracing a verb ------------------------------------------------------------------------------

# What a module defines at its top level: functions, classes, and assignments (a table of
# endpoints or of handlers is followed like a function).
Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Assign | ast.AnnAssign


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    defs: dict[str, Def] = field(default_factory=dict)
    # local name -> (module, name in it), or (module, None) for `import x.y as z`
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    constants: dict[str, str] = field(default_factory=dict)


def _load(path: Path) -> Module:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    module = Module(name, path, ast.parse(path.read_text(encoding="utf-8")))
    for node in module.tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            module.defs[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if not isinstance(target, ast.Name):
                    continue
                module.defs[target.id] = node
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    module.constants[target.id] = node.value.value
    module.imports = _imports(
        [
            s
            for s in module.tree.body
            if not isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
    )
    return module


def _imports(statements: list[ast.stmt]) -> dict[str, tuple[str, str | None]]:
    """The names `statements` import, those inside them included (a lazy import in a function
    is that function's; the CLI imports each verb's module that way)."""
    found: dict[str, tuple[str, str | None]] = {}
    for statement in statements:
        for node in ast.walk(statement):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    found[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        found[alias.asname] = (alias.name, None)
    return found


class CodeIndex:
    """Every module of nomad_driver/ and router/, parsed once."""

    def __init__(self) -> None:
        loaded = [_load(path) for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
        self.modules = {m.name: m for m in loaded}
        self.client_calls = {
            method: calls
            for module, cls in CLIENTS
            for method, calls in self._client_methods(module, cls).items()
        }

    def _client_methods(self, module_name: str, class_name: str) -> dict[str, list[ApiCall]]:
        """Client method -> the calls it makes, through its own `self.other()` calls too."""
        module = self.modules[module_name]
        cls = module.defs[class_name]
        assert isinstance(cls, ast.ClassDef)
        methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        own = {name: list(api_calls_in(node, module.path)) for name, node in methods.items()}
        uses = {
            name: {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
                and n.attr in methods
            }
            for name, node in methods.items()
        }
        out: dict[str, list[ApiCall]] = {}
        for name in methods:
            seen, todo = {name}, [name]
            while todo:
                for other in uses[todo.pop()] - seen:
                    seen.add(other)
                    todo.append(other)
            calls = [c for m in sorted(seen) for c in own[m]]
            if calls:
                out[name] = calls
        return out

    def resolve(
        self, module: Module, name: str, local: dict[str, tuple[str, str | None]] | None = None
    ) -> tuple[Module, Def] | tuple[Module, None] | None:
        """What `name` in `module` is: imported inside the function being read (`local`), one of
        the module's own definitions, or imported by the module (a module itself for `import x
        as y`), as long as it is llmgw's."""
        if local and name in local:
            target, attr = local[name]
        elif name in module.defs:
            return module, module.defs[name]
        elif name in module.imports:
            target, attr = module.imports[name]
        else:
            return None
        if attr is None:
            return (self.modules[target], None) if target in self.modules else None
        if f"{target}.{attr}" in self.modules:  # `from nomad_driver import spec`
            return self.modules[f"{target}.{attr}"], None
        if target not in self.modules:
            return None
        return self.resolve(self.modules[target], attr)

    def constant(self, module: Module, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if not isinstance(node, ast.Name):
            return None
        if node.id in module.constants:
            return module.constants[node.id]
        target = module.imports.get(node.id)
        if target and target[1] and target[0] in self.modules:
            return self.constant(self.modules[target[0]], ast.Name(id=target[1]))
        return None

    def find(self, module_name: str, qualname: str) -> tuple[Module, Def]:
        module = self.modules[module_name]
        found = module.defs.get(qualname)
        if found is None:
            raise ScanError(f"{module_name}.{qualname} is not a top-level definition the scanner can trace")
        return module, found

    def trace(self, module: Module, start: Def) -> list[ApiCall]:
        """Every Consul and Nomad call reachable from `start`."""
        clients = {cls for _, cls in CLIENTS}
        calls: list[ApiCall] = []
        seen: set[int] = set()
        todo: list[tuple[Module, Def]] = [(module, start)]
        while todo:
            mod, node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            calls += api_calls_in(node, mod.path)
            local = _imports([node]) if not isinstance(node, ast.Assign | ast.AnnAssign) else {}
            keyed: set[int] = set()  # KV method references whose key is known at the call
            # ast.walk visits a call before the attribute it calls, so `keyed` is filled in time.
            for n in ast.walk(node):
                if isinstance(n, ast.Call) and _call_name(n.func) in KV_METHODS and n.args:
                    key = self.constant(mod, n.args[0])
                    if key is not None:
                        keyed.add(id(n.func))
                        calls += [
                            ApiCall(c.method, c.path.replace("/v1/kv/<x>", f"/v1/kv/{key}"), _via(mod, n, c))
                            for c in self.client_calls[_call_name(n.func)]
                        ]
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                    found = self.resolve(mod, n.id, local)
                    if (
                        found is not None
                        and found[1] is not None
                        and getattr(found[1], "name", "") not in clients
                    ):
                        todo.append((found[0], found[1]))
                elif isinstance(n, ast.Attribute):
                    if isinstance(n.value, ast.Name):
                        target = self.resolve(mod, n.value.id, local)
                        if target is not None and target[1] is None and n.attr in target[0].defs:
                            todo.append((target[0], target[0].defs[n.attr]))
                    if id(n) not in keyed:
                        calls += [
                            ApiCall(c.method, c.path, _via(mod, n, c))
                            for c in self.client_calls.get(n.attr, [])
                        ]
        return calls


def _via(module: Module, node: ast.expr, call: ApiCall) -> str:
    """Where a client method is used, and where it makes the call."""
    return f"{module.path.relative_to(ROOT)}:{node.lineno} via {call.where}"
