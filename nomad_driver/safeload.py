"""One rule for reading JSON and YAML that came from outside: bounded in size, depth and numbers.

Every reader of untrusted text goes through here: the router's request bodies, the KV values
routers and watchers read (`llmgw/state/<m>`, `llmgw/config/models`, `llmgw/activity/<m>`), and
the files the CLI is given. Without bounds, a 2 KB body of nested brackets is a traceback, one
key of `[` x 100,000 stops every watcher pass, and a 791-byte YAML "billion laughs" hangs the CLI
and, stored in Consul, blocks the router's event loop for seconds each time it is read.

A value past a bound is a `LoadError` that names where it came from and what was wrong, never a
RecursionError, an OverflowError or a hang.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import yaml

# Deep enough for any request or definition a person or SDK writes (tool schemas nest a dozen
# levels), shallow enough that no reader recurses anywhere near Python's limit.
MAX_DEPTH = 64
MAX_JSON_BYTES = 16 * 1024 * 1024
# A models file of a thousand models is well under 1 MiB; Consul caps a KV value at 512 KiB.
MAX_YAML_BYTES = 4 * 1024 * 1024
# Nodes after every alias is expanded: anchors for shared profile settings stay cheap, while
# a "billion laughs" (each level repeating the one below) is refused after reading its events.
MAX_YAML_NODES = 200_000
MAX_YAML_ALIASES = 10_000
# Integers beyond 2**63 fit no Nomad or Go field; they are refused here rather than overflowing
# later in a float conversion.
MAX_INT_DIGITS = 19


class LoadError(ValueError):
    """Text that is not a bounded JSON or YAML value; the message says where and why."""

    def __init__(self, origin: str, detail: str) -> None:
        super().__init__(f"{origin}: {detail}" if origin else detail)
        self.origin = origin
        self.detail = detail


# --- JSON -----------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"number {text[:40]}... has more than {MAX_INT_DIGITS} digits")
    return int(text)


def json_loads(
    raw: bytes | str, origin: str = "", *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """`json.loads` with size, depth and numbers bounded (no NaN, no infinity, no 400-digit
    integers). Raises LoadError naming `origin`."""
    if len(raw) > max_bytes:
        raise LoadError(origin, f"{len(raw)} bytes; at most {max_bytes} are read")
    try:
        value = json.loads(
            raw, parse_constant=_reject_constant, parse_float=_parse_float, parse_int=_parse_int
        )
    except RecursionError:
        raise LoadError(origin, f"not valid JSON: nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as exc:
        raise LoadError(origin, f"not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:
        raise LoadError(origin, f"not valid JSON: {exc}") from None
    # Counting brackets is a C loop; only a value that could be too deep is walked.
    brackets = (
        raw.count(b"[") + raw.count(b"{") if isinstance(raw, bytes) else raw.count("[") + raw.count("{")
    )
    if brackets > max_depth and _depth(value, max_depth) > max_depth:
        raise LoadError(origin, f"not valid JSON: nested deeper than {max_depth} levels")
    return value


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed value, without recursion; stops counting past `limit`. Level by
    level, keeping only containers: a Consul answer of 10,000 service instances is a million
    values, and pushing each onto a stack cost twice as much (199 ms against 84)."""
    # `json.loads` makes plain dicts and lists only, so `type(...) is` suffices and is faster.
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return depth
        below: list[Any] = []
        for item in level:
            children = item.values() if type(item) is dict else item
            below += [c for c in children if type(c) is dict or type(c) is list]
        level = below
    return depth


# --- YAML -----------------------------------------------------------------------------------


def check_yaml_events(text: str, origin: str = "") -> None:
    """Size, depth and alias count, read from the event stream (which PyYAML produces without
    recursion) before anything builds a tree from it."""
    if len(text) > MAX_YAML_BYTES:
        raise LoadError(origin, f"{len(text)} characters; at most {MAX_YAML_BYTES} are read")
    _check_flow_depth(text, origin)
    depth = aliases = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise LoadError(origin, f"nested deeper than {MAX_DEPTH} levels{_at(event)}")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise LoadError(origin, f"more than {MAX_YAML_ALIASES} aliases{_at(event)}")


_BRACKET = re.compile(r"[\[\]{}]")


def _check_flow_depth(text: str, origin: str) -> None:
    """Flow brackets nested past the limit, found before PyYAML's scanner sees them: it looks
    ahead up to 1024 characters for a possible key at every level, which makes `[` x 5000 cost
    the best part of a second even though the parser would refuse it at level 65."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    depth = 0
    for match in _BRACKET.finditer(text):
        if match.group() in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                line = text.count("\n", 0, match.start()) + 1
                raise LoadError(origin, f"nested deeper than {MAX_DEPTH} levels at line {line}")
        elif depth:
            depth -= 1


def check_yaml_tree(node: yaml.Node, origin: str = "") -> None:
    """The size of the tree once aliases are expanded, and every number in it, checked on the
    composed graph (where an alias is a shared node) in time linear in the text."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()
    # Iterative post-order walk: (node, children_done).
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        current, done = stack.pop()
        key = id(current)
        if done:
            in_progress.discard(key)
            children = _children(current)
            total = 1 + sum(sizes[id(c)] for c in children)
            if total > MAX_YAML_NODES:
                raise LoadError(
                    origin,
                    f"expands to more than {MAX_YAML_NODES} values through its aliases{_at(current)}; "
                    "this looks like an alias bomb",
                )
            sizes[key] = total
            continue
        if key in sizes:
            continue
        if key in in_progress:
            raise LoadError(origin, f"an alias refers to a value that contains it{_at(current)}")
        if isinstance(current, yaml.ScalarNode):
            _check_scalar(current, origin)
            sizes[key] = 1
            continue
        in_progress.add(key)
        stack.append((current, True))
        for child in _children(current):
            if id(child) in in_progress:
                raise LoadError(origin, f"an alias refers to a value that contains it{_at(child)}")
            if id(child) not in sizes:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT_TAG = "tag:yaml.org,2002:int"


def _check_scalar(node: yaml.ScalarNode, origin: str) -> None:
    if node.tag == _FLOAT_TAG:
        text = str(node.value).lower().replace("_", "")
        try:
            finite = ".inf" not in text and ".nan" not in text and math.isfinite(float(text))
        except ValueError:  # sexagesimal (1:30.5), which PyYAML reads itself
            finite = len(text) < 40
        if not finite:
            raise LoadError(origin, f"{node.value!r} is not a finite number{_at(node)}")
    elif node.tag == _INT_TAG:
        digits = str(node.value).lstrip("+-").replace("_", "")
        if len(digits) > MAX_INT_DIGITS:
            raise LoadError(origin, f"number {str(node.value)[:40]} is too large{_at(node)}")


def _at(item: yaml.Node | yaml.Event) -> str:
    mark = item.start_mark
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def compose_yaml(text: str, origin: str = "") -> yaml.Node | None:
    """The node tree of a single document, checked; YAML syntax errors raise yaml.YAMLError."""
    check_yaml_events(text, origin)
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None:
        check_yaml_tree(node, origin)
    return node


def construct_yaml(node: yaml.Node) -> Any:
    """The Python value of a checked node tree (aliases stay shared objects)."""
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


def yaml_loads(text: str, origin: str = "") -> Any:
    """`yaml.safe_load` within the bounds above. Raises LoadError (bounds) or yaml.YAMLError."""
    node = compose_yaml(text, origin)
    return None if node is None else construct_yaml(node)
