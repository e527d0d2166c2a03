"""What every worker backend shares: CUDA error values, the slice's memory accounting, and the
interface the worker's hand-written operations call.

A backend serves one GPU (its device 0) for one session. Generated operations call backend
methods named like the driver's exported symbols (see remoting/native/generated/api_gen.py); the methods below
carry the semantics the worker adds: memory limits, copies, module tables, launches.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from rgpu.remoting.native.apispec import SPEC_DIR, read_enums
from rgpu.units import format_bytes


@lru_cache(maxsize=1)
def enums() -> dict[str, dict[str, int]]:
    return read_enums(SPEC_DIR / "cuda_enums.txt")


def cu(name: str) -> int:
    """A CUDA constant by name, e.g. cu('CUDA_ERROR_OUT_OF_MEMORY')."""
    for table in enums().values():
        if name in table:
            return table[name]
    raise KeyError(name)


SUCCESS = 0
INVALID_VALUE = cu("CUDA_ERROR_INVALID_VALUE")
OUT_OF_MEMORY = cu("CUDA_ERROR_OUT_OF_MEMORY")
NOT_INITIALIZED = cu("CUDA_ERROR_NOT_INITIALIZED")
INVALID_CONTEXT = cu("CUDA_ERROR_INVALID_CONTEXT")
INVALID_HANDLE = cu("CUDA_ERROR_INVALID_HANDLE")
INVALID_IMAGE = cu("CUDA_ERROR_INVALID_IMAGE")
NO_BINARY_FOR_GPU = cu("CUDA_ERROR_NO_BINARY_FOR_GPU")
NOT_FOUND = cu("CUDA_ERROR_NOT_FOUND")
NOT_SUPPORTED = cu("CUDA_ERROR_NOT_SUPPORTED")
CDP_NOT_SUPPORTED = cu("CUDA_ERROR_CDP_NOT_SUPPORTED")   # dynamic parallelism under MPS
NOT_READY = cu("CUDA_ERROR_NOT_READY")
UNKNOWN = cu("CUDA_ERROR_UNKNOWN")

# NVML
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3


class CudaError(Exception):
    """A CUDA result with an optional explanation for the application's stderr."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or f"CUDA error {code}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TensorMapRequest:
    """cuTensorMapEncodeTiled, EncodeIm2col, EncodeIm2colWide or ReplaceAddress (rgpuTensorMap): the
    client's request, every array at rank 5 with unused elements zero (native/src/tensor_map.c)."""

    kind: int                  # TENSOR_MAP_TILED, _IM2COL, _IM2COL_WIDE, _REPLACE
    rank: int
    data_type: int
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int
    wide_mode: int
    address: int
    lower_w: int
    upper_w: int
    channels: int
    pixels: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]   # rank - 1 of them in use
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    lower: tuple[int, ...]     # im2col: rank - 2 in use
    upper: tuple[int, ...]
    map: bytes                 # ReplaceAddress: the map to change

    WIRE = struct.Struct("<8IQ2i2I5Q5Q5I5I5i5i128s")

    @classmethod
    def unpack(cls, buf: Any) -> TensorMapRequest:
        v = cls.WIRE.unpack_from(buf, 0)
        return cls(*v[:13], dims=v[13:18], strides=v[18:23],  # type: ignore[misc]  # mypy cannot count v[:13]
                   box=v[23:28], element_strides=v[28:33], lower=v[33:38], upper=v[38:43], map=v[43])


TENSOR_MAP_TILED, TENSOR_MAP_IM2COL, TENSOR_MAP_IM2COL_WIDE, TENSOR_MAP_REPLACE = range(4)
TENSOR_MAP_BYTES = 128


@dataclass(frozen=True)
class FnInfo:
    """A function's (or library kernel's) handle, name and parameter layout."""

    handle: int
    name: str
    params: tuple[tuple[int, int], ...]   # (offset, size) per parameter


@dataclass
class LoadResult:
    code: int = 0             # a failed load still returns its logs
    handle: int = 0
    option_values: list[int] = field(default_factory=list)
    info_log: bytes = b""
    error_log: bytes = b""
    functions: list[FnInfo] = field(default_factory=list)


# The driver's pitch for cuMemAllocPitch is at least this (an H100 gave 512 bytes for a 1-byte-wide
# request; the texture pitch alignment it reports is smaller), so the check before allocating
# assumes it, and the pitch the driver really chose is accounted after.
PITCH_ALIGN_BYTES = 512

# CUmemPool_attribute values the worker reads or models.
MEMPOOL_RELEASE_THRESHOLD, MEMPOOL_RESERVED_CURRENT, MEMPOOL_RESERVED_HIGH = 4, 5, 6
MEMPOOL_USED_CURRENT, MEMPOOL_USED_HIGH = 7, 8

# Each session's own CUDA context on the GPU (about 525 MiB measured on an H100, less under MPS),
# charged to the slice when the session opens. `RGPU_SESSION_CONTEXT_RESERVE` in the dispatcher's
# environment (bytes or a size such as 600MiB) overrides it; the emulated GPU has no context cost
# and reserves nothing unless it is set.
CONTEXT_RESERVE_BYTES = 544 << 20


def context_reserve(backend: str, environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """The device memory charged to a slice for each session's context."""
    from rgpu.units import parse_size
    text = (environ if environ is not None else os.environ).get("RGPU_SESSION_CONTEXT_RESERVE", "")
    if text.strip() == "0":
        return 0
    if text.strip():
        return parse_size(text, "RGPU_SESSION_CONTEXT_RESERVE", component="worker")
    return CONTEXT_RESERVE_BYTES if backend == "cuda" else 0


class SliceMemory:
    """Exact accounting of the device memory a slice's sessions hold against the slice's limit.

    The limit belongs to the slice, not to the session: every session opened with the slice's
    token publishes what it holds in a one-word usage file in the slice's folder, and an
    allocation is checked against the sum of all of them, under a lock on the folder, so any
    number of sessions share one budget (and `nvidia-smi` shows what the slice holds). Each
    session's context is charged up front (`reserve_bytes`), and an allocation is claimed
    (`check`) before the driver is asked and settled at its real size (`add`) or given back
    (`cancel`) after.
    """

    def __init__(self, limit_bytes: int, usage_file: Path | None = None, reserve_bytes: int = 0) -> None:
        self.limit = limit_bytes
        self.used = 0          # what this session holds: its context reservation, allocations, a pending claim
        self.high_water = 0
        self.reserved = 0
        self.pending = 0
        self.sizes: dict[int, int] = {}
        # Memory held beyond the allocations themselves, asked for before every check: what the
        # stream-ordered pool keeps after cuMemFreeAsync (set by the worker once it is used).
        self.extra = 0
        self.extra_source: Callable[[], int] | None = None
        self._map: mmap.mmap | None = None
        self._folder: Path | None = None
        if usage_file is not None:
            usage_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(usage_file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, 8)
                self._map = mmap.mmap(fd, 8)
            finally:
                os.close(fd)
            self.usage_file = usage_file
            self._folder = usage_file.parent
        if reserve_bytes:
            with self._locked():
                others = self.slice_used() - self.used
                if reserve_bytes > self.limit - others:
                    self.close()
                    raise CudaError(OUT_OF_MEMORY, (
                        f"rgpu: worker: session refused (each session's CUDA context takes "
                        f"{format_bytes(reserve_bytes)} of the slice's {format_bytes(self.limit)}, and the "
                        f"slice's other sessions hold {format_bytes(others)}; end another session of this job or "
                        f"ask for a larger slice)"))
                self.reserved = reserve_bytes
                self._grow(reserve_bytes)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The slice's folder lock: a check and its claim are one step for all of the slice's workers."""
        if self._folder is None:
            yield
            return
        fd = os.open(self._folder / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def slice_used(self) -> int:
        """What every session of the slice holds (this one's own count included)."""
        if self._folder is None:
            return self.used
        return max(self.used, slice_usage(self._folder))

    def _grow(self, size: int) -> None:
        self.used += size
        self.high_water = max(self.high_water, self.used)
        self._publish()

    def _refusal(self, size: int, what: str) -> CudaError:
        in_use = self.slice_used()
        kept = (f", {format_bytes(self.extra)} kept by the stream-ordered memory pool after cuMemFreeAsync "
                f"(cuMemPoolTrimTo or a lower release threshold gives it back)") if self.extra else ""
        return CudaError(OUT_OF_MEMORY, (
            f"rgpu: worker: {what + ': ' if what else ''}allocation of {format_bytes(size)} refused (the slice's memory "
            f"limit is {format_bytes(self.limit)}, shared by all of its sessions, and {format_bytes(in_use)} are in use, "
            f"{format_bytes(self.reserved)} of them this session's context{kept}; free memory or ask for a larger "
            f"slice)"))

    def refresh_extra(self) -> None:
        """Count what the extra source says is held now (it may have grown or shrunk)."""
        if self.extra_source is None:
            return
        now = max(0, self.extra_source())
        if now != self.extra:
            self.used += now - self.extra
            self.extra = now
            self.high_water = max(self.high_water, self.used)
            self._publish()

    def check(self, size: int, what: str = "") -> None:
        """Claim `size` bytes for an allocation about to be made; settled by add() or cancel()."""
        self.cancel()
        self.refresh_extra()
        with self._locked():
            if size > self.limit - self.slice_used():
                raise self._refusal(size, what)
            self.pending = size
            self._grow(size)

    def cancel(self) -> None:
        """Give back a claim whose allocation failed."""
        if self.pending:
            self.used -= self.pending
            self.pending = 0
            self._publish()

    def add(self, ptr: int, size: int, what: str = "") -> None:
        """Account an allocation at its real size; raises (accounting nothing) when the real size
        no longer fits, and the caller frees it."""
        extra = size - self.pending
        if extra > 0:
            with self._locked():
                if extra > self.limit - self.slice_used():
                    self.cancel()
                    raise self._refusal(size, what)
                self._grow(extra)
        else:
            self.used += extra
            self._publish()
        self.pending = 0
        self.sizes[ptr] = size

    def resize(self, key: int, size: int, what: str = "") -> None:
        """Set what `key` holds to `size`: growth is checked against the limit (raising, with
        nothing changed, when it does not fit), shrinking always succeeds."""
        grow = size - self.sizes.get(key, 0)
        if grow > 0:
            with self._locked():
                if grow > self.limit - self.slice_used():
                    raise self._refusal(grow, what)
                self._grow(grow)
        else:
            self.used += grow
            self._publish()
        if size:
            self.sizes[key] = size
        else:
            self.sizes.pop(key, None)

    def remove(self, ptr: int) -> int:
        size = self.sizes.pop(ptr, 0)
        self.used -= size
        self._publish()
        return size

    def knows(self, ptr: int) -> bool:
        return ptr in self.sizes

    def free_bytes(self) -> int:
        """What the slice (all of its sessions) has left."""
        self.refresh_extra()
        return max(0, self.limit - self.slice_used())

    def _publish(self) -> None:
        if self._map is not None:
            self._map[0:8] = struct.pack("<Q", self.used)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            try:
                self.usage_file.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def slice_usage(folder: Path) -> int:
    """Bytes held by every live session of one slice (their usage files, `<worker pid>.used`). A
    worker killed before it could remove its file holds nothing: its file is skipped, so a crash
    does not shrink the slice's budget for the rest of the lease."""
    total = 0
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.endswith(".used"):   # <pid>.stats files live here too (datapath/usage.py)
            continue
        stem = entry.name[:-len(".used")]
        if stem.isdigit() and not _alive(int(stem)):
            continue
        try:
            data = entry.read_bytes()
        except OSError:
            continue
        if len(data) >= 8:
            total += struct.unpack_from("<Q", data)[0]
    return total


class Backend(Protocol):
    """The hand-written operations a backend provides (generated ones are looked up by name)."""

    emulated: bool
    driver_version: int
    description: str

    def set_context(self, ctx: int) -> None: ...
    def mem_alloc(self, kind: str, size: int, stream: int, pool: int, height: int, elem: int) -> tuple[int, int]: ...
    def mem_free(self, ptr: int, stream: int, is_async: bool) -> None: ...
    def mem_info(self) -> tuple[int, int]: ...
    def pool_reserved(self) -> int: ...
    def total_mem(self) -> int: ...
    def htod(self, dst: int, stream: int, data: memoryview, address: int) -> None: ...
    def dtoh_chunks(self, src: int, stream: int, size: int, chunk: int) -> Iterator[memoryview]: ...
    def dtod_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None: ...
    def pointer_attribute(self, attr: int, ptr: int) -> bytes: ...
    def pointer_attributes(self, attrs: tuple[int, ...], ptr: int) -> list[bytes | None]: ...
    def load(self, kind: str, image: bytes | mmap.mmap, options: list[tuple[int, int]], lib_options: list[tuple[int, int]],
             want_table: bool = True) -> LoadResult: ...
    def get_function(self, module: int, name: str) -> FnInfo: ...
    def param_info(self, handle: int) -> FnInfo: ...
    def unload(self, kind: str, handle: int) -> None: ...
    def launch(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int], shmem: int,
               cooperative: bool, attrs: bytes, params: memoryview, params_address: int) -> None: ...
    def close(self) -> None: ...
