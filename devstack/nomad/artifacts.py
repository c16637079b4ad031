"""The prestart work that fills a task directory: `artifact` and `template` blocks.

Artifacts go through the client's sandbox as Nomad runs it (getter.py: its environment, its
timeouts and size cap, its getters). go-getter's modes are kept: `file` puts the file at exactly
the destination, `dir` copies a directory's contents into it, `any` puts a file under the
destination directory by its own name and unpacks archives.

Templates support what a job of llmgw's needs and no more: plain text and `{{ env "NAME" }}`,
written to `DestPath`, or turned into environment variables with `Envvars`. Anything else in
`{{ }}` fails the task with a message that says so, rather than rendering something wrong.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlencode, urlparse

from devstack.nomad.consul_template import ServiceTemplateError, lookups, render_services
from devstack.nomad.getter import (
    DEFAULT,
    ArtifactConfig,
    GetterError,
    forced_getter,
    get_http,
    get_s3,
    sandbox_environment,
)
from devstack.nomad.nomad_var_template import Lookup, VarTemplateError, render_nomad_vars, uses_nomad_vars
from devstack.nomad.taskenv import TaskEnv

Json = dict[str, Any]

_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar", ".zip")
_TEMPLATE_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
_ENV_ACTION = re.compile(r'^env\s+"([^"]+)"$')


class ArtifactError(Exception):
    pass


class TemplateError(Exception):
    pass


def _inside(base: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(base.resolve())
        return True
    except ValueError:
        return False


def _local_source(url: str) -> Path:
    parsed = urlparse(url)
    return Path(unquote(parsed.netloc + parsed.path))


def fetch_artifact(
    artifact: Json,
    env: TaskEnv,
    task_dir: Path,
    alloc_root: Path,
    config: ArtifactConfig = DEFAULT,
    client_env: Mapping[str, str] | None = None,
) -> Path:
    """Fetch one artifact into the task dir, through the client's sandbox (getter.py); returns
    the destination. Errors carry the message Nomad's artifact hook puts in the task event.
    `client_env`: the agent's own environment, which is all the sandbox may inherit from."""
    raw_source = str(artifact.get("GetterSource") or "")
    try:
        if not raw_source:
            raise ArtifactError("source must be specified")
        source_text = env.replace(raw_source)
        options = {k: env.replace(str(v)) for k, v in (artifact.get("GetterOptions") or {}).items()}
        if options:
            sep = "&" if "?" in source_text else "?"
            source_text += sep + urlencode(options)
        dest = task_dir / env.replace(str(artifact.get("RelativeDest") or "local/"))
        if not _inside(alloc_root, dest):
            raise ArtifactError("artifact destination path escapes alloc directory")
        mode = str(artifact.get("GetterMode") or "any")
        if mode not in ("any", "file", "dir"):
            raise ArtifactError(f"invalid artifact mode {mode!r}; must be one of: any, file, dir")
        getter, url = forced_getter(source_text)
        if getter == "file" and config.file_getter:
            _copy_local(_local_source(url), dest, mode)
            return dest
        sandbox = sandbox_environment(task_dir, config, os.environ if client_env is None else client_env)
        headers = {k: env.replace(str(v)) for k, v in (artifact.get("GetterHeaders") or {}).items()}
        return _get_remote(getter, url, dest, mode, headers, sandbox, config)
    except GetterError as exc:
        raise ArtifactError(
            f"failed to download artifact {_go_quote(raw_source)}: {exc.nomad_text()}"
        ) from exc
    except (ArtifactError, OSError, tarfile.TarError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"failed to download artifact {_go_quote(raw_source)}: {exc}") from exc


def _get_remote(
    getter: str,
    url: str,
    dest: Path,
    mode: str,
    headers: dict[str, str],
    sandbox: dict[str, str],
    config: ArtifactConfig,
) -> Path:
    if getter not in ("http", "https", "s3"):
        # params.go client(): git, hg, gcs, s3, http, https, and nothing else. The stand-in
        # runs no git, hg or gcs getter: they would reach out.
        if getter in ("git", "hg", "gcs"):
            raise ArtifactError(f"the Nomad stand-in does not run go-getter's {getter} getter")
        raise GetterError(f"failed to download artifact: download not supported for scheme '{getter}'")
    if mode == "dir":
        raise ArtifactError("the stand-in's http and s3 getters fetch one file (mode file or any)")
    name = posixpath.basename(urlparse(url).path) or "artifact"
    target = dest if mode == "file" else (dest / name)
    if getter == "s3":
        get_s3(url, sandbox, target, config)
    else:
        get_http(url, headers, target, config)
    if mode == "any" and _is_archive(target):
        _unpack(target, dest)
        target.unlink()
    return dest


def _copy_local(source: Path, dest: Path, mode: str) -> None:
    """The stand-in's file getter (getter.py says why it has one); go-getter's modes kept."""
    if not source.exists():
        raise ArtifactError(f"stat {source}: no such file or directory")
    if mode == "file":
        if source.is_dir():
            raise ArtifactError(f"source path is a directory: {source}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    elif mode == "dir" or source.is_dir():
        if not source.is_dir():
            if not _is_archive(source):
                raise ArtifactError(f"source path must be a directory: {source}")
            _unpack(source, dest)
        else:
            shutil.copytree(source, dest, dirs_exist_ok=True)
    elif _is_archive(source):
        _unpack(source, dest)
    else:
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest / source.name)


def _is_archive(path: Path) -> bool:
    return path.name.endswith(_ARCHIVE_SUFFIXES)


def _unpack(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if not _inside(dest, dest / member):
                    raise ArtifactError(f"archive member {member!r} escapes the destination")
            zf.extractall(dest)
        return
    with tarfile.open(archive) as tf:
        tf.extractall(dest, filter="data")


def _go_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_template(text: str, env: dict[str, str]) -> str:
    def action(m: re.Match[str]) -> str:
        body = m.group(1)
        env_match = _ENV_ACTION.match(body)
        if env_match:
            return env.get(env_match.group(1), "")
        raise TemplateError(
            f"template action {{{{ {body} }}}} is not supported by the Nomad stand-in "
            '(only plain text and {{ env "NAME" }})'
        )

    return _TEMPLATE_ACTION.sub(action, text)


def render_templates(
    templates: list[Json],
    env: TaskEnv,
    task_dir: Path,
    alloc_root: Path,
    services: dict[str, list[tuple[str, int]]] | None = None,
    variables: Lookup | None = None,
) -> dict[str, str]:
    """Render every template; returns the variables of `Envvars` templates. `services`: the
    answers to templates' Consul `service` lookups (devstack.nomad.consul_template);
    `variables`: the job's Nomad Variables by path (devstack.nomad.nomad_var_template)."""
    extra_env: dict[str, str] = {}
    for tmpl in templates:
        if tmpl.get("SourcePath"):
            source = task_dir / env.replace(str(tmpl["SourcePath"]))
            try:
                text = source.read_text()
            except OSError as exc:
                raise TemplateError(f"failed to read template {source}: {exc}") from exc
        else:
            text = str(tmpl.get("EmbeddedTmpl") or "")
        if uses_nomad_vars(text):
            try:
                rendered = render_nomad_vars(text, variables or (lambda path: None), env.env)
            except VarTemplateError as exc:
                raise TemplateError(str(exc)) from exc
        elif lookups(text):
            try:
                rendered = render_services(text, services or {}, env.env)
            except ServiceTemplateError as exc:
                raise TemplateError(str(exc)) from exc
        else:
            rendered = render_template(text, env.env)
        dest_rel = env.replace(str(tmpl.get("DestPath") or ""))
        if not dest_rel:
            raise TemplateError("Must specify a destination for the template")
        dest = task_dir / dest_rel
        if not _inside(alloc_root, dest):
            raise TemplateError("destination escapes allocation directory")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(rendered)
        perms = tmpl.get("Perms")
        if perms:
            dest.chmod(int(str(perms), 8))
        if tmpl.get("Envvars"):
            for line in rendered.splitlines():
                line = line.strip()
                if not line or line.startswith("#") or "=" not in line:
                    continue
                key, _, value = line.partition("=")
                extra_env[key.strip()] = value
    return extra_env
