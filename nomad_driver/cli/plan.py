"""`llmgw plan`: what applying a models file would change, and whether each change fits,
before anything is touched.

Nomad answers "will it fit" for one job (`POST /v1/job/<id>/plan`, run in a snapshot, written
nowhere); this module asks it for every model that would change, at the replicas the model will
run once applied, and reads the answer the way the watcher reads a failed evaluation, with the
same one-line summary (`placement.summarize_placement`), so an operator sees the same words
before an apply as after it. What changed is read against both places a definition lives: the
stored definitions (`llmgw/config/models`, what watchers and routers use) and the jobs in Nomad
(their `llmgw_def_hash`, what runs).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

from nomad_driver.consul import Consul
from nomad_driver.nomad import JOB_PREFIX, Nomad
from nomad_driver.placement import summarize_placement
from nomad_driver.render import render_job
from nomad_driver.spec import Model, ModelSet, SpecError, parse_models, problem_line, read_models_text
from nomad_driver.state import CONFIG_MODELS_KEY
from nomad_driver.watcher.reconcile import job_def_hash, job_group, job_is_current, job_scaling_max

# Exit codes, for CI to gate on (documented in README and docs/operating.md).
EXIT_NOTHING_TO_DO = 0
EXIT_INVALID_FILE = 2
EXIT_UNREACHABLE = 3
EXIT_CHANGES = 6
EXIT_FITS_NOWHERE = 7

Change = Literal["added", "changed", "removed", "unchanged"]


@dataclass
class FieldChange:
    field: str  # `source`, `profile`, `profile.gpu_memory_mib`, `replicas.max`, ...
    old: Any
    new: Any


@dataclass
class Candidate:
    """Where it may go: ready, eligible nodes with the GPUs asked for. Nomad's plan says whether
    it fits, not where; the rest of the request (engine version, node pool) is Nomad's to check."""

    node_class: str
    gpu_model: str
    nodes: int


@dataclass
class Placement:
    fits: bool
    count: int  # the replicas planned
    reason: str = ""  # the watcher's one line, when it fits nowhere
    candidates: list[Candidate] = field(default_factory=list)
    preempts: list[str] = field(default_factory=list)  # allocations Nomad would evict
    updates: dict[str, int] = field(default_factory=dict)  # DesiredTGUpdates, non-zero only
    # Multi-node models (one replica over several nodes on one fabric) will name the fabric they
    # would land in here; every model is single-node until multi-node replicas exist.
    fabric: str | None = None


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


@dataclass
class FleetPlan:
    models: list[ModelPlan]
    text: str = ""  # the file as read, so that apply applies exactly what was planned

    def count(self, change: Change) -> int:
        return sum(1 for m in self.models if m.change == change)

    @property
    def unplaceable(self) -> list[ModelPlan]:
        return [m for m in self.models if m.placement is not None and not m.placement.fits]

    @property
    def has_changes(self) -> bool:
        return any(m.change != "unchanged" for m in self.models)

    @property
    def exit_code(self) -> int:
        if self.unplaceable:
            return EXIT_FITS_NOWHERE
        return EXIT_CHANGES if self.has_changes else EXIT_NOTHING_TO_DO

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": {
                EXIT_NOTHING_TO_DO: "nothing to do",
                EXIT_CHANGES: "changes",
                EXIT_FITS_NOWHERE: "fits nowhere",
            }[self.exit_code],
            "exit_code": self.exit_code,
            "summary": {
                "added": self.count("added"),
                "changed": self.count("changed"),
                "removed": self.count("removed"),
                "unchanged": self.count("unchanged"),
                "fits_nowhere": len(self.unplaceable),
            },
            "models": [asdict(m) for m in self.models],
        }


# ----- reading what is there ----------------------------------------------------------------


async def _stored_text(consul: Consul) -> str | None:
    _, entries = await consul.kv_get(CONFIG_MODELS_KEY)
    return entries[0].value.decode("utf-8", errors="replace") if entries and entries[0].value else None


def stored_definitions(consul: Consul | None = None) -> tuple[ModelSet | None, str]:
    """The definitions in Consul, and a note when they cannot be read as a models file (then
    every model is compared with its job alone). Raises ConsulError when Consul is down."""

    async def read() -> str | None:
        client = consul or Consul()
        try:
            return await _stored_text(client)
        finally:
            if consul is None:
                await client.close()

    text = asyncio.run(read())
    if text is None:
        return None, ""
    try:
        return parse_models(text, CONFIG_MODELS_KEY), ""
    except SpecError as exc:
        return (
            None,
            f"{CONFIG_MODELS_KEY} is not a valid models file ({exc.problems[0]}); compared with the jobs only",
        )


def job_to_register(model: Model, current: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job `apply` registers: the rendered definition, keeping the replicas a running job
    has (a router may have scaled it up, parking scaled it to 0), within the new maximum."""
    job = render_job(model)
    if current is not None:
        _, count = job_group(current)
        job["TaskGroups"][0]["Count"] = min(count, model.replicas_max)
    return job


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


# What decides whether the job in Nomad is current (`reconcile.job_is_current`).
_JOB_FIELDS = ("source", "profile", "replicas.max")


def classify(model: Model, stored: Model | None, job: Mapping[str, Any] | None) -> ModelPlan:
    """Added, changed (which fields) or unchanged, against the stored definition and the job."""
    plan = ModelPlan(model.name, model.job_id, "unchanged", on_demand=model.replicas_min == 0)
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


def read_plan(answer: Mapping[str, Any], job: Mapping[str, Any], count: int) -> Placement:
    """Nomad's `JobPlanResponse` as the operator wants it: fits or not, and why not in the same
    words the watcher uses once the model is applied."""
    failed = answer.get("FailedTGAllocs")
    annotations = answer.get("Annotations") if isinstance(answer.get("Annotations"), Mapping) else {}
    assert isinstance(annotations, Mapping)
    updates: dict[str, int] = {}
    for group in (annotations.get("DesiredTGUpdates") or {}).values():
        if isinstance(group, Mapping):
            for key, value in group.items():
                if isinstance(value, int) and value:
                    updates[key] = updates.get(key, 0) + value
    preempts = [
        f"{a.get('JobID', '?')}/{a.get('ID', '?')}"
        for a in annotations.get("PreemptedAllocs") or []
        if isinstance(a, Mapping)
    ]
    fits = not (isinstance(failed, Mapping) and failed)
    reason = "" if not isinstance(failed, Mapping) or fits else summarize_placement(dict(failed), dict(job))
    return Placement(fits=fits, count=count, reason=reason, preempts=preempts, updates=updates)


def candidates(model: Model, nodes: Sequence[Mapping[str, Any]]) -> list[Candidate]:
    """Ready, eligible nodes in the profile's node pool and datacenters with enough healthy GPUs
    of the memory and model asked for, grouped by node class and GPU model. Node stubs carry no meta, so the engine constraint is
    left to Nomad, whose plan has already said whether the model fits."""
    p = model.profile
    counts: dict[tuple[str, str], int] = {}
    pool = p.node_pool or "default"
    datacenters = p.datacenters or ["*"]
    for node in nodes:
        if (
            node.get("Status") != "ready"
            or node.get("SchedulingEligibility") == "ineligible"
            or node.get("Drain")
        ):
            continue
        # Where the profile places it (Nomad's pool `all` holds every node).
        if pool != "all" and str(node.get("NodePool") or "default") != pool:
            continue
        if not any(fnmatch.fnmatchcase(str(node.get("Datacenter", "")), dc) for dc in datacenters):
            continue
        node_class = str(node.get("NodeClass") or "")
        if p.gpus == 0:
            counts[(node_class, "")] = counts.get((node_class, ""), 0) + 1
            continue
        resources = node.get("NodeResources") if isinstance(node.get("NodeResources"), Mapping) else {}
        assert isinstance(resources, Mapping)
        for group in resources.get("Devices") or []:
            if (
                not isinstance(group, Mapping)
                or group.get("Type") != "gpu"
                or group.get("Vendor") != "nvidia"
            ):
                continue
            name = str(group.get("Name") or "")
            healthy = sum(
                1 for i in group.get("Instances") or [] if isinstance(i, Mapping) and i.get("Healthy")
            )
            memory = _memory_mib(group)
            if healthy < p.gpus or (p.gpu_memory_mib and memory < p.gpu_memory_mib):
                continue
            if p.gpu_models and name not in p.gpu_models:
                continue
            counts[(node_class, name)] = counts.get((node_class, name), 0) + 1
            break
    return [Candidate(c, g, n) for (c, g), n in sorted(counts.items())]


def _memory_mib(group: Mapping[str, Any]) -> int:
    attrs = group.get("Attributes") if isinstance(group.get("Attributes"), Mapping) else {}
    assert isinstance(attrs, Mapping)
    memory = attrs.get("memory")
    if not isinstance(memory, Mapping):
        return 0
    value = memory.get("Int")
    unit = str(memory.get("Unit") or "MiB")
    factor = {"MiB": 1, "GiB": 1024, "KiB": 1 / 1024}.get(unit, 1)
    return int((value or 0) * factor)


# ----- the whole plan -----------------------------------------------------------------------


def plan_models(models: ModelSet, *, consul: Consul | None = None, nomad: Nomad | None = None) -> FleetPlan:
    """Raises ConsulError or NomadError when either cannot be read; changes nothing anywhere."""
    nomad = nomad or Nomad()
    stored, note = stored_definitions(consul)
    _, job_stubs = nomad.blocking_list("jobs", params={"prefix": JOB_PREFIX, "meta": "true"})
    nodes: list[dict[str, Any]] | None = None
    out: list[ModelPlan] = []
    for name, model in sorted(models.models.items()):
        job = nomad.get_job(model.job_id)
        mp = classify(model, stored.models.get(name) if stored else None, job)
        if note:
            mp.notes.append(note)
        out.append(mp)
        if mp.change == "unchanged":
            continue
        target = job_to_register(model, job)
        count, on_demand = planned_count(model, target)
        mp.on_demand = on_demand
        target["TaskGroups"][0]["Count"] = count
        answer = nomad_plan(nomad, target)
        mp.placement = read_plan(answer, target, count)
        mp.replaces_replicas = mp.placement.updates.get("DestructiveUpdate", 0) > 0
        if mp.placement.fits:
            if nodes is None:
                _, nodes = nomad.blocking_list("nodes", params={"resources": "true"})
            mp.placement.candidates = candidates(model, nodes)

    defined = set(models.models)
    removed: dict[str, str] = {}
    for stub in job_stubs:
        meta = stub.get("Meta") if isinstance(stub.get("Meta"), Mapping) else None
        model_name = str(meta.get("llmgw_model", "")) if meta else ""
        if model_name and model_name not in defined and not stub.get("Stop"):
            removed[model_name] = str(stub.get("ID", ""))
    for model_name in stored.models if stored else {}:
        if model_name not in defined:
            removed.setdefault(model_name, stored.models[model_name].job_id if stored else "")
    for model_name, job_id in sorted(removed.items()):
        mp = ModelPlan(model_name, job_id, "removed")
        mp.notes.append(f"apply does not stop its job; run `nomad job stop {job_id}` to stop its replicas")
        out.append(mp)
    return FleetPlan(out)


def plan_text(
    text: str, origin: str, *, consul: Consul | None = None, nomad: Nomad | None = None
) -> FleetPlan:
    """Raises SpecError for an invalid file, before anything is read from the cluster."""
    return plan_models(parse_models(text, origin), consul=consul, nomad=nomad)


# ----- showing it ---------------------------------------------------------------------------

_SIGN = {"added": "+", "changed": "~", "removed": "-", "unchanged": "="}


def _value(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, list):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return str(v)


def render_text(plan: FleetPlan, origin: str) -> str:
    lines = []
    for m in plan.models:
        head = f"{_SIGN[m.change]} {m.model} ({m.change})"
        lines.append(head)
        for f in m.fields:
            lines.append(f"    {f.field}: {_value(f.old)} -> {_value(f.new)}")
        p = m.placement
        if p is not None:
            replicas = f"{p.count} replica{'s' if p.count != 1 else ''}"
            if m.on_demand:
                replicas = "1 replica when first asked for (on demand)"
            if p.fits:
                where = ", ".join(
                    f"{c.nodes} node{'s' if c.nodes != 1 else ''} of class {c.node_class or '(none)'}"
                    + (f" ({c.gpu_model})" if c.gpu_model else "")
                    for c in p.candidates
                )
                lines.append(f"    fits: {replicas}" + (f"; matching GPUs on {where}" if where else ""))
            else:
                lines.append(f"    FITS NOWHERE: {replicas}: {p.reason}")
            if m.replaces_replicas:
                n = p.updates.get("DestructiveUpdate", 0)
                lines.append(
                    f"    re-places {n} running replica{'s' if n != 1 else ''} (stops each, starts it anew)"
                )
            if p.preempts:
                lines.append(f"    would preempt: {', '.join(p.preempts)}")
        for note in m.notes:
            lines.append(f"    note: {note}")
    added, changed, removed = plan.count("added"), plan.count("changed"), plan.count("removed")
    tail = (
        f"{origin}: {added} to add, {changed} to change, {removed} removed, "
        f"{plan.count('unchanged')} unchanged"
    )
    if plan.unplaceable:
        tail += f"; {len(plan.unplaceable)} fit{'s' if len(plan.unplaceable) == 1 else ''} nowhere"
    elif not plan.has_changes:
        tail += "; nothing to do"
    lines.append(tail)
    return "\n".join(lines)


# ----- the CLI's part (shared by `plan` and `apply`) ----------------------------------------


def plan_or_exit(path: Path, *, as_json: bool, verb: str) -> FleetPlan:
    """Read, validate and plan the file; on failure say why (as JSON too, for CI) and exit 2
    (invalid file) or 3 (Nomad or Consul unreachable or refusing)."""
    import typer

    from nomad_driver.consul import ConsulError
    from nomad_driver.nomad import NomadError

    def fail(code: int, outcome: str, problems: list[str]) -> NoReturn:
        if as_json:
            typer.echo(json.dumps({"outcome": outcome, "exit_code": code, "problems": problems}, indent=2))
        else:
            for problem in problems:
                typer.echo(problem, err=True)
        raise typer.Exit(code)

    try:
        text = read_models_text(path)
        models = parse_models(text, str(path))
    except SpecError as exc:
        fail(EXIT_INVALID_FILE, "invalid file", [problem_line(path, p) for p in exc.problems])
    try:
        plan = plan_models(models)
    except (ConsulError, NomadError) as exc:
        fail(EXIT_UNREACHABLE, "unreachable", [f"llmgw {verb}: cannot plan: {exc}"])
    plan.text = text
    return plan


def show_plan(plan: FleetPlan, origin: str, *, as_json: bool) -> None:
    import typer

    if as_json:
        typer.echo(json.dumps(plan.to_json(), indent=2))
    else:
        typer.echo(render_text(plan, origin))
