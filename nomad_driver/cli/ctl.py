"""`llmgw ctl`: ask a running watcher how the fleet is doing, through its admin API.

Every read verb prints a rich table for people and, with `--json`, the admin API's own JSON for
scripts. Exit codes are part of the interface, so a cron job or a deploy pipeline can branch on
them: 0 fine, 1 `status --check` found a model that is not serving as it should, 2 bad usage,
3 the admin API cannot be reached, 4 unknown model, 5 the admin API answered with an error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from nomad_driver.admin_api import TOKEN_ENV
from nomad_driver.cli.admin_client import (
    DEFAULT_ADMIN_ADDR,
    AdminClient,
    AdminError,
    AdminUnreachable,
    UnknownModel,
)
from nomad_driver.cli.fleet_view import gpu_cell, render_summary
from nomad_driver.cli.router_view import join_routing, router_replicas, routing_cell
from nomad_driver.fields import as_int

EXIT_CHECK_FAILED = 1
EXIT_UNREACHABLE = 3
EXIT_UNKNOWN_MODEL = 4
EXIT_ADMIN_ERROR = 5

STATE_STYLES = {
    "satisfied": "green",
    "idle": "dim",
    "starting": "yellow",
    "short": "bold yellow",
    "unplaceable": "bold red",
    "parked": "bold red",
    "refused": "bold red",
    "gave-up": "bold red",
    "degraded": "bold yellow",
    "conflict": "bold red",
    "updating": "yellow",
    "update-failed": "bold yellow",
}

ctl_app = typer.Typer(
    name="ctl",
    help="Ask a running llmgw watcher how the fleet is doing (its admin API).",
    no_args_is_help=True,
)


@contextmanager
def admin_errors() -> Iterator[None]:
    """One clear line on stderr and the documented exit code, instead of a traceback."""
    try:
        yield
    except AdminUnreachable as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except UnknownModel as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(EXIT_UNKNOWN_MODEL) from None
    except AdminError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(EXIT_ADMIN_ERROR) from None


@ctl_app.callback()
def _ctl(
    ctx: typer.Context,
    addr: str = typer.Option(
        DEFAULT_ADMIN_ADDR, "--addr", envvar="LLMGW_ADMIN_ADDR", help="Admin API address."
    ),
    token: str | None = typer.Option(
        None,
        "--token",
        envvar=TOKEN_ENV,
        help="Bearer token for the admin API.",
        show_default=False,
    ),
) -> None:
    """Ask a running llmgw watcher how the fleet is doing (its admin API)."""
    client = AdminClient(addr, token)
    ctx.call_on_close(client.close)
    ctx.obj = client


def client_of(ctx: typer.Context) -> AdminClient:
    """The admin client the `ctl` group built from --addr/--token (or the environment)."""
    obj = ctx.find_object(AdminClient)
    return obj if obj is not None else AdminClient.from_env()


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def model_problem(model: dict[str, Any]) -> str | None:
    """update-failed (a new definition parked while the previous one serves), parked, refused
    (Nomad refuses llmgw's calls for it), unplaceable, gave-up (Nomad will not
    replace a failed allocation; llmgw asked it again), degraded (a slot keeps failing beside
    serving replicas) or short when a model is not serving what it should have now.

    Counted from the fields as well as the state word, so an older or newer watcher's state
    vocabulary cannot make a short model pass `--check`.
    """
    if model.get("job_conflict") or model.get("state") == "conflict":
        return "conflict"
    if model.get("state") == "update-failed" or (
        model.get("parked") is True and model.get("previous_job_id")
    ):
        return "update-failed"  # the previous definition serves; the new one is parked
    if model.get("parked") is True or model.get("state") == "parked":
        return "parked"
    if model.get("last_action_error") or model.get("state") == "refused":
        return "refused"
    if model.get("unplaceable") is True or model.get("state") == "unplaceable":
        return "unplaceable"
    if model.get("nomad_gave_up") or model.get("state") == "gave-up":
        return "gave-up"
    if model.get("degraded") or model.get("state") == "degraded":
        return "degraded"
    if as_int(model.get("ready")) < as_int(model.get("desired")) or model.get("state") in (
        "short",
        "starting",
    ):
        return "short"
    return None


def model_reason(model: dict[str, Any]) -> str:
    if model.get("reason"):
        return str(model["reason"])
    if model.get("parked"):
        return str(model.get("last_error") or "")
    refused = model.get("last_action_error")
    if isinstance(refused, dict):
        return f"Nomad refuses to {refused.get('action', 'act')}: {refused.get('message', '')}"
    if model.get("unplaceable"):
        return str(model.get("placement_reason") or "")
    if model.get("nomad_gave_up"):
        return str(model["nomad_gave_up"])
    if model.get("short"):
        return str(model.get("short_reason") or "")
    return ""


def _state_text(model: dict[str, Any]) -> Text:
    state = str(model.get("state") or "")
    problem = model_problem(model)
    # A state word that contradicts the counts loses: a model short of replicas reads as short.
    if problem and state not in (
        "conflict",
        "parked",
        "refused",
        "unplaceable",
        "gave-up",
        "short",
        "starting",
    ):
        state = problem
    state = state or "satisfied"
    return Text(state, style=STATE_STYLES.get(state, ""))


def _console() -> Console:
    # Built per call so that it writes wherever stdout is now (a pipe, a test runner).
    return Console(highlight=False, soft_wrap=False)


def _problem_first(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = {"conflict": 0, "parked": 0, "refused": 1, "unplaceable": 2, "gave-up": 2, "short": 3, None: 4}
    return sorted(models, key=lambda m: (order[model_problem(m)], str(m.get("model", ""))))


@ctl_app.command()
def status(
    ctx: typer.Context,
    models: list[str] = typer.Argument(None, help="Models to show (default all).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print the admin API's JSON."),
    check: bool = typer.Option(
        False,
        "--check",
        help="Exit 1 when any model is parked, refused by Nomad, unplaceable or short of what it should have now.",
    ),
) -> None:
    """Each model against what it should have now: desired, ready, state and why."""
    client = client_of(ctx)
    with admin_errors():
        if models:
            response: dict[str, Any] = {"models": [client.model(name) for name in models]}
        else:
            response = client.models_response()
    rows = [m for m in response["models"] if isinstance(m, dict)]
    if as_json:
        print_json(response)
    else:
        if response.get("definitions_problem"):
            # The watcher keeps running on the last good definitions; say so before the table.
            typer.echo(f"model definitions not loaded: {response['definitions_problem']}", err=True)
        table = Table(title="llmgw models against what they should have now", title_justify="left")
        # Shards and fabric only where some model has them: most fleets have no multi-node model.
        split = any(as_int(m.get("nodes")) > 1 for m in rows)
        columns = (
            "MODEL",
            "DESIRED",
            "READY",
            *(("SHARDS", "FABRIC") if split else ()),
            "STATE",
            "IN FLIGHT",
            "DESIRED BECAUSE",
            "REASON",
        )
        for column in columns:
            table.add_column(
                column, justify="right" if column in ("IN FLIGHT", "DESIRED", "READY", "SHARDS") else "left"
            )
        for m in _problem_first(rows):
            layout = (_shards_cell(m), str(m.get("fabric") or "")) if split else ()
            table.add_row(
                str(m.get("model", "")),
                str(as_int(m.get("desired"))),
                str(as_int(m.get("ready"))),
                *layout,
                _state_text(m),
                str(as_int(m.get("in_flight"))),
                # Why desired is what it is, in the watcher's words (`load: 37 in flight / 8 per replica`).
                str(m.get("desired_detail") or m.get("desired_reason") or ""),
                model_reason(m),
            )
        _console().print(table)
    if check:
        problems = [(str(m.get("model", "")), p) for m in rows if (p := model_problem(m))]
        if problems:
            listed = ", ".join(f"{name} ({problem})" for name, problem in problems)
            typer.echo(
                f"llmgw ctl status --check: {len(problems)} of {len(rows)} models not serving: {listed}",
                err=True,
            )
            raise typer.Exit(EXIT_CHECK_FAILED)


def _shards_cell(model: dict[str, Any]) -> str:
    """`1/2` (running of the shards a replica has) for a multi-node model, "" for one node."""
    nodes = as_int(model.get("nodes"))
    return f"{as_int(model.get('shards_running'))}/{nodes - 1}" if nodes > 1 else ""


@ctl_app.command("models")
def models_cmd(
    ctx: typer.Context,
    model: str | None = typer.Argument(None, help="One model to show in full.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print the admin API's JSON."),
) -> None:
    """Every defined model with its replica bounds, failures and last error."""
    client = client_of(ctx)
    with admin_errors():
        data: Any = client.model(model) if model else client.models_response()
    if as_json:
        print_json(data)
        return
    console = _console()
    if model:
        detail = Table(show_header=False, title=f"model {model}", title_justify="left")
        detail.add_column("field", style="bold")
        detail.add_column("value")
        for key, value in data.items():
            detail.add_row(str(key), _state_text(data) if key == "state" else str(value))
        console.print(detail)
        return
    table = Table(title="llmgw models", title_justify="left")
    for column in (
        "MODEL",
        "REPLICAS",
        "DESIRED",
        "READY",
        "STARTING",
        "FAILURES",
        "STATE",
        "LAST ERROR / PLACEMENT",
    ):
        table.add_column(column)
    rows = [m for m in data["models"] if isinstance(m, dict)]
    for m in sorted(rows, key=lambda m: str(m.get("model", ""))):
        table.add_row(
            str(m.get("model", "")),
            _bounds(m),
            str(as_int(m.get("desired"))),
            str(as_int(m.get("ready"))),
            str(as_int(m.get("starting"))),
            str(as_int(m.get("consecutive_failures"))),
            _state_text(m),
            str(m.get("last_error") or m.get("placement_reason") or ""),
        )
    console.print(table)


def _bounds(model: dict[str, Any]) -> str:
    # `replicas_min`/`replicas_max` as documented; a nested `replicas: {min, max}` is read too.
    replicas = model.get("replicas")
    nested: dict[str, Any] = replicas if isinstance(replicas, dict) else {}
    low = model.get("replicas_min", nested.get("min"))
    high = model.get("replicas_max", nested.get("max"))
    return f"{as_int(low)}..{as_int(high)}"


@ctl_app.command()
def summary(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the admin API's JSON."),
) -> None:
    """The whole fleet at a glance: parked and unplaceable models first, then GPU use per class."""
    client = client_of(ctx)
    with admin_errors():
        data = client.summary()
    if as_json:
        print_json(data)
        return
    render_summary(_console(), data)


@ctl_app.command("nodes")
def nodes_cmd(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the admin API's JSON."),
) -> None:
    """Every Nomad node: state, GPUs per class, fabric, engines and cached models."""
    client = client_of(ctx)
    with admin_errors():
        rows = client.nodes()
    if as_json:
        print_json({"nodes": rows})
        return
    table = Table(title="nodes", title_justify="left")
    for column in ("NAME", "STATE", "CLASS", "GPUS", "FABRIC", "ENGINES", "CACHED"):
        table.add_column(column)
    for n in rows:
        raw = n.get("engines")
        engines: dict[str, Any] = raw if isinstance(raw, dict) else {}
        table.add_row(
            str(n.get("name", "")),
            str(n.get("state") or n.get("status") or ""),
            str(n.get("class", "")),
            gpu_cell(n.get("gpus")),
            str(n.get("fabric", "")),
            " ".join(f"{e}={','.join(map(str, v))}" for e, v in sorted(engines.items())),
            ",".join(map(str, n.get("models_cached") or [])),
        )
    _console().print(table)


@ctl_app.command("replicas")
def replicas_cmd(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the admin API's JSON."),
    routers: list[str] = typer.Option(
        [],
        "--router",
        envvar="LLMGW_ROUTER_URL",
        help="A router to ask which replicas it keeps out of rotation (outlier ejection); repeatable (space-separated in the environment).",
        show_default=False,
    ),
    router_key: str | None = typer.Option(
        None,
        "--router-key",
        envvar="LLMGW_ROUTER_API_KEY",
        help="An API key of the routers, when they ask for one.",
        show_default=False,
    ),
) -> None:
    """Every replica: model, node, address, state and since when; a multi-node replica with its
    fabric and its shards' nodes and states; with --router, whether each router named keeps it
    in rotation or has ejected it, for how much longer and why."""
    client = client_of(ctx)
    with admin_errors():
        rows = client.replicas()
    asked: list[dict[str, Any]] = []
    views: list[tuple[str, list[dict[str, Any]]]] = []
    for url in routers:
        try:
            views.append((url, router_replicas(url, router_key)))
            asked.append({"router": url, "error": None})
        except RuntimeError as exc:
            # The watcher's rows still stand; the table says what this router could not.
            typer.echo(str(exc), err=True)
            asked.append({"router": url, "error": str(exc)})
    if routers:
        join_routing(rows, views)
    if as_json:
        print_json({"replicas": rows, **({"routers": asked} if routers else {})})
        return
    table = Table(title="replicas", title_justify="left")
    split = any(r.get("shards") for r in rows)
    columns = (
        "MODEL",
        "ALLOCATION",
        "NODE",
        *(("FABRIC", "SHARDS") if split else ()),
        "ADDRESS",
        "STATE",
        "SINCE",
        *(("ROUTING",) if routers else ()),
    )
    for column in columns:
        table.add_column(column)
    styles = {"ready": "green", "starting": "yellow", "failed": "bold red"}
    for r in rows:
        state = str(r.get("state", ""))
        since = r.get("since")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since)) if isinstance(since, int | float) else ""
        )
        shards = [s for s in r.get("shards") or [] if isinstance(s, dict)]
        layout = (
            (
                str(r.get("fabric") or ""),
                ", ".join(f"{s.get('node', '')} {s.get('state', '')}" for s in shards),
            )
            if split
            else ()
        )
        routing: tuple[Text, ...] = ()
        if routers:
            entries = r.get("routing") or []
            ejected = any(e.get("ejected") for e in entries)
            routing = (Text(routing_cell(entries, len(routers) > 1), style="bold red" if ejected else ""),)
        table.add_row(
            str(r.get("model", "")),
            str(r.get("alloc_id", ""))[:8],
            str(r.get("node", "")),
            *layout,
            str(r.get("address", "")),
            Text(state, style=styles.get(state, "")),
            when,
            *routing,
        )
    _console().print(table)
