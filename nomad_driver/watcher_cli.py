"""The watcher's verbs for the `llmgw` CLI: `watcher`, `apply` and `ctl retry`."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import typer

EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_UNKNOWN_MODEL = 4
EXIT_REFUSED = 5


def configure_logging(level: str) -> None:
    """key=value lines, one event each, naming the model, for grep and for log shippers."""
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.INFO),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise typer.BadParameter(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def watcher(
    listen: str = typer.Option(
        "127.0.0.1:4700",
        "--listen",
        envvar="LLMGW_ADMIN_LISTEN",
        help="HOST:PORT for the admin API and metrics.",
    ),
    max_start_failures: int = typer.Option(
        5,
        "--max-start-failures",
        envvar="LLMGW_MAX_START_FAILURES",
        min=1,
        help="Consecutive start failures after which a model is parked.",
    ),
    leader_ttl: int = typer.Option(10, "--leader-ttl", min=10, help="Consul session TTL in seconds."),
    log_level: str = typer.Option("info", "--log-level", envvar="LLMGW_LOG_LEVEL"),
) -> None:
    """Watch Nomad and Consul: park failing models, name unplaceable ones, scale idle ones down."""
    import uvicorn

    from nomad_driver.admin import create_app
    from nomad_driver.consul import Consul
    from nomad_driver.nomad import Nomad
    from nomad_driver.watcher import Watcher, WatcherConfig

    configure_logging(log_level)
    host, port = split_listen(listen)

    async def main() -> None:
        consul = Consul()
        config = WatcherConfig(address=listen, max_start_failures=max_start_failures, leader_ttl_s=leader_ttl)
        w = Watcher(consul, Nomad(), config)
        await w.start()
        server = uvicorn.Server(uvicorn.Config(create_app(w), host=host, port=port, log_level="warning"))
        try:
            await server.serve()
        finally:
            # Release the lock at once, so another watcher need not wait out the TTL.
            await w.stop()
            await consul.close()

    asyncio.run(main())


def apply(models: Path = typer.Argument(..., exists=True, dir_okay=False, help="The models file.")) -> None:
    """Validate MODELS.yaml, store it in Consul (llmgw/config/models) and register its jobs."""
    from nomad_driver.apply import ApplyConflict, apply_file
    from nomad_driver.consul import ConsulError
    from nomad_driver.nomad import NomadError
    from nomad_driver.spec import SpecError

    try:
        result = apply_file(models)
    except SpecError as exc:
        for problem in exc.problems:
            typer.echo(f"{models}: {problem}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except ApplyConflict as exc:
        typer.echo(f"llmgw apply: {exc}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None
    except (ConsulError, NomadError) as exc:
        typer.echo(f"llmgw apply: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    typer.echo(
        f"applied {len(result.models.models)} models: {len(result.registered)} registered, "
        f"{len(result.unchanged)} unchanged"
    )


def ctl_retry(
    model: str = typer.Argument(..., help="The parked model to place again."),
    addr: str = typer.Option(
        "http://127.0.0.1:4700", "--addr", envvar="LLMGW_ADMIN_ADDR", help="Admin API address."
    ),
) -> None:
    """Unpark a model: clear its failure count and restore its replicas (leader only)."""
    import httpx

    headers = {}
    token = os.environ.get("LLMGW_ADMIN_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    url = f"{addr.rstrip('/')}/v1/admin/models/{model}/retry"
    try:
        resp = httpx.post(url, headers=headers, timeout=15)
    except httpx.HTTPError as exc:
        typer.echo(f"llmgw ctl retry: cannot reach the admin API at {addr}: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    try:
        body = resp.json()
    except ValueError:
        body = {"error": resp.text[:200]}
    if resp.status_code == 404:
        typer.echo(f"llmgw ctl retry: {body.get('error', 'unknown model')}", err=True)
        raise typer.Exit(EXIT_UNKNOWN_MODEL)
    if resp.status_code != 200:
        typer.echo(f"llmgw ctl retry: {body.get('error', resp.text[:200])}", err=True)
        raise typer.Exit(EXIT_REFUSED)
    typer.echo(f"{model}: retried; its failure count is cleared and its replicas are being restored")


def register(app: typer.Typer, ctl_app: typer.Typer) -> None:
    app.command("watcher")(watcher)
    app.command("apply")(apply)
    ctl_app.command("retry")(ctl_retry)
