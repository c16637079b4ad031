"""How a plan is shown: the text `llmgw plan` and `llmgw apply` print, the JSON (`--json`), and
the exit when the file cannot be read or the cluster cannot be asked (`plan.py` makes the plan)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from nomad_driver.cli.plan import (
    EXIT_INVALID_FILE,
    EXIT_UNREACHABLE,
    FleetPlan,
    ModelPlan,
    plan_models,
)
from nomad_driver.cli.plan_reading import Placement
from nomad_driver.spec import SpecError, parse_models, problem_line, read_models_text

# ----- showing it ---------------------------------------------------------------------------

_SIGN = {"added": "+", "changed": "~", "removed": "-", "unchanged": "=", "conflict": "!"}


def _value(v: Any) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, list):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return str(v)


def _placement_lines(m: ModelPlan, p: Placement) -> list[str]:
    replicas = f"{p.count} replica{'s' if p.count != 1 else ''}"
    if m.on_demand:
        replicas = "1 replica when first asked for (on demand)"
    if not p.fits:
        return [f"    FITS NOWHERE: {replicas}: {p.reason}"]
    if p.fabric:
        replicas += f", in fabric {p.fabric} ({p.nodes} nodes)"
    where = ", ".join(
        f"{c.nodes} node{'s' if c.nodes != 1 else ''} of class {c.node_class or '(none)'}"
        + (f" ({c.gpu_model})" if c.gpu_model else "")
        for c in p.candidates
    )
    return [f"    fits: {replicas}" + (f"; matching GPUs on {where}" if where else "")]


def _surge_lines(m: ModelPlan, p: Placement) -> list[str]:
    replicas = f"{p.count} replica{'s' if p.count != 1 else ''}"
    if not p.fits and m.update == "rolling":
        return [
            f"    no room for {replicas} of the new definition beside those of {m.surge_from}: {p.reason}",
            f"    rolls one replica at a time (`update: rolling`): a replica of {m.surge_from} stops to make "
            "room for each new one, once the one before is ready; at most one replica's capacity is lost",
        ]
    if not p.fits:
        return [
            f"    CANNOT SURGE: no room for {replicas} of the new definition beside those of {m.surge_from}: "
            f"{p.reason}",
            f"    the update waits for room while {m.surge_from} serves; a profile's `update: rolling` "
            "rolls one replica at a time instead, `update: replace` replaces them all at once",
        ]
    return [
        f"    rolls out beside {m.surge_from}: {replicas} of the new definition start while its replicas "
        "serve; they are drained and stopped once the new ones are ready"
    ]


def render_text(plan: FleetPlan, origin: str) -> str:
    lines = []
    for m in plan.models:
        head = f"{_SIGN[m.change]} {m.model} ({m.change})"
        lines.append(head)
        for f in m.fields:
            lines.append(f"    {f.field}: {_value(f.old)} -> {_value(f.new)}")
        p = m.placement
        if p is not None:
            lines += _surge_lines(m, p) if m.surge_from else _placement_lines(m, p)
            if m.replaces_replicas:
                n = p.updates.get("DestructiveUpdate", 0)
                lines.append(
                    f"    re-places {n} running replica{'s' if n != 1 else ''} (stops each, starts it anew)"
                )
            if p.preempts:
                lines.append(f"    would preempt: {', '.join(p.preempts)}")
        for i, note in enumerate(m.notes):
            lines.append(f"    {'problem' if m.change == 'conflict' and i == 0 else 'note'}: {note}")
    added, changed, removed = plan.count("added"), plan.count("changed"), plan.count("removed")
    tail = (
        f"{origin}: {added} to add, {changed} to change, {removed} removed, "
        f"{plan.count('unchanged')} unchanged"
    )
    if plan.conflicts:
        n = len(plan.conflicts)
        tail += f"; {n} job{'s' if n != 1 else ''} not llmgw's: apply would apply nothing"
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
