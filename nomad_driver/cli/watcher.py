"""The watcher's verbs for the `llmgw` CLI: `watcher`, `apply` and `ctl retry`."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
from pathlib import Path

import typer

from nomad_driver.admin_api import TOKEN_ENV
from router.config import ConfigError, parse_listen

EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_UNKNOWN_MODEL = 4
EXIT_REFUSED = 5


def split_listen(listen: str) -> tuple[str, int]:
    """`--listen` read as the router reads its own, with the error naming the flag."""
    try:
        return parse_listen(listen)
    except ConfigError as exc:
        raise typer.BadParameter(f"--listen: {exc}") from None


# Listening on every interface says nothing about where others reach us.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})


def advertise_address(listen: str, explicit: str = "") -> str:
    """The HOST:PORT other watchers name when this one leads, for `llmgw ctl retry` to follow:
    the explicit one, else the listen address unless it is a wildcard, else the address Nomad
    gives the task's `admin` port (NOMAD_ADDR_admin: the host's IP and port, which a container's
    own 0.0.0.0:4700 is not), else this host's name resolved."""
    if explicit:
        return explicit
    host, port = split_listen(listen)
    if host not in WILDCARD_HOSTS:
        return listen
    from_nomad = os.environ.get("NOMAD_ADDR_admin", "")  # noqa: SIM112  (Nomad spells it so)
    if from_nomad:
        return from_nomad
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    return f"{ip}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def admin_token(host: str) -> tuple[str, str]:
    """The admin token, and a line to log about it. Beyond loopback an API without one would let
    anyone who reaches it retry (five failed starts a time) and read sources and errors; so one
    is generated, into a file only this user reads, and the log says where."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token or is_loopback(host):
        return token, ""
    directory = Path(os.environ.get("NOMAD_SECRETS_DIR") or tempfile.mkdtemp(prefix="llmgw-admin-"))
    path = directory / "llmgw-admin-token"
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token, (
        f"{TOKEN_ENV} is not set and the admin API listens on {host}, beyond loopback: generated a "
        f"token into {path}; give it to 'llmgw ctl' as {TOKEN_ENV}, or set your own"
    )


def watcher(
    listen: str = typer.Option(
        "127.0.0.1:4700",
        "--listen",
        envvar="LLMGW_ADMIN_LISTEN",
        help="HOST:PORT for the admin API and metrics.",
    ),
    advertise: str = typer.Option(
        "",
        "--advertise",
        envvar="LLMGW_ADMIN_ADVERTISE",
        help="HOST:PORT other watchers and `llmgw ctl retry` reach this one at when it leads "
        "(default: --listen, or NOMAD_ADDR_admin when listening on 0.0.0.0).",
        show_default=False,
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
    tls_cert: Path | None = typer.Option(
        None, "--tls-cert", envvar="LLMGW_ADMIN_TLS_CERT", help="PEM certificate; serve HTTPS with --tls-key."
    ),
    tls_key: Path | None = typer.Option(
        None, "--tls-key", envvar="LLMGW_ADMIN_TLS_KEY", help="PEM private key for --tls-cert."
    ),
    api_docs: bool = typer.Option(
        False, "--api-docs", help="Serve FastAPI's /docs, /redoc and /openapi.json (off by default)."
    ),
    scale_up_window: float = typer.Option(
        6.0,
        "--scale-up-window",
        envvar="LLMGW_SCALE_UP_WINDOW_S",
        min=0.5,
        help="Seconds of requests in flight averaged before load asks for more replicas "
        "(a burst of twice what the replicas carry is answered at once).",
    ),
    scale_step_interval: float = typer.Option(
        5.0,
        "--scale-step-interval",
        envvar="LLMGW_SCALE_STEP_INTERVAL_S",
        min=0.1,
        help="Least seconds between two changes of a model's count by load.",
    ),
) -> None:
    """Watch Nomad and Consul: park failing models, name unplaceable ones, scale each model by
    its load, and answer the routers' activation asks (the one writer of every job's count)."""
    import uvicorn

    from nomad_driver.consul import Consul
    from nomad_driver.logs import configure_logging
    from nomad_driver.nomad import Nomad
    from nomad_driver.watcher.admin import create_app
    from nomad_driver.watcher.loop import Watcher, WatcherConfig

    configure_logging(log_level)
    host, port = split_listen(listen)
    if bool(tls_cert) != bool(tls_key):
        typer.echo("llmgw watcher: --tls-cert and --tls-key go together: give both, or neither", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    for flag, tls_path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if tls_path is not None and not tls_path.is_file():
            typer.echo(f"llmgw watcher: {flag} {tls_path}: no such file", err=True)
            raise typer.Exit(EXIT_BAD_INPUT)
    token, token_note = admin_token(host)
    if token_note:
        logging.getLogger("llmgw.admin").warning(token_note)

    async def main() -> int:
        consul = Consul()
        config = WatcherConfig(
            address=advertise_address(listen, advertise),
            max_start_failures=max_start_failures,
            leader_ttl_s=leader_ttl,
            scale_up_window_s=scale_up_window,
            scale_step_interval_s=scale_step_interval,
            freeze_heap=True,
        )
        w = Watcher(consul, Nomad(), config)
        await w.start()
        server = uvicorn.Server(
            # log_config=None: uvicorn's lines go through the root logger, in llmgw's format.
            uvicorn.Config(
                create_app(w, token=token or None, guard_reads=not is_loopback(host), docs=api_docs),
                host=host,
                port=port,
                log_level="warning",
                log_config=None,
                ssl_certfile=str(tls_cert) if tls_cert else None,
                ssl_keyfile=str(tls_key) if tls_key else None,
            )
        )
        # uvicorn re-raises the signal that stopped it once serve() returns; with the default
        # SIGTERM handler that kills the process before the finally below releases the lock,
        # and the other watcher waits out the session TTL (twice over) to lead.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        code = 0
        try:
            await server.serve()
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            # Release the lock at once, so another watcher need not wait out the TTL.
            await w.stop()
            await consul.close()
        return code

    loop = asyncio.new_event_loop()
    code = loop.run_until_complete(main())
    # Not asyncio.run(): it would join the executor's threads, and those sit in Nomad long polls
    # for up to a minute. Nothing lives in this process that the lock release has not handed
    # over, so the abandoned polls are let go with the process.
    logging.shutdown()
    os._exit(code)


def _has_terminal() -> bool:
    """Someone can answer the question: stdin and stdout are a terminal."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def apply(
    models: Path = typer.Argument(..., exists=True, dir_okay=False, help="The models file."),
    auto_approve: bool = typer.Option(
        False, "--auto-approve", help="Apply without asking (the plan is still printed)."
    ),
    allow_unplaceable: bool = typer.Option(
        False,
        "--allow-unplaceable",
        help="Apply even when a model fits nowhere and nobody was asked (scripts, CI).",
    ),
) -> None:
    """Show the plan for MODELS.yaml, then store it in Consul (one key per model under
    llmgw/config/) and register its jobs. Asks first in a terminal (unless there is nothing to do); without one it applies a
    plan where everything fits, and refuses (exit 7) one where a model fits nowhere unless
    --allow-unplaceable. A model whose job ID is taken by a job llmgw did not render refuses the
    whole file (exit 5)."""
    from nomad_driver.cli.apply import ApplyConflict, apply_file
    from nomad_driver.cli.plan import EXIT_FITS_NOWHERE
    from nomad_driver.cli.plan_output import plan_or_exit, show_plan
    from nomad_driver.consul import ConsulError
    from nomad_driver.nomad import NomadError
    from nomad_driver.spec import SpecError, problem_line

    plan = plan_or_exit(models, as_json=False, verb="apply")
    show_plan(plan, str(models), as_json=False)
    if plan.problems:
        # Applying would stop at the first job that is someone else's; asking first would only
        # have the operator agree to something that cannot happen.
        typer.echo(f"llmgw apply: {'; '.join(plan.problems)}; nothing was applied", err=True)
        raise typer.Exit(EXIT_REFUSED)
    unplaceable = [m.model for m in plan.unplaceable]
    # With nothing to do there is nothing to agree to: no job changes, and the file is stored
    # as it is (its comments, say) without a question.
    if plan.has_changes and _has_terminal() and not auto_approve:
        question = "Apply these changes?"
        if unplaceable:
            question = (
                f"{', '.join(unplaceable)} fit{'s' if len(unplaceable) == 1 else ''} nowhere. Apply anyway?"
            )
        if not typer.confirm(question, default=False):
            typer.echo("llmgw apply: nothing applied", err=True)
            raise typer.Exit(EXIT_REFUSED)
    elif unplaceable and not allow_unplaceable:
        # Nobody was asked, so nobody agreed to a model that can only wait for room: that is
        # how a model ended up logging "no placement" for two days.
        typer.echo(
            f"llmgw apply: nothing applied: {', '.join(unplaceable)} "
            f"fit{'s' if len(unplaceable) == 1 else ''} nowhere (see above); free room or change "
            "the profile, or pass --allow-unplaceable to apply anyway",
            err=True,
        )
        raise typer.Exit(EXIT_FITS_NOWHERE)

    try:
        result = apply_file(models, text=plan.text)
    except SpecError as exc:
        for problem in exc.problems:
            typer.echo(problem_line(models, problem), err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except ApplyConflict as exc:
        typer.echo(f"llmgw apply: {exc}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None
    except (ConsulError, NomadError) as exc:
        typer.echo(f"llmgw apply: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    pinned = (
        f", {len(result.for_the_watcher)} left to the watcher to pin to a fabric "
        f"({', '.join(result.for_the_watcher)})"
        if result.for_the_watcher
        else ""
    )
    rolled = (
        f", {len(result.rolled_out)} rolled out by the watcher beside their running replicas "
        f"({', '.join(result.rolled_out)})"
        if result.rolled_out
        else ""
    )
    typer.echo(
        f"applied {len(result.models.models)} models: {len(result.registered)} registered, "
        f"{len(result.unchanged)} unchanged{pinned}{rolled}"
    )


def ctl_retry(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="The parked model to place again."),
    addr: str | None = typer.Option(
        None, "--addr", help="Admin API address (as `llmgw ctl --addr`).", show_default=False
    ),
    token: str | None = typer.Option(
        None, "--token", help="Bearer token (as `llmgw ctl --token`).", show_default=False
    ),
) -> None:
    """Unpark a model: clear its failure count and restore its replicas. The leader does it; sent
    to a follower, the request follows it to the leader."""
    from nomad_driver.cli.admin_client import AdminClient, NotLeader, retry_on_leader
    from nomad_driver.cli.ctl import admin_errors, client_of

    # Given after the verb, they win over the group's; otherwise the group's client is used.
    client = client_of(ctx)
    if addr is not None or token is not None:
        client = AdminClient(addr or client.addr, token if token is not None else os.environ.get(TOKEN_ENV))
        ctx.call_on_close(client.close)
    with admin_errors():
        try:
            answer, done_at = retry_on_leader(client, model)
        except NotLeader as exc:
            hint = "" if exc.leader_addr else "; no watcher leads right now, try again in a few seconds"
            raise NotLeader(f"{exc}{hint}", exc.leader_id, exc.leader_addr) from None
    leader = answer.get("leader") if isinstance(answer.get("leader"), dict) else {}
    who = (
        f"watcher {leader['id']} at {done_at}" if leader and leader.get("id") else f"the watcher at {done_at}"
    )
    followed = "" if done_at == client.addr else f" (the leader; {client.addr} does not lead)"
    typer.echo(
        f"{model}: retried by {who}{followed}; its failure count is cleared and its replicas are "
        "being restored"
    )


def ctl_prefetch(
    model: str = typer.Argument(..., help="The model whose weights to fetch ahead.", show_default=False),
    models: Path = typer.Option(
        ..., "--models", envvar="LLMGW_MODELS_FILE", help="The models file that defines it."
    ),
    nodes: str = typer.Option(
        "", "--nodes", help="Node names, comma-separated (default: every node it could run on)."
    ),
) -> None:
    """Fetch a model's weights into the caches of its nodes before the first request, with a
    Nomad sysbatch job (llmgw-prefetch-MODEL) running the model's own fetch task."""
    from nomad_driver.fetch.prefetch import NotFetched, render_prefetch_job
    from nomad_driver.nomad import Nomad, NomadError
    from nomad_driver.spec import SpecError, load_models

    try:
        defined = load_models(models).models
    except SpecError as exc:
        typer.echo(f"llmgw ctl prefetch: {'; '.join(exc.problems)}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    if model not in defined:
        typer.echo(f"llmgw ctl prefetch: no model '{model}' in {models}", err=True)
        raise typer.Exit(EXIT_UNKNOWN_MODEL)
    chosen = [n.strip() for n in nodes.split(",") if n.strip()]
    try:
        job = render_prefetch_job(defined[model], chosen or None)
        Nomad().register_job(job)
    except NotFetched as exc:
        typer.echo(f"llmgw ctl prefetch: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except NomadError as exc:
        typer.echo(f"llmgw ctl prefetch: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    where = ", ".join(chosen) if chosen else "every node it could run on"
    typer.echo(
        f"{model}: prefetching on {where} (Nomad job {job['ID']}); "
        f"'nomad job status {job['ID']}' shows each node's fetch"
    )


def register(app: typer.Typer, ctl_app: typer.Typer) -> None:
    app.command("watcher")(watcher)
    app.command("apply")(apply)
    ctl_app.command("retry")(ctl_retry)
    ctl_app.command("prefetch")(ctl_prefetch)
