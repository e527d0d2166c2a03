"""nvml_gpus: the GPUs NVML sees, for the tests that need two real GPUs."""

from __future__ import annotations

def nvml_gpus() -> list[tuple[str, int]]:
    """(UUID, total memory) of every GPU NVML sees."""
    import pynvml
    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            gpus.append((uuid.decode() if isinstance(uuid, bytes) else uuid, pynvml.nvmlDeviceGetMemoryInfo(h).total))
        return gpus
    finally:
        pynvml.nvmlShutdown()
