"""The engines llmgw can run, one module each, and the one place that lists them.

Everything llmgw knows about a model server (its profile rules, its task on one node and across
several, its readiness path, how a node verifies its install, how it is handed its GPUs, how its
failed starts read, how the router treats its answers) lives in that server's module, behind
`base.Engine`. The rest of llmgw asks this registry, by the name a profile gives, and never
names an engine itself: a new engine is one new module and one line below.
"""

from __future__ import annotations

import re

from nomad_driver.engines import gpu_check, llama_cpp, llama_cpp_python, vllm
from nomad_driver.engines.base import Engine
from nomad_driver.node_meta import engine_meta_key

# In the order the spec lists them when a profile names none of them.
ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    ENGINES[engine.name] = engine
    return engine


for _engine in (llama_cpp.ENGINE, vllm.ENGINE, llama_cpp_python.ENGINE):
    register(_engine)


def names() -> tuple[str, ...]:
    return tuple(ENGINES)


def get(name: str) -> Engine:
    """The engine a validated profile names."""
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"no engine {name!r} is registered (known: {', '.join(ENGINES)})") from None


def find(name: str | None) -> Engine | None:
    """The engine, or None for a name llmgw does not know (a replica without a definition)."""
    return ENGINES.get(name) if name else None


def sharding() -> tuple[str, ...]:
    """The engines that can split one model across nodes."""
    return tuple(e.name for e in ENGINES.values() if e.shards_over)


def taking_chat_format() -> tuple[str, ...]:
    return tuple(e.name for e in ENGINES.values() if e.takes_chat_format)


def from_meta_key(key: str) -> str | None:
    """The engine a node meta key lists versions of. The key is a mangled name (`llama.cpp`
    and `llama_cpp` would share one), so it is mapped back by the known names."""
    return next((name for name in ENGINES if engine_meta_key(name) == key), None)


def startup_error_patterns() -> list[re.Pattern[str]]:
    """The lines that say why an engine's start failed, most telling first: llmgw's own GPU
    check, then each engine's own words, in registration order. The watcher judges a stderr,
    or an error it stored earlier, without knowing which engine wrote it, so it tries them all."""
    patterns = [gpu_check.FAILED_PATTERN]
    for engine in ENGINES.values():
        patterns += [p for p in engine.startup_errors if p not in patterns]
    return patterns
