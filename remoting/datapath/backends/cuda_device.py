"""The real-GPU backend's state and the parts every other part uses: the driver's entry points,
allocations, the stream-capture count, virtual memory, pointer attributes, entry-point lookup."""

from __future__ import annotations

import ctypes
from typing import Any

from rgpu.remoting.native.generated.api_gen import CUDA_ARGTYPES, CudaDriverCalls, bind
from rgpu.remoting.datapath.backends.staging_ring import StagingRing
from rgpu.remoting.datapath.backends.base import MEMPOOL_RESERVED_CURRENT, NOT_SUPPORTED, SUCCESS, CudaError
from rgpu.remoting.datapath.backends.cuda_driver import (c_void_p, c_int, c_uint, c_size_t, c_uint64, byref,
                                                         STAGING_RING_BYTES, lane_slots, MAX_PARAM_BYTES, _MANUAL,
                                                         HOST_FN, STREAM_CALLBACK, STREAM_CAPTURE_UNSUPPORTED,
                                                         STREAM_CAPTURE_INVALIDATED, _load_driver, _Link)


class CudaDevice(CudaDriverCalls):
    """NVIDIA's driver for one session (device 0 of the worker): its state."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.enumerate_ns = 0   # time module loads spent building their function tables (worker profile)
        self.lib = _load_driver()
        self.lacking = bind(self, self.lib, CUDA_ARGTYPES, NOT_SUPPORTED)
        self.f: dict[str, Any] = {}
        for name, types in _MANUAL.items():
            fn = getattr(self.lib, name)
            fn.argtypes = types
            fn.restype = c_int
            self.f[name] = fn
        self._check("cuInit", 0)
        version = c_int()
        self._check("cuDriverGetVersion", byref(version))
        self.driver_version = version.value
        dev = c_int()
        self._check("cuDeviceGet", byref(dev), 0)
        # The worker holds the primary context: its pinned staging buffers live there, and the
        # application releasing its own reference must not pull them away.
        self.primary = c_void_p()
        self._check("cuDevicePrimaryCtxRetain", byref(self.primary), 0)
        self.description = f"{spec.gpu_name} (CUDA driver {self.driver_version})"
        # Pinned staging buffers are portable (every context may copy through them); the events
        # that track their DMA belong to one context each, so every context has its own
        # (recording a primary-context event on a created context's stream is INVALID_HANDLE).
        self._ring_base = 0                                  # the host-to-device staging ring
        self._ring: StagingRing[tuple[int, Any]] = StagingRing(STAGING_RING_BYTES)   # tag: (context, event)
        self._dtoh: list[int] = []
        self._events: dict[int, tuple[list[Any], list[Any]]] = {}  # context -> (free ring events, dtoh events)
        # Striped copies (protocol 12): LANE_SLOTS pinned chunks that lanes.c fills and queues to the GPU
        # itself, its staging table (the slots' copies in flight), one event per slot per context.
        self._lanes: Any = None
        self._lane_base = 0
        self._lane_chunk = 0
        self._lane_staging = 0
        self._lane_events: dict[int, Any] = {}
        # A striped host-to-device copy a thread of the worker receives while the loop goes on
        # (cuda_copies.py's htod_lanes_background), each context's side stream for them, and the
        # error of one that ended while nobody asked (the worker's next settle reports it).
        self._lane_receive: Any = None
        self._lane_sides: dict[int, Any] = {}
        self._lane_landings: list[Any] = []   # the primary context's landings of those copies
        self._lane_ring: Any = None            # ... and its landing ring (cuda_copies.py's LaneRing)
        self._lane_ring_refused = False         # the ring failed once: copies land whole
        self.lane_ring_copies = 0               # copies received through the ring (RGPU_WORKER_PROFILE)
        self._lane_receive_unreported: CudaError | None = None
        # UCX copies: a pinned buffer they land in (or leave from), and the DMA queued from it that
        # must finish before it is written again: (context, event), or None.
        self._ucx_base = 0
        self._ucx_bytes = 0
        self._ucx_pending: tuple[int, Any] | None = None
        self._ucx_events: dict[int, Any] = {}   # context -> the event its UCX DMA records
        self._lane_slots = lane_slots()
        self._ucx_chunk_events: dict[int, list[Any]] = {}   # context -> events of a device-to-host UCX copy's chunks
        self._param_buf = (ctypes.c_char * MAX_PARAM_BYTES)()
        self._param_size = c_size_t(0)
        self._extra = (c_void_p * 5)(1, ctypes.addressof(self._param_buf), 2, ctypes.addressof(self._param_size), 0)
        self._current = 0
        self._links: dict[int, _Link] = {}
        # Library images the driver reads in place (LIBRARY_BINARY_IS_PRESERVED) until cuLibraryUnload.
        self._preserved: dict[int, tuple[Any, Any]] = {}
        self._launch = self.f["cuLaunchKernel"]
        self._captures = 0   # begun minus ended stream captures: while 0, no copy checks its stream
        self._graph_host: dict[int, int] = {}   # pinned buffers of graph copy nodes -> size
        # Host nodes call these on a driver thread; they run the client's function and wait for it.
        self.host_calls: Any = None   # the worker's HostCalls (set by the worker)
        # A host node's userData is a token of ours: the client's function id and the host-copy
        # buffers of the node's graph (brought to the client's memory and back around the call).
        self._host_tokens: dict[int, tuple[int, list[tuple[int, int, bool]]]] = {}
        self._graph_regions: dict[int, list[tuple[int, int, bool]]] = {}
        self._host_fn = HOST_FN(lambda user: self._run_host(user or 0, 0))
        self._stream_callback = STREAM_CALLBACK(lambda _stream, status, user: self._run_host(user or 0, status))
        self._host_fn_address = ctypes.cast(self._host_fn, c_void_p).value
        self._stream_callback_address = ctypes.cast(self._stream_callback, c_void_p).value

    # ------------------------------------------------------------------ helpers

    def _call(self, name: str, *args: Any) -> int:
        return self.f[name](*args)

    def _check(self, name: str, *args: Any) -> None:
        r = self.f[name](*args)
        if r != SUCCESS:
            raise CudaError(r)

    def event_create(self, flags: int) -> int:
        """rgpuEventCreate: a driver event for the handle the client made (worker/client_handles.py
        keeps the pair); cuEventCreate is no longer a generated call (protocol 8)."""
        event = c_void_p()
        self._check("cuEventCreate", byref(event), flags)
        return event.value or 0

    def stream_create(self, flags: int, priority: int) -> int:
        """rgpuStreamCreate: a driver stream for the handle the client made (worker/client_handles.py
        keeps the pair). The driver clamps the priority to the device's range, as it would locally."""
        stream = c_void_p()
        self._check("cuStreamCreateWithPriority", byref(stream), flags, priority)
        return stream.value or 0

    # ------------------------------------------------------------------ memory

    def mem_alloc(self, kind: str, size: int, a: int, b: int, height: int, elem: int) -> tuple[int, int]:
        ptr = c_uint64()
        pitch = c_size_t(0)
        if kind == "plain":
            self._check("cuMemAlloc_v2", byref(ptr), size)
        elif kind == "pitch":
            self._check("cuMemAllocPitch_v2", byref(ptr), byref(pitch), size, height, elem)
        elif kind == "async":
            self._check("cuMemAllocAsync", byref(ptr), size, a or None)
        else:
            self._check("cuMemAllocFromPoolAsync", byref(ptr), size, b or None, a or None)
        return ptr.value, pitch.value

    def mem_free(self, ptr: int, stream: int, is_async: bool) -> None:
        if is_async:
            self._check("cuMemFreeAsync", ptr, stream or None)
        else:
            self._check("cuMemFree_v2", ptr)

    def mem_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        self._check("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value, total.value

    def total_mem(self) -> int:
        total = c_size_t()
        self._check("cuDeviceTotalMem_v2", byref(total), 0)
        return total.value

    def pool_reserved(self) -> int:
        """What the device's current stream-ordered pool holds from the GPU (in use or kept)."""
        r, pool = self.cuDeviceGetMemPool(0)
        if r != SUCCESS:
            raise CudaError(r)
        return self.mem_pool_attribute(pool, MEMPOOL_RESERVED_CURRENT, 0, False)

    def mem_pool_attribute(self, pool: int, attr: int, value: int, set_it: bool) -> int:
        holder: Any = c_int(value) if 1 <= attr <= 3 else c_uint64(value)
        self._check("cuMemPoolSetAttribute" if set_it else "cuMemPoolGetAttribute", pool or None, attr, byref(holder))
        return int(holder.value)

    # ------------------------------------------------------------------ the primary context (staging buffers live there)

    def _with_primary(self, fn: Any) -> Any:
        previous = self._current
        self._check("cuCtxSetCurrent", self.primary)
        try:
            return fn()
        finally:
            self._call("cuCtxSetCurrent", previous or None)

    # ------------------------------------------------------------------ stream capture (copies and graphs check it)

    def cuStreamBeginCapture_v2(self, stream: int, mode: int) -> tuple[int]:
        # A capture in the global mode refuses other threads' unsafe calls: a striped copy still
        # received in the background (its slots' event waits) must not meet it.
        self._lane_receive_join()
        res = super().cuStreamBeginCapture_v2(stream, mode)
        if res[0] == SUCCESS:
            self._captures += 1
        return res

    def cuStreamEndCapture(self, stream: int) -> tuple[int, int]:
        res = super().cuStreamEndCapture(stream)
        if res[0] in (SUCCESS, STREAM_CAPTURE_INVALIDATED) and self._captures:
            self._captures -= 1
        return res

    def capture_open(self) -> bool:
        """Whether a stream capture is open: then the worker asks the driver nothing it does not
        have to (a query in global capture mode can invalidate the capture)."""
        return self._captures > 0

    def _refuse_capture(self, stream: int, what: str) -> None:
        """A copy from or to the client's memory on a capturing stream would become a graph node
        reading a staging buffer: refused (never replayed with stale data)."""
        if not self._captures:
            return
        status = c_int()
        r = self.f["cuStreamIsCapturing"](stream or None, byref(status))
        if r != SUCCESS:
            raise CudaError(r)
        if status.value:
            raise CudaError(STREAM_CAPTURE_UNSUPPORTED, f"rgpu: worker: {what} on a capturing stream (a host-memory "
                                                        "copy node of a CUDA graph) is not remoted yet")

    def _run_host(self, token: int, status: int) -> None:
        """A host node's turn (a driver thread): the client runs its function; we wait for it."""
        calls = self.host_calls
        fn_id, regions = self._host_tokens.get(token, (0, []))
        if calls is not None and fn_id:
            calls.run(fn_id, status, regions)

    # ------------------------------------------------------------------ virtual memory management

    def vmm_create(self, size: int, flags: int, prop: bytes) -> int:
        h = c_uint64()
        buf = ctypes.create_string_buffer(prop, len(prop))
        self._check("cuMemCreate", byref(h), size, buf, flags)
        return h.value

    def vmm_release(self, handle: int) -> None:
        self._check("cuMemRelease", handle)

    def vmm_retain(self, addr: int) -> int:
        h = c_uint64()
        self._check("cuMemRetainAllocationHandle", byref(h), addr)
        return h.value

    def vmm_set_access(self, ptr: int, size: int, descs: bytes, count: int) -> None:
        buf = ctypes.create_string_buffer(descs, len(descs))
        self._check("cuMemSetAccess", ptr, size, buf, count)

    def pointer_attributes(self, attrs: tuple[int, ...], ptr: int) -> list[bytes | None]:
        """cuPointerGetAttributes: each attribute's bytes (None where it failed), in two driver calls
        for all of them (one per fill) rather than two per attribute: PyTorch's pinned DataLoader asks
        this of every batch it receives (is_pinned of pageable memory), and asking each attribute
        alone took about 1 ms on an H200 (2026-11-28). The plural call fills defaults for memory CUDA
        does not know, as the client's own call does; if the driver refuses the list as a whole, each
        attribute is asked alone."""
        n = len(attrs)
        fn = self._late_fn("cuPointerGetAttributes", [c_uint, c_void_p, c_void_p, c_uint64])
        ids = (c_int * n)(*attrs)
        fills = []
        for fill in (0x00, 0xFF):
            bufs = [(ctypes.c_ubyte * 64)(*([fill] * 64)) for _ in range(n)]
            slots = (c_void_p * n)(*(ctypes.addressof(b) for b in bufs))
            if fn(n, ids, slots, ptr) != SUCCESS:
                return [self._one_attribute(attr, ptr) for attr in attrs]
            fills.append([bytes(b) for b in bufs])
        return [_written(low, high) for low, high in zip(*fills)]

    def _one_attribute(self, attr: int, ptr: int) -> bytes | None:
        try:
            return self.pointer_attribute(attr, ptr)
        except CudaError:
            return None

    def pointer_attribute(self, attr: int, ptr: int) -> bytes:
        """The attribute's bytes, exactly as many as the driver writes (found with two fills)."""
        outs = []
        for fill in (0x00, 0xFF):
            buf = (ctypes.c_ubyte * 64)(*([fill] * 64))
            r = self._call("cuPointerGetAttribute", buf, attr, ptr)
            if r != SUCCESS:
                raise CudaError(r)
            outs.append(bytes(buf))
        return _written(outs[0], outs[1])

    def _lane_receive_join(self) -> None:
        """Wait for the striped copy received in the background, if any (cuda_copies.py); its error
        waits for lane_receive_settle."""

    def _entry(self, name: str) -> int:
        """The address of the driver's `name`, by exact symbol; 0 where the driver lacks it."""
        try:
            return int(ctypes.cast(getattr(self.lib, name), c_void_p).value or 0)
        except AttributeError:
            return 0

    def _late_fn(self, name: str, argtypes: list[Any]) -> Any:
        fn = self.f.get(name)
        if fn is None:
            fn = getattr(self.lib, name, None)
            if fn is None:
                raise CudaError(NOT_SUPPORTED, f"rgpu: worker: {name} is not in this GPU node's driver "
                                               f"({self.driver_version}); update the driver")
            fn.argtypes = argtypes
            fn.restype = c_int
            self.f[name] = fn
        return fn

    def fence(self) -> int:
        """Wait for the current context's work (rgpu's compute limiter, worker/limiter.py); the
        result the application's next synchronising call must see. Not while a stream capture may
        be under way: a synchronisation then invalidates the application's capture (found with
        NVIDIA's graphMemoryNodes sample), and captured work does not run until the graph does."""
        if self._captures:
            return 0
        return self.f["cuCtxSynchronize"]()

    def close(self) -> None:
        pass  # the process exits: the driver frees everything the session held


def _written(low: bytes, high: bytes) -> bytes:
    """The bytes the driver wrote into a buffer filled once with 0x00 (low) and once with 0xFF (high)."""
    written = [i for i in range(len(low)) if low[i] != 0x00 or high[i] != 0xFF]
    return low[:(max(written) + 1) if written else 1]
