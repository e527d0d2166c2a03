"""The worker's launch handlers: kernel admission (local memory counted against the slice), limits,
launches, event and stream creation, function attributes, tensor maps, occupancy."""

from __future__ import annotations

import struct

from rgpu.remoting.datapath.backends.base import INVALID_VALUE, SUCCESS, CudaError, TensorMapRequest
from rgpu.remoting.datapath.worker.client_handles import error_name
from rgpu.remoting.datapath.worker.codecs import LAUNCH, LAUNCH_ATTR_SIZE
from rgpu.remoting.datapath.worker.local_memory import (DEFAULT_STACK_BYTES, FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                                        LIMIT_MALLOC_HEAP_SIZE, LIMIT_STACK_SIZE, ContextReserves)
from rgpu.units import format_bytes
from rgpu.remoting.datapath.worker.handler_state import HandlerState

DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 16, 39


class LaunchHandlers(HandlerState):
    """Launches and what they need."""

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
