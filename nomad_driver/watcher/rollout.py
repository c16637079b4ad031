"""A new definition serves before the old one stops, and a broken one never takes it down.

Model jobs make no Nomad deployments (a deployment would block the watcher's scale calls), so
registering a new definition over a serving job would replace every replica at once. Instead a
model has two job IDs, `llmgw-<model>` and `llmgw-<model>~b` (`~` is in no model name, and
Nomad's ID and Variable path rules allow it), and a definition change of a serving model goes
to the other one:

- The new definition's job starts beside the serving one, with its own count of failed
  starts (the model's count belongs to the current definition, as it always has).
- Routers send new requests to the newest definition that has ready replicas (each engine's
  service carries its definition hash), so the old replicas only finish what they hold.
- Once the new job has every replica it should, the old one is scaled to 0 (its replicas
  leave Consul, drain for the group's shutdown_delay, then stop) and then stopped.
- A new definition that fails five starts is parked with its cause while the old job keeps
  serving: "update failed". Applying the previous definition again takes the old job back
  as current (it matches, and serves), and the failed one is drained in its turn.

Nothing to protect, nothing to overlap: a model whose job serves nothing (on demand and idle,
crash-looping, parked) has the new definition registered over its job, in place, as before. A
multi-node model's new replica is pinned to a fabric with room beside the serving one (its nodes
count as taken); with none, it waits (`surge`) or the old replica stops first (`rolling`).

Pure: which job is which follows from Nomad's jobs and the engines' checks alone, so a
leader that took over mid-rollout carries on where the last one was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nomad_driver.spec import Model
from nomad_driver.state import ModelState
from nomad_driver.watcher.decisions import Action, PreviousJob, Scale, StopJob
from nomad_driver.watcher.job_facts import job_conflict, job_def_hash, job_group

SECOND_JOB_SUFFIX = "~b"


def job_ids(model: Model) -> tuple[str, str]:
    """The model's two job IDs: its own, and the one a rollout alternates with."""
    return model.job_id, f"{model.job_id}{SECOND_JOB_SUFFIX}"


def _live(job: Mapping[str, Any] | None) -> bool:
    return isinstance(job, Mapping) and not job.get("Stop")


def choose_jobs(
    model: Model, jobs: Mapping[str, Mapping[str, Any]], ready_by_job: Mapping[str, int]
) -> tuple[str, str | None]:
    """(the job ID for the current definition, the job ID of a previous one still running).

    A job already on the current definition is current (when both are, the one serving more:
    the other is a leftover to drain). Otherwise the definition goes over the job in place,
    unless that job serves: then to the other ID, and the serving one is previous."""
    first, second = job_ids(model)
    a, b = jobs.get(first), jobs.get(second)
    taken = isinstance(b, Mapping) and bool(job_conflict(b, model))
    if taken:
        b = None  # someone else's job holds the second ID: never registered over, never drained
    matching = [
        jid
        for jid, job in ((first, a), (second, b))
        if job is not None and job_def_hash(job) == model.def_hash
    ]
    live = [jid for jid, job in ((first, a), (second, b)) if _live(job)]
    if len(matching) == 2 and len(live) == 2:
        current = max(matching, key=lambda jid: (ready_by_job.get(jid, 0), jid == first))
    elif matching:
        current = next((jid for jid in matching if jid in live), matching[0])
    else:
        serving = [jid for jid in live if ready_by_job.get(jid, 0) > 0]
        if not serving or model.profile.update == "replace" or taken:
            # Nothing serves, or a profile that says `update: replace`: replaced in place, over
            # the job that runs.
            return (serving or live or [first if a is not None or b is None else second])[0], None
        source = max(serving, key=lambda jid: (ready_by_job.get(jid, 0), jid == first))
        current = second if source == first else first
    other = second if current == first else first
    return current, (other if other in live else None)


def previous_steps(
    model: Model, previous: PreviousJob, state: ModelState, ready: int, desired: int
) -> list[Action]:
    """What becomes of the previous definition's job this pass: kept while the new one is not
    ready (or failed), drained once it is, stopped once drained."""
    if state.parked:
        return []  # the update failed: the previous definition keeps serving
    group, count = job_group(previous.job)
    if ready < max(desired, 1) and desired > 0:
        keep = max(0, desired - ready - 1)
        if model.profile.update == "rolling" and (state.unplaceable or state.short) and count > keep:
            # No room for the new replicas beside the old: one old replica makes room at a time,
            # as each new one turns ready, so at most one replica's capacity is lost meanwhile.
            return [
                Scale(
                    model.name,
                    previous.job_id,
                    group,
                    keep,
                    f"llmgw: no room for {model.name}'s new definition beside the previous one; "
                    f"rolling one replica at a time ({ready} of {desired} new replicas ready)",
                    "rollout",
                )
            ]
        return []  # still starting: both serve, routers prefer the new one's ready replicas
    if count > 0:
        return [
            Scale(
                model.name,
                previous.job_id,
                group,
                0,
                f"llmgw: {model.name}'s new definition serves on {ready} of {desired} replicas; "
                "draining the previous one",
                "rollout",
            )
        ]
    if previous.live == 0:
        return [StopJob(model.name, previous.job_id, f"llmgw: {model.name}'s previous definition is drained")]
    return []


def running_job(
    model: Model, jobs: Mapping[str, Mapping[str, Any] | None]
) -> tuple[str, Mapping[str, Any] | None]:
    """The job that runs the model now, as `plan` and `apply` see it (with no checks at hand):
    a live one on the current definition, else the live one with more replicas, else the
    model's own ID's (stopped, someone else's, or none)."""
    first, second = job_ids(model)
    live = [
        (jid, job)
        for jid in (first, second)
        if (job := jobs.get(jid)) is not None
        and not job.get("Stop")
        and (jid == first or not job_conflict(job, model))
    ]
    for jid, job in live:
        if job_def_hash(job) == model.def_hash:
            return jid, job
    if live:
        return max(live, key=lambda pair: (job_group(pair[1])[1], pair[0] == first))
    return first, jobs.get(first)


def rolls_out(model: Model, job: Mapping[str, Any] | None) -> bool:
    """A new definition of a single-node model whose job runs replicas: the watcher starts it
    beside them (a profile's `update: replace` registers it over them instead)."""
    return (
        model.profile.update != "replace"
        and isinstance(job, Mapping)
        and not job.get("Stop")
        and job_def_hash(job) != model.def_hash
        and job_group(job)[1] > 0
    )


def other_job_id(model: Model, job_id: str) -> str:
    first, second = job_ids(model)
    return second if job_id == first else first
