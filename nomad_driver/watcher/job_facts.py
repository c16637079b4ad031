"""What a model's Nomad job says about itself: its group and count, the definition it runs,
whether it makes deployments, whether it is llmgw's at all, and which job it is (its version,
indexes, and whether it was re-created). Read from Nomad's JSON, tolerant of odd values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nomad_driver.fields import as_int
from nomad_driver.placement import job_fabric
from nomad_driver.spec import Model
from nomad_driver.state import ModelState


def job_group(job: Mapping[str, Any] | None) -> tuple[str, int]:
    """The job's one task group and its count; ("", 0) for a job that is missing or odd."""
    if not isinstance(job, Mapping):
        return "", 0
    groups = job.get("TaskGroups")
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping):
        return "", 0
    try:
        count = int(groups[0].get("Count") or 0)
    except (TypeError, ValueError):
        count = 0
    return str(groups[0].get("Name", "")), count


def job_def_hash(job: Mapping[str, Any] | None) -> str:
    if not isinstance(job, Mapping) or not isinstance(job.get("Meta"), Mapping):
        return ""
    return str(job["Meta"].get("llmgw_def_hash", ""))


def job_scaling_max(job: Mapping[str, Any] | None) -> int | None:
    groups = job.get("TaskGroups") if isinstance(job, Mapping) else None
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping):
        return None
    scaling = groups[0].get("Scaling")
    if not isinstance(scaling, Mapping) or not isinstance(scaling.get("Max"), int):
        return None
    return int(scaling["Max"])


def job_makes_deployments(job: Mapping[str, Any] | None) -> bool:
    """A group of the job has an update strategy that makes Nomad deploy it (max_parallel > 0),
    as a model job rendered before llmgw opted out has (or a multi-node job's shard group did):
    Nomad would refuse to scale it while a deployment runs."""
    groups = job.get("TaskGroups") if isinstance(job, Mapping) else None
    if not isinstance(groups, list):
        return False
    for group in groups:
        update = group.get("Update") if isinstance(group, Mapping) else None
        max_parallel = update.get("MaxParallel") if isinstance(update, Mapping) else None
        if isinstance(max_parallel, int) and max_parallel > 0:
            return True
    return False


def job_is_current(job: Mapping[str, Any] | None, model: Model) -> bool:
    """The job in Nomad runs this definition. Replicas are not in the definition hash (scaling
    is not a new definition, and must not unpark), but Nomad refuses to scale past the job's
    scaling maximum, so a raised `replicas.max` needs the job registered again; a job that still
    makes deployments is registered again to opt out (an update in place, nothing restarts)."""
    return (
        job_def_hash(job) == model.def_hash
        and job_scaling_max(job) == model.replicas_max
        and not job_makes_deployments(job)
        # A multi-node job that is not pinned (registered by `llmgw apply`, or by an llmgw
        # before pinning was sure) could put one replica's shards in two fabrics.
        and (model.profile.nodes <= 1 or bool(job_fabric(job)))
    )


def job_version(job: Mapping[str, Any] | None) -> int:
    if not isinstance(job, Mapping):
        return 0
    try:
        return int(job.get("Version") or 0)
    except (TypeError, ValueError):
        return 0


def job_conflict(job: Mapping[str, Any] | None, model: Model) -> str:
    """Why the Nomad job with this model's ID is not llmgw's to change, or "" when it is: a
    job that llmgw did not render for this model (its meta `llmgw_model` missing or naming
    another model) is someone else's, and registering over it would replace their service."""
    if not isinstance(job, Mapping):
        return ""
    meta = job.get("Meta")
    owner = meta.get("llmgw_model") if isinstance(meta, Mapping) else None
    if owner == model.name:
        return ""
    whose = f"its meta names model {owner!r}" if owner else "its meta has no llmgw_model"
    return (
        f"Nomad job {model.job_id} was not registered by llmgw for model {model.name} ({whose}); "
        f"llmgw leaves it alone: rename the model or remove that job"
    )


def job_modify_index(job: Mapping[str, Any] | None) -> int:
    return as_int(job.get("JobModifyIndex")) if isinstance(job, Mapping) else 0


def job_create_index(job: Mapping[str, Any] | None) -> int:
    return as_int(job.get("CreateIndex")) if isinstance(job, Mapping) else 0


def job_recreated(job: Mapping[str, Any] | None, state: ModelState) -> bool:
    """The job is not the one the count's version was taken from: another CreateIndex, or, where
    the state predates knowing it, a version below the one recorded (Nomad never lowers one)."""
    created = job_create_index(job)
    if state.count_job_create_index and created:
        return created != state.count_job_create_index
    return job_version(job) < state.count_job_version
