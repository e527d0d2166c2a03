"""Domain types shared by the pool, the dispatchers and the data path. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass


# How the slices of one GPU share it (the dispatcher's `gpu_sharing`):
# - "mps": compute shares enforced by NVIDIA MPS; one fault domain for the whole GPU;
# - "isolated": one CUDA context per session without MPS (time-sliced by the driver, so a fault ends
#   only its own context), compute shares enforced by the worker's own limiter;
# - "exclusive": whole GPUs only (a slice takes 100% of it).
SHARING_MODES = ("mps", "isolated", "exclusive")
# What a request may ask for: "" (any GPU) or "strict" (only isolated or exclusive GPUs).
ISOLATION_LEVELS = ("", "strict")
STRICT_SHARING = ("isolated", "exclusive")


def isolation_allows(isolation: str, sharing: str) -> bool:
    """Whether a slice asking for `isolation` may be placed on a GPU shared as `sharing`."""
    return isolation != "strict" or sharing in STRICT_SHARING


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as a dispatcher serves it."""

    uuid: str
    index: int                    # the dispatcher's NVML index (or the inventory file's)
    name: str                     # model, e.g. "NVIDIA H200"
    total_memory_bytes: int       # physical memory
    usable_memory_bytes: int      # after RGPU_GPU_DEVICE_MEMORY_LIMIT: what slices divide
    compute_capability: str       # "9.0"
    sharing: str = "mps"          # how its slices share it: one of SHARING_MODES


@dataclass(frozen=True)
class ServerInfo:
    """A dispatcher and its GPUs as it registers with the pool."""

    address: str                  # "host:port" where it accepts data-path sessions
    hostname: str
    driver_version: str
    cuda_version: str
    gpus: tuple[GpuInfo, ...]
    static_inventory: bool = False
    version: str = ""
    data_ports: str = ""          # "45201-46225"
    compute_enforcement: str = ""  # "mps" or "time-slicing"
    launch_path: str = ""          # "native" (the workers' C launch loop) or "python (why)"


@dataclass(frozen=True)
class SliceRecord:
    """One slice of a lease: a share of one GPU on one dispatcher."""

    server: str
    gpu_uuid: str
    gpu_index: int
    gpu_name: str
    memory_limit_bytes: int
    compute_percent: int


@dataclass(frozen=True)
class LeaseRecord:
    """The slices held under one job key (a Slurm job run, or a manual request)."""

    job_key: str
    user: str
    account: str
    created_unix: float
    expires_unix: float            # 0: no expiry
    slices: tuple[SliceRecord, ...]

    @property
    def units(self) -> int:
        """GPU percent held: 100 = one whole GPU."""
        return sum(s.compute_percent for s in self.slices)

    def expired(self, now: float) -> bool:
        return bool(self.expires_unix) and now >= self.expires_unix


@dataclass(frozen=True)
class QuotaRecord:
    kind: str                      # "user" or "account"
    name: str
    limit_units: int


# A slice stands out as mostly unused when its sessions hold under this share of its memory limit
# and the limit is worth noticing: a 40 GiB slice using 2 GiB does, a 1 GiB one using 100 MiB not.
# The dashboard hatches such a slice and `rgpu-admin stats` flags it UNUSED.
UNUSED_SHARE = 0.25
UNUSED_MIN_LIMIT_BYTES = 4 << 30


def mostly_unused(limit_bytes: int, used_bytes: int) -> bool:
    return limit_bytes >= UNUSED_MIN_LIMIT_BYTES and used_bytes < UNUSED_SHARE * limit_bytes
