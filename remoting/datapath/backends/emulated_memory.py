"""The emulated GPU's memory: allocations, the stream-ordered pool, copies, memsets, pointer
attributes and virtual memory management (reserve, map, unmap)."""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator

from rgpu.remoting.datapath.backends.base import (
    INVALID_VALUE,
    NOT_FOUND,
    SUCCESS,
    CudaError,
    cu,
    enums,
)
from rgpu.remoting.datapath.backends.emulated_device import _ALIGN, NODE_TYPE_MEMCPY, EmulatedDevice
from rgpu.remoting.datapath.backends.emulated_objects import device_bytes


class EmulatedMemory(EmulatedDevice):
    """Linear device memory, kept in the worker's host RAM."""

    # ------------------------------------------------------------------ memory

    def mem_alloc(self, kind: str, size: int, a: int, b: int, height: int, elem: int) -> tuple[int, int]:
        self._need_ctx()
        pitch = 0
        if kind == "pitch":
            if elem not in (4, 8, 16) or size == 0 or height == 0:
                raise CudaError(INVALID_VALUE)
            pitch = (size + _ALIGN - 1) // _ALIGN * _ALIGN
            size = pitch * height
        if size == 0:
            raise CudaError(INVALID_VALUE)
        if kind == "pool" and b not in self.pools:
            raise CudaError(INVALID_VALUE)
        data = device_bytes(size)
        ptr = self.next_address
        self.next_address += (size + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN  # a gap catches overruns
        self.allocs[ptr] = data
        bisect.insort(self.bases, ptr)
        if kind in ("async", "pool"):
            self.pool.allocate(ptr, size)
        return ptr, pitch

    def mem_free(self, ptr: int, stream: int, is_async: bool) -> None:
        self._need_ctx()
        if ptr not in self.allocs:
            raise CudaError(INVALID_VALUE)
        del self.allocs[ptr]
        self.bases.remove(ptr)
        self.pool.free(ptr)

    def pool_reserved(self) -> int:
        return self.pool.reserved

    def mem_info(self) -> tuple[int, int]:
        self._need_ctx()
        used = sum(len(b) for b in self.allocs.values())
        return self.total - used, self.total

    def mem_pool_attribute(self, pool: int, attr: int, value: int, set_it: bool) -> int:
        if pool not in self.pools:
            raise CudaError(INVALID_VALUE)
        return self.pool.attribute(attr, value, set_it)

    def cuMemPoolTrimTo(self, pool: int, keep: int) -> tuple[int]:
        if pool not in self.pools:
            return (INVALID_VALUE,)
        self.pool.trim(keep)
        return (SUCCESS,)

    def htod(self, dst: int, stream: int, data: memoryview, address: int) -> None:
        self._need_ctx()
        self._refuse_capture(stream, "cuMemcpyHtoDAsync")
        buf, off = self._locate(dst, len(data))
        buf[off:off + len(data)] = data

    def device_window(self, ptr: int, size: int, stream: int, what: str) -> memoryview:
        """The emulated device's bytes [ptr, ptr+size), writable: UCX copies land there directly."""
        self._need_ctx()
        self._refuse_capture(stream, what)
        buf, off = self._locate(ptr, size)
        return memoryview(buf)[off:off + size]

    def dtoh_chunks(self, src: int, stream: int, size: int, chunk: int) -> Iterator[memoryview]:
        self._need_ctx()
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        buf, off = self._locate(src, size)
        view = memoryview(buf)
        for start in range(0, size, chunk):
            yield view[off + start:off + min(size, start + chunk)]

    def cuMemcpyDtoD_v2(self, dst: int, src: int, n: int) -> tuple[int]:
        self._need_ctx()
        sbuf, soff = self._locate(src, n)
        dbuf, doff = self._locate(dst, n)
        dbuf[doff:doff + n] = sbuf[soff:soff + n]
        return (SUCCESS,)

    def cuMemcpyDtoDAsync_v2(self, dst: int, src: int, n: int, stream: int) -> tuple[int]:
        return self._on_stream(stream, lambda: self.cuMemcpyDtoD_v2(dst, src, n), NODE_TYPE_MEMCPY)

    def _check_2d(self, ptr: int, pitch: int, row_bytes: int, height: int) -> None:
        """Every row inside one allocation, checked once before any row is touched: a height past
        the allocation (2^62 rows at pitch 0) is INVALID_VALUE, not a loop that never ends."""
        if height > 1 and pitch < row_bytes:
            raise CudaError(INVALID_VALUE)
        self._locate(ptr, pitch * (height - 1) + row_bytes)

    def dtod_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        self._need_ctx()
        if not width or not height:
            return
        self._check_2d(dst, dpitch, width, height)
        self._check_2d(src, spitch, width, height)
        for row in range(height):
            self.cuMemcpyDtoD_v2(dst + row * dpitch, src + row * spitch, width)

    def _memset(self, dst: int, pattern: bytes, count: int) -> tuple[int]:
        self._need_ctx()
        buf, off = self._locate(dst, len(pattern) * count)
        buf[off:off + len(pattern) * count] = pattern * count
        return (SUCCESS,)

    def cuMemsetD8_v2(self, dst: int, value: int, n: int) -> tuple[int]:
        return self._memset(dst, struct.pack("<B", value), n)

    def cuMemsetD16_v2(self, dst: int, value: int, n: int) -> tuple[int]:
        return self._memset(dst, struct.pack("<H", value), n)

    def cuMemsetD32_v2(self, dst: int, value: int, n: int) -> tuple[int]:
        return self._memset(dst, struct.pack("<I", value), n)

    def cuMemsetD8Async(self, dst: int, value: int, n: int, stream: int) -> tuple[int]:
        return self._on_stream(stream, lambda: self.cuMemsetD8_v2(dst, value, n))

    def cuMemsetD16Async(self, dst: int, value: int, n: int, stream: int) -> tuple[int]:
        return self._on_stream(stream, lambda: self.cuMemsetD16_v2(dst, value, n))

    def cuMemsetD32Async(self, dst: int, value: int, n: int, stream: int) -> tuple[int]:
        return self._on_stream(stream, lambda: self.cuMemsetD32_v2(dst, value, n))

    def _memset2d(self, dst: int, pitch: int, pattern: bytes, width: int, height: int) -> tuple[int]:
        self._need_ctx()
        if not width or not height:
            return (SUCCESS,)
        self._check_2d(dst, pitch, len(pattern) * width, height)
        for row in range(height):
            self._memset(dst + row * pitch, pattern, width)
        return (SUCCESS,)

    def cuMemsetD2D8_v2(self, dst: int, pitch: int, value: int, w: int, h: int) -> tuple[int]:
        return self._memset2d(dst, pitch, struct.pack("<B", value), w, h)

    def cuMemsetD2D16_v2(self, dst: int, pitch: int, value: int, w: int, h: int) -> tuple[int]:
        return self._memset2d(dst, pitch, struct.pack("<H", value), w, h)

    def cuMemsetD2D32_v2(self, dst: int, pitch: int, value: int, w: int, h: int) -> tuple[int]:
        return self._memset2d(dst, pitch, struct.pack("<I", value), w, h)

    def cuMemsetD2D8Async(self, dst: int, pitch: int, value: int, w: int, h: int, s: int) -> tuple[int]:
        return self.cuMemsetD2D8_v2(dst, pitch, value, w, h)

    def cuMemsetD2D16Async(self, dst: int, pitch: int, value: int, w: int, h: int, s: int) -> tuple[int]:
        return self.cuMemsetD2D16_v2(dst, pitch, value, w, h)

    def cuMemsetD2D32Async(self, dst: int, pitch: int, value: int, w: int, h: int, s: int) -> tuple[int]:
        return self.cuMemsetD2D32_v2(dst, pitch, value, w, h)

    def cuMemGetAddressRange_v2(self, ptr: int) -> tuple[int, int, int]:
        try:
            buf, off = self._locate(ptr, 1)
        except CudaError:
            return (NOT_FOUND, 0, 0)
        return (SUCCESS, ptr - off, len(buf))

    def pointer_attributes(self, attrs: tuple[int, ...], ptr: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        for attr in attrs:
            try:
                out.append(self.pointer_attribute(attr, ptr))
            except CudaError:
                out.append(None)
        return out

    def pointer_attribute(self, attr: int, ptr: int) -> bytes:
        try:
            buf, off = self._locate(ptr, 1)
        except CudaError:
            raise CudaError(INVALID_VALUE) from None
        names = {v: k.removeprefix("CU_POINTER_ATTRIBUTE_") for k, v in enums()["CUpointer_attribute"].items()}
        name = names.get(attr, "")
        base = ptr - off
        values = {
            "CONTEXT": struct.pack("<Q", self.current), "MEMORY_TYPE": struct.pack("<I", cu("CU_MEMORYTYPE_DEVICE")),
            "DEVICE_POINTER": struct.pack("<Q", ptr), "BUFFER_ID": struct.pack("<Q", base & 0xFFFFFFFF),
            # The driver's yes/no attributes are four-byte ints, as the runtime reads them.
            "IS_MANAGED": struct.pack("<I", 0), "DEVICE_ORDINAL": struct.pack("<i", 0), "RANGE_START_ADDR": struct.pack("<Q", base),
            "RANGE_SIZE": struct.pack("<Q", len(buf)), "MAPPED": struct.pack("<I", 1), "SYNC_MEMOPS": struct.pack("<I", 0),
            "IS_LEGACY_CUDA_IPC_CAPABLE": struct.pack("<I", 1), "ACCESS_FLAGS": struct.pack("<I", 3),
        }
        if name not in values:
            raise CudaError(INVALID_VALUE)
        return values[name]

    # ------------------------------------------------------------------ virtual memory management
    # Physical allocations are byte arrays; mapping one at a reserved address makes it the
    # allocation found there (offset 0, one allocation per mapping).

    def cuMemGetAllocationGranularity(self, prop: bytes, option: int) -> tuple[int, int]:
        return (SUCCESS, 2 << 20)

    def vmm_create(self, size: int, flags: int, prop: bytes) -> int:
        self._need_ctx()
        if size == 0 or size % (2 << 20):
            raise CudaError(INVALID_VALUE)
        handle = self.handles.new()
        self.physical[handle] = [device_bytes(size), 1]
        return handle

    def vmm_release(self, handle: int) -> None:
        entry = self.physical.get(handle)
        if entry is None:
            raise CudaError(INVALID_VALUE)
        entry[1] -= 1
        if entry[1] == 0:
            del self.physical[handle]

    def vmm_retain(self, addr: int) -> int:
        for ptr, (handle, size) in self.mappings.items():
            if ptr <= addr < ptr + size and handle in self.physical:
                self.physical[handle][1] += 1
                return handle
        raise CudaError(INVALID_VALUE)

    def vmm_set_access(self, ptr: int, size: int, descs: bytes, count: int) -> None:
        if not any(p <= ptr < p + s for p, (_, s) in self.mappings.items()):
            raise CudaError(INVALID_VALUE)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple[int, int]:
        align = max(alignment, _ALIGN)   # as the driver: the range starts on the alignment asked for
        ptr = (self.next_address + align - 1) // align * align
        if addr and addr % align == 0 and self._free_range(addr, size):
            self.reserved[addr] = size   # as the driver does for large ranges: the address asked for, when free
            return (SUCCESS, addr)
        self.next_address = ptr + (size + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
        self.reserved[ptr] = size
        return (SUCCESS, ptr)

    def _free_range(self, addr: int, size: int) -> bool:
        taken = [(b, b + len(m)) for b, m in self.allocs.items()] + [(b, b + s) for b, s in self.reserved.items()]
        return all(addr + size <= lo or addr >= hi for lo, hi in taken)

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[int]:
        return (SUCCESS,) if self.reserved.pop(ptr, None) is not None else (INVALID_VALUE,)

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple[int]:
        entry = self.physical.get(handle)
        if entry is None or offset or size != len(entry[0]) or ptr in self.allocs:
            return (INVALID_VALUE,)
        if not any(b <= ptr and ptr + size <= b + s for b, s in self.reserved.items()):
            return (INVALID_VALUE,)
        self.allocs[ptr] = entry[0]
        bisect.insort(self.bases, ptr)
        self.mappings[ptr] = (handle, size)
        return (SUCCESS,)

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[int]:
        if self.mappings.pop(ptr, None) is None:
            return (INVALID_VALUE,)
        del self.allocs[ptr]
        self.bases.remove(ptr)
        return (SUCCESS,)
