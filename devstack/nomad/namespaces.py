"""Namespaces, as Nomad CE keeps them (`nomad/namespace_endpoint.go`, `structs.Namespace`,
`command/agent/namespace_endpoint.go`), and the admission check a job's namespace passes
(`jobNamespaceConstraintCheckHook`).

`default` exists from the start and cannot be deleted; any other is created with
`POST /v1/namespace/<name>` (what `nomad namespace apply` sends). Jobs, allocations, evaluations
and deployments carry their namespace and every read is scoped by `?namespace=` (`*` for all),
which the HTTP layer already does; a job in a namespace that does not exist is refused at
admission with Nomad's text. The Enterprise parts (quotas, node pool, Vault and Consul
configuration) are refused with CE's "unlicensed" errors, as a CE server refuses them.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any

from devstack.nomad.state import StateStore
from devstack.nomad.validate import multierror_text

Json = dict[str, Any]


class NamespaceError(Exception):
    """A refusal with Nomad's status code and text; the server raises it as its ApiError."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


DEFAULT = "default"
DEFAULT_DESCRIPTION = "Default shared namespace"  # structs.DefaultNamespaceDescription
TABLE = "namespaces"
_VALID_NAME = re.compile(r"^[a-zA-Z0-9-]{1,128}$")  # structs.validNamespaceName
_MAX_DESCRIPTION = 256
# Enterprise-only configuration and the error a CE server gives for it (structs_ce.go).
_UNLICENSED = {
    "NodePoolConfiguration": "invalid node pool configuration: Node Pools Governance is unlicensed.",
    "VaultConfiguration": "invalid vault configuration: Multi-Cluster Vault is unlicensed.",
    "ConsulConfiguration": "invalid consul configuration: Multi-Cluster Consul is unlicensed.",
}


def _hash(ns: Json) -> str:
    """`Namespace.SetHash`: BLAKE2b-256 over the fields in Nomad's order, base64 as Go encodes
    a byte slice."""
    h = hashlib.blake2b(digest_size=32)
    for part in (ns["Name"], ns["Description"], ns["Quota"]):
        h.update(part.encode())
    caps = ns.get("Capabilities") or {}
    for key in ("EnabledTaskDrivers", "DisabledTaskDrivers", "EnabledNetworkModes", "DisabledNetworkModes"):
        for item in caps.get(key) or []:
            h.update(str(item).encode())
    for key, value in sorted((ns.get("Meta") or {}).items()):
        h.update(str(key).encode())
        h.update(str(value).encode())
    return base64.b64encode(h.digest()).decode()


def namespace(name: str, description: str = "", **fields: Any) -> Json:
    """A namespace as Nomad's API returns it (`structs.Namespace`, every field present)."""
    ns: Json = {
        "Name": name,
        "Description": description,
        "Quota": "",
        "Capabilities": None,
        "NodePoolConfiguration": None,
        "VaultConfiguration": None,
        "ConsulConfiguration": None,
        "Meta": None,
        "Hash": "",
        "CreateIndex": 0,
        "ModifyIndex": 0,
        "RequiredExtraClaims": None,
        "OptionalExtraClaims": None,
    }
    ns.update(fields)
    ns["Hash"] = _hash(ns)
    return ns


def _problems(ns: Json) -> list[str]:
    """`Namespace.Validate` on a CE server."""
    problems = []
    if not isinstance(ns["Name"], str) or not _VALID_NAME.match(ns["Name"]):
        problems.append(f'invalid name "{ns["Name"]}". Must match regex {_VALID_NAME.pattern}')
    if len(str(ns["Description"])) > _MAX_DESCRIPTION:
        problems.append(f"description longer than {_MAX_DESCRIPTION}")
    problems += [text for key, text in _UNLICENSED.items() if ns.get(key) is not None]
    return problems


def upsert(store: StateStore, body: Any, path_name: str) -> int:
    """`POST /v1/namespace[/<name>]`: create or replace one namespace; returns the index."""
    if not isinstance(body, dict):
        raise NamespaceError(400, "Request decode failed: body must be a JSON object")
    if path_name and body.get("Name") != path_name:
        raise NamespaceError(400, "Namespace name does not match request path")
    known = {k: body[k] for k in ("Description", "Quota", "Capabilities", "Meta", *_UNLICENSED) if k in body}
    ns = namespace(str(body.get("Name") or ""), str(known.pop("Description", "") or ""), **known)
    problems = _problems(ns)
    if problems:
        raise NamespaceError(500, f'Invalid namespace "{ns["Name"]}": {multierror_text(problems)}')
    if ns["Quota"]:
        # Quotas are Enterprise; a CE server has no quota specification to name.
        raise NamespaceError(500, f'namespace "{ns["Name"]}" using non-existent quota "{ns["Quota"]}"')
    return store.upsert_namespace(ns)


def delete(store: StateStore, name: str) -> int:
    """`DELETE /v1/namespace/<name>`: refused for `default` and while it still runs anything."""
    if name == DEFAULT:
        raise NamespaceError(500, "can not delete default namespace")
    if name not in store.namespaces:
        raise NamespaceError(500, "namespace not found")
    problems = []
    if any(ns == name and job.get("Status") != "dead" for (ns, _), job in store.jobs.items()):
        problems.append(f'namespace "{name}" has non-terminal jobs in regions: [global]')
    if any(a["Namespace"] == name for a in store.live_allocs.values()):
        problems.append(f'namespace "{name}" has non-terminal allocations in regions: [global]')
    if problems:
        raise NamespaceError(500, multierror_text(problems))
    return store.delete_namespace(name)


def _go_quoted_list(items: list[str]) -> str:
    """Go's `%q` of a []string: `["a" "b"]`."""
    return "[" + " ".join(f'"{i}"' for i in items) + "]"


def admission_problems(store: StateStore, job: Json) -> list[str]:
    """`jobNamespaceConstraintCheckHook.Validate`: the namespace exists and allows the job's task
    drivers and network modes. Its first refusal, as Nomad returns only one."""
    ns = store.namespaces.get(job["Namespace"])
    if ns is None:
        return [f'job "{job["ID"]}" is in nonexistent namespace "{job["Namespace"]}"']
    caps = ns.get("Capabilities")
    if not caps:
        return []

    def allowed(value: str, enabled_key: str, disabled_key: str) -> bool:
        enabled, disabled = caps.get(enabled_key) or [], caps.get(disabled_key) or []
        return (not enabled or value in enabled) and value not in disabled

    groups = job.get("TaskGroups") or []
    drivers = [
        str(t.get("Driver"))
        for g in groups
        for t in g.get("Tasks") or []
        if not allowed(str(t.get("Driver")), "EnabledTaskDrivers", "DisabledTaskDrivers")
    ]
    if len(drivers) == 1:
        return [f'used task driver "{drivers[0]}" is not allowed in namespace "{ns["Name"]}"']
    if drivers:
        return [f'used task drivers {_go_quoted_list(drivers)} are not allowed in namespace "{ns["Name"]}"']
    modes = [
        str(n.get("Mode") or "host")
        for g in groups
        for n in g.get("Networks") or []
        if not allowed(str(n.get("Mode") or "host"), "EnabledNetworkModes", "DisabledNetworkModes")
    ]
    if len(modes) == 1:
        return [f'used group network mode "{modes[0]}" is not allowed in namespace "{ns["Name"]}"']
    if modes:
        return [
            f'used group network modes {_go_quoted_list(modes)} are not allowed in namespace "{ns["Name"]}"'
        ]
    return []
