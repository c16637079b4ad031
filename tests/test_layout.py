"""The rooms of the product and what each may import (docs/design.md, "Rooms"): the root of
nomad_driver holds the contracts and clients every room shares; the watcher, the node agent and
the router each build on those alone; only the CLI knows them all. An import across that line
makes a room drag in another's dependencies (the router loading the watcher's server) or lets
one process start depending on another's internals, so each is refused here, naming the file
and line.

Engines have a package of their own (`nomad_driver/engines/`, one module per engine behind one
registry): everything else asks the registry, so a second place that knows an engine is refused
here too, by the name it would have to write."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("nomad_driver", "router")

ROOMS = ("nomad_driver.watcher", "nomad_driver.cli", "nomad_driver.node_agent")

# Room -> the modules it must not import (a prefix covers the package and everything in it).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "router": (*ROOMS, "devstack"),
    "nomad_driver.watcher": ("nomad_driver.cli", "nomad_driver.node_agent", "router", "devstack"),
    "nomad_driver.node_agent": ("nomad_driver.cli", "nomad_driver.watcher", "router", "devstack"),
    "nomad_driver.cli": ("devstack",),
    # Render loads the engines to ask them: an engine that imported it would be a circle. (spec
    # loads them too; an engine names spec's types only for the type checker.)
    "nomad_driver.engines": (
        *ROOMS,
        "router",
        "devstack",
        "nomad_driver.render",
        "nomad_driver.render_files",
    ),
    # The root: contracts and clients, which every room imports, so they import no room.
    "nomad_driver": (*ROOMS, "router", "devstack"),
}

# The router's whole view of nomad_driver (docs/design.md, Rooms): the contracts it reads and the
# shared client and rules it runs on. Anything else of the root is the watcher's or the CLI's
# business, and a new name here is a design decision, made in the doc first.
ROUTER_MAY_IMPORT = frozenset(
    {
        "nomad_driver.spec",  # definitions
        "nomad_driver.redaction",  # the one masking of credentials in what it shows
        "nomad_driver.state",  # the KV contract
        "nomad_driver.config_kv",  # where the definitions live in KV, read as every reader reads them
        "nomad_driver.consul",  # the one Consul client
        "nomad_driver.blocking",  # the one blocking-query loop
        "nomad_driver.placement",  # the one wording of "fits nowhere"
        "nomad_driver.safeload",  # bounded reading of what came from outside
        "nomad_driver.endpoint",  # addresses and client TLS as HashiCorp's tools read them
        "nomad_driver.certs",  # certificate expiry metrics
        "nomad_driver.logs",  # one log format
        "nomad_driver.engines",  # what the engine of a model does with its answers and connections
    }
)

ENGINES_PACKAGE = ROOT / "nomad_driver" / "engines"
# What every engine builds on; the other modules of the package are each one engine's own.
ENGINE_SHARED_PARTS = frozenset({"base", "job_parts", "gpu_check"})
# The rooms that reach engine knowledge through the registry alone, never a module in it.
REGISTRY_ONLY = ("router", "nomad_driver.watcher")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) of every import in the file, those inside functions too."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target, node.lineno
            # `from nomad_driver import cli` imports the room as surely as `import nomad_driver.cli`.
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno


def room_of(module: str) -> str:
    """The most specific room in FORBIDDEN that holds `module`."""
    return max((r for r in FORBIDDEN if module == r or module.startswith(r + ".")), key=len)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations() -> list[str]:
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            room = room_of(module_name(path))
            flagged: set[int] = set()
            for target, line in imports_of(path):
                if _within(target, room) or line in flagged:
                    continue  # a room's own modules, or a line already named
                for banned in FORBIDDEN[room]:
                    if _within(target, banned):
                        found.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {target}")
                        flagged.add(line)
                        break
    return found


def test_each_room_imports_only_what_it_may() -> None:
    found = violations()
    assert not found, "imports across rooms (docs/design.md, Rooms):\n" + "\n".join(found)


def test_the_router_imports_only_the_roots_contracts_and_shared_clients() -> None:
    found = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        for target, line in imports_of(path):
            if not _within(target, "nomad_driver") or target == "nomad_driver":
                continue
            # `from nomad_driver.spec import Model` also yields `nomad_driver.spec.Model`.
            if not any(_within(target, allowed) for allowed in ROUTER_MAY_IMPORT):
                found.append(f"{path.relative_to(ROOT)}:{line}: router imports {target}")
    assert not found, "the router imports what docs/design.md does not give it:\n" + "\n".join(found)


def engine_module(target: str) -> str | None:
    """The module of nomad_driver/engines/ that `target` is or lies in, else None; the registry
    itself (and a name imported from it, `from nomad_driver.engines import get`) is None too."""
    if not target.startswith("nomad_driver.engines."):
        return None
    part = target.split(".")[2]
    return part if (ENGINES_PACKAGE / f"{part}.py").exists() else None


def test_outside_the_engine_package_no_module_imports_an_engines_own_module() -> None:
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_relative_to(ENGINES_PACKAGE):
                continue
            room = room_of(module_name(path))
            flagged: set[int] = set()
            for target, line in imports_of(path):
                part = engine_module(target)
                if part is None or line in flagged:
                    continue
                if part not in ENGINE_SHARED_PARTS or room.startswith(REGISTRY_ONLY):
                    found.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {target}")
                    flagged.add(line)
    assert not found, "engine knowledge reached past the registry (nomad_driver.engines):\n" + "\n".join(
        found
    )


def _string_constants(path: Path) -> Iterator[tuple[str, int]]:
    """The file's string literals but its docstrings: what code says, not what it documents."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.value, node.lineno


def test_no_product_module_but_an_engines_own_names_an_engine() -> None:
    from nomad_driver import engines

    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.is_relative_to(ENGINES_PACKAGE):
                continue
            for text, line in _string_constants(path):
                named = [name for name in engines.names() if name in text]
                if named:
                    found.append(f"{path.relative_to(ROOT)}:{line}: names {', '.join(named)}")
    assert not found, "an engine named outside its module (ask nomad_driver.engines):\n" + "\n".join(found)


def test_the_import_walk_sees_the_imports_it_judges() -> None:
    """The rule above is only as good as this reading of the files: it must find these."""
    found = {
        (module_name(p), target)
        for top in PRODUCT
        for p in (ROOT / top).rglob("*.py")
        for target, _ in imports_of(p)
    }
    # A plain import, one inside a function, and one of each room the CLI is allowed to use.
    assert ("router.discovery", "nomad_driver.blocking") in found
    assert ("nomad_driver.cli.app", "router.server") in found
    assert ("nomad_driver.cli.watcher", "nomad_driver.watcher.loop") in found
    assert ("nomad_driver.cli.app", "nomad_driver.node_agent.agent") in found
    assert room_of("nomad_driver.watcher.loop") == "nomad_driver.watcher"
    assert room_of("nomad_driver.render") == "nomad_driver"
    assert room_of("router.app") == "router"
    assert ("router.assemble", "nomad_driver.engines") in found
    assert engine_module("nomad_driver.engines.vllm.ENGINE") == "vllm"
    assert engine_module("nomad_driver.engines.get") is None
