"""Nomad API JSON -> HCL jobspec, for the part of a job that llmgw renders.

The table below is the whole mapping between the two spellings (`RestartPolicy` is `restart`,
`GetterSource` is `source`, durations are nanoseconds in JSON and "30s" in HCL). A JSON field
with no entry here raises instead of being dropped, so a field added to the rendered job either
shows up in the HCL too or fails loudly in the tests.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Matched whole (fullmatch): `$` also matches before a trailing newline.
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_NS_UNITS = (("h", 3_600_000_000_000), ("m", 60_000_000_000), ("s", 1_000_000_000), ("ms", 1_000_000))


@dataclass(frozen=True)
class Field:
    hcl: str
    # attr: `name = value`; duration: nanoseconds as "30s"; map: `name { k = v }`;
    # block: one nested object; presence: the same, written even when empty (a block whose
    # being there is the setting, like a task's `consul {}`); blocks: one nested block per list item; labeled: one block per
    # item with the item's `label_key` as the block label; named: one block per map entry, the
    # key as its label; ports: Nomad's network ports.
    kind: str = "attr"
    schema: Schema | None = None
    label_key: str = "Name"


@dataclass(frozen=True)
class Schema:
    fields: dict[str, Field] = field(default_factory=dict)


def duration(ns: int) -> str:
    if ns == 0:
        return "0s"
    for unit, size in _NS_UNITS:
        if ns % size == 0:
            return f"{ns // size}{unit}"
    return f"{ns}ns"


CONSTRAINT = Schema({"LTarget": Field("attribute"), "Operand": Field("operator"), "RTarget": Field("value")})
AFFINITY = Schema(
    {
        "LTarget": Field("attribute"),
        "Operand": Field("operator"),
        "RTarget": Field("value"),
        "Weight": Field("weight"),
    }
)
DEVICE = Schema(
    {
        "Count": Field("count"),
        "Constraints": Field("constraint", "blocks", CONSTRAINT),
        "Affinities": Field("affinity", "blocks", AFFINITY),
    }
)
RESOURCES = Schema(
    {
        "CPU": Field("cpu"),
        "Cores": Field("cores"),
        "MemoryMB": Field("memory"),
        "MemoryMaxMB": Field("memory_max"),
        "Devices": Field("device", "labeled", DEVICE),
    }
)
ARTIFACT = Schema(
    {
        "GetterSource": Field("source"),
        "GetterMode": Field("mode"),
        "RelativeDest": Field("destination"),
        "GetterOptions": Field("options", "map"),
        "GetterHeaders": Field("headers", "map"),
    }
)
# A multi-node replica's leader finds its shards through a Consul `service` lookup in a template.
TEMPLATE = Schema(
    {
        "EmbeddedTmpl": Field("data"),
        "DestPath": Field("destination"),
        "Envvars": Field("env"),
        "ChangeMode": Field("change_mode"),
        "Splay": Field("splay", "duration"),
    }
)
# The fetch of a model's weights (fetch/render.py): a prestart task, and the weights cache as a
# host volume that the group asks for and the tasks mount.
LIFECYCLE = Schema({"Hook": Field("hook"), "Sidecar": Field("sidecar")})
VOLUME = Schema({"Type": Field("type"), "Source": Field("source"), "ReadOnly": Field("read_only")})
VOLUME_MOUNT = Schema(
    {"Volume": Field("volume"), "Destination": Field("destination"), "ReadOnly": Field("read_only")}
)
# The task's Consul block, empty: it is what gets the task a Consul workload identity, so that
# its template's lookups carry a token on a Consul with ACLs.
CONSUL = Schema({"Namespace": Field("namespace"), "Cluster": Field("cluster")})
TASK = Schema(
    {
        "Driver": Field("driver"),
        "Lifecycle": Field("lifecycle", "block", LIFECYCLE),
        "Config": Field("config", "map"),
        "Env": Field("env", "map"),
        "Meta": Field("meta", "map"),
        "Constraints": Field("constraint", "blocks", CONSTRAINT),
        "Artifacts": Field("artifact", "blocks", ARTIFACT),
        "Templates": Field("template", "blocks", TEMPLATE),
        "Consul": Field("consul", "presence", CONSUL),
        "VolumeMounts": Field("volume_mount", "blocks", VOLUME_MOUNT),
        "Resources": Field("resources", "block", RESOURCES),
        "KillTimeout": Field("kill_timeout", "duration"),
    }
)
CHECK = Schema(
    {
        "Name": Field("name"),
        "Type": Field("type"),
        "Path": Field("path"),
        "PortLabel": Field("port"),
        "Interval": Field("interval", "duration"),
        "Timeout": Field("timeout", "duration"),
    }
)
SERVICE = Schema(
    {
        "Name": Field("name"),
        "PortLabel": Field("port"),
        "Tags": Field("tags"),
        "Meta": Field("meta", "map"),
        "Checks": Field("check", "blocks", CHECK),
    }
)
RESTART = Schema(
    {
        "Attempts": Field("attempts"),
        "Interval": Field("interval", "duration"),
        "Delay": Field("delay", "duration"),
        "Mode": Field("mode"),
    }
)
RESCHEDULE = Schema(
    {
        "Attempts": Field("attempts"),
        "Interval": Field("interval", "duration"),
        "Delay": Field("delay", "duration"),
        "DelayFunction": Field("delay_function"),
        "MaxDelay": Field("max_delay", "duration"),
        "Unlimited": Field("unlimited"),
    }
)
UPDATE = Schema({"MaxParallel": Field("max_parallel")})
SCALING = Schema({"Min": Field("min"), "Max": Field("max"), "Enabled": Field("enabled")})
GROUP = Schema(
    {
        "Count": Field("count"),
        "Constraints": Field("constraint", "blocks", CONSTRAINT),
        "Affinities": Field("affinity", "blocks", AFFINITY),
        "Volumes": Field("volume", "named", VOLUME),
        "Scaling": Field("scaling", "block", SCALING),
        "Networks": Field("network", "ports"),
        "Services": Field("service", "blocks", SERVICE),
        "RestartPolicy": Field("restart", "block", RESTART),
        "ReschedulePolicy": Field("reschedule", "block", RESCHEDULE),
        "Update": Field("update", "block", UPDATE),
        "Meta": Field("meta", "map"),
        "ShutdownDelay": Field("shutdown_delay", "duration"),
        "Tasks": Field("task", "labeled", TASK),
    }
)
JOB = Schema(
    {
        "Type": Field("type"),
        "Namespace": Field("namespace"),
        "Region": Field("region"),
        "Datacenters": Field("datacenters"),
        "NodePool": Field("node_pool"),
        "Priority": Field("priority"),
        "Meta": Field("meta", "map"),
        "Constraints": Field("constraint", "blocks", CONSTRAINT),
        "TaskGroups": Field("group", "labeled", GROUP),
    }
)


def quote(value: str) -> str:
    """An HCL string literal. `${...}` is left alone on purpose: Nomad resolves runtime
    variables such as ${NOMAD_PORT_http} and ${meta.x} itself."""
    escaped = (
        value.replace("\\", "\\\\")
        .replace('"', '\\"')
        .replace("\n", "\\n")
        .replace("\r", "\\r")
        .replace("\t", "\\t")
        .replace("%{", "%%{")
    )
    return f'"{escaped}"'


def literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as an HCL value")


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._attrs: list[tuple[int, str, str]] = []

    def attr(self, depth: int, name: str, value: str) -> None:
        self._attrs.append((depth, name, value))

    def _flush(self) -> None:
        # `nomad fmt` aligns the `=` of consecutive attributes; so do we.
        width = max((len(n) for _, n, _ in self._attrs), default=0)
        for depth, name, value in self._attrs:
            self.lines.append(f"{'  ' * depth}{name.ljust(width)} = {value}")
        self._attrs = []

    def open(self, depth: int, header: str) -> None:
        self._flush()
        if self.lines and not self.lines[-1].endswith("{"):
            self.lines.append("")
        self.lines.append(f"{'  ' * depth}{header} {{")

    def close(self, depth: int) -> None:
        self._flush()
        if self.lines[-1].endswith("{"):
            self.lines[-1] += "}"
        else:
            self.lines.append(f"{'  ' * depth}}}")

    def text(self) -> str:
        self._flush()
        return "\n".join(self.lines) + "\n"


def _object(
    w: _Writer, depth: int, obj: dict[str, Any], schema: Schema, where: str, skip: tuple[str, ...]
) -> None:
    unknown = [k for k in obj if k not in schema.fields and k not in skip and not _empty(obj[k])]
    if unknown:
        raise ValueError(f"{where}: no HCL mapping for {', '.join(unknown)}")
    # Attributes first, then blocks, as Nomad's own examples read.
    ordered = sorted(
        (k for k in schema.fields if k in obj and _present(schema.fields[k], obj[k])),
        key=lambda k: schema.fields[k].kind not in ("attr", "duration"),
    )
    for key in ordered:
        spec = schema.fields[key]
        value = obj[key]
        path = f"{where}.{key}"
        emit = _EMITTERS[spec.kind]
        emit(w, depth, spec, value, path)


def _present(spec: Field, value: Any) -> bool:
    return value is not None if spec.kind == "presence" else not _empty(value)


def _value(value: Any, depth: int) -> str:
    text = literal(value)
    if isinstance(value, list) and len(text) > 80:
        # Long argument lists one item a line, so a diff of two renders shows which changed.
        inner = "  " * (depth + 1)
        text = "[\n" + ",\n".join(inner + literal(v) for v in value) + "\n" + "  " * depth + "]"
    return text


def _emit_attr(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    w.attr(depth, spec.hcl, _value(value, depth))


def _emit_duration(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    w.attr(depth, spec.hcl, quote(duration(int(value))))


def _emit_map(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    w.open(depth, spec.hcl)
    for key, item in value.items():
        if not _IDENT.fullmatch(key):
            raise ValueError(f"{path}: key {key!r} is not an HCL identifier")
        w.attr(depth + 1, key, _value(item, depth + 1))
    w.close(depth)


def _emit_block(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    assert spec.schema is not None
    w.open(depth, spec.hcl)
    _object(w, depth + 1, value, spec.schema, path, ())
    w.close(depth)


def _emit_blocks(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    for i, item in enumerate(value):
        _emit_block(w, depth, spec, item, f"{path}[{i}]")


def _emit_labeled(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    assert spec.schema is not None
    for i, item in enumerate(value):
        w.open(depth, f"{spec.hcl} {quote(item[spec.label_key])}")
        _object(w, depth + 1, item, spec.schema, f"{path}[{i}]", (spec.label_key,))
        w.close(depth)


def _emit_named(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    """A map of blocks keyed by their label (a group's `volume "NAME"`)."""
    assert spec.schema is not None
    for label, item in value.items():
        w.open(depth, f"{spec.hcl} {quote(label)}")
        _object(w, depth + 1, item, spec.schema, f"{path}[{label}]", ("Name",))
        w.close(depth)


def _emit_ports(w: _Writer, depth: int, spec: Field, value: Any, path: str) -> None:
    for i, network in enumerate(value):
        unknown = [k for k in network if k not in ("Mode", "DynamicPorts", "ReservedPorts") and network[k]]
        if unknown:
            raise ValueError(f"{path}[{i}]: no HCL mapping for {', '.join(unknown)}")
        w.open(depth, "network")
        if network.get("Mode"):
            w.attr(depth + 1, "mode", quote(network["Mode"]))
        for kind in ("DynamicPorts", "ReservedPorts"):
            for port in network.get(kind) or []:
                body: list[tuple[str, str]] = []
                if kind == "ReservedPorts":
                    body.append(("static", literal(port["Value"])))
                if port.get("To"):
                    body.append(("to", literal(port["To"])))
                w.open(depth + 1, f"port {quote(port['Label'])}")
                for name, text in body:
                    w.attr(depth + 2, name, text)
                w.close(depth + 1)
        w.close(depth)


_EMITTERS: dict[str, Callable[[_Writer, int, Field, Any, str], None]] = {
    "attr": _emit_attr,
    "duration": _emit_duration,
    "map": _emit_map,
    "block": _emit_block,
    "presence": _emit_block,
    "blocks": _emit_blocks,
    "labeled": _emit_labeled,
    "named": _emit_named,
    "ports": _emit_ports,
}


def job_to_hcl(job: dict[str, Any]) -> str:
    """The HCL jobspec for a Nomad API Job object."""
    w = _Writer()
    w.open(0, f"job {quote(job['ID'])}")
    skip: tuple[str, ...] = ("ID",)
    if job.get("Name", job["ID"]) == job["ID"]:
        skip = ("ID", "Name")
    elif "Name" in job:
        w.attr(1, "name", quote(job["Name"]))
        skip = ("ID", "Name")
    _object(w, 1, job, JOB, "Job", skip)
    w.close(0)
    return w.text()
