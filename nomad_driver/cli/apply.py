"""`llmgw apply MODELS.yaml`: validate, store the definitions in Consul, register the jobs.

The definitions go to one key per model under `llmgw/config/` (`config_kv.py`), in
transactions claimed and committed with check-and-set (`config_store.py`), so two operators
applying at once cannot silently undo each other: the second is told the definitions moved
under it. The watchers read that prefix (blocking) and take it from there; the jobs are also
registered here so that a cluster with no watcher running still gets them.

A Nomad job that llmgw did not render for a model (its meta `llmgw_model` missing or naming
another model) is never registered over: apply refuses before it stores or registers anything,
so an operator's own `llmgw-<something>` job cannot be replaced by a model of that name.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nomad_driver.cli.plan import Fleet, job_to_register
from nomad_driver.config_kv import definition_keys
from nomad_driver.config_store import StoreConflict, store_keys
from nomad_driver.consul import Consul
from nomad_driver.nomad import Nomad
from nomad_driver.spec import ModelSet, parse_models, read_models_text
from nomad_driver.watcher.job_facts import job_conflict, job_is_current
from nomad_driver.watcher.rollout import job_ids, rolls_out, running_job


class ApplyConflict(Exception):
    """The definitions in Consul changed between reading and writing them."""


class JobNotOurs(ApplyConflict):
    """A model's job ID is taken in Nomad by a job llmgw did not render for that model."""


@dataclass
class ApplyResult:
    models: ModelSet
    registered: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    # Multi-node models whose job the leading watcher registers: only it chooses their fabric.
    for_the_watcher: list[str] = field(default_factory=list)
    # Models whose replicas run: the leading watcher rolls the new definition out beside them
    # (watcher/rollout.py), so registering it here would replace them all at once.
    rolled_out: list[str] = field(default_factory=list)


async def store_definitions(
    consul: Consul, text: str, origin: str = "<string>", *, checked: bool = False
) -> bool:
    """Write the file's keys; False when they were all there unchanged. An old single
    `llmgw/config/models` key is deleted as the new keys are committed. `checked`: the text
    already passed `parse_models`."""
    try:
        result = await store_keys(consul, definition_keys(text, origin, checked=checked))
    except StoreConflict as exc:
        raise ApplyConflict(str(exc)) from None
    return result.changed


def current_jobs(nomad: Nomad, models: ModelSet) -> dict[str, Mapping[str, Any] | None]:
    """Each model's job in Nomad now; raises JobNotOurs, naming every job that is not llmgw's
    for its model, before anything is changed."""
    jobs: dict[str, Mapping[str, Any] | None] = {
        name: nomad.get_job(model.job_id) for name, model in sorted(models.models.items())
    }
    problems = [job_conflict(jobs[name], model) for name, model in sorted(models.models.items())]
    problems = [p for p in problems if p]
    if problems:
        raise JobNotOurs("; ".join(problems) + "; nothing was applied")
    return jobs


def register_jobs(
    nomad: Nomad, models: ModelSet, jobs: Mapping[str, Mapping[str, Any] | None] | None = None
) -> ApplyResult:
    result = ApplyResult(models)
    jobs = current_jobs(nomad, models) if jobs is None else jobs
    fleet = Fleet(nomad)  # read only for a multi-node model, to pin it to a fabric
    for name, model in sorted(models.models.items()):
        first, second = job_ids(model)
        both = {first: jobs.get(name), second: nomad.get_job(second)}
        job_id, current = running_job(model, both)
        if current is not None and job_is_current(current, model):
            result.unchanged.append(name)
            continue
        if rolls_out(model, current):
            result.rolled_out.append(name)
            continue
        if model.profile.nodes > 1:
            # Registered without a fabric, Nomad could put one replica's shards in two fabrics
            # (or start them, only for the watcher to move them a second later): the leading
            # watcher registers it pinned to a fabric with room, within a pass of the new
            # definitions. Without a running watcher a multi-node model does not run.
            result.for_the_watcher.append(name)
            continue
        # Keeps the replicas it has (a router may have scaled it up, parking to 0); the
        # watcher decides the count, apply only changes what runs. `llmgw plan` plans this job.
        job, _ = job_to_register(model, current, fleet, job_id=job_id)
        nomad.register_job(job)
        result.registered.append(name)
    return result


def apply_file(
    path: str | Path, *, consul: Consul | None = None, nomad: Nomad | None = None, text: str | None = None
) -> ApplyResult:
    """Raises SpecError (bad file), ApplyConflict (JobNotOurs among them), ConsulError or
    NomadError. `text`: the file as already read (and planned), so what is applied is what the
    operator was shown."""
    if text is None:
        text = read_models_text(path)
    models = parse_models(text, str(path))
    nomad = nomad or Nomad()
    jobs = current_jobs(nomad, models)

    async def store() -> None:
        client = consul or Consul()
        try:
            await store_definitions(client, text, str(path), checked=True)
        finally:
            if consul is None:
                await client.close()

    asyncio.run(store())
    return register_jobs(nomad, models, jobs)
