"""`llmgw plan`: what applying a models file would change, and whether each change fits,
before anything is touched.

Nomad answers "will it fit" for one job (`POST /v1/job/<id>/plan`, run in a snapshot, written
nowhere); this module asks it for every model that would change, at the replicas the model will
run once applied, and reads the answer the way the watcher reads a failed evaluation, with the
same one-line summary (`placement.summarize_placement`), so an operator sees the same words
before an apply as after it. What changed is read against both places a definition lives: the
stored definitions (`llmgw/config/`, what watchers and routers use) and the jobs in Nomad
(their `llmgw_def_hash`, what runs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Literal

from nomad_driver.cli.plan_reading import (
    Placement,
    candidates,
    namespace_default_pool,
    read_plan,
)
from nomad_driver.config_kv import CONFIG_PREFIX, StoredDefinitions, config_entries
from nomad_driver.consul import Consul, KVEntry
from nomad_driver.nomad import JOB_PREFIX, Nomad, NomadError
from nomad_driver.placement import fabric_rooms, no_fabric_reason
from nomad_driver.render import render_job
from nomad_driver.spec import Model, ModelSet, parse_models
from nomad_driver.watcher.job_facts import (
    job_conflict,
    job_def_hash,
    job_group,
    job_is_current,
    job_scaling_max,
)
from nomad_driver.watcher.multinode import pin_to_fabric, set_replica_count
from nomad_driver.watcher.rollout import job_ids, other_job_id, rolls_out, running_job

# Exit codes, for CI to gate on (documented in README and docs/operating.md).
EXIT_NOTHING_TO_DO = 0
EXIT_INVALID_FILE = 2
EXIT_UNREACHABLE = 3
EXIT_CHANGES = 6
EXIT_FITS_NOWHERE = 7
EXIT_JOB_CONFLICT = 8

# `conflict`: the model's job ID is taken in Nomad by a job llmgw did not render for it.
Change = Literal["added", "changed", "removed", "unchanged", "conflict"]


@dataclass
class FieldChange:
    field: str  # `source`, `profile`, `profile.gpu_memory_mib`, `replicas.max`, ...
    old: Any
    new: Any


@dataclass
class ModelPlan:
    model: str
    job_id: str
    change: Change
    fields: list[FieldChange] = field(default_factory=list)
    replaces_replicas: bool = False  # Nomad would stop running replicas and start new ones
    on_demand: bool = False  # min 0: planned at 1 replica, as its first request would ask
    placement: Placement | None = None
    notes: list[str] = field(default_factory=list)
    # A rollout: the job whose running replicas the new definition starts beside (rollout.py),
    # and how, when there is no room beside them (the profile's `update`).
    surge_from: str = ""
    update: str = ""


@dataclass
class FleetPlan:
    models: list[ModelPlan]
    text: str = ""  # the file as read, so that apply applies exactly what was planned
    problems: list[str] = field(default_factory=list)  # why apply would refuse the file

    def count(self, change: Change) -> int:
        return sum(1 for m in self.models if m.change == change)

    @property
    def unplaceable(self) -> list[ModelPlan]:
        return [m for m in self.models if m.placement is not None and not m.placement.fits]

    @property
    def conflicts(self) -> list[ModelPlan]:
        return [m for m in self.models if m.change == "conflict"]

    @property
    def has_changes(self) -> bool:
        return any(m.change != "unchanged" for m in self.models)

    @property
    def exit_code(self) -> int:
        # A conflict first: apply refuses the whole file over it, so nothing else would happen.
        if self.conflicts:
            return EXIT_JOB_CONFLICT
        if self.unplaceable:
            return EXIT_FITS_NOWHERE
        return EXIT_CHANGES if self.has_changes else EXIT_NOTHING_TO_DO

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": {
                EXIT_NOTHING_TO_DO: "nothing to do",
                EXIT_CHANGES: "changes",
                EXIT_FITS_NOWHERE: "fits nowhere",
                EXIT_JOB_CONFLICT: "job conflict",
            }[self.exit_code],
            "exit_code": self.exit_code,
            "summary": {
                "added": self.count("added"),
                "changed": self.count("changed"),
                "removed": self.count("removed"),
                "unchanged": self.count("unchanged"),
                "conflict": self.count("conflict"),
                "fits_nowhere": len(self.unplaceable),
            },
            "problems": self.problems,
            "models": [asdict(m) for m in self.models],
        }


# ----- reading what is there ----------------------------------------------------------------


def stored_definitions(consul: Consul | None = None) -> tuple[dict[str, Model] | None, str]:
    """The definitions in Consul (`config_kv.py`: one key per model, or the legacy single key),
    and a note naming the keys that cannot be read (then those models are compared with their
    job alone). Raises ConsulError when Consul is down."""

    async def read() -> list[KVEntry]:
        client = consul or Consul()
        try:
            return (await client.kv_get(CONFIG_PREFIX, recurse=True))[1]
        finally:
            if consul is None:
                await client.close()

    stored = StoredDefinitions()
    stored.read(config_entries(asyncio.run(read())))
    if not stored.layout and not stored.problems:
        return None, ""
    note = f"{stored.problems[0]}; compared with the jobs only" if stored.problems else ""
    return (stored.models if stored.layout else None), note


class Fleet:
    """What is read of Nomad's nodes, allocations and namespace, each once and only when a model
    needs it: most plans need the node list alone, and only a multi-node model its fabrics."""

    def __init__(self, nomad: Nomad) -> None:
        self.nomad = nomad

    @cached_property
    def node_stubs(self) -> list[dict[str, Any]]:
        _, stubs = self.nomad.blocking_list("nodes", params={"resources": "true"})
        return stubs

    @cached_property
    def nodes(self) -> list[dict[str, Any]]:
        """Every node in full: the list's stubs carry no meta, where each node's fabric is."""
        out = []
        for stub in self.node_stubs:
            node_id = str(stub.get("ID", ""))
            try:
                full = self.nomad.request_json("node", node_id, what=f"node {node_id}")
            except NomadError as exc:
                if exc.status != 404:
                    raise
                continue  # garbage-collected between the list and the read
            if isinstance(full, dict):
                out.append({**full, **stub})
        return out

    @cached_property
    def allocs(self) -> list[dict[str, Any]]:
        _, allocs = self.nomad.blocking_list("allocations", params={"resources": "true"})
        return allocs

    @cached_property
    def default_pool(self) -> str:
        """The node pool a job that names none lands in (see `namespace_default_pool`)."""
        try:
            namespace = self.nomad.request_json(
                "namespace", self.nomad.namespace, what=f"namespace {self.nomad.namespace}"
            )
        except NomadError as exc:
            if exc.status != 404:  # a Nomad without namespaces (the dev stack's stand-in)
                raise
            namespace = None
        return namespace_default_pool(namespace)


def job_to_register(
    model: Model, current: Mapping[str, Any] | None, fleet: Fleet, *, job_id: str | None = None
) -> tuple[dict[str, Any], str | None]:
    """The job `apply` registers: the rendered definition, keeping the replicas a running job
    has (a router may have scaled it up, parking scaled it to 0), within the new maximum; a
    multi-node replica whole (its leader and every shard, or nothing) and pinned to a fabric
    as the watcher pins it. Returns the job and that fabric (None for a single-node model, or
    when no fabric has room: then it goes unpinned, as the watcher registers it)."""
    job = render_job(model, job_id=job_id)
    if current is not None:
        _, count = job_group(current)
        set_replica_count(job, min(count, model.replicas_max))
    if model.profile.nodes <= 1:
        return job, None
    return job, pin_to_fabric(job, model, fleet.nodes, fleet.allocs)


def no_room_reason(model: Model, fleet: Fleet) -> str:
    """Why no fabric holds a replica of `model`, counted as `pin_to_fabric` counts (its own
    running shards are room it would take over)."""
    others = [a for a in fleet.allocs if a.get("JobID") != model.job_id]
    return no_fabric_reason(fabric_rooms(fleet.nodes, others, model.name), model.profile.nodes)


# ----- what changed -------------------------------------------------------------------------


def _model_fields(model: Model) -> dict[str, Any]:
    out: dict[str, Any] = {"source": model.source, "profile": model.profile_name}
    for key, value in model.profile.model_dump(mode="json").items():
        out[f"profile.{key}"] = value
    out["replicas.min"] = model.replicas_min
    out["replicas.max"] = model.replicas_max
    out["idle_timeout"] = model.idle_timeout_s
    out["activation_timeout"] = model.activation_timeout_s
    return out


def field_changes(old: Model, new: Model) -> list[FieldChange]:
    before, after = _model_fields(old), _model_fields(new)
    return [FieldChange(k, before.get(k), after.get(k)) for k in after if before.get(k) != after.get(k)]


def _job_field_changes(job: Mapping[str, Any], model: Model) -> list[FieldChange]:
    """Without stored definitions, what the job's meta tells: source, profile, definition."""
    meta = job.get("Meta") if isinstance(job.get("Meta"), Mapping) else {}
    assert isinstance(meta, Mapping)
    out = []
    if meta.get("llmgw_source", model.source) != model.source:
        out.append(FieldChange("source", meta.get("llmgw_source"), model.source))
    if meta.get("llmgw_profile", model.profile_name) != model.profile_name:
        out.append(FieldChange("profile", meta.get("llmgw_profile"), model.profile_name))
    if not out and job_def_hash(job) != model.def_hash:
        out.append(FieldChange("definition", job_def_hash(job), model.def_hash))
    if job_scaling_max(job) != model.replicas_max:
        out.append(FieldChange("replicas.max", job_scaling_max(job), model.replicas_max))
    return out


# What decides whether the job in Nomad is current (`job_facts.job_is_current`).
_JOB_FIELDS = ("source", "profile", "replicas.max")


def classify(model: Model, stored: Model | None, job: Mapping[str, Any] | None) -> ModelPlan:
    """Added, changed (which fields) or unchanged, against the stored definition and the job."""
    plan = ModelPlan(model.name, model.job_id, "unchanged", on_demand=model.replicas_min == 0)
    conflict = job_conflict(job, model)
    if conflict:
        # Someone else's job under this model's ID: apply refuses the file rather than replace it.
        plan.change = "conflict"
        plan.notes.append(conflict)
        return plan
    if job is None:
        plan.change = "added"
        if stored is not None:
            plan.notes.append("defined in Consul but has no job in Nomad: its job is registered again")
        return plan
    if job.get("Stop") and job_is_current(job, model):
        plan.notes.append(
            "its job is stopped in Nomad and stays stopped (`nomad job run` or a changed definition starts it)"
        )
    fields = field_changes(stored, model) if stored is not None else []
    explains_job = any(f.field in _JOB_FIELDS or f.field.startswith("profile.") for f in fields)
    if not job_is_current(job, model) and not explains_job:
        # The stored definitions do not say why the job differs (they were edited by hand,
        # or lost): say what the job's own meta tells.
        fields += _job_field_changes(job, model)
    if fields:
        plan.change = "changed"
        plan.fields = fields
    return plan


# ----- Nomad's answer -----------------------------------------------------------------------


def planned_count(model: Model, job: Mapping[str, Any]) -> tuple[int, bool]:
    """The replicas to plan for: what the registered job keeps, at least the minimum (a parked
    model whose definition changes is restored to it); 1 for an on-demand model, which is what
    its first request asks for. Returns (count, on demand)."""
    _, count = job_group(job)
    count = max(count, model.replicas_min)
    return (count, False) if count > 0 else (1, True)


def nomad_plan(nomad: Nomad, job: dict[str, Any]) -> dict[str, Any]:
    """Nomad's `JobPlanResponse` for registering `job`, with its diff: computed in a snapshot
    and written nowhere. Made here rather than in the client, because only the operator's
    `plan` and `apply` ask it, with the operator's token (tests/acl_table.py, "operator")."""
    data = nomad.request_json(
        "job",
        str(job["ID"]),
        "plan",
        what=f"plan {job['ID']}",
        method="post",
        body={"Job": job, "Diff": True},
    )
    return data if isinstance(data, dict) else {}


# ----- the whole plan -----------------------------------------------------------------------


def plan_placement(
    nomad: Nomad, fleet: Fleet, model: Model, job: Mapping[str, Any] | None, *, job_id: str | None = None
) -> tuple[Placement, bool]:
    """Nomad's plan of the job `apply` would register, at the replicas it will run; for a
    multi-node model, pinned to the fabric the watcher would choose. Returns the placement and
    whether the model is planned on demand."""
    target, fabric = job_to_register(model, job, fleet, job_id=job_id)
    count, on_demand = planned_count(model, target)
    set_replica_count(target, count)
    placement = read_plan(nomad_plan(nomad, target), target, count)
    if model.profile.nodes > 1:
        placement.fabric, placement.nodes = fabric, model.profile.nodes
        if fabric is None:
            # Unpinned, Nomad may still find nodes, but in fabrics that are not connected to
            # one another: that replica could never run.
            reason = no_room_reason(model, fleet)
            placement.reason = f"{reason}; {placement.reason}" if not placement.fits else reason
            placement.fits = False
    if placement.fits:
        placement.candidates = candidates(
            model,
            fleet.nodes if fabric else fleet.node_stubs,
            default_pool="default" if model.profile.node_pool else fleet.default_pool,
            fabric=fabric,
        )
    return placement, on_demand


def plan_models(models: ModelSet, *, consul: Consul | None = None, nomad: Nomad | None = None) -> FleetPlan:
    """Raises ConsulError or NomadError when either cannot be read; changes nothing anywhere."""
    nomad = nomad or Nomad()
    stored, note = stored_definitions(consul)
    _, job_stubs = nomad.blocking_list("jobs", params={"prefix": JOB_PREFIX, "meta": "true"})
    fleet = Fleet(nomad)
    out: list[ModelPlan] = []
    problems: list[str] = []
    for name, model in sorted(models.models.items()):
        first, second = job_ids(model)
        both = {
            first: nomad.get_job(first),
            second: nomad.get_job(second),
        }
        job_id, job = running_job(model, both)
        mp = classify(model, stored.get(name) if stored else None, job)
        mp.job_id = job_id
        if mp.change == "conflict":
            problems.extend(mp.notes)
        if note:
            mp.notes.append(note)
        out.append(mp)
        if mp.change in ("unchanged", "conflict"):
            continue
        if rolls_out(model, job):
            # Planned as the watcher does it: the new definition's own job beside the running one.
            mp.surge_from, mp.update = job_id, model.profile.update
            mp.placement, mp.on_demand = plan_placement(
                nomad, fleet, model, job, job_id=other_job_id(model, job_id)
            )
        else:
            mp.placement, mp.on_demand = plan_placement(nomad, fleet, model, job, job_id=job_id)
        mp.replaces_replicas = mp.placement.updates.get("DestructiveUpdate", 0) > 0

    defined = set(models.models)
    removed: dict[str, str] = {}
    for stub in job_stubs:
        meta = stub.get("Meta") if isinstance(stub.get("Meta"), Mapping) else None
        model_name = str(meta.get("llmgw_model", "")) if meta else ""
        if model_name and model_name not in defined and not stub.get("Stop"):
            removed[model_name] = str(stub.get("ID", ""))
    for model_name, stored_model in (stored or {}).items():
        if model_name not in defined:
            removed.setdefault(model_name, stored_model.job_id)
    for model_name, job_id in sorted(removed.items()):
        mp = ModelPlan(model_name, job_id, "removed")
        mp.notes.append(f"apply does not stop its job; run `nomad job stop {job_id}` to stop its replicas")
        out.append(mp)
    return FleetPlan(out, problems=problems)


def plan_text(
    text: str, origin: str, *, consul: Consul | None = None, nomad: Nomad | None = None
) -> FleetPlan:
    """Raises SpecError for an invalid file, before anything is read from the cluster."""
    return plan_models(parse_models(text, origin), consul=consul, nomad=nomad)
