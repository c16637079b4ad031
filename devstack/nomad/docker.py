"""The Docker plugin's rule on host paths, as Nomad's docker driver applies it at task start.

Nomad's docker plugin defaults to `volumes { enabled = false }` (hashicorp/nomad
drivers/docker/config.go, the `volumes` block's literal default `{ enabled = false }`), and then
refuses any bind mount of a host path outside the allocation's directory
(drivers/docker/driver.go: `containerBinds` for `config.volumes`, `toDockerMount` for `mount`
blocks), failing the task with "volumes are not enabled; cannot mount host path: ...". A client
opts in with `plugin "docker" { config { volumes { enabled = true } } }`, per node. The stand-in
runs no Docker tasks; the tests apply this rule to llmgw's jobs as the client would at start.
"""

from __future__ import annotations

import json
import posixpath
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
