"""Carrying out one model's decision on Nomad and Consul, on the leader only: register, scale,
park and write its state, and record how Nomad took it, so a refusal that will not heal becomes
the model's `last_action_error`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from nomad_driver.consul import ConsulError, ConsulUnavailable
from nomad_driver.nomad import Nomad, NomadError, NomadUnavailable
from nomad_driver.placement import PlacementWarnings
from nomad_driver.render import render_job
from nomad_driver.spec import Model
from nomad_driver.state import ActionError
from nomad_driver.watcher.engine_errors import EngineErrors
from nomad_driver.watcher.fenced import FencedStates
from nomad_driver.watcher.leader import Leadership, LeaseLost
from nomad_driver.watcher.multinode import pin_to_fabric, scale_replica, set_replica_count
from nomad_driver.watcher.reconcile import (
    Action,
    Decision,
    ModelView,
    NomadAction,
    Park,
    RegisterJob,
    Scale,
    WriteState,
    model_health,
)
from nomad_driver.watcher.watch import Watch

log = logging.getLogger("llmgw.watcher")

# Nomad answers that say "not now" rather than "never": a job that vanished (the next pass
# registers it again), a timeout, a conflict, a rate limit. Every other 4xx is a refusal that
# asking again will not change, and becomes the model's `last_action_error`.
_TRANSIENT_NOMAD_STATUS = frozenset({404, 408, 409, 429})


class Actor:
    def __init__(
        self,
        nomad: Nomad,
        leadership: Leadership,
        states: FencedStates,
        engine_errors: EngineErrors,
        nodes: Watch[tuple[dict[str, Any], ...]],
        allocs: Watch[tuple[dict[str, Any], ...]],
        clock: Callable[[], float],
    ) -> None:
        self.nomad = nomad
        self.leadership = leadership
        self.states = states
        self.engine_errors = engine_errors
        self.nodes = nodes
        self.allocs = allocs
        self.clock = clock
        # Refusals are logged like placement warnings: on change or every ten minutes.
        self.refusal_warnings = PlacementWarnings(clock)

    async def apply_decision(self, model: Model, d: Decision, view: ModelView) -> Decision:
        """Apply one model's actions, then record how Nomad took them: a refusal that will not
        heal becomes the model's `last_action_error` (stored, shown, counted, alerted on), and
        the next success, or nothing left to ask of Nomad, clears it. Returns the decision as
        it now stands, so the Consul UI check shows the refusal in the same pass."""
        condition = d.state.last_action_error
        asked_nomad = False
        parked = False
        write: WriteState | None = None
        for action in d.actions:
            if isinstance(action, WriteState):
                write = action  # written last, with the outcome of the Nomad calls
                continue
            if not self.leadership.is_leader:
                raise LeaseLost("leadership lost during the pass")
            if isinstance(action, Park):
                action = replace(action, state=action.state.model_copy(update={"last_action_error": None}))
            outcome = await self._apply(model, action)
            if isinstance(action, NomadAction):
                asked_nomad = True
                if isinstance(outcome, ActionError):
                    condition = condition if outcome.same_refusal(condition) else outcome
                elif outcome:
                    condition = None
                    parked = isinstance(action, Park)
        if not asked_nomad:
            condition = None  # nothing asked of Nomad, nothing refused
        if condition is None:
            self.refusal_warnings.clear(d.model)
        if parked:
            return d  # Park wrote the state itself, with no refusal
        state = write.state if write is not None else d.state
        if condition != state.last_action_error:
            state = state.model_copy(update={"last_action_error": condition})
        elif write is None:
            return d
        if not await self.states.write(d.model, state, view.state_index):
            return d
        health, output = model_health(d.model, state, d.desired, d.ready, d.starting)
        return replace(d, state=state, health=health, health_output=output)

    async def _apply(self, model: Model, action: Action) -> ActionError | bool:
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
            kind = {RegisterJob: "register", Scale: "scale", Park: "park"}.get(type(action), "")
            if isinstance(exc, NomadUnavailable) or exc.status in _TRANSIENT_NOMAD_STATUS or not kind:
                log.warning("event=action_failed model=%s action=%s error=%r", model.name, kind, str(exc))
                return False
            # Nomad's own words, without our "nomad POST /v1/...: HTTP 400:" in front.
            said = str(exc).split(f"HTTP {exc.status}: ", 1)[-1]
            refusal = ActionError(action=kind, status=exc.status, message=said, since=self.clock())
            if self.refusal_warnings.should_log(model.name, f"{kind} {exc.status} {exc}"):
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
            log.warning(
                "event=action_failed model=%s action=%s error=%r", model.name, type(action).__name__, str(exc)
            )
            return False
        return True

    async def _apply_once(self, model: Model, action: Action) -> None:
        if isinstance(action, RegisterJob):
            job = render_job(model)
            set_replica_count(job, action.count)
            pin_to_fabric(
                job, model, self.nodes.snapshot.data if self.nodes.snapshot else (), self._live_allocs()
            )
            self.leadership.check_lease(f"registering {model.job_id}")
            await asyncio.to_thread(self.nomad.register_job, job)
            log.info("event=job_registered model=%s job=%s count=%d", model.name, model.job_id, action.count)
        elif isinstance(action, Scale):
            self.leadership.check_lease(f"scaling {action.job_id}")
            await asyncio.to_thread(
                scale_replica, self.nomad, action.job_id, action.group, action.count, action.message, model
            )
            log.info("event=scaled model=%s count=%d message=%r", model.name, action.count, action.message)
        elif isinstance(action, Park):
            await self._park(model, action)
        elif isinstance(action, WriteState):
            await self.states.write(model.name, action.state, action.cas)

    def _live_allocs(self) -> tuple[dict[str, Any], ...]:
        return self.allocs.snapshot.data if self.allocs.snapshot else ()

    async def _park(self, model: Model, action: Park) -> None:
        # Read before anything is written (the pass already did; this is its cached answer), so
        # the first parked state anyone sees names the engine's own error.
        error = await self.engine_errors.read(action)
        message = (
            f"llmgw: parked {model.name} after {action.failures} consecutive start failures: {error}; "
            f"fix the source or profile, or run 'llmgw ctl retry {model.name}'"
        )
        # Stop it first: a replica placed while we write state would be a sixth start.
        self.leadership.check_lease(f"parking {action.job_id}")
        await asyncio.to_thread(scale_replica, self.nomad, action.job_id, action.group, 0, message, model)
        state = action.state.model_copy(update={"last_error": error})
        await self.states.write(model.name, state, action.cas)
        log.error(
            "event=parked model=%s failures=%d last_error=%r",
            model.name,
            action.failures,
            error,
        )
