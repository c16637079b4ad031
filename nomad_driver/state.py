"""The model state contract in Consul KV, shared by the watcher (the only writer) and the
router, admin API, metrics and CLI (readers).

`llmgw/state/<model>` holds one JSON object per model. Readers must survive anything in that
key: a value written by an older or newer llmgw, or garbage, is reported and treated as "no
state yet" rather than crashing a router that is serving other models.
"""

from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nomad_driver.safeload import LoadError, json_loads

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
        data: Any = json_loads(raw)
    except LoadError as exc:
        raise MalformedState(key, f"not JSON ({exc.detail})") from None
    if not isinstance(data, dict):
        raise MalformedState(key, f"expected a JSON object, got {type(data).__name__}")
    try:
        return ModelState.model_validate(data)
    except ValidationError as exc:
        raise MalformedState(key, str(exc).replace("\n", "; ")) from exc


# Clocks on different hosts disagree by seconds, not minutes; a time further ahead than this is
# not a request that happened, and believing it (1e300) would keep a model from idling forever.
ACTIVITY_FUTURE_SLACK_S = 300.0


def parse_activity(raw: bytes | str | None, now: float | None = None) -> float | None:
    """`llmgw/activity/<model>` holds the Unix time of the last request, as text. Anything that
    is not a finite time up to a few minutes ahead of `now` reads as "no activity known"."""
    if raw is None or len(raw) > 64:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    limit = (time.time() if now is None else now) + ACTIVITY_FUTURE_SLACK_S
    if not math.isfinite(value) or not 0 <= value <= limit:
        return None
    return value
