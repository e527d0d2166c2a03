"""The worker's hand-written handlers (contexts, memory, copies, modules, launches, session info).
Each takes (payload, payload address, seq) and returns (CUresult, reply payload), or None for
async operations. Generated handlers live in api_gen; the dispatch table is in loop.py."""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.arrays import (DESC2D, DESC3D, HOST, MEMCPY3D, RESOURCE_DESC_SIZE,
                                                    TEXTURE_DESC_SIZE, VIEW_DESC_SIZE, parse_copy, parse_desc)
from rgpu.remoting.datapath.backends.base import (CDP_NOT_SUPPORTED, INVALID_IMAGE, INVALID_VALUE, NOT_FOUND, NOT_SUPPORTED,
                                                  PITCH_ALIGN_BYTES, SUCCESS, CudaError, LoadResult, SliceMemory,
                                                  TensorMapRequest)
from rgpu.remoting.datapath.worker.client_handles import ClientEvents, ClientStreams, error_name
from rgpu.remoting.datapath.worker.codecs import (ALLOC, COPY, HEADER, LAUNCH, LAUNCH_ATTR_SIZE, MAX_MODULE_NODES,
                                                  MODULE_NODE, U32, U64, fn_bytes, fn_without_handle, lp, read_options,
                                                  take_str)
from rgpu.remoting.datapath.worker.hostcalls import HostCalls
from rgpu.remoting.datapath.worker.image_cache import (IMAGE_BY_HASH, IMAGE_BYTES, IMAGE_BYTES_TO_CACHE,
                                                           IMAGE_WANT_TABLE, ImageCache)
from rgpu.remoting.datapath.worker.local_memory import (DEFAULT_STACK_BYTES, FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                                        LIMIT_MALLOC_HEAP_SIZE, LIMIT_STACK_SIZE, ContextReserves)
from rgpu.remoting.datapath.worker.module_footprint import ImageFootprints, ImageUnreadable
from rgpu.remoting.datapath.worker.native_loop import NativeLaunches
from rgpu.remoting.datapath.worker.shared_pinned import SHARE, SHARED_COPY, SharedRegions
from rgpu.remoting.datapath.worker.spec import SessionSpec
from rgpu.units import format_bytes

log = logging.getLogger("rgpu.worker")


MAX_ARRAY_READ = 64 << 20
DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 16, 39   # one rgpuMemcpyArrayToHost request (the client sends 4 MiB pieces)


def _on_worker_device(data: bytes, at: int) -> bytes:
    """A CUmemLocation at `at` naming a device names the application's device ordinal; the
    worker's GPU is its device 0."""
    kind, _ = struct.unpack_from("<ii", data, at)
    if kind != 1:   # CU_MEM_LOCATION_TYPE_DEVICE
        return data
    return data[:at] + struct.pack("<ii", kind, 0) + data[at + 8:]


def cdp_refused_message(kind: str, spec: SessionSpec) -> str:
    """The line an application gets when the driver refuses a module that uses dynamic parallelism
    (kernels that launch kernels): NVIDIA MPS does not run those, an isolated GPU does."""
    what = "cuLibraryLoadData" if kind == "library" else "cuModuleLoadData"
    gpu = f"GPU {spec.gpu_index} ({spec.gpu_name}) of {spec.server}"
    if spec.sharing == "mps":
        return (f"rgpu: worker: {what}: this module uses CUDA dynamic parallelism (kernels that launch kernels), "
                f"which NVIDIA MPS does not support, and {gpu} is shared through MPS: ask for isolation=strict "
                f"(an isolated or exclusive GPU) to run it")
    return f"rgpu: worker: {what}: the driver of {gpu} does not support CUDA dynamic parallelism here"


class Handlers:
    """Mixed into the Worker, which owns these attributes."""

    sock: socket.socket
    send_lock: threading.Lock
    hostcalls: HostCalls
    backend: Any
    spec: SessionSpec
    memory: SliceMemory | None
    current_ctx: int | None
    vmm_refs: dict[int, int]
    graph_allocs: dict[int, int]
    native_launches: NativeLaunches | None
    image_cache: ImageCache
    footprints: ImageFootprints
    pool_allocs: dict[int, int]
    pool_live: int
    reserves: ContextReserves | None
    admitted: set[int]
    load_steps: dict[str, list[int]] | None = None   # RGPU_WORKER_PROFILE: time per module-load step
    client_events: ClientEvents
    client_streams: ClientStreams
    sent: int                                          # bytes this session sent (loop.py counts them)
    _reply: Callable[[int, int, bytes, str], None]     # the Worker's (loop.py)

    # ------------------------------------------------------------------ contexts

    def h_init(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        return SUCCESS, b""

    def h_total_mem(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        total = self.backend.total_mem()
        limit = self.memory.limit if self.memory else total
        return SUCCESS, U64.pack(min(total, limit))

    def h_primary_retain(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        ctx = self.backend.primary_ctx_retain()
        return SUCCESS, U64.pack(ctx)

    def h_ctx_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        flags, _dev, _has_params = struct.unpack_from("<IiI", p, 0)
        ctx = self.backend.ctx_create(flags)
        self.current_ctx = ctx  # a new context is current on the creating thread
        return SUCCESS, U64.pack(ctx)

    def h_ctx_destroy(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (ctx,) = U64.unpack_from(p, 0)
        self.backend.ctx_destroy(ctx)
        self.current_ctx = None  # whatever the driver made current now, set it again next time
        return SUCCESS, b""

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

    # ---- copies whose bytes travel on UCX (protocol 10; datapath/transport.py) ----

    def _ucx_copy(self, p: memoryview, name: str) -> tuple[Any, int, int, int]:
        """(the session's UCX link, device address, size, the driver's stream) of a UCX copy frame,
        or a CudaError that says what is wrong with it."""
        link = getattr(self, "ucx", None)
        if link is None:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {name} on a session that did not negotiate UCX (a client "
                            "of another rgpu version, or not rgpu's; install the same rgpu version on both sides)")
        if len(p) < protocol.UCX_COPY.size:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: truncated {name} frame ({len(p)} bytes, want "
                            f"{protocol.UCX_COPY.size}; install the same rgpu version on both sides)")
        dev, stream, size = protocol.UCX_COPY.unpack_from(p, 0)
        if not 0 < size <= self.spec.memory_limit:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {name} of {size} bytes (want 1 byte up to the slice's "
                            f"{format_bytes(self.spec.memory_limit)})")
        return link, dev, size, stream

    def _ucx_staging(self, size: int) -> Any:
        """A host buffer for a backend whose device memory the worker cannot address and that has
        no pinned buffer for the copy (_ucx_pinned): kept between copies. Bytes land here, then take
        the backend's htod (through its pinned ring); device-to-host gathers the backend's chunks
        here before sending (whole on an H100, tests/remoting/test_gpu_ucx.py, before the pinned
        buffer; the second copy kept it no faster than TCP)."""
        import ctypes
        buf = getattr(self, "_ucx_buf", None)
        if buf is None or ctypes.sizeof(buf) < size:
            buf = self._ucx_buf = (ctypes.c_char * size)()
        return buf

    def _ucx_pinned(self, size: int) -> int:
        """The backend's pinned buffer for a UCX copy of `size` bytes (the CUDA backend: its DMA goes
        straight from or into it, no second host copy), or 0: none (a backend without one, or a copy
        larger than it keeps), then the bytes take _ucx_staging."""
        buffer = getattr(self.backend, "ucx_buffer", None)
        return buffer(size) if buffer is not None else 0

    def h_htod_ucx(self, p: memoryview, address: int, seq: int) -> None:
        """Protocol 15: the bytes come in chunks (protocol.ucx_chunks); on a GPU each chunk's DMA is
        queued the moment it is in, so PCIe moves one chunk while the next arrives."""
        import ctypes
        link, dst, size, stream = self._ucx_copy(p, "rgpuMemcpyHtoDUcx")
        fd = self.sock.fileno()
        chunks = protocol.ucx_chunks(size)
        try:
            real = self.client_streams.real(stream, "cuMemcpyHtoDAsync")
            window = getattr(self.backend, "device_window", None)
            target = window(dst, size, real, "cuMemcpyHtoDAsync") if window is not None else None
        except CudaError:
            # The client sends the bytes whatever the answer: take them off the wire (truncated into
            # a scratch word), so the next copy's messages are not mistaken for this one's.
            scratch = ctypes.c_uint64()
            for i, _at, _n in chunks:
                try:
                    link.recv(protocol.ucx_tag(seq, i), ctypes.addressof(scratch), ctypes.sizeof(scratch), fd)
                except CudaError:
                    pass
            raise
        if target is not None:   # the emulated device: straight into its memory
            holder = (ctypes.c_char * size).from_buffer(target)
            base = ctypes.addressof(holder)
            for i, at, n in chunks:
                link.recv(protocol.ucx_tag(seq, i), base + at, n, fd)
            del holder
        elif (pinned := self._ucx_pinned(size)):   # a real GPU: into pinned memory, a DMA per chunk from there
            for i, at, n in chunks:
                link.recv(protocol.ucx_tag(seq, i), pinned + at, n, fd)
                self.backend.htod_ucx(dst + at, real, n, at)
        else:
            staging = self._ucx_staging(size)
            base, view = ctypes.addressof(staging), memoryview(staging).cast("B")
            for i, at, n in chunks:
                link.recv(protocol.ucx_tag(seq, i), base + at, n, fd)
                self.backend.htod(dst + at, real, view[at:at + n], base + at)
            del view
        self.ucx_received = getattr(self, "ucx_received", 0) + size

    def h_dtoh_ucx(self, p: memoryview, address: int, seq: int) -> None:
        """Protocol 15: the bytes go in chunks; on a GPU every chunk's DMA is queued at once and each
        chunk is sent the moment its DMA is done, so the network moves one while PCIe fills the next."""
        import ctypes
        link, src, size, stream = self._ucx_copy(p, "rgpuMemcpyDtoHUcx")
        real = self.client_streams.real(stream, "cuMemcpyDtoHAsync")
        chunks = protocol.ucx_chunks(size)
        window = getattr(self.backend, "device_window", None)
        ready: Any = ((at, n) for _, at, n in chunks)
        if window is not None:
            holder: Any = (ctypes.c_char * size).from_buffer(window(src, size, real, "cuMemcpyDtoHAsync"))
        elif (pinned := self._ucx_pinned(size)):   # a real GPU: DMAs into pinned memory, sent from there
            holder = (ctypes.c_char * size).from_address(pinned)
            ready = self.backend.dtoh_ucx_chunks(src, real, size, protocol.UCX_CHUNK_BYTES)
        else:
            holder = self._ucx_staging(size)
            view, at = memoryview(holder).cast("B"), 0
            for chunk in self.backend.dtoh_chunks(src, real, size, protocol.CHUNK_BYTES):
                view[at:at + len(chunk)] = chunk
                at += len(chunk)
            del view
        # Each chunk's send is posted (the client's receives are), the REPLY on TCP after the first;
        # the sends complete once the client, having read the reply, takes them.
        base, sends, replied, why = ctypes.addressof(holder), [], False, ""
        try:
            for i, (at, n) in enumerate(ready):
                sends.append((link.post_send(protocol.ucx_tag(seq, i), base + at, n), n))
                if not replied:
                    self._reply(seq, SUCCESS, b"", "")
                    replied = True
        except CudaError as exc:
            if not replied:
                raise            # nothing was sent: the client gets the error
            why = exc.message    # the client was told success: the session cannot go on truthfully
        for req, n in sends:
            why = link.finish_send(req, n, self.sock.fileno()) or why
        del holder
        if why:
            log.error("rgpu: worker: a device-to-host copy over UCX failed after its reply (%s); ending the session", why)
            raise ConnectionError(why)
        self.sent += size
        return None

    # ---- same-host page-locked memory read in place (protocol 15; worker/shared_pinned.py) ----

    def _shared(self) -> SharedRegions:
        regions: SharedRegions | None = getattr(self, "shared_regions", None)
        if regions is None:
            regions = self.shared_regions = SharedRegions(self.spec.client.get("uid"),
                                                          getattr(self.backend, "host_register", None),
                                                          getattr(self.backend, "host_unregister", None))
        return regions

    def h_host_share(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        size, nonce = SHARE.unpack_from(p, 0)
        if not hasattr(self.backend, "device_window") and not hasattr(self.backend, "htod_host"):
            raise CudaError(NOT_SUPPORTED, "")   # a backend that cannot copy from host memory in place
        if size == 0:
            return SUCCESS, self._shared().socket_name()
        return SUCCESS, U64.pack(self._shared().add(size, nonce))

    def h_host_unshare(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (region,) = U64.unpack_from(p, 0)
        self._shared().remove(region)
        return SUCCESS, b""

    def h_htod_shared(self, wait: bool) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            dst, stream, region, offset, size = SHARED_COPY.unpack_from(p, 0)
            at, host = self._shared().span(region, offset, size, "cuMemcpyHtoD from shared page-locked memory")
            real = self.client_streams.real(stream, "cuMemcpyHtoDAsync")
            window = getattr(self.backend, "device_window", None)
            if window is not None:   # the emulated device: from the client's pages into its memory
                window(dst, size, real, "cuMemcpyHtoDAsync")[:] = host
            else:                    # a GPU: one DMA from the client's registered pages
                self.backend.htod_host(dst, real, at, size, wait)
            del host
            self.shared_bytes = getattr(self, "shared_bytes", 0) + size
            return SUCCESS, b""
        return run

    def h_dtoh_shared(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        src, stream, region, offset, size = SHARED_COPY.unpack_from(p, 0)
        at, host = self._shared().span(region, offset, size, "cuMemcpyDtoH into shared page-locked memory")
        real = self.client_streams.real(stream, "cuMemcpyDtoHAsync")
        window = getattr(self.backend, "device_window", None)
        if window is not None:
            host[:] = window(src, size, real, "cuMemcpyDtoHAsync")
        else:
            self.backend.dtoh_host(src, real, at, size)
        del host
        self.shared_bytes = getattr(self, "shared_bytes", 0) + size
        return SUCCESS, b""

    # ---- copies whose bytes come striped over the session's data lanes (protocol 12; worker/lanes.py) ----

    def _striped_copy(self, p: memoryview, name: str, close_if_truncated: bool) -> tuple[Any, tuple[int, int, int, int]]:
        """The session's lanes and a striped copy's (address, stream, size, chunk), or the CudaError
        that refuses the frame (no lanes, a truncated frame, sizes the lanes refuse)."""
        lanes = getattr(self, "lanes", None)
        if lanes is None:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: {name} on a session that has no data lanes (a client of "
                                           "another rgpu version, or not rgpu's; install the same rgpu version on "
                                           "both sides)")
        if len(p) < protocol.LANES_COPY.size:
            if close_if_truncated:
                lanes.close("a truncated striped copy frame")
            raise CudaError(INVALID_VALUE, f"rgpu: worker: truncated {name} frame ({len(p)} bytes, want "
                                           f"{protocol.LANES_COPY.size}; install the same rgpu version on both sides)")
        fields = protocol.LANES_COPY.unpack_from(p, 0)
        lanes.check(fields[2], fields[3])
        return lanes, fields

    def h_htod_lanes(self, p: memoryview, address: int, seq: int) -> None:
        import ctypes
        lanes, (dst, stream, size, chunk) = self._striped_copy(p, "rgpuMemcpyHtoDLanes", close_if_truncated=True)
        try:
            if size > self.spec.memory_limit:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: a host-to-device copy of {size} bytes (more than the "
                                               f"slice's {format_bytes(self.spec.memory_limit)})")
            real = self.client_streams.real(stream, "cuMemcpyHtoDAsync")
            striped = getattr(self.backend, "htod_lanes", None)
            window = getattr(self.backend, "device_window", None)
            target = None if striped is not None or window is None else window(dst, size, real, "cuMemcpyHtoDAsync")
        except CudaError:
            lanes.receive(seq, size, chunk, 0)   # the client sends the bytes whatever the answer: drop them
            raise
        if striped is not None:   # a real GPU: through pinned staging, each chunk's copy queued as it lands
            striped(dst, real, size, chunk, seq, lanes)
        elif target is not None:   # the emulated device: straight into its memory
            holder = (ctypes.c_char * size).from_buffer(target)
            try:
                lanes.receive(seq, size, chunk, ctypes.addressof(holder))
            finally:
                del holder
        else:
            lanes.receive(seq, size, chunk, 0)
            raise CudaError(NOT_SUPPORTED, "rgpu: worker: this backend cannot take striped copies")

    def h_dtoh_lanes(self, p: memoryview, address: int, seq: int) -> None:
        """The REPLY goes first (an error: nothing follows on the lanes), then the bytes, striped."""
        import ctypes
        lanes, (src, stream, size, chunk) = self._striped_copy(p, "rgpuMemcpyDtoHLanes", close_if_truncated=False)
        if size > self.spec.memory_limit:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: a device-to-host copy of {size} bytes (more than the "
                                           f"slice's {format_bytes(self.spec.memory_limit)})")
        real = self.client_streams.real(stream, "cuMemcpyDtoHAsync")
        striped = getattr(self.backend, "dtoh_lanes", None)
        if striped is not None:   # a real GPU: through pinned staging, each chunk sent as its copy completes
            gpu = striped(src, real, size, chunk, lanes)
            self._reply(seq, SUCCESS, b"", "")
            why = lanes.send(seq, size, chunk, 0, gpu)
        else:
            window = getattr(self.backend, "device_window", None)
            if window is None:
                raise CudaError(NOT_SUPPORTED, "rgpu: worker: this backend cannot send striped copies")
            holder = (ctypes.c_char * size).from_buffer(window(src, size, real, "cuMemcpyDtoHAsync"))
            self._reply(seq, SUCCESS, b"", "")
            try:
                why = lanes.send(seq, size, chunk, ctypes.addressof(holder))
            finally:
                del holder
        if why:   # the client was told success and reads its lanes: it sees them fail too
            log.warning("rgpu: worker: a device-to-host copy of %d bytes over data lanes failed (%s); the session's "
                        "lanes are closed, its later copies use its one connection", size, why)
        return None

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

    # ------------------------------------------------------------------ arrays, texture and surface objects
    # Every array counts against the slice from its creation until it is destroyed, at the footprint
    # the backend gives (the driver's own figure where it can say, cuda.py). Keys in the accounting
    # lie below -2**64, apart from device pointers (positive) and VMM handles (negated).

    @staticmethod
    def _array_key(kind: str, handle: int) -> int:
        return -((2 if kind == "mipmapped" else 1) << 64) - handle

    def h_array_create(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        what = {"2d": "cuArrayCreate", "3d": "cuArray3DCreate", "mipmapped": "cuMipmappedArrayCreate"}[kind]

        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            (levels,) = U32.unpack_from(p, 0)
            size = DESC2D.size if kind == "2d" else DESC3D.size
            if len(p) < 8 + size:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: truncated {what} request")
            desc = parse_desc(bytes(p[8:8 + size]), kind != "2d")
            levels = levels if kind == "mipmapped" else 1
            if not 1 <= levels <= desc.max_levels():
                raise CudaError(INVALID_VALUE, f"rgpu: worker: {what}: {levels} mipmap levels for a "
                                               f"{desc.width} x {desc.height} x {desc.depth} array (at most "
                                               f"{desc.max_levels()})")
            footprint = self.backend.array_footprint(desc, levels)
            label = (f"{what} ({desc.width} x {desc.height} x {desc.depth}, format {desc.format:#x} x {desc.channels}"
                     + (f", {levels} levels" if kind == "mipmapped" else "") + ")")
            assert self.memory is not None
            self.memory.check(footprint, label)
            try:
                handle = self.backend.array_create(kind, desc, levels)
            except BaseException:
                self.memory.cancel()
                raise
            self.memory.add(self._array_key(kind, handle), footprint, label)
            return SUCCESS, U64.pack(handle)
        return run

    def h_array_destroy(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            (handle,) = U64.unpack_from(p, 0)
            self.backend.array_destroy(kind, handle)
            if self.memory is not None:
                self.memory.remove(self._array_key(kind, handle))
            return SUCCESS, b""
        return run

    def h_tex_object_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        at = RESOURCE_DESC_SIZE + TEXTURE_DESC_SIZE
        if len(p) < at + 8 + VIEW_DESC_SIZE:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated cuTexObjectCreate request")
        (has_view,) = U32.unpack_from(p, at)
        view = bytes(p[at + 8:at + 8 + VIEW_DESC_SIZE]) if has_view else None
        handle = self.backend.tex_object_create(bytes(p[:RESOURCE_DESC_SIZE]), bytes(p[RESOURCE_DESC_SIZE:at]), view)
        return SUCCESS, U64.pack(handle)

    @staticmethod
    def _array_copy(p: memoryview, to_host: bool) -> tuple[int, int, bytes, int]:
        """(kind, stream, descriptor, packed host bytes) of rgpuMemcpyArray / ...ToHost. The host side
        (the request's data, or the worker's buffer for the reply) must be exactly the packed box:
        a pitch or offset past it would have the driver read or write the worker's own memory."""
        kind, _, stream = struct.unpack_from("<IIQ", p, 0)
        desc = bytes(p[16:16 + MEMCPY3D.size])
        if len(desc) != MEMCPY3D.size or kind not in (0, 1, 2):
            raise CudaError(INVALID_VALUE, "rgpu: worker: malformed 2D/3D copy request")
        c = parse_copy(desc)
        depth = c.depth if kind == 2 else 1
        host = c.dst if to_host else c.src
        packed = c.width * c.height * depth
        if host.kind == HOST and (host.x or host.y or host.pitch != c.width or
                                  (kind == 2 and (host.z or host.lod or host.height != c.height))):
            raise CudaError(INVALID_VALUE, "rgpu: worker: a 2D/3D copy's host side is not its packed data")
        if c.dst.kind == HOST if not to_host else (c.dst.kind != HOST or c.src.kind == HOST):
            raise CudaError(INVALID_VALUE, "rgpu: worker: a 2D/3D copy request names the wrong host side")
        return kind, stream, desc, packed if host.kind == HOST else 0

    def h_memcpy_array(self, p: memoryview, address: int, seq: int) -> None:
        """A 2D/3D copy with no host side, or with this request's data as its (packed) source."""
        kind, stream, desc, packed = self._array_copy(p, to_host=False)
        stream = self.client_streams.real(stream, "a 2D/3D copy")
        (size,) = U64.unpack_from(p, 16 + MEMCPY3D.size)
        at = 24 + MEMCPY3D.size
        data = p[at:at + size]
        if len(data) != size or size != packed:
            raise CudaError(INVALID_VALUE, "rgpu: worker: a 2D/3D copy's data does not match its extent")
        self.backend.memcpy_array(kind, desc, stream, data, address + at)

    def h_memcpy_array_to_host(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """A 2D/3D copy into the client's memory: the packed rows come back as DATA frames."""
        kind, stream, desc, packed = self._array_copy(p, to_host=True)
        stream = self.client_streams.real(stream, "a 2D/3D copy to this process")
        if packed > MAX_ARRAY_READ:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: a 2D/3D copy of {format_bytes(packed)} to the client refused "
                                           f"(at most {format_bytes(MAX_ARRAY_READ)} a request; rgpu's client library "
                                           "sends pieces of 4 MiB: install the same rgpu version on both sides)")
        data = memoryview(self.backend.memcpy_array_to_host(kind, desc, stream))
        for start in range(0, len(data), protocol.CHUNK_BYTES):
            chunk = data[start:start + protocol.CHUNK_BYTES]
            self.sock.sendmsg([HEADER.pack(len(chunk), protocol.OP_DATA, 0, 0, 0, 0), chunk])
            self.sent += protocol.HEADER_SIZE + len(chunk)
        return SUCCESS, b""

    # ------------------------------------------------------------------ modules

    def _load_reply(self, res: LoadResult, with_functions: bool) -> bytes:
        parts = [U64.pack(res.handle), U32.pack(len(res.option_values))]
        parts.extend(U64.pack(v & 0xFFFFFFFFFFFFFFFF) for v in res.option_values)
        parts += [lp(res.info_log), lp(res.error_log)]
        if with_functions:
            parts.append(U32.pack(len(res.functions)))
            parts.extend(fn_bytes(fn) for fn in res.functions)
        return b"".join(parts)

    def h_load(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            options, off = read_options(p, 0)
            lib_options, off = read_options(p, off)
            (size,) = U64.unpack_from(p, off)
            how, want_table = p[off + 8] & ~IMAGE_WANT_TABLE, bool(p[off + 8] & IMAGE_WANT_TABLE)
            digest = bytes(p[off + 9:off + 41])
            off += 41
            if how not in (IMAGE_BYTES, IMAGE_BY_HASH, IMAGE_BYTES_TO_CACHE) or len(digest) != 32:
                raise CudaError(INVALID_VALUE, "rgpu: worker: a module load names its image in no way this worker "
                                "knows (install the same rgpu version on the CPU and GPU nodes)")
            checked = False   # whether `digest` is the image's, as the worker computed it
            step = self._load_step
            t = step("", 0)
            if how == IMAGE_BY_HASH:
                image = self.image_cache.get(digest)
                if image is None or len(image) != size:
                    return SUCCESS, b""   # not cached here: the client sends the bytes
                checked = True
            else:
                image = bytes(p[off:off + size])
                if how == IMAGE_BYTES_TO_CACHE:
                    checked = self.image_cache.put(digest, image)
            t = step("image from the cache" if how == IMAGE_BY_HASH else "image from the wire (stored)"
                     if checked else "image from the wire", t, len(image))
            # The module's variables live in device memory from the load on: charged first.
            footprint, label = self._module_footprint(kind, image, digest if checked else None)
            t = step("footprint", t)
            try:
                res = self.backend.load(kind, image, options, lib_options, want_table)
                step("driver load and function table", t)
            except BaseException:
                if footprint and self.memory is not None:
                    self.memory.cancel()
                raise
            code = getattr(res, "code", SUCCESS)
            if footprint and self.memory is not None:
                if code == SUCCESS:
                    self.memory.add(self._module_key(kind, res.handle), footprint, label)
                else:
                    self.memory.cancel()
            if code == CDP_NOT_SUPPORTED:
                raise CudaError(code, cdp_refused_message(kind, self.spec))
            return code, self._load_reply(res, code == SUCCESS)
        return run

    def _load_step(self, name: str, since: int, image_bytes: int = 0) -> int:
        """RGPU_WORKER_PROFILE: time spent in each step of module loads (`load_steps` in the profile)."""
        now = time.perf_counter_ns()
        if self.load_steps is not None and name:
            entry = self.load_steps.setdefault(name, [0, 0, 0])
            entry[0] += 1
            entry[1] += now - since
            entry[2] += image_bytes
        return now

    @staticmethod
    def _module_key(kind: str, handle: int) -> int:
        return -((4 if kind == "library" else 3) << 64) - handle

    def _module_footprint(self, kind: str, image: bytes | mmap.mmap, digest: bytes | None) -> tuple[int, str]:
        """The device memory the image's variables take, claimed against the slice (0: nothing
        claimed); an image whose variables cannot be counted is refused."""
        what = "cuLibraryLoadData" if kind == "library" else "cuModuleLoadData"
        try:
            footprint = self.footprints.of(image, digest)
        except ImageUnreadable as exc:
            raise CudaError(INVALID_IMAGE, f"rgpu: worker: {what} refused: the memory its variables take cannot be "
                            f"counted against the slice ({exc}); load a cubin, PTX or fatbin made by nvcc, NVRTC or "
                            f"nvJitLink") from None
        label = f"{what} (the module's __device__ and __constant__ variables take {format_bytes(footprint)})"
        if footprint and self.memory is not None:
            self.memory.check(footprint, label)
        return footprint, label

    def h_get_function(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (module,) = U64.unpack_from(p, 0)
        name, _ = take_str(p, 8)
        return SUCCESS, fn_bytes(self.backend.get_function(module, name))

    def h_param_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (handle,) = U64.unpack_from(p, 0)
        return SUCCESS, fn_without_handle(self.backend.param_info(handle))

    def h_unload(self, kind: str) -> Callable[[memoryview, int, int], tuple[int, bytes]]:
        def run(p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
            (handle,) = U64.unpack_from(p, 0)
            self.backend.unload(kind, handle)
            if self.memory is not None:
                self.memory.remove(self._module_key(kind, handle))
            return SUCCESS, b""
        return run

    def h_link_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        options, _ = read_options(p, 0)
        return SUCCESS, U64.pack(self.backend.link_create(options))

    def h_link_add(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        state, kind = struct.unpack_from("<Qi", p, 0)
        name, off = take_str(p, 12)
        options, off = read_options(p, off)
        (size,) = U64.unpack_from(p, off)
        off += 8
        code, info, error = self.backend.link_add(state, kind, name, options, bytes(p[off:off + size]))
        return code, lp(info) + lp(error)

    def h_link_complete(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (state,) = U64.unpack_from(p, 0)
        code, info, error, cubin = self.backend.link_complete(state)
        body = lp(info) + lp(error)
        if code == SUCCESS:
            body += U64.pack(len(cubin)) + cubin
        return code, body

    def h_link_destroy(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        (state,) = U64.unpack_from(p, 0)
        self.backend.link_destroy(state)
        return SUCCESS, b""

    # ------------------------------------------------------------------ launches

    def _context_reserves(self) -> ContextReserves | None:
        if self.reserves is None and self.memory is not None:
            sms = self.backend.cuDeviceGetAttribute(DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)[1]
            per_sm = self.backend.cuDeviceGetAttribute(DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, 0)[1]
            self.reserves = ContextReserves(self.memory, max(1, sms) * max(1, per_sm))
        return self.reserves

    def _admit(self, f: int) -> None:
        """Before a kernel's first launch: the local memory it needs per thread, beyond the stack
        size, is what the driver will reserve for every resident thread at that launch; charged
        first (raising OUT_OF_MEMORY when it does not fit). Admitted kernels skip this (and may run
        on the native launch loop)."""
        if not f or f in self.admitted:
            return
        if self.backend.capture_open():
            # A query now could invalidate the capture: the kernel is admitted at its first launch
            # outside one (a captured kernel that only ever runs in graphs is not charged).
            return
        reserves = self._context_reserves()
        if reserves is not None:
            r, local = self.backend.cuFuncGetAttribute(FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f)
            if r != SUCCESS:   # a library's CUkernel launched as a function
                r, local = self.backend.cuKernelGetAttribute(FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f, 0)
            if r == SUCCESS and local > DEFAULT_STACK_BYTES:
                reserves.reserve_stack(self.current_ctx or 0, local, "kernel launch")
        self.admitted.add(f)
        if self.native_launches is not None:
            self.native_launches.admit(f)

    def h_set_limit(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        limit, value = struct.unpack_from("<iQ", p, 0)
        reserves = self._context_reserves()
        ctx = self.current_ctx or 0
        heap_before = None
        if reserves is not None and limit == LIMIT_STACK_SIZE:
            reserves.reserve_stack(ctx, value, "cuCtxSetLimit(CU_LIMIT_STACK_SIZE)")
        elif reserves is not None and limit == LIMIT_MALLOC_HEAP_SIZE:
            heap_before = reserves.reserve_heap(ctx, value, f"cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, "
                                                            f"{format_bytes(value)})")
        (r,) = self.backend.cuCtxSetLimit(limit, value)
        if r != SUCCESS and reserves is not None and heap_before is not None:
            reserves.reserve_heap(ctx, heap_before, "")   # refused by the driver: the old heap stands
        return r, b""

    def h_launch(self, p: memoryview, address: int, seq: int) -> None:
        f, stream, gx, gy, gz, bx, by, bz, shmem, coop, nattrs, argsize, _, _ = LAUNCH.unpack_from(p, 0)
        if LAUNCH.size + nattrs * LAUNCH_ATTR_SIZE + argsize > len(p):   # checked before the driver reads them
            raise CudaError(INVALID_VALUE, f"rgpu: worker: a launch's attributes and arguments ({nattrs} and "
                            f"{argsize} bytes) overrun its request ({len(p)} bytes)")
        stream = self.client_streams.real(stream, "cuLaunchKernel")
        self._admit(f)
        off = LAUNCH.size
        attrs = bytes(p[off:off + nattrs * LAUNCH_ATTR_SIZE]) if nattrs else b""
        if attrs:
            attrs = self.client_events.launch_attrs(attrs, LAUNCH_ATTR_SIZE)
        off += nattrs * LAUNCH_ATTR_SIZE
        self.backend.launch(f, stream, (gx, gy, gz), (bx, by, bz), shmem, bool(coop), attrs,
                            p[off:off + argsize], address + off)

    def h_event_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """rgpuEventCreate (async): the driver's event for the handle the client already gave the
        application (client_handles.py)."""
        handle, flags = struct.unpack_from("<QI", p, 0)
        try:
            real = self.backend.event_create(flags)
        except CudaError as exc:
            raise self.client_events.creation_failed(handle, exc.code) from None
        self.client_events.created(handle, real)
        return SUCCESS, b""

    def h_stream_create(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """rgpuStreamCreate (async): the driver's stream for the client's handle (client_handles.py)."""
        handle, flags, priority = struct.unpack_from("<QIi", p, 0)
        try:
            real = self.backend.stream_create(flags, priority)
        except CudaError as exc:
            raise self.client_streams.creation_failed(handle, exc.code) from None
        self.client_streams.created(handle, real)
        return SUCCESS, b""

    def h_set_attribute(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """rgpuSetAttribute (async): cuFuncSetAttribute or cuKernelSetAttribute, which the client
        checked as the driver does (native/src/func_attrs.c). A refusal all the same answers the
        session's next synchronising call, which learns which call it was."""
        attrib, value, handle, is_kernel = struct.unpack_from("<iiQI", p, 0)
        if is_kernel:
            name, (code,) = "cuKernelSetAttribute", self.backend.cuKernelSetAttribute(attrib, value, handle, 0)
        else:
            name, (code,) = "cuFuncSetAttribute", self.backend.cuFuncSetAttribute(handle, attrib, value)
        if code != SUCCESS:
            raise CudaError(code, f"rgpu: worker: {name} (attribute {attrib}, value {value}) failed on the GPU server "
                                  f"with {error_name(code)}; it was pipelined and this is the first synchronising "
                                  "call after it")
        return SUCCESS, b""

    def h_tensor_map(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """rgpuTensorMap: the driver's 128-byte encoding of a tensor map (native/src/tensor_map.c)."""
        if len(p) < TensorMapRequest.WIRE.size:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: rgpuTensorMap carried {len(p)} bytes, expected "
                                           f"{TensorMapRequest.WIRE.size} (client and server builds differ)")
        return SUCCESS, self.backend.tensor_map(TensorMapRequest.unpack(p))

    def h_potential_block_size(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        f, smem, limit, flags = struct.unpack_from("<QQiI", p, 0)
        min_grid, block = self.backend.max_potential_block_size(f, smem, limit, flags)
        return SUCCESS, struct.pack("<ii", min_grid, block)

    def h_max_active_clusters(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        f, stream, gx, gy, gz, bx, by, bz, shmem, nattrs = struct.unpack_from("<QQ8I", p, 0)
        stream = self.client_streams.real(stream, "cuOccupancyMaxActiveClusters")
        off = struct.calcsize("<QQ8I")
        attrs = bytes(p[off:off + nattrs * LAUNCH_ATTR_SIZE])
        clusters = self.backend.max_active_clusters(f, stream, (gx, gy, gz), (bx, by, bz), shmem, attrs)
        return SUCCESS, struct.pack("<i", clusters)

    # ------------------------------------------------------------------ capture and graphs

    def h_capture_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        stream, what = struct.unpack_from("<QI", p, 0)
        stream = self.client_streams.real(stream, "cuStreamGetCaptureInfo")
        status, cid, graph, deps, edges = self.backend.capture_info(stream, what)
        out = [struct.pack("<iIQQQ", status, 0, cid, graph, len(deps))]
        out.extend(U64.pack(d) for d in deps)
        if what == 2:
            out.extend(U64.pack(e) for e in edges)
        return SUCCESS, b"".join(out)

    @staticmethod
    def _node_list(p: memoryview, lister: Callable[[int, int, bool], tuple[int, list[int]]]) -> tuple[int, bytes]:
        graph, cap, want = struct.unpack_from("<QQI", p, 0)
        total, nodes = lister(graph, cap, bool(want))
        return SUCCESS, struct.pack("<QQ", total, len(nodes)) + b"".join(U64.pack(n) for n in nodes)

    def h_graph_nodes(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        return self._node_list(p, self.backend.graph_nodes)

    def h_graph_roots(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuGraphGetRootNodes, answered as cuGraphGetNodes is (protocol 11)."""
        return self._node_list(p, self.backend.graph_roots)

    def h_capture_to_graph(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuStreamBeginCaptureToGraph: the stream's capture appends to an existing graph, after
        the given nodes (protocol 11)."""
        stream, graph, mode, _, ndeps = struct.unpack_from("<QQiIQ", p, 0)
        stream = self.client_streams.real(stream, "cuStreamBeginCaptureToGraph")
        if 32 + 8 * ndeps > len(p):
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated cuStreamBeginCaptureToGraph request")
        deps = list(struct.unpack_from(f"<{ndeps}Q", p, 32))
        self.backend.capture_to_graph(stream, graph, deps, mode)
        return SUCCESS, b""

    def h_exec_child_set(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuGraphExecChildGraphNodeSetParams (protocol 11)."""
        exe, node, child = struct.unpack_from("<QQQ", p, 0)
        self.backend.exec_child_set(exe, node, child)
        return SUCCESS, b""

    def h_graph_add_node(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        graph, kind, _, ndeps = struct.unpack_from("<QIIQ", p, 0)
        off = 24
        deps = list(struct.unpack_from(f"<{ndeps}Q", p, off))
        off += 8 * ndeps
        (plen,) = U64.unpack_from(p, off)
        payload = bytes(p[off + 8:off + 8 + plen])
        size = 0
        if kind == 7:   # a host node: from now on the loop lends its reader while handlers run
            self.hostcalls.active = True
        if kind == 1 and plen >= 8:   # a kernel node (cuda_graph.c's NODE_KERNEL): its kernel's local memory, as at a launch
            self._admit(U64.unpack_from(payload, 0)[0])
        if kind in (9, 10):   # an event record or wait node: the client's event, mapped to the driver's
            name = "cuGraphAddEventRecordNode" if kind == 9 else "cuGraphAddEventWaitNode"
            payload = U64.pack(self.client_events.real(U64.unpack_from(payload, 0)[0], name))
        if kind == 4:   # a graph memory allocation: counted against the slice while its node exists
            (size,) = U64.unpack_from(payload, 88)
            assert self.memory is not None
            self.memory.check(size, "graph memory allocation node")
        try:
            node, aux = self.backend.graph_add_node(kind, graph, deps, payload)
        except BaseException:
            if self.memory is not None:
                self.memory.cancel()
            raise
        if kind == 4 and self.memory is not None:
            self.memory.add(-(node + (1 << 62)), size)
            self.graph_allocs[aux] = -(node + (1 << 62))
        elif kind == 5 and self.memory is not None:
            key = self.graph_allocs.pop(struct.unpack_from("<Q", payload, 0)[0], None)
            if key is not None:
                self.memory.remove(key)
        return SUCCESS, struct.pack("<QQ", node, aux)

    def h_graph_add_edges(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuGraphAddDependencies(_v2), and cuGraphAddNode_v2's edge data (graph_generic.c): the
        edges go to the driver as they are; flag 1 removes the just-added `to` node if they fail."""
        graph, flags, _, n = struct.unpack_from("<QIIQ", p, 0)
        if len(p) != 24 + 24 * n:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated graph dependencies")
        froms = list(struct.unpack_from(f"<{n}Q", p, 24))
        tos = list(struct.unpack_from(f"<{n}Q", p, 24 + 8 * n))
        edges = bytes(p[24 + 16 * n:24 + 24 * n])
        self.backend.graph_add_edges(graph, froms, tos, edges, drop_new_node=bool(flags & 1))
        return SUCCESS, b""

    def h_graph_host_refresh(self, p: memoryview, address: int, seq: int) -> None:
        buffer, size = struct.unpack_from("<QQ", p, 0)
        data = p[16:16 + size]
        if len(data) != size:
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated graph host-copy data")
        self.backend.graph_host_write(buffer, data)

    def h_graph_host_readback(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        stream, n = struct.unpack_from("<QQ", p, 0)
        stream = self.client_streams.real(stream, "cuGraphLaunch")
        pairs = [struct.unpack_from("<QQ", p, 16 + 16 * i) for i in range(n)]
        return SUCCESS, self.backend.graph_host_read(stream, pairs)

    def h_capture_host_copy(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        stream, to_host, _, dev, size = struct.unpack_from("<QIIQQ", p, 0)
        stream = self.client_streams.real(stream, "a copy on a capturing stream")
        data = b"" if to_host else bytes(p[32:32 + size])
        if len(data) != (0 if to_host else size):
            raise CudaError(INVALID_VALUE, "rgpu: worker: truncated captured host copy")
        buffer, graph = self.backend.capture_host_copy(stream, bool(to_host), dev, size, data)
        return SUCCESS, struct.pack("<QQ", buffer, graph)

    def h_capture_host_func(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """cuLaunchHostFunc (kind 0) or cuStreamAddCallback (kind 1) on a capturing stream: a host
        node that runs the client's function `fn_id` (an id of the client's table, never an address)."""
        stream, kind, _, fn_id = struct.unpack_from("<QIIQ", p, 0)
        stream = self.client_streams.real(stream, "cuLaunchHostFunc")
        if kind not in (0, 1):
            raise CudaError(INVALID_VALUE, f"rgpu: worker: unknown captured host function kind {kind} (client and "
                                           "server builds differ; install the same rgpu version on both)")
        self.hostcalls.active = True
        self.backend.capture_host_func(stream, kind, fn_id)
        return SUCCESS, b""

    def h_host_node(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """A host node's function id: read (set=0), or set on the graph's node or, with an
        executable graph, on its instance."""
        exe, node, fn_id, set_it, _ = struct.unpack_from("<QQQII", p, 0)
        return SUCCESS, U64.pack(self.backend.host_node_params(exe, node, fn_id if set_it else None))

    def h_kernel_node_set(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        exe, node, plen = struct.unpack_from("<QQQ", p, 0)
        if plen >= 8:
            self._admit(U64.unpack_from(p, 24)[0])
        self.backend.kernel_node_set(exe, node, bytes(p[24:24 + plen]))
        return SUCCESS, b""

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

    def h_private_table_size(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        size = getattr(self.backend, "private_table_size", None)
        if size is None or len(p) < 16:
            return NOT_FOUND, b""
        return SUCCESS, U64.pack(size(bytes(p[:16])))

    def h_module_nodes(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        """Private table 6e163fbe slot 7 on the worker's driver: the module's function nodes, each
        with its owner and the fields the client copies into its own node (module_nodes.c)."""
        walk = getattr(self.backend, "module_nodes", None)
        if walk is None:
            return NOT_FOUND, b""
        ctx, module = struct.unpack_from("<QQ", p, 0)
        nodes = walk(ctx, module)[:MAX_MODULE_NODES]
        return SUCCESS, U32.pack(len(nodes)) + b"".join(MODULE_NODE.pack(*n) for n in nodes)

    def h_session_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        info = {"memory_limit": self.memory.limit if self.memory else 0,
                "memory_used": self.memory.used if self.memory else 0,
                "compute_percent": self.spec.compute_percent,
                "compute_enforcement": self.spec.compute_enforcement,
                "backend": self.spec.backend, "gpu": self.spec.gpu_name, "pid": os.getpid(),
                "launch_path": "native" if self.native_launches is not None else "python",
                "native_launches": self.native_launches.launched.value if self.native_launches else 0}
        return SUCCESS, lp(json.dumps(info).encode())

