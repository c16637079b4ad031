"""Reading a node's GPUs through NVML (pynvml, from the nvidia-ml-py package).

The pynvml module is passed in rather than imported at the call sites, so the rules here
(what makes a GPU unhealthy, what a missing counter means) are tested against a fake at the
pynvml call boundary on machines without a GPU, and `bench/gpu_check.py` exercises the real
library where there is one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("llmgw.node_agent.nvml")

# Xid codes that mean the GPU cannot be trusted with a replica until someone looks at it
# (NVIDIA's Xid catalogue: 48 double-bit ECC, 63/64 page retirement, 74 NVLink, 79 fallen off
# the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP errors).
# Application-caused Xids such as 13 or 31 are not here: a crashing engine is llmgw's watcher's
# business, not a reason to mark the hardware bad.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})


@dataclass
class GpuReading:
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_pct: int | None
    temperature_c: int | None
    ecc_uncorrected: int | None
    ecc_corrected: int | None
    retired_pages: int | None
    retired_pages_pending: bool
    xids: list[int] = field(default_factory=list)

    @property
    def unhealthy_reasons(self) -> list[str]:
        reasons = []
        if self.ecc_uncorrected:
            reasons.append(f"{self.ecc_uncorrected} uncorrected ECC errors")
        if self.retired_pages_pending:
            reasons.append("retired pages pending a reset")
        critical = sorted({x for x in self.xids if x in CRITICAL_XIDS})
        if critical:
            reasons.append("Xid " + ",".join(str(x) for x in critical))
        return reasons

    @property
    def healthy(self) -> bool:
        return not self.unhealthy_reasons


class NvmlUnavailable(RuntimeError):
    """No driver, no library, or no GPU: the node agent reports engines only."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlReader:
    """Holds an initialised NVML session and the Xid event set across readings, so Xid
    events that arrive between two readings are not lost."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML is not available: {exc}") from exc
        self._xids: dict[str, list[int]] = {}
        self._event_set: Any = None
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._register_xid_events()

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("Xid events are not available on this driver: %s", exc)
            return
        for handle in self._handles:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError as exc:
                # Not supported on some boards (and inside some containers); the other
                # health signals still work.
                log.info("Xid events not supported for a GPU: %s", exc)

    def _drain_xid_events(self) -> None:
        nvml = self._nvml
        if self._event_set is None:
            return
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    log.warning("reading Xid events failed: %s", exc)
                return
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
            except nvml.NVMLError:
                uuid = "unknown"
            self._xids.setdefault(uuid, []).append(int(data.eventData))

    def _optional(self, fn: Any, *args: Any) -> Any:
        """A counter the board does not support reads as None, not as an error: consumer
        cards have no ECC, and that must not make them look broken."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            if getattr(exc, "value", None) != self._nvml.NVML_ERROR_NOT_SUPPORTED:
                log.warning("NVML call %s failed: %s", getattr(fn, "__name__", fn), exc)
            return None

    def read(self) -> list[GpuReading]:
        nvml = self._nvml
        self._drain_xid_events()
        readings = []
        for index, handle in enumerate(self._handles):
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            utilization = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle)
            retired_dbe = self._optional(
                nvml.nvmlDeviceGetRetiredPages, handle, nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            )
            retired_sbe = self._optional(
                nvml.nvmlDeviceGetRetiredPages,
                handle,
                nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            )
            retired = (
                None
                if retired_dbe is None and retired_sbe is None
                else len(retired_dbe or []) + len(retired_sbe or [])
            )
            readings.append(
                GpuReading(
                    index=index,
                    uuid=uuid,
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_total_mib=int(memory.total) // (1024 * 1024),
                    memory_used_mib=int(memory.used) // (1024 * 1024),
                    utilization_pct=None if utilization is None else int(utilization.gpu),
                    temperature_c=self._optional(
                        nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
                    ),
                    ecc_uncorrected=self._optional(
                        nvml.nvmlDeviceGetTotalEccErrors,
                        handle,
                        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        nvml.NVML_VOLATILE_ECC,
                    ),
                    ecc_corrected=self._optional(
                        nvml.nvmlDeviceGetTotalEccErrors,
                        handle,
                        nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                        nvml.NVML_VOLATILE_ECC,
                    ),
                    retired_pages=retired,
                    retired_pages_pending=bool(
                        self._optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
                    ),
                    xids=list(self._xids.get(uuid, [])),
                )
            )
        return readings

    def close(self) -> None:
        nvml = self._nvml
        try:
            if self._event_set is not None:
                nvml.nvmlEventSetFree(self._event_set)
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
