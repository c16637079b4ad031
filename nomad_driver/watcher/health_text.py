"""The model's entry in the Consul UI: its status and the one line that says why."""

from __future__ import annotations

import time

from nomad_driver.state import ModelState
from nomad_driver.watcher.decisions import HealthStatus


def model_health(
    model: str, state: ModelState, desired: int, ready: int, starting: int, why: str = ""
) -> tuple[HealthStatus, str]:
    """The status and text of the model's entry in the Consul UI: why, in one line; `why` is
    why it should have `desired` (`load: 37 in flight / 8 per replica`)."""
    status, text = _health(model, state, desired, ready, starting)
    return status, f"{text} ({why})" if why and not state.parked and not state.job_conflict else text


def utc_text(seconds: float) -> str:
    """A stored Unix time for people; a value no calendar holds (a hand-edited 1e300) reads as
    such, rather than failing the pass that shows it."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):
        return f"an unreadable time ({seconds!r})"


def _health(
    model: str, state: ModelState, desired: int, ready: int, starting: int
) -> tuple[HealthStatus, str]:
    if state.job_conflict:
        return "critical", state.job_conflict
    if state.parked and state.rollout_from:
        # The update failed, not the model: the previous definition serves (rollout.py).
        return "warning", (
            f"update failed: {state.last_error or 'no error recorded'} "
            f"({state.consecutive_failures} consecutive start failures); serving the previous "
            f"definition ({state.rollout_from}); apply it again or a fixed one"
        )
    if state.parked:
        return "critical", (
            f"parked after {state.consecutive_failures} consecutive start failures: "
            f"{state.last_error or 'no error recorded'}; fix the source or profile, "
            f"or run 'llmgw ctl retry {model}'"
        )
    refused = state.last_action_error
    if refused is not None:
        return "critical", (
            f"Nomad refuses to {refused.action} it (HTTP {refused.status}) since "
            f"{utc_text(refused.since)}: {refused.message}; "
            "fix the job or llmgw's Nomad token; cleared when Nomad next accepts"
        )
    if state.unplaceable and state.rollout_from:
        return "warning", (
            f"update waiting for room: {state.placement_reason}; the previous definition "
            f"({state.rollout_from}) serves meanwhile (a profile's `update: replace` replaces it in place)"
        )
    if state.unplaceable:
        return "critical", f"unplaceable: {state.placement_reason}"
    if state.nomad_gave_up:
        return "critical", state.nomad_gave_up
    if state.degraded:
        # Replicas serve: a warning, not an outage (partial.py).
        return "warning", f"degraded: {ready} of {desired} replicas ready; {state.degraded}"
    if state.short:
        # The minimum serves: a warning, not an outage.
        return (
            "warning",
            f"short: {ready} of {desired} replicas ready, Nomad cannot place more: {state.short_reason}",
        )
    if state.rollout_from and ready < desired:
        return "passing", (
            f"updating: {ready} of {desired} replicas of the new definition ready; the previous "
            f"definition ({state.rollout_from}) serves until they are"
        )
    if desired > 0 and ready == 0 and starting == 0:
        return "critical", f"nothing ready: 0 of {desired} replicas"
    if ready >= desired:
        if desired == 0 and ready == 0:
            return "passing", "on demand: no replica running, none asked for"
        return "passing", f"{ready} of {desired} replicas ready"
    note = f", {state.consecutive_failures} start failures in a row" if state.consecutive_failures else ""
    return "warning", f"starting: {ready} of {desired} replicas ready, {starting} starting{note}"
