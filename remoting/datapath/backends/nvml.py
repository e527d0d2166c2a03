"""NVML sessions on a real GPU: NVIDIA's libnvidia-ml, called by exact symbol for the session's
GPU, except memory, which reports the slice (its limit, and what the slice's sessions hold)."""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path
from typing import Any

from rgpu.remoting.native.generated.api_gen import NVML_ARGTYPES, NvmlCalls, bind
from rgpu.remoting.datapath.backends.base import (
    NVML_ERROR_NOT_SUPPORTED,
    NVML_SUCCESS,
    CudaError,
    slice_usage,
)


class RealNvml(NvmlCalls):
    emulated = False

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        bind(self, self.lib, NVML_ARGTYPES, NVML_ERROR_NOT_SUPPORTED)
        for name, types in (("nvmlInit_v2", []), ("nvmlShutdown", []),
                            ("nvmlDeviceGetHandleByUUID", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]),
                            ("nvmlSystemGetCudaDriverVersion_v2", [ctypes.POINTER(ctypes.c_int)])):
            getattr(self.lib, name).argtypes = types
        r = self.lib.nvmlInit_v2()
        if r != NVML_SUCCESS:
            raise CudaError(r, f"rgpu: worker: NVML did not start (error {r}; check the NVIDIA driver on the GPU node)")
        handle = ctypes.c_void_p()
        r = self.lib.nvmlDeviceGetHandleByUUID(spec.gpu_uuid.encode(), ctypes.byref(handle))
        if r != NVML_SUCCESS:
            raise CudaError(r, f"rgpu: worker: NVML does not know GPU {spec.gpu_uuid} (error {r})")
        self.nvml_device = handle.value
        version = ctypes.c_int()
        self.lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version))
        self.driver_version = version.value
        self.description = f"{spec.gpu_name} (NVML)"

    def set_context(self, ctx: int) -> None:
        pass

    def _slice(self) -> tuple[int, int]:
        total = self.spec.memory_limit
        return total, min(slice_usage(Path(self.spec.usage_dir)), total)

    def nvmlDeviceGetMemoryInfo(self, device: int) -> tuple[int, bytes]:
        total, used = self._slice()
        return (NVML_SUCCESS, struct.pack("<QQQ", total, total - used, used))

    def nvmlDeviceGetMemoryInfo_v2(self, device: int, memory: bytes) -> tuple[int, bytes]:
        total, used = self._slice()
        version = struct.unpack_from("<I", memory)[0]
        return (NVML_SUCCESS, struct.pack("<IxxxxQQQQ", version, total, 0, total - used, used))

    def close(self) -> None:
        self.lib.nvmlShutdown()
