"""Carrying out one model's decision on Nomad and Consul, on the leader only: register, scale,
park and write its state, and record how Nomad took it, so a refusal that will not heal becomes
the model's `last_action_error`."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from nomad_driver.consul import ConsulError, ConsulUnavailable
from nomad_driver.fields import as_int
from nomad_driver.nomad import Nomad, NomadError, NomadUnavailable
from nomad_driver.placement import PlacementWarnings, fabric_constraint, summarize_placement
from nomad_driver.render import render_job
from nomad_driver.spec import Model
from nomad_driver.state import ActionError, Attempt, ask_numbers
from nomad_driver.watcher.decisions import (
    Action,
    Activate,
    Decision,
    ForceReschedule,
    ModelView,
    NomadAction,
    Park,
    RegisterJob,
    Scale,
    StopJob,
    WriteState,
)
from nomad_driver.watcher.engine_errors import EngineErrors
from nomad_driver.watcher.fenced import FencedStates
from nomad_driver.watcher.health_text import model_health
from nomad_driver.watcher.leader import Leadership, LeaseLost
from nomad_driver.watcher.multinode import scale_replica, set_replica_count

log = logging.getLogger("llmgw.watcher")

# Nomad answers that say "not now" rather than "never": a job that vanished (the next pass
# registers it again), a timeout, a conflict, a rate limit. Every other 4xx is a refusal that
# asking again will not change, and becomes the model's `last_action_error`.
_TRANSIENT_NOMAD_STATUS = frozenset({404, 408, 409, 429})
# Nomad's admission checks of a job (validation, node pool, namespace, its mutators) give no
# status code, so Nomad answers them with 500, and only its words tell them from a server
# failing: go-multierror's "N error(s) occurred:" (the validators' collected errors), a mutator's
# "error in job mutator", the node pool or namespace the job names not existing. Any other 5xx
# (no cluster leader, a timeout, a proxy's 502/503/504) is an outage: retried, never a condition.
_NOMAD_REFUSAL_500 = re.compile(
    r"\b\d+ errors? occurred:|error in job mutator|nonexistent node pool|nonexistent namespace"
)
# What changes between two reports of the same failure (an object's address in a connection
# error) is not a change worth a log line.
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]+\b")
# Nomad's `Job.Scale` while the job's latest deployment is active (job_endpoint.go): "not now",
# for as long as the deployment runs (a model load can keep it active for minutes).
DEPLOYMENT_BLOCKS_SCALE = "job scaling blocked due to active deployment"
# A held scale is asked again when the model's job or allocations change (a deployment ends
# by its allocations turning healthy or failing), and at least this often regardless.
DEPLOYMENT_RETRY_S = 30.0
# How long the leader waits for an activation's evaluation before answering "placed" (Nomad's
# scheduler answers in well under a second; the routers give up after 30 s).
EVALUATION_WAIT_S = 10.0
EVAL_DONE = ("complete", "failed", "canceled", "blocked")


def _deployment_mark(view: ModelView) -> tuple[int, int]:
    """What changes when a deployment ends: the job, or one of its allocations (health)."""
    job = view.job or {}
    try:
        job_index = int(job.get("ModifyIndex") or job.get("JobModifyIndex") or 0)
    except (TypeError, ValueError):
        job_index = 0
    allocs = 0
    for a in view.allocs:
        try:
            allocs = max(allocs, int(a.get("ModifyIndex") or 0))
        except (TypeError, ValueError):
            continue
    return job_index, allocs


def nomads_words(exc: NomadError) -> str:
    """Nomad's own answer, on one line, without our "nomad POST /v1/...: HTTP 500:" in front."""
    text = str(exc).split(f"HTTP {exc.status}: ", 1)[-1] if exc.status else str(exc)
    return " ".join(text.split())


def is_refusal(exc: NomadError) -> bool:
    """Nomad said no in a way that asking again will not change: a 4xx that is not "not now",
    or a 500 in the words of its admission checks. Unreachable, timed out, other 5xx: no."""
    if exc.status == 500:
        return bool(_NOMAD_REFUSAL_500.search(nomads_words(exc)))
    if isinstance(exc, NomadUnavailable):
        return False
    return 400 <= exc.status < 500 and exc.status not in _TRANSIENT_NOMAD_STATUS


class Actor:
    def __init__(
        self,
        nomad: Nomad,
        leadership: Leadership,
        states: FencedStates,
        engine_errors: EngineErrors,
        clock: Callable[[], float],
    ) -> None:
        self.nomad = nomad
        self.leadership = leadership
        self.states = states
        self.engine_errors = engine_errors
        self.clock = clock
        # The count this watcher last set per job, and the JobModifyIndex Nomad gave it.
        self._scaled: dict[str, tuple[int, int]] = {}
        # Refusals and failed calls are logged like placement warnings: on change or every ten
        # minutes, never on every pass (a Nomad outage would otherwise log each model per pass).
        self.refusal_warnings = PlacementWarnings(clock)
        self.failure_warnings = PlacementWarnings(clock)
        # Scales Nomad refused for an active deployment, per model: the count asked, the
        # job and allocations as they were then, and when. Not asked again until those change.
        self.held: dict[str, tuple[int, tuple[int, int], float]] = {}

    async def apply_decision(self, model: Model, d: Decision, view: ModelView) -> Decision:
        """Apply one model's actions, then record how Nomad took them: a refusal that will not
        heal becomes the model's `last_action_error` (stored, shown, counted, alerted on), and
        the next success, or nothing left to ask of Nomad, clears it. Returns the decision as
        it now stands, so the Consul UI check shows the refusal in the same pass."""
        condition = d.state.last_action_error
        asked_nomad = False
        parked = False
        park_undone = False
        write: WriteState | None = None
        attempt: Attempt | None = None
        for action in d.actions:
            if isinstance(action, WriteState):
                write = action  # written last, with the outcome of the Nomad calls
                continue
            if not self.leadership.is_leader:
                raise LeaseLost("leadership lost during the pass")
            if isinstance(action, Activate):
                attempt, outcome = await self._activate(model, action, view)
                attempt = attempt.model_copy(update={"answered": ask_numbers(view.asks)})
                asked_nomad = True
                if isinstance(outcome, ActionError):
                    condition = condition if outcome.same_refusal(condition) else outcome
                elif outcome:
                    condition = None
                    self.failure_warnings.clear(d.model)
                continue
            if isinstance(action, Park):
                action = replace(action, state=action.state.model_copy(update={"last_action_error": None}))
            if isinstance(action, Scale) and (
                self._still_held(model, action, view) or self._asked_already(action, view)
            ):
                continue
            outcome = await self._apply(model, action, view)
            # Not scaled to 0: the replicas still run (and crash-loop), so nothing may say parked.
            park_undone = park_undone or (isinstance(action, Park) and outcome is not True)
            if isinstance(action, NomadAction):
                asked_nomad = True
                if isinstance(outcome, ActionError):
                    condition = condition if outcome.same_refusal(condition) else outcome
                elif outcome:
                    condition = None
                    parked = isinstance(action, Park)
                    self.failure_warnings.clear(d.model)  # the next failure is news
        if not asked_nomad:
            condition = None  # nothing asked of Nomad, nothing refused
            self.failure_warnings.clear(d.model)
        if condition is None:
            self.refusal_warnings.clear(d.model)
        if parked:
            return d  # Park wrote the state itself, with no refusal
        state = write.state if write is not None else d.state
        if park_undone:
            # Counted, not parked: the next pass, seeing the count, asks for the park again.
            state = state.model_copy(update={"parked": False, "parked_def_hash": ""})
            write = write or WriteState(d.model, state, view.state_index)
        if attempt is not None:
            state = state.model_copy(update={"attempt": attempt})
        if condition != state.last_action_error:
            state = state.model_copy(update={"last_action_error": condition})
        elif write is None and attempt is None:
            return d
        if not await self.states.write(d.model, state, view.state_index):
            return d
        health, output = model_health(d.model, state, d.desired, d.ready, d.starting, d.desired_detail)
        return replace(d, state=state, health=health, health_output=output)

    async def _activate(
        self, model: Model, action: Activate, view: ModelView
    ) -> tuple[Attempt, ActionError | bool]:
        """Scale for a router's ask and read the evaluation at once: the waiting requests are
        answered by Nomad's own verdict on this call, not by an older one."""
        at = self.clock()
        try:
            replies = await self._scale_replica(
                model, action.job_id, action.group, action.count, action.message
            )
            evals = [str(r.get("EvalID") or "") for r in replies if r.get("EvalID")]
            answers = [await asyncio.to_thread(self._evaluation, e) for e in evals]
        except NomadError as exc:
            if exc.status == 400 and DEPLOYMENT_BLOCKS_SCALE in str(exc):
                # A deployment is rolling the job out: its allocations are placed and
                # starting, which is what the ask wanted.
                return Attempt(asked=action.asked, at=at, result="placed", reason=nomads_words(exc)), False
            outcome = await self._refused_or_failed(model, "scale", exc)
            attempt = Attempt(asked=action.asked, at=at, result="error", reason=nomads_words(exc))
            log.warning(
                "event=activation_failed model=%s asked=%.3f error=%r", model.name, action.asked, str(exc)
            )
            return attempt, outcome
        except LeaseLost:
            raise
        # The first that failed to place says why (a replica without its shards is no replica).
        failed = next(((e, a) for e, a in zip(evals, answers, strict=True) if a.get("FailedTGAllocs")), None)
        if failed is not None:
            reason = summarize_placement(dict(failed[1]["FailedTGAllocs"]), job=dict(view.job or {}))
            attempt = Attempt(asked=action.asked, at=at, eval=failed[0], result="unplaceable", reason=reason)
        else:
            attempt = Attempt(asked=action.asked, at=at, eval=evals[0] if evals else "", result="placed")
        log.info(
            "event=activated model=%s count=%d asked=%.3f eval=%s result=%s reason=%r",
            model.name,
            action.count,
            action.asked,
            attempt.eval or "-",
            attempt.result,
            attempt.reason,
        )
        return attempt, True

    def _evaluation(self, eval_id: str) -> dict[str, Any]:
        """The evaluation once Nomad decided it, or as it stands after EVALUATION_WAIT_S."""
        deadline = time.monotonic() + EVALUATION_WAIT_S
        index, evaluation = self.nomad.evaluation(eval_id)
        while evaluation.get("Status") not in EVAL_DONE and time.monotonic() < deadline:
            index, evaluation = self.nomad.evaluation(
                eval_id, index=index, wait_s=max(1.0, deadline - time.monotonic())
            )
        return evaluation

    async def _refused_or_failed(self, model: Model, kind: str, exc: NomadError) -> ActionError | bool:
        if not is_refusal(exc):
            self._failed(model, kind, exc)
            return False
        said = nomads_words(exc)
        return ActionError(action=kind, status=exc.status, message=said, since=self.clock())

    def _asked_already(self, action: Scale, view: ModelView) -> bool:
        """This watcher set the job to this count itself, and the pass's view of the job is
        older than that call: asking again would make a second scaling event for nothing."""
        known = self._scaled.get(action.job_id)
        job = view.job
        if view.previous is not None and action.job_id == view.previous.job_id:
            job = view.previous.job  # a rollout's previous definition, drained
        seen = as_int(job.get("JobModifyIndex")) if job is not None else 0
        return known is not None and known[0] == action.count and seen < known[1]

    def _still_held(self, model: Model, action: Scale, view: ModelView) -> bool:
        held = self.held.get(model.name)
        if held is None:
            return False
        count, mark, since = held
        return (
            count == action.count
            and mark == _deployment_mark(view)
            and self.clock() - since < DEPLOYMENT_RETRY_S
        )

    async def _apply(self, model: Model, action: Action, view: ModelView | None = None) -> ActionError | bool:
        """True when it was done; an ActionError when Nomad refused for good; False when the
        call failed in a way that says nothing about the model (the next pass retries)."""
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(3),
                wait=wait_random_exponential(multiplier=0.2, max=2.0),
                retry=retry_if_exception_type((NomadUnavailable, ConsulUnavailable)),
                reraise=True,
            ):
                with attempt:
                    await self._apply_once(model, action)
        except NomadError as exc:
            kind = {
                RegisterJob: "register",
                Scale: "scale",
                Park: "park",
                ForceReschedule: "reschedule",
                StopJob: "stop",
            }.get(type(action), "")
            if isinstance(action, Scale) and exc.status == 400 and DEPLOYMENT_BLOCKS_SCALE in str(exc):
                # Not a refusal of the model: held, said once, asked again once it ends.
                if model.name not in self.held:
                    log.info(
                        "event=scale_held model=%s count=%d reason=%r",
                        model.name,
                        action.count,
                        DEPLOYMENT_BLOCKS_SCALE,
                    )
                mark = _deployment_mark(view) if view is not None else (0, 0)
                self.held[model.name] = (action.count, mark, self.clock())
                return False
            if not kind or not is_refusal(exc):
                self._failed(model, kind, exc)
                return False
            said = nomads_words(exc)
            refusal = ActionError(action=kind, status=exc.status, message=said, since=self.clock())
            if self.refusal_warnings.should_log(model.name, f"{kind} {exc.status} {said}"):
                log.warning(
                    "event=action_refused model=%s action=%s status=%d error=%r",
                    model.name,
                    kind,
                    exc.status,
                    str(exc),
                )
            return refusal
        except ConsulError as exc:
            # Our own call failed: nothing is concluded about the model; the next pass retries.
            self._failed(model, type(action).__name__, exc)
            return False
        if isinstance(action, Scale | Park | RegisterJob) and self.held.pop(model.name, None) is not None:
            log.info("event=scale_unheld model=%s count=%s", model.name, getattr(action, "count", 0))
        return True

    def _failed(self, model: Model, kind: str, exc: Exception) -> None:
        """A call that failed for now (Nomad or Consul down, slow, not answering as it should):
        retried on the next pass, said when it first happens or changes and every ten minutes."""
        if self.failure_warnings.should_log(model.name, f"{kind} {_ADDRESS.sub('0x', str(exc))}"):
            log.warning("event=action_failed model=%s action=%s error=%r", model.name, kind, str(exc))

    async def _apply_once(self, model: Model, action: Action) -> None:
        if isinstance(action, RegisterJob):
            job = render_job(model, job_id=action.job_id or None)
            set_replica_count(job, action.count)
            if action.fabric:
                # The fabric reconcile chose from the pass's nodes: every shard lands in it.
                job.setdefault("Constraints", []).append(fabric_constraint(action.fabric))
            self.leadership.check_lease(f"registering {job['ID']}")
            await asyncio.to_thread(
                functools.partial(self.nomad.register_job, job, enforce_index=action.job_modify_index)
            )
            log.info(
                "event=job_registered model=%s job=%s count=%d fabric=%s",
                model.name,
                job["ID"],
                action.count,
                action.fabric or "-",
            )
        elif isinstance(action, StopJob):
            self.leadership.check_lease(f"stopping {action.job_id}")
            await asyncio.to_thread(self.nomad.stop_job, action.job_id)
            log.info(
                "event=job_stopped model=%s job=%s message=%r", model.name, action.job_id, action.message
            )
        elif isinstance(action, ForceReschedule):
            self.leadership.check_lease(f"rescheduling {action.job_id}")
            await asyncio.to_thread(self.nomad.force_reschedule, action.job_id)
            log.warning(
                "event=nomad_gave_up model=%s job=%s allocs=%s action=force_reschedule",
                model.name,
                action.job_id,
                ",".join(a[:8] for a in action.allocs),
            )
        elif isinstance(action, Scale):
            await self._scale_replica(model, action.job_id, action.group, action.count, action.message)
            log.info(
                "event=scaled model=%s count=%d reason=%s message=%r",
                model.name,
                action.count,
                action.reason or "-",
                action.message,
            )
        elif isinstance(action, Park):
            await self._park(model, action)
        elif isinstance(action, WriteState):
            await self.states.write(model.name, action.state, action.cas)

    async def _scale_replica(
        self, model: Model, job_id: str, group: str, count: int, message: str
    ) -> list[dict[str, Any]]:
        """Every count the watcher writes goes through here, the lease checked before each call."""
        replies = await asyncio.to_thread(
            scale_replica,
            self.nomad,
            job_id,
            group,
            count,
            message,
            model,
            check_lease=self.leadership.check_lease,
        )
        # Nomad's index for this count: a view of the job older than it has not seen it yet.
        self._scaled[job_id] = (count, max((as_int(r.get("JobModifyIndex")) for r in replies), default=0))
        return replies

    async def _park(self, model: Model, action: Park) -> None:
        # Read before anything is written (the pass already did; this is its cached answer), so
        # the first parked state anyone sees names the engine's own error.
        error = await self.engine_errors.read(action)
        message = (
            f"llmgw: parked {model.name} after {action.failures} consecutive start failures: {error}; "
            f"fix the source or profile, or run 'llmgw ctl retry {model.name}'"
        )
        # Stop it first: a replica placed while we write state would be a sixth start.
        await self._scale_replica(model, action.job_id, action.group, 0, message)
        state = action.state.model_copy(update={"last_error": error})
        await self.states.write(model.name, state, action.cas)
        log.error(
            "event=parked model=%s failures=%d last_error=%r",
            model.name,
            action.failures,
            error,
        )
