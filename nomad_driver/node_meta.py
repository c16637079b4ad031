"""The node metadata contract: the keys the node agent publishes on each Nomad node, which job
rendering, placement, the fleet summary and the admin API read. Defined once here, so the writer
and its readers cannot drift apart (a renamed key would leave every job unplaceable)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ENGINES_DIR_KEY = "llmgw_engines_dir"
ENGINE_KEY_PREFIX = "llmgw_engine_"
MODELS_CACHED_KEY = "llmgw_models_cached"
# Where the node's weights cache is (the `llmgw-weights` host volume's path); the node agent
# publishes its --models-dir here, and the fetch and the engine read it.
MODELS_DIR_KEY = "llmgw_models_dir"
# Set by the operator in the client's `meta`, read by the fetch: the cache's bound (500G), and
# the stall rule's minimum rate (100K) and window in seconds (300).
MODELS_MAX_KEY = "llmgw_models_max"
FETCH_MIN_RATE_KEY = "llmgw_fetch_min_rate"
FETCH_STALL_WINDOW_KEY = "llmgw_fetch_stall_window"
FABRIC_KEY = "llmgw_fabric"
GPU_CLASS_KEY = "llmgw_gpu_class"
GPU_COUNT_KEY = "llmgw_gpu_count"
GPUS_UNHEALTHY_KEY = "llmgw_gpus_unhealthy"
NVML_KEY = "llmgw_nvml"


def engine_meta_key(engine: str) -> str:
    """`llama.cpp` -> `llmgw_engine_llama_cpp`, listing the installed versions: node meta keys
    that jobs interpolate must be plain identifiers."""
    return ENGINE_KEY_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", engine)


def interpolated(key: str) -> str:
    """How a job names the node's value of `key`: `${meta.llmgw_fabric}`."""
    return f"${{meta.{key}}}"


def models_cached(meta: Mapping[str, Any]) -> set[str]:
    """The models whose weights the node reports on its disk."""
    raw = meta.get(MODELS_CACHED_KEY) or ""
    return {m.strip() for m in str(raw).split(",") if m.strip()}
