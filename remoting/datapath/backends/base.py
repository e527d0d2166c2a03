"""What every worker backend shares: CUDA error values, the slice's memory accounting, and the
interface the worker's hand-written operations call.

A backend serves one GPU (its device 0) for one session. Generated operations call backend
methods named like the driver's exported symbols (see remoting/native/generated/api_gen.py); the methods below
carry the semantics the worker adds: memory limits, copies, module tables, launches.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Protocol

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
NOT_FOUND = cu("CUDA_ERROR_NOT_FOUND")
NOT_SUPPORTED = cu("CUDA_ERROR_NOT_SUPPORTED")
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


class SliceMemory:
    """Exact accounting of the device memory a session holds against its slice's limit.

    The worker sees every allocation, so the limit is exact: bytes as requested (pitch times
    height for pitched ones). Usage is also published in a one-word file that the slice's NVML
    sessions read, so `nvidia-smi` shows what the slice's sessions hold.
    """

    def __init__(self, limit_bytes: int, usage_file: Path | None = None) -> None:
        self.limit = limit_bytes
        self.used = 0
        self.high_water = 0
        self.sizes: dict[int, int] = {}
        self._map: mmap.mmap | None = None
        if usage_file is not None:
            usage_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(usage_file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, 8)
                self._map = mmap.mmap(fd, 8)
            finally:
                os.close(fd)
            self.usage_file = usage_file

    def check(self, size: int) -> None:
        if size > self.limit - self.used:
            raise CudaError(OUT_OF_MEMORY, (
                f"rgpu: worker: allocation of {format_bytes(size)} refused (the slice's memory limit is "
                f"{format_bytes(self.limit)} and {format_bytes(self.used)} are in use; free memory or "
                f"ask for a larger slice)"))

    def add(self, ptr: int, size: int) -> None:
        self.sizes[ptr] = size
        self.used += size
        self.high_water = max(self.high_water, self.used)
        self._publish()

    def remove(self, ptr: int) -> int:
        size = self.sizes.pop(ptr, 0)
        self.used -= size
        self._publish()
        return size

    def knows(self, ptr: int) -> bool:
        return ptr in self.sizes

    def free_bytes(self) -> int:
        return max(0, self.limit - self.used)

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


def slice_usage(folder: Path) -> int:
    """Bytes held by every live session of one slice (their usage files)."""
    total = 0
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.endswith(".used"):   # <pid>.stats files live here too (datapath/usage.py)
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
    def total_mem(self) -> int: ...
    def htod(self, dst: int, stream: int, data: memoryview, address: int) -> None: ...
    def dtoh_chunks(self, src: int, stream: int, size: int, chunk: int) -> Iterator[memoryview]: ...
    def dtod_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None: ...
    def pointer_attribute(self, attr: int, ptr: int) -> bytes: ...
    def load(self, kind: str, image: bytes, options: list[tuple[int, int]], lib_options: list[tuple[int, int]]) -> LoadResult: ...
    def get_function(self, module: int, name: str) -> FnInfo: ...
    def param_info(self, handle: int) -> FnInfo: ...
    def unload(self, kind: str, handle: int) -> None: ...
    def launch(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int], shmem: int,
               cooperative: bool, attrs: bytes, params: memoryview, params_address: int) -> None: ...
    def close(self) -> None: ...
