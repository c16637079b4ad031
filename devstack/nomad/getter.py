"""The artifact sandbox of a Nomad client: what the getter may see, how long it may take, how
much it may fetch, and which sources it takes at all.

Read against hashicorp/nomad (2.0):

- `client/allocrunner/taskrunner/getter/util.go` `environment()` and `util_linux.go`
  `defaultEnvironment()`: the getter runs as a subprocess whose environment is PATH, TMPDIR (the
  task's `tmp`) and HOME, plus the names the client's `artifact.set_environment_variables`
  lists, read from the *agent's* environment. Nothing of the task reaches it: not its `env`
  block, not a template's `env = true` (the template hook runs after the artifact hook anyway).
  So an `s3::` artifact finds AWS credentials only in its own URL or on the client.
- `nomad/structs/config/artifact.go` `DefaultArtifactConfig()`: `http_read_timeout`,
  `gcs_timeout`, `git_timeout`, `hg_timeout`, `s3_timeout` 30m; `http_max_size` and
  `decompression_size_limit` 100GB (go-humanize: 10^9 bytes a GB); 4096 files unpacked.
- `getter/params.go` `deadline()`: whatever the getter does, its subprocess is killed at the
  largest of those timeouts (30m at least) plus a minute. A 140 GB model at 60 MB/s takes 39
  minutes: it never arrives through an artifact with the defaults.
- `getter/params.go` `client()`: the getters are git, hg, gcs, s3, http and https. There is no
  file getter (the pre-sandbox `getter.go` said so: "If a getter type is not listed here, it is
  not supported (e.g. file)"), so a `file://` source or a bare path, which go-getter's file
  detector turns into `file://`, fails with "download not supported for scheme 'file'" before
  Landlock is ever asked. The stand-in says the same. It keeps a file getter of its own, off
  unless a node's config sets `file_getter: true`, for its tests of the artifact hook's modes
  and events; llmgw's jobs never ask it (a raw_exec engine reads a file:// source in place, and
  llmgw's fetch copies it for a docker one).
- `artifact_hook.go` wraps every failure as `failed to download artifact "<source>": <err>`, and
  `getter/util.go` `runCmd` wraps the subprocess's as `getter subprocess failed: <exit>: <output>`;
  the subprocess prints `failed to download artifact: <go-getter's error>`.

The stand-in's getters: `http`/`https` (a plain GET with the artifact's headers), `s3` (path-style
`s3::http(s)://HOST/BUCKET/KEY`, signed with the URL's `aws_access_key_id`/`aws_access_key_secret`
or the sandbox's AWS_* variables) and, unless turned off, `file`. Nothing here may reach beyond
this machine, so only local servers answer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx

from devstack.nomad.encode import parse_go_duration
from nomad_driver.fetch.sigv4 import sign_get

MINUTE = 60.0
GB = 1000**3
# The key a fleet entry's client block takes, and where a parsed node carries it until the
# server hands it to the client (it is never part of the node's JSON).
ARTIFACT_KEY = "artifact"
NODE_CONFIG_KEY = "_artifact_config"
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": GB, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}  # fmt: skip
_TIMEOUT_KEYS = ("http_read_timeout", "gcs_timeout", "git_timeout", "hg_timeout", "s3_timeout")
_KEYS = {
    *_TIMEOUT_KEYS, "http_max_size", "decompression_file_count_limit", "decompression_size_limit",
    "disable_artifact_inspection", "disable_filesystem_isolation", "filesystem_isolation_extra_paths",
    "set_environment_variables", "file_getter",
}  # fmt: skip
NO_CREDENTIALS = (
    "NoCredentialProviders: no valid providers in chain. Deprecated.\n"
    "\tFor verbose messaging see aws.Config.CredentialsChainVerboseErrors"
)


class GetterError(Exception):
    """What the getter subprocess printed before it exited 1 (or was killed: `exit`)."""

    def __init__(self, message: str, exit: str = "exit status 1") -> None:
        super().__init__(message)
        self.exit = exit

    def nomad_text(self) -> str:
        return f"getter subprocess failed: {self.exit}: {self}"


@dataclass(frozen=True)
class ArtifactConfig:
    """A client's `artifact` block, with Nomad's defaults; timeouts in seconds, sizes in bytes."""

    http_read_timeout: float = 30 * MINUTE
    gcs_timeout: float = 30 * MINUTE
    git_timeout: float = 30 * MINUTE
    hg_timeout: float = 30 * MINUTE
    s3_timeout: float = 30 * MINUTE
    http_max_size: int = 100 * GB
    decompression_file_count_limit: int = 4096
    decompression_size_limit: int = 100 * GB
    disable_artifact_inspection: bool = False
    disable_filesystem_isolation: bool = False
    filesystem_isolation_extra_paths: tuple[str, ...] = ()
    set_environment_variables: str = ""
    file_getter: bool = False  # the stand-in's own; see the module docstring

    def deadline(self) -> float:
        """params.go deadline(): when the getter subprocess is killed, whatever it is doing."""
        return max(30 * MINUTE, *(getattr(self, k) for k in _TIMEOUT_KEYS)) + MINUTE


DEFAULT = ArtifactConfig()


def _bytes(text: object, where: str) -> int:
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number) :]
    if not number or unit not in _UNITS:
        raise ValueError(f"{where}: {text!r} is not a size (e.g. 100GB, 512MiB)")
    return int(float(number) * _UNITS[unit])


def parse_artifact_config(raw: object, where: str) -> ArtifactConfig:
    """A client's `artifact` block in Nomad's HCL names; errors name the key."""
    if raw is None:
        return DEFAULT
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: 'artifact' must be a mapping of the client's artifact settings")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: artifact: unknown key(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        at = f"{where}: artifact.{key}"
        if key in _TIMEOUT_KEYS:
            try:
                values[key] = parse_go_duration(str(value)) / 1e9
            except ValueError:
                raise ValueError(f"{at}: {value!r} is not a duration (e.g. 30m)") from None
        elif key in ("http_max_size", "decompression_size_limit"):
            values[key] = _bytes(value, at)
        elif key == "filesystem_isolation_extra_paths":
            if not isinstance(value, list):
                raise ValueError(f"{at}: must be a list of paths")
            values[key] = tuple(str(v) for v in value)
        elif key == "decompression_file_count_limit":
            values[key] = int(value)
        elif key == "set_environment_variables":
            values[key] = str(value)
        else:
            if not isinstance(value, bool):
                raise ValueError(f"{at}: must be true or false")
            values[key] = value
    return ArtifactConfig(**values)


def _home(client_env: Mapping[str, str]) -> str:
    # util_linux.go findHomeDir: $HOME, else /root for root, else a path that does not exist.
    return client_env.get("HOME") or ("/root" if os.geteuid() == 0 else "/nonexistent")


def sandbox_environment(
    task_dir: Path, config: ArtifactConfig, client_env: Mapping[str, str]
) -> dict[str, str]:
    """util.go environment(): the getter's whole environment. `client_env` is the agent's own."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "TMPDIR": str(task_dir / "tmp"), "HOME": _home(client_env)}
    for name in config.set_environment_variables.replace(",", " ").split():
        env[name] = client_env.get(name, "")  # os.Getenv: an unset name is set, empty
    return env


def forced_getter(source: str) -> tuple[str, str]:
    """go-getter's detection, as far as the stand-in needs it: `X::URL` forces getter X, a bare
    path becomes `file://` (the file detector), otherwise the URL's scheme."""
    force, sep, rest = source.partition("::")
    if sep and "/" not in force:
        return force, rest
    if source.startswith("/"):
        return "file", "file://" + source
    return urlsplit(source).scheme, source


class _Budget:
    """The getter's clock: its own timeout for the protocol and the subprocess's deadline."""

    def __init__(self, timeout: float, config: ArtifactConfig) -> None:
        now = time.monotonic()
        self.timeout_at = now + timeout
        self.killed_at = now + config.deadline()

    def check(self) -> None:
        now = time.monotonic()
        if now >= self.killed_at:
            # exec.CommandContext kills the subprocess; nothing it printed says why.
            raise GetterError("", exit="signal: killed")
        if now >= self.timeout_at:
            raise GetterError("failed to download artifact: context deadline exceeded")

    def left(self) -> float:
        return max(0.01, min(self.timeout_at, self.killed_at) - time.monotonic())


def _stream(url: str, headers: dict[str, str], dest: Path, budget: _Budget, max_bytes: int | None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    try:
        with httpx.stream("GET", url, headers=headers, timeout=budget.left(), follow_redirects=True) as resp:
            if resp.status_code >= 400:
                raise GetterError(f"failed to download artifact: bad response code: {resp.status_code}")
            length = int(resp.headers.get("content-length") or -1)
            if max_bytes is not None and length > max_bytes:
                # go-getter HttpGetter with MaxBytes: refused before a byte is written.
                raise GetterError(
                    f"failed to download artifact: {dest}: Content-Length {length} exceeds http_max_size {max_bytes}"
                )
            with dest.open("wb") as out:
                for chunk in resp.iter_bytes(1 << 16):
                    done += len(chunk)
                    if max_bytes is not None and done > max_bytes:
                        raise GetterError(
                            f"failed to download artifact: {dest}: body exceeds http_max_size {max_bytes}"
                        )
                    out.write(chunk)
                    budget.check()
    except httpx.TimeoutException:
        budget.check()
        raise GetterError("failed to download artifact: context deadline exceeded") from None
    except httpx.HTTPError as exc:
        raise GetterError(f"failed to download artifact: {exc}") from None


def get_http(url: str, headers: Mapping[str, str], dest: Path, config: ArtifactConfig) -> None:
    _stream(url, dict(headers), dest, _Budget(config.http_read_timeout, config), config.http_max_size)


def get_s3(url: str, sandbox_env: Mapping[str, str], dest: Path, config: ArtifactConfig) -> None:
    """go-getter's S3Getter on a path-style URL: credentials from the URL's query, else from the
    AWS SDK's environment chain, which inside the sandbox is the sandbox's environment."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    key = query.pop("aws_access_key_id", "") or sandbox_env.get("AWS_ACCESS_KEY_ID", "")
    secret = query.pop("aws_access_key_secret", "") or sandbox_env.get("AWS_SECRET_ACCESS_KEY", "")
    token = query.pop("aws_access_token", "") or sandbox_env.get("AWS_SESSION_TOKEN", "")
    region = query.pop("region", "") or sandbox_env.get("AWS_REGION", "") or "us-east-1"
    if not (key and secret):
        raise GetterError(f"failed to download artifact: {NO_CREDENTIALS}")
    rest = urlencode(query)
    target = f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{rest}" if rest else "")
    headers = sign_get(
        target, access_key=key, secret_key=secret, region=region, session_token=token, extra={}
    )
    _stream(target, headers, dest, _Budget(config.s3_timeout, config), None)
