"""The model state contract in Consul KV, shared by the watcher (the only writer) and the
router, admin API, metrics and CLI (readers).

`llmgw/state/<model>` holds one JSON object per model. Readers must survive anything in that
key: a value written by an older or newer llmgw, or garbage, is reported and treated as "no
state yet" rather than crashing a router that is serving other models.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

KV_PREFIX = "llmgw/"
STATE_PREFIX = "llmgw/state/"
ACTIVITY_PREFIX = "llmgw/activity/"
CONFIG_MODELS_KEY = "llmgw/config/models"
LEADER_KEY = "llmgw/leader"


def state_key(model: str) -> str:
    return f"{STATE_PREFIX}{model}"


def activity_key(model: str) -> str:
    return f"{ACTIVITY_PREFIX}{model}"


class ModelState(BaseModel):
    """What the watcher knows about one model that Nomad does not remember for it."""

    # Extra keys are kept, not refused: a newer watcher may add fields an older router reads.
    model_config = ConfigDict(extra="allow")

    parked: bool = False
    consecutive_failures: int = Field(default=0, ge=0)
    last_error: str = ""
    # The definition hash the model was parked under; a different hash means it was re-applied
    # with a new source or profile, which unparks it.
    parked_def_hash: str = ""
    unplaceable: bool = False
    placement_reason: str = ""
    placement_eval: str = ""
    updated_at: float = 0.0
    # The count's ledger (`parking.Ledger`): what keeps it true after Nomad forgets task events
    # (ten per task) and whole allocations (garbage collection), and across watchers.
    # Starts at or before this Nomad time (UnixNano) never count: the newest healthy start,
    # the last retry, or when the current definition reached Nomad.
    failures_after_ns: int = 0
    # The newest start already counted, by its allocation and its `Started` time; with
    # `counted_failures`, the failures up to and including it (0 and "": none yet).
    counted_through_alloc: str = ""
    counted_through_ns: int = 0
    counted_failures: int = Field(default=0, ge=0)
    # The definition hash the count belongs to, and the first Nomad job version that ran it:
    # allocations of older versions ran an older definition and never count (-1: the new
    # definition is not in Nomad yet).
    count_def_hash: str = ""
    count_job_version: int = 0
    # Set when the Nomad job `llmgw-<model>` was not rendered by llmgw for this model (its meta
    # `llmgw_model` is missing or names another): the watcher leaves that job alone.
    job_conflict: str = ""

    def to_kv(self) -> bytes:
        return self.model_dump_json().encode()

    def touched(self) -> ModelState:
        return self.model_copy(update={"updated_at": time.time()})


class MalformedState(ValueError):
    """A state value that is not the JSON llmgw writes; carries the key for the log line."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"malformed llmgw state at {key}: {detail}")
        self.key = key


def parse_state(key: str, raw: bytes | str | None) -> ModelState:
    if raw is None or raw == b"" or raw == "":
        return ModelState()
    try:
        data: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedState(key, f"not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise MalformedState(key, f"expected a JSON object, got {type(data).__name__}")
    try:
        return ModelState.model_validate(data)
    except ValidationError as exc:
        raise MalformedState(key, str(exc).replace("\n", "; ")) from exc


def parse_activity(raw: bytes | str | None) -> float | None:
    """`llmgw/activity/<model>` holds the Unix time of the last request, as text."""
    if raw is None:
        return None
    try:
        return float(raw)
    except (TypeError, ValueError):
        return None
