"""The `llmgw` command line. Each verb imports its module lazily, so `llmgw render` works on a
laptop with no cluster libraries in use and `llmgw --help` stays fast."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer

app = typer.Typer(
    name="llmgw",
    help="Serve many LLMs on a Nomad + Consul GPU cluster.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Serve many LLMs on a Nomad + Consul GPU cluster."""
    # A callback keeps typer from collapsing the app into its first verb while it has only one.


class JobFormat(StrEnum):
    hcl = "hcl"
    json = "json"


@app.command()
def render(
    models_file: Path = typer.Argument(..., help="The models file (YAML).", show_default=False),
    out: Path | None = typer.Option(None, "--out", "-o", help="Directory to write the jobs into."),
    fmt: JobFormat = typer.Option(
        JobFormat.hcl, "--format", "-f", help="hcl for `nomad job run`, json for the API."
    ),
    check: bool = typer.Option(False, "--check", help="Only validate the models file; write nothing."),
    namespace: str | None = typer.Option(
        None,
        "--namespace",
        envvar="NOMAD_NAMESPACE",
        help="Nomad namespace to write into the jobs (default: none, so `nomad job run` decides).",
        show_default=False,
    ),
    # Placement moved into the models file (profiles.NAME.node_pool and .datacenters), where
    # apply and the watcher read it too; the old flags stay only to say so.
    datacenter: list[str] = typer.Option([], "--datacenter", "-d", hidden=True),
    node_pool: str | None = typer.Option(None, "--node-pool", hidden=True),
) -> None:
    """Write one Nomad job per model, without a cluster. Exit code 2 when the file is invalid."""
    from nomad_driver.render_files import render_files
    from nomad_driver.spec import SpecError, load_models, problem_line

    if datacenter or node_pool:
        typer.echo(
            "llmgw render: --datacenter and --node-pool are set in the models file now, so that "
            "apply and the watcher place models in the same pool: set 'node_pool' and "
            "'datacenters' on the profile (see docs/models.md)",
            err=True,
        )
        raise typer.Exit(2)

    try:
        model_set = load_models(models_file)
    except SpecError as exc:
        for problem in exc.problems:
            typer.echo(problem_line(models_file, problem), err=True)
        count = len(exc.problems)
        typer.echo(f"{models_file}: {count} problem{'s' if count != 1 else ''}; nothing written", err=True)
        raise typer.Exit(2) from None

    if check:
        names = ", ".join(model_set.models) or "none"
        typer.echo(f"{models_file}: valid, {len(model_set.models)} models ({names})")
        return
    if out is None:
        typer.echo(
            "llmgw render: give an output directory with -o DIR, or --check to only validate", err=True
        )
        raise typer.Exit(2)

    # Everything is rendered before anything is written, so a failure leaves DIR as it was.
    files = render_files(list(model_set.models.values()), fmt.value, namespace=namespace or None)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            target = out / name
            tmp = target.with_name(f".{name}.tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
            typer.echo(f"wrote {target}")
    except OSError as exc:
        typer.echo(f"llmgw render: cannot write to {out}: {exc.strerror or exc}", err=True)
        raise typer.Exit(1) from None


@app.command("plan")
def plan_command(
    models_file: Path = typer.Argument(..., help="The models file (YAML).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="The plan as JSON (docs/operating.md has its shape)."),
) -> None:
    """Show what `llmgw apply MODELS.yaml` would change and whether each change fits, touching
    nothing. Exit codes: 0 nothing to do, 2 invalid file, 3 Nomad or Consul unreachable,
    6 changes that all fit, 7 something fits nowhere, 8 a model's job is not llmgw's."""
    from nomad_driver.cli.plan_output import plan_or_exit, show_plan

    plan = plan_or_exit(models_file, as_json=as_json, verb="plan")
    show_plan(plan, str(models_file), as_json=as_json)
    raise typer.Exit(plan.exit_code)


@app.command("router")
def router_command(
    listen: str = typer.Option(
        "127.0.0.1:8080",
        "--listen",
        envvar="LLMGW_ROUTER_LISTEN",
        help="HOST:PORT to serve the OpenAI API on.",
    ),
    api_keys_file: Path | None = typer.Option(
        None, "--api-keys-file", help="Bearer tokens, one a line (also LLMGW_API_KEYS, comma-separated)."
    ),
    # The same variable the certificate-expiry metric reads, so the file served is the file
    # whose expiry is published.
    tls_cert: Path | None = typer.Option(
        None,
        "--tls-cert",
        envvar="LLMGW_ROUTER_TLS_CERT",
        help="PEM certificate; serve HTTPS with --tls-key.",
    ),
    tls_key: Path | None = typer.Option(
        None, "--tls-key", envvar="LLMGW_ROUTER_TLS_KEY", help="PEM private key for --tls-cert."
    ),
    models_file: Path | None = typer.Option(
        None,
        "--models",
        envvar="LLMGW_MODELS_FILE",
        help="Definitions to use while Consul holds none under llmgw/config/.",
    ),
    max_body_mib: float = typer.Option(8.0, "--max-body-mib", help="Largest request body accepted."),
    first_byte_timeout: float = typer.Option(
        600.0, "--first-byte-timeout", help="Seconds a replica may think before its first byte."
    ),
    max_connections: int = typer.Option(
        0,
        "--max-connections",
        envvar="LLMGW_ROUTER_MAX_CONNECTIONS",
        min=0,
        help="Open client connections; past it the one idle, or sending its body slowly, the longest is closed "
        "(0: from the fd limit).",
    ),
    no_activation: bool = typer.Option(
        False, "--no-activation", help="Never scale models up through Nomad; answer 503 instead."
    ),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Serve the OpenAI-compatible API in front of every model's replicas."""
    from router.config import ConfigError
    from router.server import serve

    try:
        serve(
            listen=listen,
            api_keys_file=str(api_keys_file or ""),
            tls_cert=str(tls_cert or ""),
            tls_key=str(tls_key or ""),
            models_file=str(models_file or ""),
            max_body_bytes=int(max_body_mib * 1024 * 1024),
            first_byte_timeout_s=first_byte_timeout,
            max_connections=max_connections,
            activation=not no_activation,
            log_level=log_level,
        )
    except ConfigError as exc:
        typer.echo(f"llmgw router: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command("node-agent")
def node_agent_command(
    listen: str = typer.Option(
        "127.0.0.1:4710", "--listen", envvar="LLMGW_NODE_AGENT_LISTEN", help="HOST:PORT for /metrics."
    ),
    engines_dir: Path = typer.Option(
        Path("/opt/llmgw/engines"),
        "--engines-dir",
        envvar="LLMGW_ENGINES_DIR",
        help="<dir>/<engine>/<version>/",
    ),
    models_dir: Path = typer.Option(
        Path("/opt/llmgw/models"), "--models-dir", envvar="LLMGW_MODELS_DIR", help="<dir>/<model>/ weights"
    ),
    fabric: str = typer.Option("", "--fabric", envvar="LLMGW_FABRIC", help="Interconnect fabric name."),
    gpu_class: str = typer.Option("", "--gpu-class", help="Override the GPU class (default: the GPU name)."),
    node_id: str = typer.Option(
        "", "--node-id", envvar="LLMGW_NODE_ID", help="Nomad node ID (default: the agent's own node)."
    ),
    interval: float = typer.Option(15.0, "--interval", help="Seconds between readings."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Publish this node's GPUs, engines and cached weights as Nomad node metadata."""
    from nomad_driver.logs import configure_logging
    from nomad_driver.node_agent.agent import NodeAgentConfig, serve

    configure_logging(log_level)
    config = NodeAgentConfig(
        engines_dir=engines_dir,
        models_dir=models_dir,
        fabric=fabric,
        gpu_class=gpu_class,
        node_id=node_id,
        interval_s=interval,
    )
    serve(config, listen)


@app.command("fetch")
def fetch_command(
    source: str = typer.Argument(..., help="The model's source, as its definition says.", show_default=False),
    model: str = typer.Option(..., "--model", help="The model's name: its directory in the cache."),
    cache_dir: Path = typer.Option(
        Path("/opt/llmgw/models"), "--cache", envvar="LLMGW_MODELS_DIR", help="The node's weights cache."
    ),
    max_size: str = typer.Option(
        "", "--max-size", help="Bound of the cache (500G); least recently used models go first."
    ),
    min_rate: str = typer.Option("100K", "--min-rate", help="Bytes per second below which it is stalled."),
    stall_window: str = typer.Option("300", "--stall-window", help="Seconds under --min-rate that fail it."),
) -> None:
    """Download a model's weights into this node's cache, or find them there (the fetch task).

    An option the job fills from node meta (`${meta.llmgw_models_max}`, ...) that the node does
    not set arrives as that literal text, and means the default."""
    from nomad_driver.fetch.download import StallRule
    from nomad_driver.fetch.run import FetchRequest, fetch, parse_seconds, parse_size

    default = StallRule()
    try:
        bound = parse_size(max_size)
        rate = parse_size(min_rate)
        window = parse_seconds(stall_window)
    except ValueError as exc:
        typer.echo(f"llmgw fetch: {exc}", err=True)
        raise typer.Exit(2) from None
    rule = StallRule(
        min_rate=float(rate) if rate is not None else default.min_rate,
        window_s=window if window is not None else default.window_s,
    )
    raise typer.Exit(fetch(FetchRequest(source, model, cache_dir, bound, rule)))


from nomad_driver.cli.ctl import ctl_app  # noqa: E402  (a sub-app must exist when the CLI is built)

app.add_typer(ctl_app, name="ctl")

from nomad_driver.cli.watcher import register as _register_watcher_verbs  # noqa: E402

_register_watcher_verbs(app, ctl_app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
