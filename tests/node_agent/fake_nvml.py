"""A stand-in for the pynvml module at its call boundary: the same function names, constants,
error class and return shapes, with GPUs whose counters a test can change between readings."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_TEMPERATURE_GPU = 0
NVML_VOLATILE_ECC = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
nvmlEventTypeXidCriticalError = 0x8


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total_mib: int = 81559
    memory_used_mib: int = 0
    utilization: int = 0
    temperature: int = 40
    ecc_uncorrected: int | None = 0  # None: the board has no ECC (consumer cards)
    ecc_corrected: int | None = 0
    retired_dbe: list[int] = field(default_factory=list)
    retired_pending: bool = False


class FakeNVML:
    def __init__(self, gpus: list[FakeGpu], driver_loaded: bool = True) -> None:
        self.gpus = gpus
        self.driver_loaded = driver_loaded
        self.pending_xids: list[tuple[int, int]] = []  # (gpu index, xid)
        self.NVMLError = NVMLError
        for name, value in globals().items():
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, value)

    def nvmlInit(self) -> None:
        if not self.driver_loaded:
            raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.gpus[handle].name

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.gpus[handle].uuid

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self.gpus[handle]
        mib = 1024 * 1024
        used = gpu.memory_used_mib * mib
        return SimpleNamespace(
            total=gpu.memory_total_mib * mib, used=used, free=gpu.memory_total_mib * mib - used
        )

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.gpus[handle].utilization, memory=0)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return self.gpus[handle].temperature

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        gpu = self.gpus[handle]
        value = gpu.ecc_uncorrected if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else gpu.ecc_corrected
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetRetiredPages(self, handle: int, cause: int) -> list[int]:
        gpu = self.gpus[handle]
        if gpu.ecc_uncorrected is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return list(gpu.retired_dbe) if cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return 1 if self.gpus[handle].retired_pending else 0

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, event_types: int, event_set: str) -> None:
        pass

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        if not self.pending_xids:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        index, xid = self.pending_xids.pop(0)
        return SimpleNamespace(device=index, eventType=nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass
