"""What the session server tells a worker about its session."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rgpu.slice_size import SliceLimits


@dataclass(frozen=True)
class SessionSpec:
    """What the session server tells the worker about its session (from the verified token)."""

    mode: str                 # "cuda" or "nvml"
    backend: str              # "cuda" or "emulated"
    gpu_uuid: str
    gpu_index: int
    gpu_name: str
    gpu_total_memory: int
    compute_capability: str
    memory_limit: int
    compute_percent: int
    job_key: str
    slice_number: int
    usage_dir: str            # this slice's usage files (one per CUDA session)
    server: str
    compute_enforcement: str  # "mps", "time-slicing", "isolated (rgpu limiter)" or "exclusive"
    client: dict[str, Any]
    launch_library: str = ""  # librgpu-worker.so (the native launch loop); "" runs launches in Python
    counters_dir: str = ""    # where the worker publishes its traffic counters (datapath/counters.py); "": nowhere
    sharing: str = "mps"      # how its GPU is shared (rgpu.model.SHARING_MODES)
    compute_lending: bool = False   # isolated: may use the share the GPU's idle sessions leave
    gpu_dir: str = ""         # files the workers of this GPU share (limiter loads, emulated fault domain)
    faults_dir: str = ""      # where a worker reports a sticky GPU fault and reads the verdict (faults.py)
    image_cache_dir: str = ""  # module images of this node's workers, by uid and SHA-256 (image_cache.py); "": none
    image_cache_bytes: int = 0  # its bound (all users together); 0: no cache
    transport: str = "auto"   # the dispatcher's transport setting (datapath/transport.py)
    ucx_peer: str = ""        # the client's UCX worker address (hex) from HELLO; "": it offered none
    ucx_library: str = ""     # librgpu-worker.so, whose ucx_link.c drives UCX; "": none built
    frame_stall_s: float = 30.0   # an unfinished frame's bytes may stop this long (frames.FrameProgress); 0: no limit

    def __post_init__(self) -> None:
        # The slice's bytes and percent, checked once here (InvalidRequest, one line).
        object.__setattr__(self, "limits", SliceLimits(self.memory_limit, self.compute_percent, component="worker"))

    limits: SliceLimits = field(init=False, repr=False, compare=False)

    @classmethod
    def from_json(cls, text: str) -> SessionSpec:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

