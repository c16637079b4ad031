"""Simulated client nodes: a YAML fleet description turned into Nomad's Node JSON.

The JSON follows `nomad/structs/structs.go` `Node` (Go field names) and what a real client
fingerprints: the attributes every node reports, `driver.*` attributes mirrored in `Drivers`, and
`nvidia/gpu` device groups with the attributes of Nomad's NVIDIA plugin. IDs are derived from
names, so a fleet file gives the same node and GPU IDs on every run and a failing test can be
replayed exactly.

A fleet file is either a list of node entries or `{nodes: [...]}`:

    - name: gpu-h100-0          # required, unique
      datacenter: dc1           # default dc1
      node_pool: default
      node_class: h100          # default ""
      cpu_mhz: 64000            # NodeResources.Cpu.CpuShares
      cpu_cores: 64
      memory_mib: 1048576
      disk_mb: 2000000
      status: ready             # ready | down | initializing | disconnected
      eligibility: eligible     # eligible | ineligible
      drain: false              # a draining node is also ineligible, as in Nomad
      reserved: {cpu_mhz: 0, memory_mib: 0, disk_mb: 0}
      attributes: {driver.raw_exec: "1"}
      plugins: {docker: {config: {volumes: {enabled: true}}}}   # as a client's plugin "docker" block
      artifact: {http_read_timeout: 2h}   # the client's artifact block (getter.py)
      meta: {llmgw_gpu_class: h100}
      gpus:
        - model: NVIDIA H100 80GB HBM3
          memory_mib: 81559
          count: 8
          unhealthy: 1          # the last N instances report unhealthy
          lost: 0               # of the healthy ones, the last N are offered but CUDA cannot see them
          # optional: power_w, bar1_mib, driver_version, cores_clock_mhz, memory_clock_mhz,
          #           pci_bandwidth_mbs, display_state, persistence_mode
"""

from __future__ import annotations

import copy
import hashlib
import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from devstack.nomad.attributes import int_attr, string_attr
from devstack.nomad.docker import PluginConfigError, plugin_attributes
from devstack.nomad.getter import ARTIFACT_KEY, NODE_CONFIG_KEY, parse_artifact_config

Json = dict[str, Any]

NOMAD_VERSION = "2.0.5"
LOOPBACK = "127.0.0.1"
MIN_DYNAMIC_PORT = 20000
MAX_DYNAMIC_PORT = 32000
# Fixed rather than "now", so that node JSON is byte-for-byte reproducible across runs.
FINGERPRINT_TIME = "2026-01-01T00:00:00Z"

_NODE_NS = uuid.UUID("6a1f4f8e-3d2b-4c47-9a3e-6c1b4f0e9d21")

_NODE_KEYS = {
    "name", "datacenter", "node_pool", "node_class", "cpu_mhz", "cpu_cores", "memory_mib", "disk_mb",
    "status", "eligibility", "drain", "reserved", "attributes", "meta", "gpus", "http_addr", "plugins",
    "host_volumes", ARTIFACT_KEY,
}  # fmt: skip
_GPU_KEYS = {
    "model", "memory_mib", "count", "unhealthy", "lost", "power_w", "bar1_mib", "driver_version",
    "cores_clock_mhz", "memory_clock_mhz", "pci_bandwidth_mbs", "display_state", "persistence_mode",
}  # fmt: skip
_RESERVED_KEYS = {"cpu_mhz", "memory_mib", "disk_mb"}
NODE_STATUSES = ("initializing", "ready", "down", "disconnected")
ELIGIBILITIES = ("eligible", "ineligible")


class NodeSpecError(ValueError):
    """A fleet entry that cannot be turned into a node; the message names the file, the node
    and the field."""


def node_id(name: str) -> str:
    return str(uuid.uuid5(_NODE_NS, f"node/{name}"))


def gpu_id(node_name: str, model: str, index: int) -> str:
    """Shaped like an NVML UUID (`GPU-6b5fa173-5fa6-2d38-54fe-d64c1fe4fe10`)."""
    return "GPU-" + str(uuid.uuid5(_NODE_NS, f"gpu/{node_name}/{model}/{index}"))


def _int(spec: Mapping[str, Any], key: str, default: int | None, where: str, minimum: int = 0) -> int:
    value = spec.get(key, default)
    if value is None:
        raise NodeSpecError(f"{where}: '{key}' is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise NodeSpecError(f"{where}: '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise NodeSpecError(f"{where}: '{key}' must be >= {minimum}, got {value}")
    return value


def _str(spec: Mapping[str, Any], key: str, default: str, where: str) -> str:
    value = spec.get(key, default)
    if not isinstance(value, str):
        raise NodeSpecError(f"{where}: '{key}' must be a string, got {value!r}")
    return value


def _str_map(spec: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise NodeSpecError(f"{where}: '{key}' must be a mapping of strings")
    out: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
            raise NodeSpecError(f"{where}: '{key}.{k}' must be a string, got {v!r}")
        # Nomad's attributes and meta are strings; YAML turns `1` and `true` into other types.
        out[k] = str(v).lower() if isinstance(v, bool) else str(v)
    return out


def _unknown(spec: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(spec) - allowed)
    if extra:
        raise NodeSpecError(f"{where}: unknown key(s) {', '.join(map(repr, extra))}")


def _gpu_group(node_name: str, spec: Any, where: str) -> Json:
    if not isinstance(spec, Mapping):
        raise NodeSpecError(f"{where}: each gpus entry must be a mapping")
    _unknown(spec, _GPU_KEYS, where)
    model = _str(spec, "model", "", where)
    if not model:
        raise NodeSpecError(f"{where}: 'model' is required (the name NVML reports, e.g. 'NVIDIA L4')")
    memory = _int(spec, "memory_mib", None, where, minimum=1)
    count = _int(spec, "count", 1, where, minimum=1)
    unhealthy = _int(spec, "unhealthy", 0, where)
    if unhealthy > count:
        raise NodeSpecError(f"{where}: 'unhealthy' ({unhealthy}) exceeds 'count' ({count})")
    instances = []
    for i in range(count):
        healthy = i < count - unhealthy
        instances.append(
            {
                "ID": gpu_id(node_name, model, i),
                "Healthy": healthy,
                "HealthDescription": "" if healthy else "GPU is unhealthy: XID 79 (fallen off the bus)",
                "Locality": {"PciBusID": f"00000000:{0x17 + i * 0x10:02X}:00.0"},
            }
        )
    lost = _int(spec, "lost", 0, where)
    if lost > count - unhealthy:
        raise NodeSpecError(f"{where}: 'lost' ({lost}) exceeds the healthy GPUs ({count - unhealthy})")
    for instance in instances[count - unhealthy - lost : count - unhealthy]:
        instance[_LOST] = True
    attrs = {
        "memory": int_attr(memory, "MiB"),
        "power": int_attr(_int(spec, "power_w", 350, where), "W"),
        "bar1": int_attr(_int(spec, "bar1_mib", min(memory + 1024, 131072), where), "MiB"),
        "driver_version": string_attr(_str(spec, "driver_version", "550.54.15", where)),
        "cores_clock": int_attr(_int(spec, "cores_clock_mhz", 1980, where), "MHz"),
        "memory_clock": int_attr(_int(spec, "memory_clock_mhz", 2619, where), "MHz"),
        "pci_bandwidth": int_attr(_int(spec, "pci_bandwidth_mbs", 15760, where), "MB/s"),
        "display_state": string_attr(_str(spec, "display_state", "Disabled", where)),
        "persistence_mode": string_attr(_str(spec, "persistence_mode", "Enabled", where)),
    }
    return {
        "Vendor": "nvidia",
        "Type": "gpu",
        "Name": model,
        "Instances": instances,
        "Attributes": {k: v.to_json() for k, v in attrs.items()},
    }


# A GPU the device plugin still advertises as healthy but the driver no longer has (a card
# swapped under a stale fingerprint, say): Nomad hands it out, CUDA cannot see it. The mark is
# taken off the instance and kept in node meta `devstack_gpus_lost`, which no Nomad node has.
_LOST = "_lost"
LOST_GPUS_META = "devstack_gpus_lost"
# The node's GPUs as its driver has them, for the dev world's engines (devstack/fake_cuda.py).
NODE_GPUS_VAR = "LLMGW_DEVSTACK_NODE_GPUS"


def simulated_gpus_env(node: Json | None) -> dict[str, str]:
    """What a process on `node` gets beside Nomad's task env: its hardware's GPUs (healthy and
    not lost, as CUDA enumerates them), or nothing on a node without GPUs."""
    if not node:
        return {}
    lost = set(str((node.get("Meta") or {}).get(LOST_GPUS_META) or "").split(","))
    gpus = []
    for device in (node.get("NodeResources") or {}).get("Devices") or []:
        if device.get("Vendor") != "nvidia" or device.get("Type") != "gpu":
            continue
        memory = ((device.get("Attributes") or {}).get("memory") or {}).get("Int") or 0
        for instance in device.get("Instances") or []:
            if instance.get("Healthy") and instance.get("ID") not in lost:
                gpus.append({"uuid": instance["ID"], "name": device.get("Name"), "memory_mib": memory})
    return {NODE_GPUS_VAR: json.dumps(gpus)} if gpus else {}


def _drivers(attributes: Mapping[str, str]) -> Json:
    drivers: Json = {}
    for key, value in sorted(attributes.items()):
        parts = key.split(".")
        if len(parts) != 2 or parts[0] != "driver":
            continue
        detected = value.strip().lower() in ("1", "t", "true")
        drivers[parts[1]] = {
            "Attributes": None,
            "Detected": detected,
            "Healthy": detected,
            "HealthDescription": "Healthy" if detected else "Driver not detected",
            "UpdateTime": FINGERPRINT_TIME,
        }
    return drivers


def computed_class(node: Json) -> str:
    """`Node.ComputeClass` hashes the non-unique fields; any stable hash of the same inputs
    groups nodes the same way, which is all the scheduler uses the class for."""
    devices = [
        {"Vendor": d["Vendor"], "Type": d["Type"], "Name": d["Name"], "Attributes": d["Attributes"]}
        for d in node["NodeResources"]["Devices"] or []
    ]
    material = repr(
        (
            node["Datacenter"],
            sorted((k, v) for k, v in node["Attributes"].items() if not k.startswith("unique.")),
            sorted((k, v) for k, v in node["Meta"].items() if not k.startswith("unique.")),
            node["NodeClass"],
            node["NodePool"],
            repr(devices),
        )
    )
    return "v1:" + str(int.from_bytes(hashlib.sha256(material.encode()).digest()[:8], "big"))


def node_from_spec(spec: dict[str, Any]) -> Json:
    """One node from its fleet entry. Raises NodeSpecError naming the node and the field."""
    if not isinstance(spec, Mapping):
        raise NodeSpecError(f"node entry must be a mapping, got {type(spec).__name__}")
    raw_name = spec.get("name")
    if not isinstance(raw_name, str) or not raw_name:
        raise NodeSpecError("node entry: 'name' is required and must be a non-empty string")
    name = raw_name
    where = f"node {name!r}"
    _unknown(spec, _NODE_KEYS, where)

    status = _str(spec, "status", "ready", where)
    if status not in NODE_STATUSES:
        raise NodeSpecError(f"{where}: 'status' must be one of {', '.join(NODE_STATUSES)}, got {status!r}")
    eligibility = _str(spec, "eligibility", "eligible", where)
    if eligibility not in ELIGIBILITIES:
        raise NodeSpecError(f"{where}: 'eligibility' must be eligible or ineligible, got {eligibility!r}")
    drain = spec.get("drain", False)
    if not isinstance(drain, bool):
        raise NodeSpecError(f"{where}: 'drain' must be true or false")
    if drain:
        # Nomad marks a draining node ineligible for the whole drain.
        eligibility = "ineligible"

    cpu_mhz = _int(spec, "cpu_mhz", 16000, where, minimum=1)
    cores = _int(spec, "cpu_cores", max(1, cpu_mhz // 2000), where, minimum=1)
    memory_mib = _int(spec, "memory_mib", 65536, where, minimum=1)
    disk_mb = _int(spec, "disk_mb", 500000, where, minimum=1)
    reserved_spec = spec.get("reserved") or {}
    if not isinstance(reserved_spec, Mapping):
        raise NodeSpecError(f"{where}: 'reserved' must be a mapping")
    _unknown(reserved_spec, _RESERVED_KEYS, f"{where}: reserved")

    datacenter = _str(spec, "datacenter", "dc1", where)
    pool = _str(spec, "node_pool", "default", where) or "default"
    meta = _str_map(spec, "meta", where)
    given = _str_map(spec, "attributes", where)

    gpus_spec = spec.get("gpus") or []
    if not isinstance(gpus_spec, list):
        raise NodeSpecError(f"{where}: 'gpus' must be a list of device groups")
    devices = [_gpu_group(name, g, f"{where}: gpus[{i}]") for i, g in enumerate(gpus_spec)]
    models = [d["Name"] for d in devices]
    if len(set(models)) != len(models):
        raise NodeSpecError(f"{where}: gpus: one entry per model (the NVIDIA plugin groups by model)")
    lost = [i["ID"] for d in devices for i in d["Instances"] if i.pop(_LOST, False)]
    if lost:
        meta[LOST_GPUS_META] = ",".join(lost)

    host_volumes = _host_volumes(spec, where)
    http_addr = _str(spec, "http_addr", f"{LOOPBACK}:4646", where)
    attributes = {
        "arch": "x86_64",
        "cpu.arch": "amd64",
        "cpu.modelname": "AMD EPYC 9454 48-Core Processor",
        "cpu.numcores": str(cores),
        "cpu.reservablecores": str(cores),
        "cpu.frequency": str(cpu_mhz // cores),
        "cpu.totalcompute": str(cpu_mhz),
        "cpu.usablecompute": str(cpu_mhz),
        "kernel.name": "linux",
        "kernel.version": "6.8.0-45-generic",
        "memory.totalbytes": str(memory_mib * 1024 * 1024),
        "nomad.advertise.address": http_addr,
        "nomad.version": NOMAD_VERSION,
        "nomad.revision": "0000000000000000000000000000000000000000",
        "nomad.service_discovery": "true",
        "os.name": "ubuntu",
        "os.version": "22.04",
        "os.signals": "SIGABRT,SIGALRM,SIGBUS,SIGCHLD,SIGCONT,SIGHUP,SIGINT,SIGKILL,SIGQUIT,SIGTERM",
        "unique.hostname": name,
        "unique.network.ip-address": LOOPBACK,
        "unique.storage.bytesfree": str(disk_mb * 1024 * 1024),
        "unique.storage.bytestotal": str(disk_mb * 1024 * 1024),
        "unique.storage.volume": "/dev/nvme0n1p1",
    }
    try:
        attributes.update(plugin_attributes(spec.get("plugins"), where))
    except PluginConfigError as exc:
        raise NodeSpecError(str(exc)) from None
    attributes.update(given)

    node: Json = {
        "ID": node_id(name),
        "SecretID": "",
        "Datacenter": datacenter,
        "Name": name,
        "CgroupParent": "",
        "HTTPAddr": http_addr,
        "TLSEnabled": False,
        "Attributes": attributes,
        "NodeResources": {
            "Cpu": {
                "CpuShares": cpu_mhz,
                "TotalCpuCores": cores,
                "ReservableCpuCores": list(range(cores)),
            },
            "Memory": {"MemoryMB": memory_mib},
            "Disk": {"DiskMB": disk_mb},
            "Networks": [
                {
                    "Mode": "host",
                    "Device": "lo",
                    "CIDR": f"{LOOPBACK}/32",
                    "IP": LOOPBACK,
                    "MBits": 1000,
                    "DNS": None,
                    "ReservedPorts": None,
                    "DynamicPorts": None,
                    "CNI": None,
                }
            ],
            "NodeNetworks": [
                {
                    "Mode": "host",
                    "Device": "lo",
                    "MacAddress": "",
                    "Speed": 1000,
                    "Addresses": [
                        {
                            "Family": "ipv4",
                            "Alias": "default",
                            "Address": LOOPBACK,
                            "ReservedPorts": "",
                            "Gateway": "",
                        }
                    ],
                }
            ],
            "Devices": devices or None,
            "MinDynamicPort": MIN_DYNAMIC_PORT,
            "MaxDynamicPort": MAX_DYNAMIC_PORT,
        },
        "ReservedResources": {
            "Cpu": {"CpuShares": _int(reserved_spec, "cpu_mhz", 0, where), "ReservedCpuCores": None},
            "Memory": {"MemoryMB": _int(reserved_spec, "memory_mib", 0, where)},
            "Disk": {"DiskMB": _int(reserved_spec, "disk_mb", 0, where)},
            "Networks": {"ReservedHostPorts": ""},
        },
        "Links": {},
        "Meta": meta,
        "NodeClass": _str(spec, "node_class", "", where),
        "NodePool": pool,
        "ComputedClass": "",
        "DrainStrategy": (
            {
                "Deadline": 3600 * 10**9,
                "IgnoreSystemJobs": False,
                "ForceDeadline": "2026-01-01T01:00:00Z",
                "StartedAt": FINGERPRINT_TIME,
            }
            if drain
            else None
        ),
        "SchedulingEligibility": eligibility,
        "Status": status,
        "StatusDescription": "",
        "IdentitySigningKeyID": "",
        "StatusUpdatedAt": 0,
        "Events": [
            {
                "Message": "Node registered",
                "Subsystem": "Cluster",
                "Details": None,
                "Timestamp": FINGERPRINT_TIME,
                "CreateIndex": 0,
            }
        ],
        "Drivers": _drivers(attributes),
        "CSIControllerPlugins": None,
        "CSINodePlugins": None,
        "HostVolumes": host_volumes,
        "GCVolumesOnNodeGC": False,
        "HostNetworks": None,
        "LastDrain": None,
        "NodeMaxAllocs": 0,
        "LastMissedHeartbeatIndex": 0,
        "LastAllocUpdateIndex": 0,
        "CreateIndex": 0,
        "ModifyIndex": 0,
    }
    node["ComputedClass"] = computed_class(node)
    if spec.get(ARTIFACT_KEY) is not None:
        # The client's config, not the node's JSON: the server hands it to the client.
        try:
            node[NODE_CONFIG_KEY] = parse_artifact_config(spec[ARTIFACT_KEY], where)
        except ValueError as exc:
            raise NodeSpecError(str(exc)) from None
    return node


def _host_volumes(spec: Mapping[str, Any], where: str) -> Json | None:
    """`host_volume "NAME" { path = ..., read_only = ... }` of the client's config, as the node
    reports it (`Node.HostVolumes`: name -> {Path, ReadOnly}; client/config and
    nomad/structs ClientHostVolumeConfig). None when the node declares none, as Nomad's JSON has it."""
    raw = spec.get("host_volumes")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise NodeSpecError(f"{where}: 'host_volumes' must map a volume name to {{path, read_only}}")
    volumes: Json = {}
    for name, volume in raw.items():
        if not isinstance(volume, Mapping) or not str(volume.get("path") or "").startswith("/"):
            raise NodeSpecError(f"{where}: host_volumes.{name}: 'path' must be an absolute path")
        volumes[str(name)] = {"Path": str(volume["path"]), "ReadOnly": bool(volume.get("read_only", False))}
    return volumes


def load_nodes(path: str | Path) -> list[Json]:
    """Every node of a fleet file, validated; errors name the file and the node."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise NodeSpecError(f"{path}: cannot read nodes file: {exc}") from exc
    except yaml.YAMLError as exc:
        raise NodeSpecError(f"{path}: not valid YAML: {exc}") from exc
    if isinstance(data, Mapping):
        _unknown(data, {"nodes"}, str(path))
        data = data.get("nodes")
    if not isinstance(data, list) or not data:
        raise NodeSpecError(f"{path}: expected a non-empty list of nodes (or a mapping with 'nodes')")
    nodes: list[Json] = []
    seen: set[str] = set()
    for i, entry in enumerate(data):
        try:
            node = node_from_spec(entry)
        except NodeSpecError as exc:
            raise NodeSpecError(f"{path}: nodes[{i}]: {exc}") from None
        if node["Name"] in seen:
            raise NodeSpecError(f"{path}: nodes[{i}]: node {node['Name']!r} appears twice")
        seen.add(node["Name"])
        nodes.append(node)
    return nodes


def node_stub(node: Json, resources: bool = False, os: bool = False) -> Json:
    """`Node.Stub`: what `/v1/nodes` lists. `resources=true` adds NodeResources and
    ReservedResources, `os=true` adds Attributes with only `os.name`."""
    address = node.get("HTTPAddr", "").rpartition(":")[0]
    stub: Json = {
        "Address": address,
        "ID": node["ID"],
        "Datacenter": node["Datacenter"],
        "Name": node["Name"],
        "NodePool": node["NodePool"],
        "NodeClass": node["NodeClass"],
        "Version": node["Attributes"].get("nomad.version", ""),
        "Drain": node.get("DrainStrategy") is not None,
        "SchedulingEligibility": node["SchedulingEligibility"],
        "Status": node["Status"],
        "StatusDescription": node.get("StatusDescription", ""),
        "Drivers": copy.deepcopy(node.get("Drivers")),
        "HostVolumes": copy.deepcopy(node.get("HostVolumes")),
        "LastDrain": copy.deepcopy(node.get("LastDrain")),
        "CreateIndex": node.get("CreateIndex", 0),
        "ModifyIndex": node.get("ModifyIndex", 0),
    }
    if os:
        stub["Attributes"] = {"os.name": node["Attributes"].get("os.name", "")}
    if resources:
        stub["NodeResources"] = copy.deepcopy(node.get("NodeResources"))
        stub["ReservedResources"] = copy.deepcopy(node.get("ReservedResources"))
    return stub
