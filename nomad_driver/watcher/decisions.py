"""The view `reconcile` decides from, and the decisions it returns: the watcher's contract
between what one pass read and what it will do (`acting.py` carries the actions out)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from nomad_driver.placement import FabricRoom
from nomad_driver.spec import Model
from nomad_driver.state import Ask, ModelState
from nomad_driver.watcher.parking import (
    StartId,
)
from nomad_driver.watcher.partial import Degraded
from nomad_driver.watcher.scaling import (
    DEFAULT_STEP_INTERVAL_S,
)

HealthStatus = Literal["passing", "warning", "critical"]


@dataclass(frozen=True)
class ModelView:
    """Everything the watcher knows about one model at one moment."""

    model: Model
    job: Mapping[str, Any] | None = None
    allocs: tuple[Mapping[str, Any], ...] = ()
    evals: tuple[Mapping[str, Any], ...] = ()
    ready: int = 0  # engine instances passing their Consul check
    # The starts whose engine passes its Consul check now, as (Started time, allocation ID).
    healthy_starts: frozenset[StartId] = frozenset()
    state: ModelState | None = None
    state_index: int = 0  # the state key's ModifyIndex; 0 when it does not exist
    state_problem: str = ""  # a malformed stored state, to report and replace
    activity: float | None = None  # last request, Unix time, from the routers
    scaled_at: float | None = None  # when the watcher first saw the job's current count
    now: float = 0.0
    # Requests in flight on its replicas, summed over routers, and how many distinct replicas
    # they are on (`llmgw/inflight/`).
    in_flight: int = 0
    busy_replicas: int = 0
    # Load scaling (`scaling.LoadHistory`): in flight averaged over the up window, the highest
    # recommendation of the scale-down delay, and the count that keeps every busy allocation
    # (from the replicas the routers name). None: no history (a hand-built view), which holds
    # the count for a scale-down delay after it was first seen, as a watcher's first sight does.
    in_flight_average: float | None = None
    load_held: int | None = None
    busy_floor: int | None = None
    # Since the job's count last changed, for the step rate limit (inf: not seen changing).
    since_step_s: float = float("inf")
    step_interval_s: float = DEFAULT_STEP_INTERVAL_S
    # Each live router's latest ask for this model (none: nobody waits for an activation).
    asks: tuple[Ask, ...] = ()
    # How late the routers' activity can reach the watcher: their publishing interval.
    activity_grace_s: float = 0.0
    # A multi-node model's fabrics as the pass measured them, without its own allocations (the
    # nodes its replica holds are its room); None until the nodes are read, or for one node.
    fabric_rooms: tuple[FabricRoom, ...] | None = None
    # The Nomad job that runs (or will run) the current definition: one of the model's two job
    # IDs (rollout.py); "" means the model's own `llmgw-<model>`.
    job_id: str = ""
    # The other job, while it still runs an older definition beside this one.
    previous: PreviousJob | None = None


@dataclass(frozen=True)
class PreviousJob:
    """The job of the definition a rollout replaces: it serves until the new one is ready."""

    job_id: str
    job: Mapping[str, Any]
    ready: int  # its engines passing their checks
    live: int  # its allocations placed or running


@dataclass(frozen=True)
class RegisterJob:
    model: str
    count: int
    fabric: str = ""  # a multi-node model's job is pinned to this fabric
    # The JobModifyIndex of the job the decision saw (0: none): Nomad registers only over that
    # one, so a leader acting on an old view cannot undo a newer registration.
    job_modify_index: int = 0
    job_id: str = ""  # "" : the model's own `llmgw-<model>`


@dataclass(frozen=True)
class StopJob:
    """Stop the job of a definition that a rollout replaced, once its replicas are gone."""

    model: str
    job_id: str
    message: str


@dataclass(frozen=True)
class Scale:
    model: str
    job_id: str
    group: str
    count: int
    message: str
    reason: str = ""  # scaling.Reason, for the log line


@dataclass(frozen=True)
class Activate:
    """Answer a router's ask: scale (to the same count too, so Nomad evaluates afresh), read
    the evaluation at once, and record the attempt in the state for the waiting requests."""

    model: str
    job_id: str
    group: str
    count: int
    asked: float
    message: str


@dataclass(frozen=True)
class Park:
    """Scale to 0 and write the parked state; the watcher first reads the failed replica's
    stderr so that the stored error is the engine's own words."""

    model: str
    job_id: str
    group: str
    failures: int
    alloc_id: str
    task: str
    event_error: str
    state: ModelState  # to write with last_error filled in
    cas: int
    # Who failed, when it was not the engine named by alloc_id/task itself: a multi-node
    # replica's shard (`shard 1a2b3c4d on node ib-a-1`), whose stderr alloc_id/task then name.
    cause: str = ""


@dataclass(frozen=True)
class WriteState:
    model: str
    state: ModelState
    cas: int


@dataclass(frozen=True)
class ForceReschedule:
    """Ask Nomad to replace failed allocations it has given up on (`given_up.py`)."""

    model: str
    job_id: str
    allocs: tuple[str, ...]


Action = RegisterJob | Scale | Activate | Park | WriteState | ForceReschedule | StopJob


# The actions that call Nomad, whose refusals become the model's `last_action_error`.
NomadAction = (RegisterJob, Scale, Activate, Park, ForceReschedule, StopJob)


@dataclass(frozen=True)
class Decision:
    model: str
    desired: int
    ready: int
    starting: int
    state: ModelState
    health: HealthStatus
    health_output: str
    actions: tuple[Action, ...] = field(default=())
    # Why desired is what it is (`scaling.Reason`) and the line people read for it.
    desired_reason: str = "min"
    desired_detail: str = ""
    recommendation: int = 0
    # A partial failure (partial.py), for the watcher to name with the engine's own words.
    degraded: Degraded | None = None
