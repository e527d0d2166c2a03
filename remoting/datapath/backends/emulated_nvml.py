"""NVML on an emulated GPU: what rgpu's libnvidia-ml answers for a slice of it."""

from __future__ import annotations

import struct
from typing import Any

from rgpu.remoting.datapath.backends.base import (
    NVML_ERROR_NOT_SUPPORTED,
    SUCCESS,
    slice_usage,
)
from rgpu.remoting.datapath.backends.emulated_device import EMULATED_DRIVER_VERSION


class EmulatedNvml:
    """NVML answers for an emulated GPU; memory shows the slice."""

    emulated = True
    driver_version = EMULATED_DRIVER_VERSION

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.description = f"emulated {spec.gpu_name} (NVML)"

    def set_context(self, ctx: int) -> None:
        pass

    def _text(self, text: str, length: int) -> tuple[int, bytes]:
        data = text.encode() + b"\0"
        if len(data) > length:
            return (7, b"")  # NVML_ERROR_INSUFFICIENT_SIZE
        return (SUCCESS, data)

    def _used(self) -> int:
        from pathlib import Path
        return slice_usage(Path(self.spec.usage_dir))

    def nvmlDeviceGetMemoryInfo(self, device: int) -> tuple[int, bytes]:
        total = self.spec.memory_limit
        used = min(self._used(), total)
        return (SUCCESS, struct.pack("<QQQ", total, total - used, used))

    def nvmlDeviceGetMemoryInfo_v2(self, device: int, memory: bytes) -> tuple[int, bytes]:
        total = self.spec.memory_limit
        used = min(self._used(), total)
        return (SUCCESS, struct.pack("<IxxxxQQQQ", struct.unpack_from("<I", memory)[0], total, 0, total - used, used))

    def nvmlSystemGetDriverVersion(self, length: int) -> tuple[int, bytes]:
        return self._text("580.00.00-emulated", length)

    def nvmlDeviceGetName(self, device: int, length: int) -> tuple[int, bytes]:
        return self._text(self.spec.gpu_name, length)

    def nvmlDeviceGetUUID(self, device: int, length: int) -> tuple[int, bytes]:
        return self._text(self.spec.gpu_uuid, length)

    def nvmlDeviceGetPciInfo_v3(self, device: int) -> tuple[int, bytes]:
        bus = b"00000000:06:00.0"
        return (SUCCESS, struct.pack("<16s5I32s", bus, 0, 6, 0, 0x233510DE, 0x17FE10DE, bus))

    def nvmlDeviceGetCudaComputeCapability(self, device: int) -> tuple[int, int, int]:
        major, _, minor = self.spec.compute_capability.partition(".")
        return (SUCCESS, int(major), int(minor or 0))

    def nvmlDeviceGetUtilizationRates(self, device: int) -> tuple[int, bytes]:
        return (SUCCESS, struct.pack("<II", 0, 0))

    def nvmlDeviceGetTemperature(self, device: int, sensor: int) -> tuple[int, int]:
        return (SUCCESS, 35)

    def nvmlDeviceGetPowerUsage(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 70000)

    def nvmlDeviceGetPowerManagementLimit(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 700000)   # milliwatts, as an H200 SXM's

    def nvmlDeviceGetPowerManagementDefaultLimit(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 700000)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, device: int) -> tuple[int, int, int]:
        return (SUCCESS, 200000, 700000)

    def nvmlDeviceGetComputeMode(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 0)

    def nvmlDeviceGetPersistenceMode(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 1)

    def nvmlDeviceGetPerformanceState(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 0)

    def nvmlDeviceGetFanSpeed(self, device: int) -> tuple[int, int]:
        return (NVML_ERROR_NOT_SUPPORTED, 0)

    def close(self) -> None:
        pass
