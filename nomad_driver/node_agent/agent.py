"""`llmgw node-agent`: runs on every GPU node (a Nomad system job) and tells Nomad what the node
has, as dynamic node metadata that jobs constrain on and the watcher counts.

It publishes through the local Nomad client's `/v1/client/metadata`, and only what changed:
each write is batched into the node's registration by Nomad, and rewriting unchanged keys every
few seconds would wake every blocking query on the node list across the cluster.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import httpx
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from nomad_driver.endpoint import nomad_tls
from nomad_driver.node_agent.inventory import EngineInstall, EngineScanner, cached_models
from nomad_driver.node_agent.nvml import GpuReading, NvmlReader, NvmlUnavailable
from nomad_driver.node_meta import (
    ENGINES_DIR_KEY,
    FABRIC_KEY,
    GPU_CLASS_KEY,
    GPU_COUNT_KEY,
    GPUS_UNHEALTHY_KEY,
    MODELS_CACHED_KEY,
    MODELS_DIR_KEY,
    NVML_KEY,
    engine_meta_key,
)
from nomad_driver.nomad import tls_from_env

log = logging.getLogger("llmgw.node_agent")

Meta = dict[str, str | None]


DEFAULT_MODELS_DIR = Path("/opt/llmgw/models")


@dataclass
class NodeAgentConfig:
    engines_dir: Path = Path("/opt/llmgw/engines")
    models_dir: Path = DEFAULT_MODELS_DIR
    fabric: str = ""
    gpu_class: str = ""  # overrides the class derived from the GPU name
    node_id: str = ""  # empty: the node of the Nomad agent we talk to
    nomad_addr: str = field(default_factory=lambda: os.environ.get("NOMAD_ADDR", "http://127.0.0.1:4646"))
    nomad_token: str = field(default_factory=lambda: os.environ.get("NOMAD_TOKEN", ""))
    interval_s: float = 15.0

    def __post_init__(self) -> None:
        # `--models-dir ${meta.llmgw_models_dir}` (the node's own cache, as a jobspec may pass
        # it) arrives as that literal text on a node that does not set it: the default, then.
        if str(self.models_dir).startswith("${"):
            self.models_dir = DEFAULT_MODELS_DIR


@dataclass
class Inventory:
    gpus: list[GpuReading] | None  # None: NVML unavailable
    engines: list[EngineInstall]
    models: list[str]


def _with_server_name(name: str) -> Callable[[httpx.Request], None]:
    def hook(request: httpx.Request) -> None:
        request.extensions["sni_hostname"] = name

    return hook


def gpu_class_of(gpus: list[GpuReading]) -> str:
    """The most common GPU name on the node: mixed nodes exist, and the class is what
    capacity is counted under."""
    if not gpus:
        return ""
    return Counter(g.name for g in gpus).most_common(1)[0][0]


def build_meta(inventory: Inventory, config: NodeAgentConfig) -> dict[str, str]:
    meta: dict[str, str] = {ENGINES_DIR_KEY: str(config.engines_dir)}
    versions: dict[str, list[str]] = {}
    for install in inventory.engines:
        versions.setdefault(install.engine, []).append(install.version)
    for engine, found in versions.items():
        meta[engine_meta_key(engine)] = ",".join(sorted(found))
    meta[MODELS_CACHED_KEY] = ",".join(inventory.models)
    # Where `llmgw fetch` writes and the engines read (fetch/render.py): the same directory the
    # operator declares as the `llmgw-weights` host volume.
    meta[MODELS_DIR_KEY] = str(config.models_dir)
    # A `${meta.llmgw_fabric}` that Nomad could not interpolate arrives as that literal text;
    # publishing it would make every such node look like one fabric named "${meta...}".
    if config.fabric and not config.fabric.startswith("${"):
        meta[FABRIC_KEY] = config.fabric
    if inventory.gpus is None:
        meta[NVML_KEY] = "unavailable"
    else:
        meta[NVML_KEY] = "ok"
        meta[GPU_CLASS_KEY] = config.gpu_class or gpu_class_of(inventory.gpus)
        meta[GPU_COUNT_KEY] = str(len(inventory.gpus))
        meta[GPUS_UNHEALTHY_KEY] = ",".join(g.uuid for g in inventory.gpus if not g.healthy)
    return meta


def meta_changes(published: dict[str, str], wanted: dict[str, str]) -> Meta:
    """Keys to set, and keys llmgw published before but no longer has (sent as null, which
    Nomad's API takes as "unset"), so a removed engine stops attracting jobs."""
    changes: Meta = {k: v for k, v in wanted.items() if published.get(k) != v}
    for key in published:
        if key not in wanted:
            changes[key] = None
    return changes


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["uuid", "name"]
        self.nvml_available = Gauge(
            "llmgw_node_nvml_available", "1 when NVML answers on this node", registry=registry
        )
        self.gpu_healthy = Gauge("llmgw_node_gpu_healthy", "1 healthy, 0 not", labels, registry=registry)
        self.memory_total = Gauge(
            "llmgw_node_gpu_memory_total_bytes", "GPU memory", labels, registry=registry
        )
        self.memory_used = Gauge(
            "llmgw_node_gpu_memory_used_bytes", "GPU memory used", labels, registry=registry
        )
        self.utilization = Gauge(
            "llmgw_node_gpu_utilization_ratio", "GPU busy fraction", labels, registry=registry
        )
        self.temperature = Gauge(
            "llmgw_node_gpu_temperature_celsius", "GPU temperature", labels, registry=registry
        )
        self.ecc = Gauge(
            "llmgw_node_gpu_ecc_errors", "volatile ECC error count", [*labels, "type"], registry=registry
        )
        self.retired = Gauge(
            "llmgw_node_gpu_retired_pages", "retired memory pages", labels, registry=registry
        )
        self.xids = Gauge("llmgw_node_gpu_xid_events", "critical Xid events seen", labels, registry=registry)
        self.engine = Gauge(
            "llmgw_node_engine_installed",
            "verified engine installs",
            ["engine", "version"],
            registry=registry,
        )
        self.publish_errors = PromCounter(
            "llmgw_node_metadata_publish_errors", "failed writes of node metadata", registry=registry
        )

    def update(self, inventory: Inventory) -> None:
        self.nvml_available.set(0 if inventory.gpus is None else 1)
        for gauge in (self.gpu_healthy, self.memory_total, self.memory_used, self.utilization):
            gauge.clear()
        for gauge in (self.temperature, self.ecc, self.retired, self.xids, self.engine):
            gauge.clear()
        for gpu in inventory.gpus or []:
            key = (gpu.uuid, gpu.name)
            self.gpu_healthy.labels(*key).set(1 if gpu.healthy else 0)
            self.memory_total.labels(*key).set(gpu.memory_total_mib * 1024 * 1024)
            self.memory_used.labels(*key).set(gpu.memory_used_mib * 1024 * 1024)
            self.xids.labels(*key).set(len(gpu.xids))
            if gpu.utilization_pct is not None:
                self.utilization.labels(*key).set(gpu.utilization_pct / 100)
            if gpu.temperature_c is not None:
                self.temperature.labels(*key).set(gpu.temperature_c)
            if gpu.ecc_uncorrected is not None:
                self.ecc.labels(*key, "uncorrected").set(gpu.ecc_uncorrected)
            if gpu.ecc_corrected is not None:
                self.ecc.labels(*key, "corrected").set(gpu.ecc_corrected)
            if gpu.retired_pages is not None:
                self.retired.labels(*key).set(gpu.retired_pages)
        for install in inventory.engines:
            self.engine.labels(install.engine, install.version).set(1)


def load_nvml() -> ModuleType:
    import pynvml

    return pynvml


class NodeAgent:
    def __init__(
        self,
        config: NodeAgentConfig,
        nvml_loader: Callable[[], ModuleType] = load_nvml,
        http: httpx.Client | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.metrics = NodeMetrics(self.registry)
        self.scanner = EngineScanner(config.engines_dir)
        self._nvml_loader = nvml_loader
        self._nvml: NvmlReader | None = None
        self._nvml_reported = False
        self.published: dict[str, str] = {}
        headers = {"X-Nomad-Token": config.nomad_token} if config.nomad_token else {}
        verify, cert = tls_from_env(config.nomad_addr)
        server_name = nomad_tls().server_name
        self._http = http or httpx.Client(
            base_url=config.nomad_addr,
            headers=headers,
            timeout=10.0,
            verify=verify,
            cert=(cert[0], cert[1]) if cert else None,
            # NOMAD_TLS_SERVER_NAME: httpcore sends it as SNI and verifies the certificate
            # against it, as the nomad CLI does.
            event_hooks={"request": [_with_server_name(server_name)]} if server_name else None,
        )
        self._stop = threading.Event()

    def _read_gpus(self) -> list[GpuReading] | None:
        if self._nvml is None:
            try:
                self._nvml = NvmlReader(self._nvml_loader())
            except (NvmlUnavailable, ImportError, OSError) as exc:
                if not self._nvml_reported:
                    # Said once: a CPU-only node or a node whose driver is broken is a state,
                    # not an event to log every interval.
                    log.warning(
                        "no GPU information on this node (%s); publishing engines and models only", exc
                    )
                    self._nvml_reported = True
                return None
        try:
            return self._nvml.read()
        except Exception as exc:
            log.warning("reading GPUs through NVML failed, will re-initialise: %s", exc)
            self._nvml.close()
            self._nvml = None
            return None

    def inventory(self) -> Inventory:
        return Inventory(
            gpus=self._read_gpus(),
            engines=self.scanner.scan(),
            models=cached_models(self.config.models_dir),
        )

    def publish(self, changes: Meta) -> None:
        body: dict[str, object] = {"Meta": changes}
        if self.config.node_id:
            body["NodeID"] = self.config.node_id
        response = self._http.post("/v1/client/metadata", json=body)
        if response.status_code >= 400:
            raise httpx.HTTPStatusError(
                f"Nomad refused node metadata ({response.status_code}): {response.text.strip()}",
                request=response.request,
                response=response,
            )

    def run_once(self) -> Meta:
        """One pass: read, publish what changed, update metrics. Returns what was sent."""
        inventory = self.inventory()
        self.metrics.update(inventory)
        wanted = build_meta(inventory, self.config)
        changes = meta_changes(self.published, wanted)
        if not changes:
            return {}
        try:
            self.publish(changes)
        except httpx.HTTPError as exc:
            self.metrics.publish_errors.inc()
            log.warning("publishing node metadata failed, will retry next pass: %s", exc)
            return {}
        self.published = wanted
        log.info("node metadata updated: %s", ", ".join(f"{k}={v}" for k, v in sorted(changes.items())))
        return changes

    def adopt_published(self) -> None:
        """Start from what a previous run of the agent left in Nomad, so keys it published
        and this run no longer has are unset rather than left behind."""
        try:
            response = self._http.get("/v1/client/metadata", params=self._node_params())
            response.raise_for_status()
            dynamic = response.json().get("Dynamic") or {}
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("could not read this node's metadata, publishing everything: %s", exc)
            return
        self.published = {k: v for k, v in dynamic.items() if k.startswith("llmgw_") and v is not None}

    def _node_params(self) -> dict[str, str]:
        return {"node_id": self.config.node_id} if self.config.node_id else {}

    def run_forever(self) -> None:
        self.adopt_published()
        while not self._stop.is_set():
            self.run_once()
            self._stop.wait(self.config.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._nvml is not None:
            self._nvml.close()


def serve(config: NodeAgentConfig, listen: str) -> None:
    """Run the agent until SIGTERM/SIGINT, with its metrics on `listen` (HOST:PORT)."""
    import signal

    from prometheus_client import start_http_server

    host, _, port = listen.rpartition(":")
    agent = NodeAgent(config)
    start_http_server(int(port), addr=host or "127.0.0.1", registry=agent.registry)
    log.info("node agent serving metrics on %s, publishing to %s", listen, config.nomad_addr)

    def _stop(signum: int, _frame: object) -> None:
        log.info("node agent stopping on signal %d", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    agent.run_forever()
