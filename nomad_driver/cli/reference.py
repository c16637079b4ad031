"""docs/reference.md, generated from the code: the CLI's own commands and options, the
environment variables the code reads, and the admin API's routes.

    python -m nomad_driver.cli.reference > docs/reference.md

tests/test_docs.py fails when the committed page differs from a fresh run, so a flag, variable or
endpoint added without regenerating it is caught before an operator meets the difference.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer.main

PACKAGE_ROOTS = ("nomad_driver", "router")
ENV_RE = re.compile(r"\"((?:LLMGW|NOMAD|CONSUL)_[A-Za-z0-9_]+)\"")

# What the variables read outside any CLI option mean. One read by an option takes that
# option's help instead, so it is written once.
ENV_NOTES: dict[str, str] = {
    "NOMAD_ADDR": "Nomad's HTTP API (`https://` for TLS); default `http://127.0.0.1:4646`",
    "NOMAD_TOKEN": "Nomad ACL token",
    "NOMAD_NAMESPACE": "Nomad namespace of the model jobs, for every command and job; default `default`",
    "NOMAD_REGION": "Nomad region the router's calls go to",
    "NOMAD_CACERT": "CA certificate that signed Nomad's HTTPS certificate",
    "NOMAD_CLIENT_CERT": "client certificate for Nomad's mutual TLS",
    "NOMAD_CLIENT_KEY": "private key of NOMAD_CLIENT_CERT",
    "NOMAD_CAPATH": "a directory of CA certificates, instead of NOMAD_CACERT",
    "NOMAD_TLS_SERVER_NAME": "the name Nomad's certificate is verified against (and the SNI), when NOMAD_ADDR "
    "is not one of its names, e.g. `server.global.nomad`; as the nomad CLI reads it",
    "NOMAD_SKIP_VERIFY": "`true`: do not verify Nomad's certificate (a Go boolean; anything else is an error)",
    "LLMGW_VERIFY_SKIPPED_PASSES": "a file: the watcher runs the passes it would skip with nothing new and "
    "appends every model whose decision came out different (the test suite sets it)",
    "NOMAD_ADDR_admin": "set by Nomad for the task's `admin` port; the watcher advertises it when it listens on 0.0.0.0",
    "CONSUL_HTTP_ADDR": "Consul's HTTP API, `host:port` or a URL; default `127.0.0.1:8500`",
    "CONSUL_HTTP_SSL": "`true`: `https://` for a `host:port` CONSUL_HTTP_ADDR, and for an `http://` one",
    "CONSUL_HTTP_TOKEN": "Consul ACL token",
    "CONSUL_CACERT": "CA certificate that signed Consul's HTTPS certificate",
    "CONSUL_CLIENT_CERT": "client certificate for Consul's mutual TLS",
    "CONSUL_CLIENT_KEY": "private key of CONSUL_CLIENT_CERT",
    "CONSUL_CAPATH": "a directory of CA certificates, instead of CONSUL_CACERT",
    "CONSUL_TLS_SERVER_NAME": "the name Consul's certificate is verified against (and the SNI), when "
    "CONSUL_HTTP_ADDR is not one of its names, e.g. `server.dc1.consul` (a `:port` is dropped); as the consul CLI reads it",
    "CONSUL_HTTP_SSL_VERIFY": "`false`: do not verify Consul's certificate (a Go boolean; anything else is an error)",
    "LLMGW_ADMIN_TOKEN": (
        "the watcher: when set, `POST` on the admin API needs `Authorization: Bearer <it>`; "
        "listening beyond loopback, every route but `/healthz` and `/metrics` needs it, and "
        "unset there the watcher generates one into `$NOMAD_SECRETS_DIR/llmgw-admin-token` "
        "(else a new directory under `/tmp`) and logs where; `llmgw ctl`: the token it sends"
    ),
    "LLMGW_API_KEYS": "the router: API keys, comma-separated (with `--api-keys-file`)",
    "LLMGW_ROUTER_URL": "`llmgw ctl replicas`: routers to ask for their outlier ejections (`--router`); "
    "the dev stack exports its router's",
    "LLMGW_ROUTER_API_KEY": "`llmgw ctl replicas`: the API key it sends to those routers",
    "LLMGW_TLS_CERTS": "more certificate files whose expiry is published, comma-separated",
    "LLMGW_ROUTER_CLIENT_SEND_S": "the router: seconds a client may stop reading before it is dropped; default 30",
    "LLMGW_ROUTER_MAX_WAITING": "the router: requests that may wait for one model's replica; default 128, then 429",
    "LLMGW_ROUTER_POLICY": "the router: `affinity` (default), `least-outstanding` or `round-robin`",
    "NOMAD_ALLOC_ID": "set by Nomad; the router's ID for its in-flight key (else host, PID and a random suffix)",
    "NOMAD_SECRETS_DIR": "set by Nomad; where the watcher writes the admin token it generates",
}

# One line per admin API route; the bodies are in docs/admin-api.md.
ADMIN_ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/healthz"): "`{status, leader, passes}`; 200 while the watcher runs",
    ("GET", "/metrics"): "Prometheus text",
    ("GET", "/v1/admin/models"): "every defined model with what it should have and has, and the leader",
    ("GET", "/v1/admin/models/{model}"): "one model; 404 when it is not defined",
    (
        "POST",
        "/v1/admin/models/{model}/retry",
    ): "unpark the model (leader only: a follower answers 409 naming the leader)",
    ("GET", "/v1/admin/summary"): "the fleet: nodes, GPUs per class, replicas, parked, unplaceable, idle",
    ("GET", "/v1/admin/nodes"): "every node with its GPUs, engines and fabric",
    ("GET", "/v1/admin/replicas"): "every replica with its state",
}


def _root() -> Path:
    return Path(__file__).resolve().parents[2]


# Typer carries its own copy of click, so commands and parameters are told apart by what they
# have, not by click's classes.


def commands() -> Iterator[tuple[str, Any]]:
    """(`llmgw VERB`, command) for every verb, sub-verbs included, sorted by name."""
    from nomad_driver.cli.app import app

    def walk(cmd: Any, path: str) -> Iterator[tuple[str, Any]]:
        if hasattr(cmd, "commands"):
            if [p for p in cmd.params if _is_option(p) and not p.hidden]:
                yield path, cmd  # a group's own options: `llmgw ctl --addr`
            for name in sorted(cmd.commands):
                yield from walk(cmd.commands[name], f"{path} {name}")
        else:
            yield path, cmd

    yield from walk(typer.main.get_command(app), "llmgw")


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


def _is_option(param: Any) -> bool:
    return str(getattr(param, "param_type_name", "")) == "option"


def _default(param: Any) -> str:
    value = param.default
    if _is_option(param) and param.is_flag:
        return ""
    if value is None or value == () or value == [] or value == "":
        return ""
    if hasattr(value, "value"):  # an enum choice
        value = value.value
    return f"`{value}`"


def _envvars(param: Any) -> list[str]:
    env = getattr(param, "envvar", None)
    if not env:
        return []
    return [env] if isinstance(env, str) else list(env)


def cli_section() -> list[str]:
    out = ["## Commands", ""]
    for path, cmd in commands():
        out += [f"### `{path}`", "", _first_paragraph(cmd.help), ""]
        args = [p for p in cmd.params if str(getattr(p, "param_type_name", "")) == "argument"]
        opts = [p for p in cmd.params if _is_option(p) and not p.hidden]
        usage = " ".join([path, "[OPTIONS]" if opts else "", *(str(a.name).upper() for a in args)])
        out += ["```", " ".join(usage.split()), "```", ""]
        if opts:
            out += ["| option | environment | default | what |", "| --- | --- | --- | --- |"]
            for opt in opts:
                names = ", ".join(f"`{o}`" for o in [*opt.opts, *opt.secondary_opts])
                env = ", ".join(f"`{e}`" for e in _envvars(opt))
                help_text = " ".join((opt.help or "").split()).replace("|", "\\|")
                out.append(f"| {names} | {env} | {_default(opt)} | {help_text} |")
            out.append("")
    return out


def env_readers() -> dict[str, list[str]]:
    """Every Nomad, Consul and llmgw variable named in the code, with the files that name it."""
    root = _root()
    found: dict[str, list[str]] = {}
    for package in PACKAGE_ROOTS:
        for path in sorted((root / package).rglob("*.py")):
            for name in ENV_RE.findall(path.read_text(encoding="utf-8")):
                where = str(path.relative_to(root))
                if where not in found.setdefault(name, []):
                    found[name].append(where)
    return found


def env_section() -> list[str]:
    by_option: dict[str, list[str]] = {}
    for path, cmd in commands():
        for param in cmd.params:
            for env in _envvars(param):
                flag = next(iter(getattr(param, "opts", [])), str(param.name))
                by_option.setdefault(env, []).append(f"`{path} {flag}`")
    names = sorted(set(env_readers()) | set(by_option))
    out = [
        "## Environment variables",
        "",
        "Every variable the code reads. Those an option also takes are that option's default.",
        "",
        "| variable | what |",
        "| --- | --- |",
    ]
    for name in names:
        if name in by_option:
            what = "sets " + ", ".join(by_option[name])
            if name in ENV_NOTES:
                what = f"{ENV_NOTES[name]}; " + what
        else:
            what = ENV_NOTES.get(name) or "read by " + ", ".join(f"`{w}`" for w in env_readers()[name])
        out.append(f"| `{name}` | {what} |")
    return [*out, ""]


def admin_routes() -> list[tuple[str, str, list[str]]]:
    """(method, path, path parameters) of every route the watcher's admin API serves."""
    from nomad_driver.consul import Consul
    from nomad_driver.nomad import Nomad
    from nomad_driver.watcher.admin import create_app
    from nomad_driver.watcher.loop import Watcher, WatcherConfig

    consul = Consul("http://127.0.0.1:1")
    try:
        app = create_app(Watcher(consul, Nomad("http://127.0.0.1:1"), WatcherConfig()))
        schema: dict[str, Any] = app.openapi()
    finally:
        asyncio.run(consul.close())
    routes = []
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            params = [str(p["name"]) for p in op.get("parameters", [])]
            routes.append((method.upper(), path, params))
    return sorted(routes, key=lambda r: (r[1], r[0]))


def admin_section() -> list[str]:
    out = [
        "## Admin API",
        "",
        "Served by every watcher at `--listen`. The routes answer with plain JSON objects, not",
        "schema models, so their bodies are not generated here: each is documented field by field",
        "in [admin-api.md](admin-api.md), which the docs test checks names every route below.",
        "",
        "| method | path | what |",
        "| --- | --- | --- |",
    ]
    for method, path, _ in admin_routes():
        out.append(f"| `{method}` | `{path}` | {ADMIN_ROUTES.get((method, path), '')} |")
    return [*out, ""]


def render() -> str:
    lines = [
        "# Reference",
        "",
        "<!-- Generated by `python -m nomad_driver.cli.reference > docs/reference.md`; do not edit. -->",
        "",
        "Every `llmgw` command with its options, every environment variable llmgw reads, and every",
        "admin API route, taken from the code itself. The reasons and the examples are in the other",
        "pages: [models.md](models.md), [operating.md](operating.md), [admin-api.md](admin-api.md).",
        "",
        *cli_section(),
        *env_section(),
        *admin_section(),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
