"""The NVML inventory: GPUs as the NVIDIA driver reports them (pynvml, from nvidia-ml-py)."""

from __future__ import annotations

from typing import Any

from rgpu.remoting.dispatcher.inventory.base import (
    Inventory,
    COMPONENT,
)

from rgpu.errors import ConfigError, RgpuError
from rgpu.model import GpuInfo

# --- NVML -------------------------------------------------------------------------------------

def cuda_version_string(version: int) -> str:
    """NVML reports the CUDA driver version as 1000*major + 10*minor (13000 -> "13.0")."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes; current ones return str.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _no_driver_error(exc: Exception) -> ConfigError:
    return ConfigError(COMPONENT, "no usable NVIDIA driver on this host", f"NVML: {exc}",
                       "install the NVIDIA driver (`nvidia-smi` must work), or pass --inventory FILE "
                       "to serve a static GPU list for development and demos")


class NvmlInventory:
    backend = "cuda"
    description = "NVML"

    def read(self) -> Inventory:
        try:
            import pynvml  # loaded only here, so the static path never touches libnvidia-ml
        except ImportError:
            raise ConfigError(COMPONENT, "cannot read GPUs: the pynvml module is missing",
                              "rgpu needs the nvidia-ml-py package", "pip install nvidia-ml-py") from None

        # Errors that mean "there is no driver to talk to" rather than "the driver failed".
        no_driver = tuple(getattr(pynvml, name) for name in (
            "NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission")
            if hasattr(pynvml, name))
        try:
            pynvml.nvmlInit()
        except no_driver as exc:
            raise _no_driver_error(exc) from None
        except pynvml.NVMLError as exc:
            raise RgpuError(COMPONENT, "NVML failed to start", str(exc),
                            "check the driver with `nvidia-smi`; see the kernel log (dmesg) for Xid errors") from None
        try:
            return self._query(pynvml)
        except pynvml.NVMLError as exc:
            raise RgpuError(COMPONENT, "NVML query failed", str(exc),
                            "check the GPUs with `nvidia-smi -q`; a GPU that fell off the bus needs a reset") from None
        finally:
            pynvml.nvmlShutdown()

    @staticmethod
    def _query(nvml: Any) -> Inventory:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        get_cuda = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or nvml.nvmlSystemGetCudaDriverVersion
        cuda = cuda_version_string(int(get_cuda()))
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
            gpus.append(GpuInfo(uuid=_text(nvml.nvmlDeviceGetUUID(handle)), index=index,
                                name=_text(nvml.nvmlDeviceGetName(handle)), total_memory_bytes=total,
                                usable_memory_bytes=total, compute_capability=f"{major}.{minor}"))
        if not gpus:
            raise RgpuError(COMPONENT, "NVML sees no GPUs on this host", "the driver is loaded but lists none",
                            "check `nvidia-smi -L`; run the dispatcher only on GPU nodes")
        return Inventory(driver_version=driver, cuda_version=cuda, gpus=tuple(gpus), static=False)
