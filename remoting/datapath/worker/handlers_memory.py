"""The worker's memory handlers: allocations (counted against the slice), frees, memory info, the
stream-ordered pool, plain copies, pointer attributes, virtual memory management."""

from __future__ import annotations

import struct
from collections.abc import Callable

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, PITCH_ALIGN_BYTES, SUCCESS, CudaError
from rgpu.remoting.datapath.worker.codecs import ALLOC, COPY, HEADER, U32, U64, lp
from rgpu.remoting.datapath.worker.handler_state import HandlerState


def _on_worker_device(data: bytes, at: int) -> bytes:
    """A CUmemLocation at `at` naming a device names the application's device ordinal; the
    worker's GPU is its device 0."""
    kind, _ = struct.unpack_from("<ii", data, at)
    if kind != 1:   # CU_MEM_LOCATION_TYPE_DEVICE
        return data
    return data[:at] + struct.pack("<ii", kind, 0) + data[at + 8:]


class MemoryHandlers(HandlerState):
    """Memory and the copies that travel on the session's connection."""

    # ------------------------------------------------------------------ memory

    def h_alloc(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        what = {"plain": "cuMemAlloc", "pitch": "cuMemAllocPitch", "async": "cuMemAllocAsync",
                "pool": "cuMemAllocFromPoolAsync"}[kind]

        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            size, a, b, height, elem = ALLOC.unpack_from(p, 0)
            if kind in ("async", "pool"):
                a = self.client_streams.real(a, what)   # the stream
            assert self.memory is not None
            if kind == "pitch":
                # The GPU reserves pitch x height: claim it at the smallest pitch the driver
                # chooses, then account the pitch it chose.
                pitch = -(-max(size, 1) // PITCH_ALIGN_BYTES) * PITCH_ALIGN_BYTES
                label = f"{what} ({size} B wide x {height} rows at a pitch of at least {pitch} B)"
                self.memory.check(pitch * max(height, 1), label)
            else:
                label = what
                pooled = kind in ("async", "pool")
                if pooled:
                    self.memory.refresh_extra()
                # From the pool, what it already keeps is reused first: only the rest is new.
                self.memory.check(max(0, size - self.memory.extra) if pooled else size, what)
            try:
                ptr, pitch = self.backend.mem_alloc(kind, size, a, b, height, elem)
            except BaseException:
                self.memory.cancel()
                raise
            counted = pitch * height if kind == "pitch" else size
            if kind in ("async", "pool"):
                self.pool_allocs[ptr] = counted
                self.pool_live += counted
                self.memory.extra_source = self._pool_kept
                self.memory.refresh_extra()   # what it reused is no longer kept
            try:
                self.memory.add(ptr, counted, label)
            except CudaError:
                self.backend.mem_free(ptr, 0, False)
                if self.pool_allocs.pop(ptr, None) is not None:
                    self.pool_live -= counted
                    self.memory.refresh_extra()
                raise
            return SUCCESS, struct.pack("<QQ", ptr, pitch)
        return run

    def _pool_kept(self) -> int:
        """What the stream-ordered pool holds beyond its live allocations: freed memory it keeps
        (up to its release threshold, until trimmed) and its rounding."""
        assert self.memory is not None
        if self.backend.capture_open():   # no query that could invalidate a capture: the last figure stands
            return self.memory.extra
        try:
            reserved = self.backend.pool_reserved()
        except CudaError:
            return self.memory.extra   # unknown now: keep the last figure
        return max(0, reserved - self.pool_live)

    def h_free(self, is_async: bool) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            ptr, stream = struct.unpack_from("<QQ", p, 0)
            if is_async:
                stream = self.client_streams.real(stream, "cuMemFreeAsync")
            self.backend.mem_free(ptr, stream, is_async)
            if self.memory is not None:
                self.memory.remove(ptr)
                size = self.pool_allocs.pop(ptr, None)
                if size is not None:
                    self.pool_live -= size
                    # Freed into the pool, which may keep it: counted as kept from now, so the
                    # slice's other sessions never see room the pool still holds.
                    self.memory.refresh_extra()
            return SUCCESS, b""
        return run

    def h_mem_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        gpu_free, gpu_total = self.backend.mem_info()
        assert self.memory is not None
        total = min(self.memory.limit, gpu_total)
        free = min(self.memory.free_bytes(), gpu_free)
        return SUCCESS, struct.pack("<QQ", free, total)

    def h_pool_attribute(self, set_it: bool) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            pool, attr, value = struct.unpack_from("<QiQ", p, 0)
            out = self.backend.mem_pool_attribute(pool, attr, value, set_it)
            return SUCCESS, U64.pack(out)
        return run

    def h_htod(self, p: memoryview, address: int, seq: int) -> None:
        dst, stream, size = COPY.unpack_from(p, 0)
        stream = self.client_streams.real(stream, "cuMemcpyHtoDAsync")
        data = p[24:24 + size]
        if len(data) != size:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated host-to-device copy")
        self.backend.htod(dst, stream, data, address + 24)

    def h_dtoh(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        src, stream, size = COPY.unpack_from(p, 0)
        stream = self.client_streams.real(stream, "cuMemcpyDtoHAsync")
        for chunk in self.backend.dtoh_chunks(src, stream, size, protocol.CHUNK_BYTES):
            with self.send_lock:   # whole frames: a host node's HOST_CALL may go out between two
                self.sock.sendall(HEADER.pack(len(chunk), protocol.OP_DATA, 0, 0, 0, 0))
                self.sock.sendall(chunk)
            self.sent += protocol.HEADER_SIZE + len(chunk)
        return SUCCESS, b""

    def h_dtod_2d(self, p: memoryview, address: int, seq: int) -> None:
        dst, dpitch, src, spitch, width, height, stream = struct.unpack_from("<7Q", p, 0)
        stream = self.client_streams.real(stream, "cuMemcpy2DAsync")
        self.backend.dtod_2d(dst, dpitch, src, spitch, width, height, stream)

    def h_pointer_attribute(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        attr, ptr = struct.unpack_from("<iQ", p, 0)
        return SUCCESS, lp(self.backend.pointer_attribute(attr, ptr))

    def h_pointer_attributes(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (n,) = U32.unpack_from(p, 0)
        attrs = struct.unpack_from(f"<{n}i", p, 4)
        (ptr,) = U64.unpack_from(p, 4 + 4 * n)
        # cuPointerGetAttributes fills, rather than fails: for an attribute that failed the client
        # writes 8 zero bytes (an empty answer) and keeps no copy of it (it would not be the single query's)
        answers = self.backend.pointer_attributes(tuple(attrs), ptr)
        return SUCCESS, b"".join(lp(a if a is not None else b"") for a in answers)

    # ------------------------------------------------------------------ virtual memory management
    # A physical allocation counts against the slice from cuMemCreate until its last handle
    # (cuMemCreate's and every cuMemRetainAllocationHandle's) is released. Its key in the
    # accounting is the negated handle: device pointers are positive.

    def h_mem_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        size, flags = struct.unpack_from("<QQ", p, 0)
        prop = _on_worker_device(bytes(p[16:48]), 8)
        assert self.memory is not None
        self.memory.check(size, "cuMemCreate")
        try:
            handle = self.backend.vmm_create(size, flags, prop)
        except BaseException:
            self.memory.cancel()
            raise
        self.memory.add(-handle, size)
        self.vmm_refs[handle] = 1
        return SUCCESS, U64.pack(handle)

    def h_mem_release(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (handle,) = U64.unpack_from(p, 0)
        self.backend.vmm_release(handle)
        refs = self.vmm_refs.get(handle, 0) - 1
        if refs > 0:
            self.vmm_refs[handle] = refs
        else:
            self.vmm_refs.pop(handle, None)
            if self.memory is not None:
                self.memory.remove(-handle)
        return SUCCESS, b""

    def h_mem_retain(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (addr,) = U64.unpack_from(p, 0)
        handle = self.backend.vmm_retain(addr)
        if handle in self.vmm_refs:
            self.vmm_refs[handle] += 1
        return SUCCESS, U64.pack(handle)

    def h_mem_set_access(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        ptr, size, count = struct.unpack_from("<QQQ", p, 0)
        descs = bytes(p[24:24 + 12 * count])
        if len(descs) != 12 * count:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated cuMemSetAccess")
        descs = b"".join(_on_worker_device(descs[i:i + 12], 0) for i in range(0, len(descs), 12))
        self.backend.vmm_set_access(ptr, size, descs, count)
        return SUCCESS, b""
