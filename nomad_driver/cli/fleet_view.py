"""How `llmgw ctl summary` and `llmgw ctl nodes` draw the fleet for people: what needs a person
first (parked, unplaceable, refused), then GPU use per class as bars (`--json` prints the
admin API's answer instead)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from nomad_driver.fields import as_int


def gpu_bar(use: dict[str, Any], width: int = 30) -> Text:
    """Used, unhealthy, unavailable and free as one bar, so a class that only looks roomy
    (broken or drained cards) reads differently from one that is."""
    total = as_int(use.get("total"))
    bar = Text()
    if total <= 0:
        return bar.append("-" * width, style="dim")
    parts = [
        ("used", "█", "cyan"),
        ("unhealthy", "█", "red"),
        ("unavailable", "▒", "grey50"),
        ("free", "░", "green"),
    ]
    drawn = 0
    for i, (key, char, style) in enumerate(parts):
        cells = width - drawn if i == len(parts) - 1 else round(as_int(use.get(key)) * width / total)
        cells = max(0, min(cells, width - drawn))
        bar.append(char * cells, style=style)
        drawn += cells
    return bar


def render_summary(console: Console, s: dict[str, Any]) -> None:
    # What needs a person comes first; capacity after.
    parked = [p for p in s.get("parked") or [] if isinstance(p, dict)]
    if parked:
        console.print(
            Text("PARKED", style="bold red")
            + Text(" (not placed again until the definition changes or `llmgw ctl retry MODEL`)")
        )
        table = Table()
        for column in ("MODEL", "FAILURES", "LAST ERROR"):
            table.add_column(column)
        for p in parked:
            table.add_row(
                str(p.get("model", "")),
                str(as_int(p.get("consecutive_failures"))),
                str(p.get("last_error", "")),
            )
        console.print(table)
    unplaceable = [u for u in s.get("unplaceable") or [] if isinstance(u, dict)]
    if unplaceable:
        console.print(Text("UNPLACEABLE", style="bold red") + Text(" (fits on no node now)"))
        table = Table()
        table.add_column("MODEL")
        table.add_column("REASON")
        for u in unplaceable:
            table.add_row(str(u.get("model", "")), str(u.get("reason", "")))
        console.print(table)
    if not parked and not unplaceable:
        console.print(Text("no parked or unplaceable models", style="green"))

    models = s.get("models") or {}
    parked_names = {p.get("model") for p in parked}
    short = ", ".join(
        f"{m.get('model')} parked"
        if m.get("model") in parked_names
        else f"{m.get('model')} {as_int(m.get('ready'))} of {as_int(m.get('desired'))} ready"
        for m in models.get("short_models") or []
        if isinstance(m, dict)
    )
    console.print(
        f"models: {as_int(models.get('total'))} total, {as_int(models.get('satisfied'))} satisfied, "
        f"{as_int(models.get('short'))} short" + (f" ({short})" if short else "")
    )

    gpus = Table(title="GPUs per class", title_justify="left")
    for column in ("CLASS", "USE", "USED", "FREE", "UNHEALTHY", "UNAVAILABLE", "TOTAL"):
        gpus.add_column(column, justify="left" if column in ("CLASS", "USE") else "right")
    for use in s.get("gpus") or []:
        gpus.add_row(
            str(use.get("class", "")),
            gpu_bar(use),
            *(str(as_int(use.get(k))) for k in ("used", "free", "unhealthy", "unavailable", "total")),
        )
    console.print(gpus)
    console.print(Text("█ used  ", style="cyan") + Text("█ unhealthy  ", style="red")
                  + Text("▒ unavailable (down, draining, ineligible)  ", style="grey50")
                  + Text("░ free", style="green"))  # fmt: skip

    nodes = s.get("nodes") or {}
    console.print(
        f"nodes: {as_int(nodes.get('total'))} total, {as_int(nodes.get('ready'))} ready, "
        f"{as_int(nodes.get('draining'))} draining, {as_int(nodes.get('ineligible'))} ineligible, "
        f"{as_int(nodes.get('down'))} down"
    )
    replicas = s.get("replicas") or {}
    console.print(
        f"replicas: {as_int(replicas.get('total'))} total, {as_int(replicas.get('ready'))} ready, "
        f"{as_int(replicas.get('starting'))} starting"
    )

    fabrics = s.get("fabrics") or []
    if fabrics:
        table = Table(title="fabrics", title_justify="left")
        for column in ("FABRIC", "NODES", "WITH WEIGHTS", "MODELS PRESENT", "ENTIRELY FREE NODES"):
            table.add_column(column, justify="left" if column == "FABRIC" else "right")
        for f in fabrics:
            table.add_row(
                str(f.get("fabric", "")),
                *(
                    str(as_int(f.get(k)))
                    for k in ("nodes", "nodes_with_weights", "models_present", "largest_free_block")
                ),
            )
        console.print(table)

    idle = s.get("idle_replicas") or []
    if idle:
        table = Table(
            title="idle replicas (ready, not asked for in 10 minutes or more)", title_justify="left"
        )
        for column in ("MODEL", "NODE", "ALLOCATION", "IDLE", "GPUS"):
            table.add_column(column)
        for r in idle:
            minutes = as_int(r.get("idle_seconds")) // 60
            table.add_row(
                str(r.get("model", "")),
                str(r.get("node", "")),
                str(r.get("alloc_id", ""))[:8],
                f"{minutes // 60}h{minutes % 60:02d}m",
                str(as_int(r.get("gpus"))),
            )
        console.print(table)


def gpu_cell(gpus: Any) -> str:
    parts = []
    for use in gpus if isinstance(gpus, list) else []:
        if isinstance(use, dict):
            bad = f", {as_int(use.get('unhealthy'))} unhealthy" if as_int(use.get("unhealthy")) else ""
            parts.append(
                f"{use.get('class', '')} {as_int(use.get('used'))}/{as_int(use.get('total'))} used{bad}"
            )
    return "; ".join(parts)
