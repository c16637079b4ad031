"""The Docker plugin as far as the stand-in runs it: its rule on host paths, checked when a
`docker` task starts, and its per-node configuration from the nodes file.

Nomad's docker plugin defaults to `volumes { enabled = false }` (hashicorp/nomad
drivers/docker/config.go, the `volumes` block's literal default `{ enabled = false }`), and then
refuses any bind mount of a host path outside the allocation's directory
(drivers/docker/driver.go: `containerBinds` for `config.volumes`, `toDockerMount` for `mount`
blocks), failing the task with "volumes are not enabled; cannot mount host path: ...". A client
opts in with `plugin "docker" { config { volumes { enabled = true } } }`, per node, and then
fingerprints `driver.docker.volumes.enabled` (drivers/docker/fingerprint.go). The nodes file says
the same as `plugins: {docker: {config: {volumes: {enabled: true}}}}`.

The stand-in runs no containers: a docker task that passes the plugin's checks stays running,
without a process, until it is stopped, so jobs written for Docker are placed, admitted and
refused as on a real client while nothing answers on their ports.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from typing import Any


def _quoted(text: str) -> str:
    # Go's %q for the ASCII paths jobs use: double quotes, backslash escapes.
    return json.dumps(text)


def _inside(parent: str, path: str) -> bool:
    parent, path = posixpath.normpath(parent), posixpath.normpath(path)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def volumes_refusal(
    config: dict[str, Any],
    *,
    volumes_enabled: bool,
    alloc_dir: str = "/var/nomad/alloc/0",
    task_dir: str = "/var/nomad/alloc/0/task",
) -> str | None:
    """Nomad's error for a docker task's `volumes`, `volume_driver` and `mount` blocks on a
    client whose plugin has volumes as given, or None when the task may start."""
    if volumes_enabled:
        return None
    driver = str(config.get("volume_driver") or "")
    if driver:
        return f"volumes are not enabled; cannot use volume driver {_quoted(driver)}"
    for bind in config.get("volumes") or []:
        source = str(bind).split(":", 1)[0]
        # A relative source is inside the task's directory, which is always allowed.
        expanded = posixpath.join(task_dir, source) if not source.startswith("/") else source
        if not _inside(alloc_dir, expanded):
            return f"volumes are not enabled; cannot mount host path: {_quoted(str(bind))}"
    for mount in config.get("mount") or config.get("mounts") or []:
        kind = str(mount.get("type") or "volume")
        source = str(mount.get("source") or "")
        if kind == "bind":
            expanded = posixpath.join(task_dir, source) if not source.startswith("/") else source
            if not _inside(alloc_dir, expanded):
                return f"volumes are not enabled; cannot mount host path: {_quoted(expanded)}"
        elif kind != "tmpfs":
            return f"volumes are not enabled; cannot mount volume: {_quoted(source)}"
    return None


# Attributes a client with the docker plugin fingerprints (drivers/docker/fingerprint.go).
DETECTED = "driver.docker"
VOLUMES_ENABLED = "driver.docker.volumes.enabled"
DOCKER_VERSION = "27.5.1"


class PluginConfigError(ValueError):
    """A nodes file's `plugins` entry the stand-in does not understand; says where."""


def _mapping(value: object, where: str) -> Mapping[str, object]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PluginConfigError(f"{where}: must be a mapping")
    return value


def plugin_attributes(plugins: object, where: str) -> dict[str, str]:
    """The attributes a client fingerprints for the nodes file's `plugins` entry. Only what the
    stand-in enforces is accepted, so a setting that would change nothing is not silently kept."""
    attributes: dict[str, str] = {}
    for name, body in _mapping(plugins, f"{where}: plugins").items():
        if name != "docker":
            raise PluginConfigError(f"{where}: plugins: unknown plugin {name!r} (the stand-in knows docker)")
        block = _mapping(body, f"{where}: plugins.docker")
        for key in block:
            if key != "config":
                raise PluginConfigError(f"{where}: plugins.docker: unknown key {key!r}")
        config = _mapping(block.get("config"), f"{where}: plugins.docker.config")
        for key in config:
            if key != "volumes":
                raise PluginConfigError(f"{where}: plugins.docker.config: unknown key {key!r}")
        volumes = _mapping(config.get("volumes"), f"{where}: plugins.docker.config.volumes")
        enabled = volumes.get("enabled", False)
        if set(volumes) - {"enabled"} or not isinstance(enabled, bool):
            raise PluginConfigError(f"{where}: plugins.docker.config.volumes: only 'enabled = true|false'")
        attributes[DETECTED] = "true"
        attributes["driver.docker.version"] = DOCKER_VERSION
        if enabled:
            attributes[VOLUMES_ENABLED] = "true"
    return attributes


def start_error(
    config: dict[str, Any], attributes: Mapping[str, str], alloc_dir: str, task_dir: str
) -> str | None:
    """What `StartTask` answers for this task on a node with these attributes, or None."""
    enabled = attributes.get(VOLUMES_ENABLED, "").lower() in ("1", "t", "true")
    refusal = volumes_refusal(config, volumes_enabled=enabled, alloc_dir=alloc_dir, task_dir=task_dir)
    if refusal is None:
        return None
    image = str(config.get("image") or "")
    # The pulled image's ID in Nomad; here a stable stand-in for it, derived from the name.
    image_id = "sha256:" + hashlib.sha256(image.encode()).hexdigest()
    return f"Failed to create container configuration for image {_quoted(image)} ({_quoted(image_id)}): {refusal}"
