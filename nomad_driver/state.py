"""The model state contract in Consul KV, shared by the watcher (the only writer) and the
router, admin API, metrics and CLI (readers).

`llmgw/state/<model>` holds one JSON object per model. Readers must survive anything in that
key: a value written by an older or newer llmgw, or garbage, is reported and treated as "no
state yet" rather than crashing a router that is serving other models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nomad_driver.redaction import redact
from nomad_driver.safeload import LoadError, json_loads

KV_PREFIX = "llmgw/"
STATE_PREFIX = "llmgw/state/"
ACTIVITY_PREFIX = "llmgw/activity/"
INFLIGHT_PREFIX = "llmgw/inflight/"
CONFIG_MODELS_KEY = "llmgw/config/models"
LEADER_KEY = "llmgw/leader"


def state_key(model: str) -> str:
    return f"{STATE_PREFIX}{model}"


def activity_key(model: str) -> str:
    return f"{ACTIVITY_PREFIX}{model}"


def inflight_key(router: str) -> str:
    return f"{INFLIGHT_PREFIX}{router}"


class ActionError(BaseModel):
    """Nomad refused what the leader asked for a model, in a way that asking again will not
    change (a 4xx: ACL denied, a scaling bound, a bad namespace; a 500 in the words of Nomad's
    validation: a node pool that does not exist, a bad constraint): kept until the action next
    succeeds, so the refusal shows where operators look instead of only in the log."""

    model_config = ConfigDict(extra="allow")

    action: str = ""  # register | scale | park
    status: int = 0  # Nomad's HTTP status
    message: str = ""  # Nomad's answer
    since: float = 0.0  # Unix time of the first refusal in this run of refusals

    # Nomad's refusal quotes the job it was given (an artifact's source, say); masked as it is
    # made, since it is stored in KV and shown to everyone who reads the model's state.
    @field_validator("message")
    @classmethod
    def _redacted(cls, text: str) -> str:
        return redact(text)

    def same_refusal(self, other: ActionError | None) -> bool:
        return other is not None and (self.action, self.status, self.message) == (
            other.action,
            other.status,
            other.message,
        )


@dataclass(frozen=True)
class Ask:
    """One router's latest ask for a model (a request that found no ready replica): `asker` is
    the router process, `seq` its number for this model within that process, `at` its time by
    that router's clock. `seq` 0 is a router from before asks were numbered."""

    asker: str
    seq: int
    at: float


def ask_numbers(asks: Iterable[Ask]) -> dict[str, int]:
    """What an attempt made for these asks answers (`Attempt.answered`): each numbered ask."""
    return {ask.asker: ask.seq for ask in asks if ask.seq > 0}


class Attempt(BaseModel):
    """The leading watcher's answer to the routers' asks (activation of a model with no ready
    replica): `answered` the asks it answers (asker -> number), `asked` the latest ask's time,
    `at` when it asked Nomad, `eval` the evaluation, `result` `placed` or `unplaceable` with
    Nomad's reason. A router waits for the attempt that answers its own ask (`answers`)."""

    model_config = ConfigDict(extra="allow")

    asked: float = 0.0
    at: float = 0.0
    eval: str = ""
    result: str = ""  # placed | unplaceable
    reason: str = ""
    # Each live router's latest ask number for the model when the leader acted. None: written
    # by a watcher from before asks were numbered, which only knew `asked`.
    answered: dict[str, int] | None = None

    def answers(self, ask: Ask) -> bool:
        """Whether this attempt answers `ask` (or a later ask of the same router). By number
        where both sides number asks: times from different routers' clocks do not order, and a
        router whose clock ran behind took an answer given before its request as its own (a
        stale "unplaceable"), or the watcher took its ask as answered and it waited for nothing.
        By time with an older router or watcher, which is right only while the clocks agree."""
        if self.answered is None or ask.seq <= 0:
            return self.asked >= ask.at
        return self.answered.get(ask.asker, 0) >= ask.seq

    @field_validator("reason")
    @classmethod
    def _redacted(cls, text: str) -> str:
        return redact(text)


class CountedStart(BaseModel):
    """One start by its identity: its allocation and the time of its `Started` event."""

    model_config = ConfigDict(extra="allow")

    alloc: str
    started_ns: int


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
    last_action_error: ActionError | None = None
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
    # Failures after that start, counted while an earlier start was still loading (so the count
    # could not be folded past it yet): each still counts after Nomad forgets it.
    counted_later: list[CountedStart] = Field(default_factory=list)
    # The newest starts up to `counted_through_*` whose outcome is counted: a start Nomad
    # reports late, older than that one but not named here, is still counted.
    counted_decided: list[CountedStart] = Field(default_factory=list)
    # Starts at or before this one are taken as decided (the list above is bounded).
    counted_decided_floor: CountedStart | None = None
    # The definition hash the count belongs to, and the first Nomad job version that ran it:
    # allocations of older versions ran an older definition and never count (-1: the new
    # definition is not in Nomad yet).
    count_def_hash: str = ""
    count_job_version: int = 0
    # The CreateIndex of the Nomad job `count_job_version` belongs to: a job purged and
    # registered again starts its versions over at 0 (0 here: not yet known).
    count_job_create_index: int = 0
    # The Nomad index of the job version that brought the definition (its JobModifyIndex when
    # the watcher first saw it): an allocation created at or before it was updated in place,
    # and its starts count only after `count_def_after_ns` (the newest start Nomad showed then).
    count_def_index: int = 0
    count_def_after_ns: int = 0
    # A retry's baseline: failed allocations whose starts all lie before it are asked of Nomad
    # again even while other replicas serve (watcher/given_up.py).
    retried_through_ns: int = 0
    # Some replicas serve while a slot keeps failing (a bad node, a bad GPU): the model is not
    # parked, and this says which slot, where and why; "" otherwise.
    degraded: str = ""
    # Nomad gave up on a failed allocation (its reschedule budget spent) and llmgw asked it again
    # (watcher/given_up.py): what Nomad would not do, in words; "" otherwise.
    nomad_gave_up: str = ""
    # Set when the Nomad job `llmgw-<model>` was not rendered by llmgw for this model (its meta
    # `llmgw_model` is missing or names another): the watcher leaves that job alone.
    job_conflict: str = ""
    # Multi-node replicas: the fabrics Nomad could not place the replica on since its last
    # healthy start or new definition (tried last when choosing again), and the leader start
    # (`<alloc>@<Started ns>`) the watcher last restarted the replica for after a shard failed.
    fabrics_tried: list[str] = Field(default_factory=list)
    replica_restarted: str = ""
    # A scale-up by load that Nomad cannot place while the minimum runs: the model serves, but
    # with fewer replicas than its load asks for. Nomad's reason, summarised like placement's.
    short: bool = False
    short_reason: str = ""
    # The leader's answer to the latest activation asked by a router (see `Attempt`).
    attempt: Attempt | None = None
    # A new definition rolls out beside the previous one (watcher/rollout.py): the Nomad job
    # that still runs the previous definition, serving until the new one's replicas are ready,
    # then drained and stopped; "" when none. Parked with this set: the update failed, and the
    # previous definition keeps serving.
    rollout_from: str = ""

    # Built redacted by the watcher; masked on reading too, for a value stored before that or
    # written by hand, since every reader shows it (router, admin API, ctl, the Consul UI).
    @field_validator("last_error", "placement_reason", "short_reason")
    @classmethod
    def _redacted(cls, text: str) -> str:
        return redact(text)

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


# Bounds on what a router may claim, so one poisoned key cannot keep a model up forever.
MAX_INFLIGHT_VALUE = 1 << 20
MAX_ACTIVITY_INTERVAL_S = 300.0
MAX_REQUESTS = 1_000_000
# A router's record holds while it is this many of its intervals old at most, and from this far
# ahead of the reader's clock.
INFLIGHT_STALE_INTERVALS = 3
INFLIGHT_FUTURE_SLACK_S = 60.0
# Ask numbers stay exact in every JSON reader; a router asks far fewer times than this.
MAX_ASK_SEQ = 2**53
MAX_ASKER_LEN = 256


@dataclass(frozen=True)
class RouterInFlight:
    """One router's `llmgw/inflight/<router>`: its requests in flight per model, and the
    replicas they are on, as of `at` (Unix time); refreshed every `interval_s` while any is
    open."""

    at: float
    interval_s: float
    requests: dict[str, int] = field(default_factory=dict)
    replicas: dict[str, frozenset[str]] = field(default_factory=dict)
    # The router's latest ask per model (Unix time): a request that found no ready replica and
    # waits for the leader to answer it (`ModelState.attempt`).
    asked: dict[str, float] = field(default_factory=dict)
    # That ask's number per model, and the router process that numbers them ("" and none: a
    # router from before asks were numbered).
    ask_seq: dict[str, int] = field(default_factory=dict)
    asker: str = ""

    def live(self, now: float) -> bool:
        """Refreshed recently: a router that stopped refreshing (a crash) holds nothing. A
        time far in the future is a bad clock or a bad value, not a request."""
        return self._live_from() <= now <= self._live_until()

    def changes_at(self, now: float) -> float:
        """When `live` next flips with nothing written (inf: never again)."""
        return min((t for t in (self._live_from(), self._live_until()) if t > now), default=math.inf)

    def _live_from(self) -> float:
        return self.at - INFLIGHT_FUTURE_SLACK_S

    def _live_until(self) -> float:
        return self.at + INFLIGHT_STALE_INTERVALS * self.interval_s


def parse_inflight(raw: bytes | str | None) -> RouterInFlight | None:
    """None for anything that is not what a router writes (garbage, out of bounds)."""
    if not raw or len(raw) > MAX_INFLIGHT_VALUE:
        return None
    try:
        data: Any = json_loads(raw, "llmgw/inflight")
    except LoadError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        return None
    at, interval = data.get("at"), data.get("interval_s")
    if not isinstance(at, int | float) or not isinstance(interval, int | float):
        return None
    if not (math.isfinite(at) and math.isfinite(interval)):
        return None
    if not 0 < interval <= MAX_ACTIVITY_INTERVAL_S:
        return None
    requests: dict[str, int] = {}
    replicas: dict[str, frozenset[str]] = {}
    asked: dict[str, float] = {}
    ask_seq: dict[str, int] = {}
    for model, use in data["models"].items():
        if not isinstance(use, dict):
            continue
        n = use.get("requests")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_REQUESTS:
            continue
        requests[str(model)] = n
        names = use.get("replicas")
        replicas[str(model)] = (
            frozenset(str(r) for r in names if isinstance(r, str)) if isinstance(names, list) else frozenset()
        )
        ask = use.get("asked")
        if isinstance(ask, int | float) and not isinstance(ask, bool) and math.isfinite(ask) and ask > 0:
            asked[str(model)] = float(ask)
        seq = use.get("ask_seq")
        if isinstance(seq, int) and not isinstance(seq, bool) and 0 < seq <= MAX_ASK_SEQ:
            ask_seq[str(model)] = seq
    asker = data.get("asker")
    if not isinstance(asker, str) or not 0 < len(asker) <= MAX_ASKER_LEN:
        asker, ask_seq = "", {}
    return RouterInFlight(float(at), float(interval), requests, replicas, asked, ask_seq, asker)
