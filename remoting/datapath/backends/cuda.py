"""The real-GPU backend: NVIDIA's driver, called by exact versioned symbol.

Generated entry points come from api_gen.CudaDriverCalls (ctypes, argtypes from the spec); this
class adds what needs semantics: contexts, allocations, copies through pinned staging buffers,
module loads that report every function's parameter layout (cuFuncGetParamInfo), launches from
one packed parameter buffer, and pointer attributes copied with exactly the width the driver
writes.

Why ctypes rather than cuda.bindings' Python API: the client is called through a specific
versioned symbol (cuCtxCreate_v2 and _v4 take different arguments; CUDA 13 changed signatures
under the same base name), and cuda.bindings exposes only the newest version of each name. The
worker forwards each call to the same symbol with the same C arguments, and the launch path
costs one ctypes call.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from collections.abc import Iterator
from typing import Any

from rgpu.remoting.native.generated.api_gen import CUDA_ARGTYPES, CudaDriverCalls, bind
from rgpu.remoting.datapath.backends.arrays import DEFERRED_MAPPING, HOST, ArrayDesc, footprint
from rgpu.remoting.datapath.backends.nccl_cuda import CudaNccl
from rgpu.remoting.datapath.backends.staging_ring import StagingRing
from rgpu.remoting.datapath.backends.base import (
    INVALID_HANDLE,
    INVALID_VALUE,
    MEMPOOL_RESERVED_CURRENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    CudaError,
    TENSOR_MAP_BYTES,
    TENSOR_MAP_IM2COL,
    TENSOR_MAP_IM2COL_WIDE,
    TENSOR_MAP_REPLACE,
    FnInfo,
    LoadResult,
    TensorMapRequest,
    cu,
)

c_void_p, c_int, c_uint, c_size_t, c_uint64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_uint64
byref = ctypes.byref
P = ctypes.POINTER

STAGING_RING_BYTES = 16 << 20   # host-to-device copies in flight (pinned)
STAGING_CHUNK = 4 << 20         # a bigger copy goes through the ring in pieces of this size
DTOH_CHUNK = 4 << 20
# A UCX copy (protocol 10) lands in one pinned buffer, kept and grown up to this size, and its DMA
# goes straight from there (RGPU_UCX_PINNED_MAX_BYTES; larger copies take the staging ring).
UCX_PINNED_MAX_BYTES = 256 << 20
# Pinned slots (one chunk each) of striped copies (worker/lanes.py); RGPU_LANE_SLOTS in the dispatcher's
# environment overrides it. 16: with 8 lanes, 8 slots left no slot free while chunks' DMAs ran (every
# lane waited for one), which the H200's 0.54-0.78x of raw TCP on 8 lanes may owe to; not measured yet.
LANE_SLOTS = 16


def lane_slots() -> int:
    text = os.environ.get("RGPU_LANE_SLOTS", "").strip()
    return max(2, min(int(text), 256)) if text.isdigit() else LANE_SLOTS
MAX_PARAM_BYTES = 32768

JIT_INFO_LOG_BUFFER = 3
LIBRARY_BINARY_IS_PRESERVED = 1   # CUlibraryOption: the driver reads the image where it lies, no copy
JIT_INFO_LOG_BUFFER_SIZE = 4
JIT_ERROR_LOG_BUFFER = 5
JIT_ERROR_LOG_BUFFER_SIZE = 6
MEMHOSTALLOC_PORTABLE = 1
MEMHOSTREGISTER_PORTABLE = 1
MODULE_NODES_TABLE = bytes.fromhex("6e163fbeb958444d835ce182aff1991e")
LAUNCH_ATTRIBUTE_COOPERATIVE = cu("CU_LAUNCH_ATTRIBUTE_COOPERATIVE")

# What a GPU across the network cannot do for this client, whatever the local driver says. Managed
# memory is emulated by the client (native/src/managed.c) without concurrent access: the device
# says MANAGED_MEMORY 1, CONCURRENT_MANAGED_ACCESS 0, as GPUs before Pascal did.
_ATTRIBUTE_OVERRIDES = {cu(f"CU_DEVICE_ATTRIBUTE_{name}"): 0 for name in (
    "CAN_MAP_HOST_MEMORY", "CONCURRENT_MANAGED_ACCESS", "PAGEABLE_MEMORY_ACCESS",
    "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES", "DIRECT_MANAGED_MEM_ACCESS_FROM_HOST",
    "HOST_NATIVE_ATOMIC_SUPPORTED", "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", "COOPERATIVE_MULTI_DEVICE_LAUNCH",
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "HANDLE_TYPE_FABRIC_SUPPORTED", "IPC_EVENT_SUPPORTED",
    "DMA_BUF_SUPPORTED", "GPU_DIRECT_RDMA_SUPPORTED", "HOST_ALLOC_DMA_BUF_SUPPORTED")}


class CUDA_MEMCPY2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", c_size_t), ("srcY", c_size_t), ("srcMemoryType", c_int), ("srcHost", c_void_p),
                ("srcDevice", c_uint64), ("srcArray", c_void_p), ("srcPitch", c_size_t),
                ("dstXInBytes", c_size_t), ("dstY", c_size_t), ("dstMemoryType", c_int), ("dstHost", c_void_p),
                ("dstDevice", c_uint64), ("dstArray", c_void_p), ("dstPitch", c_size_t),
                ("WidthInBytes", c_size_t), ("Height", c_size_t)]


class CUDA_MEMCPY3D(ctypes.Structure):
    _fields_ = [("srcXInBytes", c_size_t), ("srcY", c_size_t), ("srcZ", c_size_t), ("srcLOD", c_size_t),
                ("srcMemoryType", c_int), ("srcHost", c_void_p), ("srcDevice", c_uint64), ("srcArray", c_void_p),
                ("reserved0", c_void_p), ("srcPitch", c_size_t), ("srcHeight", c_size_t),
                ("dstXInBytes", c_size_t), ("dstY", c_size_t), ("dstZ", c_size_t), ("dstLOD", c_size_t),
                ("dstMemoryType", c_int), ("dstHost", c_void_p), ("dstDevice", c_uint64), ("dstArray", c_void_p),
                ("reserved1", c_void_p), ("dstPitch", c_size_t), ("dstHeight", c_size_t),
                ("WidthInBytes", c_size_t), ("Height", c_size_t), ("Depth", c_size_t)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint), ("blockDimX", c_uint),
                ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", c_void_p), ("numAttrs", c_uint)]


# Hand-written calls: (symbol, argtypes).
_MANUAL = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [P(c_int)],
    "cuDeviceGet": [P(c_int), c_int],
    "cuCtxSetCurrent": [c_void_p],
    "cuDevicePrimaryCtxRetain": [P(c_void_p), c_int],
    "cuCtxCreate_v4": [P(c_void_p), c_void_p, c_uint, c_int],
    "cuCtxDestroy_v2": [c_void_p],
    "cuMemAlloc_v2": [P(c_uint64), c_size_t],
    "cuMemAllocPitch_v2": [P(c_uint64), P(c_size_t), c_size_t, c_size_t, c_uint],
    "cuMemAllocAsync": [P(c_uint64), c_size_t, c_void_p],
    "cuMemAllocFromPoolAsync": [P(c_uint64), c_size_t, c_void_p, c_void_p],
    "cuMemFree_v2": [c_uint64],
    "cuMemFreeAsync": [c_uint64, c_void_p],
    "cuMemGetInfo_v2": [P(c_size_t), P(c_size_t)],
    "cuDeviceTotalMem_v2": [P(c_size_t), c_int],
    "cuMemPoolSetAttribute": [c_void_p, c_int, c_void_p],
    "cuMemPoolGetAttribute": [c_void_p, c_int, c_void_p],
    "cuMemHostAlloc": [P(c_void_p), c_size_t, c_uint],
    "cuMemFreeHost": [c_void_p],
    "cuMemHostRegister_v2": [c_void_p, c_size_t, c_uint],
    "cuMemHostUnregister": [c_void_p],
    "cuMemcpyHtoDAsync_v2": [c_uint64, c_void_p, c_size_t, c_void_p],
    "cuMemcpyDtoHAsync_v2": [c_void_p, c_uint64, c_size_t, c_void_p],
    "cuMemcpy2DAsync_v2": [c_void_p, c_void_p],
    "cuEventCreate": [P(c_void_p), c_uint],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuPointerGetAttribute": [c_void_p, c_int, c_uint64],
    "cuModuleLoadDataEx": [P(c_void_p), c_void_p, c_uint, c_void_p, c_void_p],
    "cuLibraryLoadData": [P(c_void_p), c_void_p, c_void_p, c_void_p, c_uint, c_void_p, c_void_p, c_uint],
    "cuModuleUnload": [c_void_p],
    "cuLibraryUnload": [c_void_p],
    "cuModuleGetFunction": [P(c_void_p), c_void_p, ctypes.c_char_p],
    "cuModuleGetFunctionCount": [P(c_uint), c_void_p],
    "cuModuleEnumerateFunctions": [c_void_p, c_uint, c_void_p],
    "cuLibraryGetKernelCount": [P(c_uint), c_void_p],
    "cuLibraryEnumerateKernels": [c_void_p, c_uint, c_void_p],
    "cuFuncGetName": [P(ctypes.c_char_p), c_void_p],
    "cuKernelGetName": [P(ctypes.c_char_p), c_void_p],
    "cuFuncGetParamInfo": [c_void_p, c_size_t, P(c_size_t), P(c_size_t)],
    "cuKernelGetParamInfo": [c_void_p, c_size_t, P(c_size_t), P(c_size_t)],
    "cuFuncLoad": [c_void_p],
    "cuLinkCreate_v2": [c_uint, c_void_p, c_void_p, P(c_void_p)],
    "cuLinkAddData_v2": [c_void_p, c_int, c_void_p, c_size_t, ctypes.c_char_p, c_uint, c_void_p, c_void_p],
    "cuLinkComplete": [c_void_p, P(c_void_p), P(c_size_t)],
    "cuLinkDestroy": [c_void_p],
    "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p, c_void_p],
    "cuLaunchKernelEx": [c_void_p, c_void_p, c_void_p, c_void_p],
    "cuOccupancyMaxActiveClusters": [P(c_int), c_void_p, c_void_p],
    "cuOccupancyMaxPotentialBlockSizeWithFlags": [P(c_int), P(c_int), c_void_p, c_void_p, c_size_t, c_int, c_uint],
    "cuDevicePrimaryCtxReset_v2": [c_int],
    "cuDeviceGetAttribute": [P(c_int), c_int, c_int],
    "cuStreamIsCapturing": [c_void_p, P(c_int)],
    "cuStreamGetCaptureInfo_v3": [c_void_p, P(c_int), P(c_uint64), P(c_void_p), P(c_void_p), c_void_p, P(c_size_t)],
    "cuGraphGetNodes": [c_void_p, c_void_p, P(c_size_t)],
    "cuMemCreate": [P(c_uint64), c_size_t, c_void_p, c_uint64],
    "cuMemRelease": [c_uint64],
    "cuMemRetainAllocationHandle": [P(c_uint64), c_void_p],
    "cuMemSetAccess": [c_uint64, c_size_t, c_void_p, c_size_t],
    "cuArrayCreate_v2": [P(c_void_p), c_void_p],
    "cuArray3DCreate_v2": [P(c_void_p), c_void_p],
    "cuArrayDestroy": [c_void_p],
    "cuArrayGetMemoryRequirements": [c_void_p, c_void_p, c_int],
    "cuMipmappedArrayCreate": [P(c_void_p), c_void_p, c_uint],
    "cuMipmappedArrayDestroy": [c_void_p],
    "cuMipmappedArrayGetMemoryRequirements": [c_void_p, c_void_p, c_int],
    "cuTexObjectCreate": [P(ctypes.c_ulonglong), c_void_p, c_void_p, c_void_p],
    "cuMemcpy3DAsync_v2": [c_void_p, c_void_p],
    "cuMemcpy2DUnaligned_v2": [c_void_p],
}

for _name in ("cuGraphAddEmptyNode", "cuGraphAddKernelNode_v2", "cuGraphAddMemsetNode", "cuGraphAddMemcpyNode",
              "cuGraphAddMemAllocNode", "cuGraphAddMemFreeNode"):
    _MANUAL[_name] = [P(c_void_p), c_void_p, c_void_p, c_size_t] + {  # type: ignore[operator]
        "cuGraphAddEmptyNode": [], "cuGraphAddKernelNode_v2": [c_void_p], "cuGraphAddMemsetNode": [c_void_p, c_void_p],
        "cuGraphAddMemcpyNode": [c_void_p, c_void_p], "cuGraphAddMemAllocNode": [c_void_p],
        "cuGraphAddMemFreeNode": [c_uint64]}[_name]
_MANUAL["cuGraphExecKernelNodeSetParams_v2"] = [c_void_p, c_void_p, c_void_p]
_MANUAL["cuCtxSynchronize"] = []
_MANUAL["cuStreamSynchronize"] = [c_void_p]
_MANUAL["cuGraphKernelNodeSetParams_v2"] = [c_void_p, c_void_p]
_MANUAL["cuGraphAddHostNode"] = [P(c_void_p), c_void_p, c_void_p, c_size_t, c_void_p]
_MANUAL["cuGraphHostNodeGetParams"] = [c_void_p, c_void_p]
_MANUAL["cuGraphHostNodeSetParams"] = [c_void_p, c_void_p]
_MANUAL["cuGraphExecHostNodeSetParams"] = [c_void_p, c_void_p, c_void_p]
_MANUAL["cuLaunchHostFunc"] = [c_void_p, c_void_p, c_void_p]
_MANUAL["cuStreamAddCallback"] = [c_void_p, c_void_p, c_void_p, c_uint]
# rgpuStreamCreate (protocol 8: cuStreamCreate* are the client's, no longer generated calls)
_MANUAL["cuStreamCreateWithPriority"] = [P(c_void_p), c_uint, c_int]

# The host functions the driver calls for a host node: userData is the id the client registered.
HOST_FN = ctypes.CFUNCTYPE(None, c_void_p)
STREAM_CALLBACK = ctypes.CFUNCTYPE(None, c_void_p, c_int, c_void_p)


class CUDA_HOST_NODE_PARAMS(ctypes.Structure):
    _fields_ = [("fn", c_void_p), ("userData", c_void_p)]


class CUDA_KERNEL_NODE_PARAMS_v2(ctypes.Structure):
    _fields_ = [("func", c_void_p), ("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
                ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint),
                ("kernelParams", c_void_p), ("extra", c_void_p), ("kern", c_void_p), ("ctx", c_void_p)]


STREAM_CAPTURE_UNSUPPORTED = 900
STREAM_CAPTURE_INVALIDATED = 901


def _load_driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    # The worker must reach NVIDIA's driver, not rgpu's client library (a session would call
    # itself). Tests chain the two on purpose, on a machine without a GPU: they say so.
    if os.environ.get("RGPU_WORKER_ALLOW_RGPU_LIBCUDA") != "1":
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcuda.so" in line and "/" in line:
                    folder = os.path.dirname(line[line.index("/"):].strip())
                    if os.path.exists(os.path.join(folder, "rgpu-native.stamp")):
                        raise CudaError(NOT_SUPPORTED, f"rgpu: worker: loaded rgpu's own libcuda.so.1 from {folder} "
                                                       "instead of NVIDIA's (remove that folder from the dispatcher's "
                                                       "LD_LIBRARY_PATH)")
    return lib


class _Link:
    def __init__(self, options: list[tuple[int, int]]) -> None:
        self.info = ctypes.create_string_buffer(65536)
        self.error = ctypes.create_string_buffer(65536)
        opts = [(JIT_INFO_LOG_BUFFER, ctypes.addressof(self.info)), (JIT_INFO_LOG_BUFFER_SIZE, len(self.info)),
                (JIT_ERROR_LOG_BUFFER, ctypes.addressof(self.error)), (JIT_ERROR_LOG_BUFFER_SIZE, len(self.error))]
        opts += [(o, v) for o, v in options if o not in (3, 4, 5, 6)]
        self.opts = (c_int * len(opts))(*[o for o, _ in opts])
        self.vals = (c_void_p * len(opts))(*[v for _, v in opts])
        self.n = len(opts)
        self.inputs: list[bytes] = []   # kept alive until the link is destroyed


def preserved_library_options(options: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """cuLibraryLoadData's options with LIBRARY_BINARY_IS_PRESERVED set (the worker keeps the image)."""
    return [(o, v) for o, v in options if o != LIBRARY_BINARY_IS_PRESERVED] + [(LIBRARY_BINARY_IS_PRESERVED, 1)]


class CudaBackend(CudaDriverCalls, CudaNccl):
    emulated = False

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

    def set_context(self, ctx: int) -> None:
        self._check("cuCtxSetCurrent", ctx or None)
        self._current = ctx

    def primary_ctx_retain(self) -> int:
        ctx = c_void_p()
        self._check("cuDevicePrimaryCtxRetain", byref(ctx), 0)
        return ctx.value or 0

    def ctx_create(self, flags: int) -> int:
        ctx = c_void_p()
        self._check("cuCtxCreate_v4", byref(ctx), None, flags, 0)
        self._current = ctx.value or 0
        return self._current

    def ctx_destroy(self, ctx: int) -> None:
        self._forget_events(ctx)
        self._forget_lane_events(ctx)
        self._check("cuCtxDestroy_v2", ctx)

    def cuDevicePrimaryCtxReset_v2(self, dev: int) -> tuple[int]:
        # A reset destroys the primary context whatever its references: release the staging
        # buffers first; they are made again on next use.
        self._drop_staging()
        self._drop_lane_staging()
        self._forget_lane_events(self.primary.value or 0)
        self._forget_events(self.primary.value or 0)
        r = self._call("cuDevicePrimaryCtxReset_v2", 0)
        ctx = c_void_p()
        self._call("cuDevicePrimaryCtxRetain", byref(ctx), 0)
        self.primary = ctx
        return (r,)

    def cuDeviceGetAttribute(self, attrib: int, dev: int) -> tuple[int, int]:
        value = c_int()
        r = self._call("cuDeviceGetAttribute", byref(value), attrib, 0)
        if r == SUCCESS and attrib in _ATTRIBUTE_OVERRIDES:
            return (SUCCESS, _ATTRIBUTE_OVERRIDES[attrib])
        return (r, value.value)

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

    # ------------------------------------------------------------------ staging buffers

    def _with_primary(self, fn: Any) -> Any:
        previous = self._current
        self._check("cuCtxSetCurrent", self.primary)
        try:
            return fn()
        finally:
            self._call("cuCtxSetCurrent", previous or None)

    def _make_staging(self) -> None:
        def make() -> None:
            p = c_void_p()
            self._check("cuMemHostAlloc", byref(p), STAGING_RING_BYTES, MEMHOSTALLOC_PORTABLE)
            self._ring_base = p.value or 0
            for _ in range(2):
                p = c_void_p()
                self._check("cuMemHostAlloc", byref(p), DTOH_CHUNK, MEMHOSTALLOC_PORTABLE)
                self._dtoh.append(p.value or 0)
        self._with_primary(make)
        self._ring.clear()

    def _drop_staging(self) -> None:
        self._wait_busy()
        self._ucx_wait()
        for address in ([self._ring_base] if self._ring_base else []) + self._dtoh + \
                ([self._ucx_base] if self._ucx_base else []):
            self._call("cuMemFreeHost", address)
        self._ring_base, self._dtoh = 0, []
        self._ucx_base = self._ucx_bytes = 0

    # ------------------------------------------------------------------ UCX copies' pinned buffer

    def _ucx_wait(self) -> None:
        """Wait for the DMA queued from the UCX buffer (its bytes may then be overwritten)."""
        if self._ucx_pending is not None:
            _, event = self._ucx_pending
            self._ucx_pending = None
            self._call("cuEventSynchronize", event)

    def ucx_buffer(self, n: int) -> int:
        """Pinned memory for a UCX copy of n bytes to land in or leave from, free to write (the
        previous copy's DMA from it has finished); 0 when n is beyond UCX_PINNED_MAX_BYTES."""
        limit = int(os.environ.get("RGPU_UCX_PINNED_MAX_BYTES") or UCX_PINNED_MAX_BYTES)
        if n > limit:
            return 0
        self._ucx_wait()
        if self._ucx_bytes < n:
            if self._ucx_base:
                self._call("cuMemFreeHost", self._ucx_base)
                self._ucx_base = self._ucx_bytes = 0
            size = max(n, 16 << 20)

            def make() -> None:
                p = c_void_p()
                self._check("cuMemHostAlloc", byref(p), size, MEMHOSTALLOC_PORTABLE)
                self._ucx_base, self._ucx_bytes = p.value or 0, size
            self._with_primary(make)
        return self._ucx_base

    def htod_ucx(self, dst: int, stream: int, n: int, offset: int = 0) -> None:
        """Queue the DMA of n bytes at `offset` of the UCX buffer to dst (a UCX copy's chunk, the
        moment it is in); the buffer stays busy until the last one queued has run (the next UCX copy
        waits for it, not this one)."""
        self._refuse_capture(stream, "cuMemcpyHtoDAsync")
        event = self._ucx_events.get(self._current)
        if event is None:   # one per context, as the ring's (it goes with its context)
            event = self._ucx_events[self._current] = self._new_event()
        r = self._call("cuMemcpyHtoDAsync_v2", dst, self._ucx_base + offset, n, stream or None)
        if r == SUCCESS:
            r = self._call("cuEventRecord", event, stream or None)
        if r != SUCCESS:
            # Nothing tracks this copy's DMA: wait for the stream before the buffer is reused.
            self._call("cuStreamSynchronize", stream or None)
            raise CudaError(r)
        self._ucx_pending = (self._current, event)

    def dtoh_ucx_chunks(self, src: int, stream: int, n: int, chunk: int) -> Iterator[tuple[int, int]]:
        """Queue n bytes at src into the UCX buffer as DMAs of `chunk` bytes, each followed by an
        event; yield (offset, length) of each chunk once it is there (the first may be sent while
        the others are still copied down)."""
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        events = self._ucx_chunk_events.setdefault(self._current, [])
        spans = [(at, min(chunk, n - at)) for at in range(0, n, chunk)]
        while len(events) < len(spans):
            events.append(self._new_event())
        queued = 0
        try:
            for (at, k), event in zip(spans, events):
                self._check("cuMemcpyDtoHAsync_v2", self._ucx_base + at, src + at, k, stream or None)
                self._check("cuEventRecord", event, stream or None)
                queued += 1
            for (at, k), event in zip(spans, events):
                self._check("cuEventSynchronize", event)
                yield at, k
        finally:
            if queued:   # the buffer is free again only once every DMA into it has run
                self._call("cuEventSynchronize", events[queued - 1])

    # ------------------------------------------------------------------ the client's shared page-locked memory
    # Same host (protocol 15, worker/shared_pinned.py): the client's cuMemHostAlloc pages, mapped here
    # from its memfd, page-locked once; a copy is then one DMA from or into the application's pages.

    def host_register(self, address: int, size: int) -> None:
        self._with_primary(lambda: self._check("cuMemHostRegister_v2", address, size, MEMHOSTREGISTER_PORTABLE))

    def host_unregister(self, address: int) -> None:
        """As cuMemFreeHost: the device's work finishes first (a DMA may still read the pages)."""
        self._call("cuCtxSynchronize")   # the session's current context; the primary one below

        def unregister() -> None:
            self._call("cuCtxSynchronize")
            self._check("cuMemHostUnregister", address)
        self._with_primary(unregister)

    def htod_host(self, dst: int, stream: int, address: int, n: int, wait: bool) -> None:
        """One DMA from registered host memory; `wait`: return once it has read the pages."""
        self._refuse_capture(stream, "cuMemcpyHtoDAsync")
        self._check("cuMemcpyHtoDAsync_v2", dst, address, n, stream or None)
        if wait:
            self._check("cuStreamSynchronize", stream or None)

    def dtoh_host(self, src: int, stream: int, address: int, n: int) -> None:
        """One DMA into registered host memory, in stream order, waited for."""
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        self._check("cuMemcpyDtoHAsync_v2", address, src, n, stream or None)
        self._check("cuStreamSynchronize", stream or None)

    def _context_events(self) -> tuple[list[Any], list[Any]]:
        """The current context's events: free ones for ring copies (made as needed), and two for
        device-to-host chunks (made on its first copy)."""
        events = self._events.get(self._current)
        if events is None:
            events = ([], [self._new_event(), self._new_event()])
            self._events[self._current] = events
        return events

    def _new_event(self) -> Any:
        e = c_void_p()
        self._check("cuEventCreate", byref(e), 2)  # CU_EVENT_DISABLE_TIMING
        return e

    def _retire_oldest(self) -> None:
        """Wait until the GPU has read the oldest staged copy; its event goes back to its context."""
        ctx, event = self._ring.oldest()
        self._call("cuEventSynchronize", event)
        self._ring.retire_oldest()
        free = self._events.get(ctx)
        if free is not None:
            free[0].append(event)

    def _wait_busy(self) -> None:
        """Wait for every staged copy (the ring is first in, first out: all of them)."""
        while len(self._ring):
            self._retire_oldest()

    def _forget_events(self, ctx: int) -> None:
        """Before a context goes: its copies finish, its events go with it."""
        if self._ucx_pending is not None and self._ucx_pending[0] == ctx:
            self._ucx_wait()
        self._ucx_events.pop(ctx, None)
        self._ucx_chunk_events.pop(ctx, None)
        if ctx in self._events:
            if any(owner == ctx for owner, _ in self._ring.tags()):
                self._wait_busy()
            del self._events[ctx]

    def _stage(self, n: int) -> tuple[int, Any]:
        """(address, event) of n pinned bytes for one copy, waiting for the GPU only when the
        ring is full; the caller records the event after queueing the copy."""
        if not self._ring_base:
            self._make_staging()
        free = self._context_events()[0]
        event = free.pop() if free else self._new_event()
        while (offset := self._ring.take(n, (self._current, event))) is None:
            self._retire_oldest()
        return self._ring_base + offset, event

    # ------------------------------------------------------------------ capture and graphs

    def cuStreamBeginCapture_v2(self, stream: int, mode: int) -> tuple[int]:
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

    def capture_info(self, stream: int, what: int) -> tuple[int, int, int, list[int], list[int]]:
        status = c_int()
        if what == 0:
            r = self.f["cuStreamIsCapturing"](stream or None, byref(status))
            if r != SUCCESS:
                raise CudaError(r)
            return status.value, 0, 0, [], []
        cid, graph, deps, edges, n = c_uint64(), c_void_p(), c_void_p(), c_void_p(), c_size_t()
        r = self.f["cuStreamGetCaptureInfo_v3"](stream or None, byref(status), byref(cid), byref(graph), byref(deps),
                                                byref(edges) if what == 2 else None, byref(n))
        if r != SUCCESS:
            raise CudaError(r)
        count = n.value if status.value else 0
        dep_list = list((c_uint64 * count).from_address(deps.value)) if count and deps.value else [0] * count
        edge_list = list((c_uint64 * count).from_address(edges.value)) if count and edges.value else [0] * count
        return status.value, cid.value, graph.value or 0, dep_list, edge_list

    def _node_list(self, fn: Any, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        n = c_size_t(cap)
        if not want:
            r = fn(graph, None, byref(n))
            if r != SUCCESS:
                raise CudaError(r)
            return n.value, []
        arr = (c_void_p * max(cap, 1))()
        r = fn(graph, arr, byref(n))
        if r != SUCCESS:
            raise CudaError(r)
        return n.value, [v or 0 for v in arr[:min(cap, n.value)]]

    def graph_nodes(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        return self._node_list(self.f["cuGraphGetNodes"], graph, cap, want)

    def graph_roots(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        fn = self._late_fn("cuGraphGetRootNodes", [c_void_p, c_void_p, P(c_size_t)])
        return self._node_list(fn, graph, cap, want)

    def capture_to_graph(self, stream: int, graph: int, deps: list[int], mode: int) -> None:
        """cuStreamBeginCaptureToGraph with default edges (the client refuses others)."""
        d = (c_void_p * max(len(deps), 1))(*deps)
        fn = self._late_fn("cuStreamBeginCaptureToGraph", [c_void_p, c_void_p, c_void_p, c_void_p, c_size_t, c_int])
        r = fn(stream or None, graph or None, d if deps else None, None, len(deps), mode)
        if r != SUCCESS:
            raise CudaError(r)
        self._captures += 1

    def graph_add_edges(self, graph: int, froms: list[int], tos: list[int], edges: bytes, drop_new_node: bool) -> None:
        """cuGraphAddDependencies_v2 with the application's edge data (8 bytes an edge); with
        `drop_new_node`, the node `tos[0]` was just added for these edges and goes if they fail."""
        n = len(froms)
        f, t = (c_void_p * max(n, 1))(*froms), (c_void_p * max(n, 1))(*tos)
        data = ctypes.create_string_buffer(edges, max(len(edges), 1))
        fn = self._late_fn("cuGraphAddDependencies_v2", [c_void_p, c_void_p, c_void_p, c_void_p, c_size_t])
        r = fn(graph or None, f, t, data, n)
        if r != SUCCESS:
            if drop_new_node and tos:
                self._late_fn("cuGraphDestroyNode", [c_void_p])(tos[0] or None)
            raise CudaError(r)

    def exec_child_set(self, exe: int, node: int, child: int) -> None:
        fn = self._late_fn("cuGraphExecChildGraphNodeSetParams", [c_void_p, c_void_p, c_void_p])
        r = fn(exe or None, node or None, child or None)
        if r != SUCCESS:
            raise CudaError(r)

    def _kernel_params(self, payload: bytes) -> tuple[CUDA_KERNEL_NODE_PARAMS_v2, list[Any]]:
        """The packed node parameters as the driver's struct; the arguments go as one buffer."""
        (f,) = struct.unpack_from("<Q", payload, 0)
        is_kernel, gx, gy, gz, bx, by, bz, shmem, argsize, _ = struct.unpack_from("<10I", payload, 8)
        args = ctypes.create_string_buffer(payload[48:48 + argsize], max(argsize, 1))
        size = c_size_t(argsize)
        extra = (c_void_p * 5)(1, ctypes.addressof(args), 2, ctypes.addressof(size), 0)
        k = CUDA_KERNEL_NODE_PARAMS_v2(func=None if is_kernel else f, gridDimX=gx, gridDimY=gy, gridDimZ=gz,
                                       blockDimX=bx, blockDimY=by, blockDimZ=bz, sharedMemBytes=shmem,
                                       kernelParams=None, extra=ctypes.addressof(extra),
                                       kern=f if is_kernel else None, ctx=None)
        return k, [args, size, extra]   # alive until the driver has copied them

    def graph_add_node(self, kind: int, graph: int, deps: list[int], payload: bytes) -> tuple[int, int]:
        node = c_void_p()
        d = (c_void_p * max(len(deps), 1))(*deps)
        head = (byref(node), graph, d if deps else None, len(deps))
        aux = 0
        if kind == 0:
            self._check("cuGraphAddEmptyNode", *head)
        elif kind == 1:
            k, _keep = self._kernel_params(payload)
            self._check("cuGraphAddKernelNode_v2", *head, byref(k))
        elif kind in (2, 3):
            size = 40 if kind == 2 else 200
            params = ctypes.create_string_buffer(payload[:size], size)
            (ctx,) = struct.unpack_from("<Q", payload, size)
            self._check("cuGraphAddMemsetNode" if kind == 2 else "cuGraphAddMemcpyNode", *head, params, ctx or None)
        elif kind == 4:
            bytesize, n = struct.unpack_from("<QQ", payload, 88)
            descs = ctypes.create_string_buffer(payload[104:104 + 12 * n], max(12 * n, 1))
            pool = bytearray(payload[:88])
            if struct.unpack_from("<i", pool, 8)[0] == 1:   # the pool's location: the worker's device 0
                struct.pack_into("<i", pool, 12, 0)
            for i in range(n):
                if struct.unpack_from("<i", descs, 12 * i)[0] == 1:
                    struct.pack_into("<i", descs, 12 * i + 4, 0)
            params = ctypes.create_string_buffer(bytes(pool) + struct.pack("<QQQQ", ctypes.addressof(descs) if n else 0,
                                                                            n, bytesize, 0), 120)
            self._check("cuGraphAddMemAllocNode", *head, params)
            (aux,) = struct.unpack_from("<Q", params.raw, 112)
        elif kind == 5:
            (dptr,) = struct.unpack_from("<Q", payload, 0)
            self._check("cuGraphAddMemFreeNode", *head, dptr)
        elif kind == 7:   # a host node: the driver calls our trampoline with the client's function id
            (fn_id,) = struct.unpack_from("<Q", payload, 0)
            host_params = CUDA_HOST_NODE_PARAMS(self._host_fn_address, self._host_token(fn_id, self._regions(graph)))
            self._check("cuGraphAddHostNode", *head, byref(host_params))
        elif kind == 8:   # a child graph: the driver clones it into the node
            (child,) = struct.unpack_from("<Q", payload, 0)
            fn = self._late_fn("cuGraphAddChildGraphNode", [P(c_void_p), c_void_p, c_void_p, c_size_t, c_void_p])
            r = fn(*head, child or None)
            if r != SUCCESS:
                raise CudaError(r)
        elif kind in (9, 10):   # an event record or wait node (the worker's event)
            (event,) = struct.unpack_from("<Q", payload, 0)
            name = "cuGraphAddEventRecordNode" if kind == 9 else "cuGraphAddEventWaitNode"
            r = self._late_fn(name, [P(c_void_p), c_void_p, c_void_p, c_size_t, c_void_p])(*head, event or None)
            if r != SUCCESS:
                raise CudaError(r)
        elif kind == 6:   # a 1D copy with a host side: through a pinned buffer of this worker's
            to_host, _, dev, size, ctx = struct.unpack_from("<IIQQQ", payload, 0)
            aux = self._graph_host_buffer(size)
            self._regions(graph).append((aux, size, bool(to_host)))
            m = CUDA_MEMCPY3D(WidthInBytes=size, Height=1, Depth=1)
            if to_host:
                m.srcMemoryType, m.srcDevice, m.dstMemoryType, m.dstHost = 2, dev, 1, aux
            else:
                m.srcMemoryType, m.srcHost, m.dstMemoryType, m.dstDevice = 1, aux, 2, dev
            self._check("cuGraphAddMemcpyNode", *head, byref(m), ctx or None)
        else:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: unknown graph node kind {kind}")
        return node.value or 0, aux

    def _regions(self, graph: int) -> list[tuple[int, int, bool]]:
        return self._graph_regions.setdefault(graph, [])

    def _host_token(self, fn_id: int, regions: list[tuple[int, int, bool]]) -> int:
        token = len(self._host_tokens) + 1
        self._host_tokens[token] = (fn_id, regions)
        return token

    def _run_host(self, token: int, status: int) -> None:
        """A host node's turn (a driver thread): the client runs its function; we wait for it."""
        calls = self.host_calls
        fn_id, regions = self._host_tokens.get(token, (0, []))
        if calls is not None and fn_id:
            calls.run(fn_id, status, regions)

    def capture_host_func(self, stream: int, kind: int, fn_id: int) -> None:
        """cuLaunchHostFunc (kind 0) or cuStreamAddCallback (kind 1) on a capturing stream; the
        driver decides (it refuses a stream callback in capture)."""
        _, _, graph, _, _ = self.capture_info(stream, 1)
        token = self._host_token(fn_id, self._regions(graph))
        if kind == 0:
            self._check("cuLaunchHostFunc", stream or None, self._host_fn_address, token)
        else:
            self._check("cuStreamAddCallback", stream or None, self._stream_callback_address, token, 0)

    def _node_token(self, node: int) -> tuple[int, list[tuple[int, int, bool]]]:
        params = CUDA_HOST_NODE_PARAMS()
        self._check("cuGraphHostNodeGetParams", node, byref(params))
        if params.fn != self._host_fn_address:
            return 0, []
        return self._host_tokens.get(params.userData or 0, (0, []))

    def host_node_params(self, exe: int, node: int, fn_id: int | None) -> int:
        """A host node's function id; with `fn_id`, set it first (on `exe`'s instance if given)."""
        try:
            old_fn, regions = self._node_token(node)
        except CudaError:
            if fn_id is None or not exe:
                raise
            old_fn, regions = 0, []   # the graph is gone; its executable graph still holds the node
        if fn_id is None:
            return old_fn
        params = CUDA_HOST_NODE_PARAMS(self._host_fn_address, self._host_token(fn_id, regions))
        if exe:
            self._check("cuGraphExecHostNodeSetParams", exe, node, byref(params))
        else:
            self._check("cuGraphHostNodeSetParams", node, byref(params))
        return fn_id

    def capture_host_copy(self, stream: int, to_host: bool, dev: int, size: int, data: bytes) -> tuple[int, int]:
        """A copy with a host side on a capturing stream: captured through a pinned buffer of this
        worker's (its data now, refreshed before each launch, read back after)."""
        address = self._graph_host_buffer(size)
        if to_host:
            self._check("cuMemcpyDtoHAsync_v2", address, dev, size, stream or None)
        else:
            ctypes.memmove(address, data, size)
            self._check("cuMemcpyHtoDAsync_v2", dev, address, size, stream or None)
        _, _, graph, _, _ = self.capture_info(stream, 1)
        self._regions(graph).append((address, size, to_host))
        return address, graph

    def _graph_host_buffer(self, size: int) -> int:
        """A pinned buffer for a graph's copy node; allocated in relaxed capture mode, since an
        application's capture in global mode forbids allocations on other threads' behalf."""
        code, mode = self.cuThreadExchangeStreamCaptureMode(2)   # CU_STREAM_CAPTURE_MODE_RELAXED
        if code != SUCCESS:
            raise CudaError(code)
        buf = c_void_p()
        try:
            self._with_primary(lambda: self._check("cuMemHostAlloc", byref(buf), max(size, 1), MEMHOSTALLOC_PORTABLE))
        finally:
            self.cuThreadExchangeStreamCaptureMode(mode)
        self._graph_host[buf.value or 0] = size
        return buf.value or 0

    def _graph_buffer(self, buffer: int, size: int) -> None:
        if self._graph_host.get(buffer, -1) < size:
            raise CudaError(INVALID_VALUE, "rgpu: worker: unknown graph host-copy buffer")

    def graph_host_write(self, buffer: int, data: memoryview) -> None:
        """The data of a host-to-device copy node, once no launch still reads its buffer."""
        self._graph_buffer(buffer, len(data))
        self._check("cuCtxSynchronize")
        ctypes.memmove(buffer, (ctypes.c_char * len(data)).from_buffer_copy(data), len(data))

    def graph_host_peek(self, buffer: int, size: int) -> bytes:
        """A copy node's pinned buffer as it is now (a host node's call, while the graph runs)."""
        self._graph_buffer(buffer, size)
        return ctypes.string_at(buffer, size)

    def graph_host_poke(self, buffer: int, data: bytes) -> None:
        self._graph_buffer(buffer, len(data))
        ctypes.memmove(buffer, data, len(data))

    def graph_host_read(self, stream: int, pairs: list[tuple[int, int]]) -> bytes:
        for buffer, size in pairs:
            self._graph_buffer(buffer, size)
        self._check("cuStreamSynchronize", stream or None)
        return b"".join(ctypes.string_at(buffer, size) for buffer, size in pairs)

    def kernel_node_set(self, exe: int, node: int, payload: bytes) -> None:
        k, _keep = self._kernel_params(payload)
        if exe:
            self._check("cuGraphExecKernelNodeSetParams_v2", exe, node, byref(k))
        else:
            self._check("cuGraphKernelNodeSetParams_v2", node, byref(k))

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

    # ------------------------------------------------------------------ copies

    def htod(self, dst: int, stream: int, data: memoryview, address: int) -> None:
        """Copy through the pinned ring: the socket buffer is reused at once, the DMA is async."""
        self._refuse_capture(stream, "cuMemcpyHtoDAsync")
        n = len(data)
        if n > STAGING_CHUNK:
            for off in range(0, n, STAGING_CHUNK):
                part = data[off:off + STAGING_CHUNK]
                self.htod(dst + off, stream, part, address + off)
            return
        staging, event = self._stage(n)
        ctypes.memmove(staging, address, n)
        r = self._call("cuMemcpyHtoDAsync_v2", dst, staging, n, stream or None)
        if r == SUCCESS:
            r = self._call("cuEventRecord", event, stream or None)
        if r != SUCCESS:
            # Nothing tracks this copy's DMA: wait for the stream before its bytes are reused.
            self._call("cuStreamSynchronize", stream or None)
            raise CudaError(r)

    def htod_lanes(self, dst: int, stream: int, size: int, chunk: int, seq: int, lanes: Any) -> None:
        """A striped copy (worker/lanes.py): lanes.c receives each chunk into a pinned slot and queues
        its copy to `dst` on `stream` as it lands; the slots stay busy until their events complete."""
        try:
            self._refuse_capture(stream, "cuMemcpyHtoDAsync")
            gpu = self._lane_copy(lanes, chunk, dst, stream)
        except CudaError:
            lanes.receive(seq, size, chunk, 0)   # the client sends the bytes whatever the answer: drop them
            raise
        lanes.receive(seq, size, chunk, 0, gpu)
        if gpu.error:
            raise CudaError(gpu.error)

    def dtoh_lanes(self, src: int, stream: int, size: int, chunk: int, lanes: Any) -> Any:
        """The staging of a striped device-to-host copy, for lanes.send (lanes.c queues each chunk's copy
        into a free slot and sends it once its event completes); a CudaError before anything is sent."""
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        return self._lane_copy(lanes, chunk, src, stream)

    def _lane_copy(self, lanes: Any, chunk: int, dst: int, stream: int) -> Any:
        if self._lane_staging and (chunk > self._lane_chunk or lanes is not self._lanes):
            self._drop_lane_staging()
        if not self._lane_staging:
            def make() -> int:
                p = c_void_p()
                self._check("cuMemHostAlloc", byref(p), self._lane_slots * chunk, MEMHOSTALLOC_PORTABLE)
                return p.value or 0
            self._lane_base = self._with_primary(make)
            self._lanes, self._lane_chunk = lanes, chunk
            self._lane_staging = lanes.staging_new(self._lane_base, self._lane_slots, chunk)
        events = self._lane_events.get(self._current)
        if events is None:
            events = (c_void_p * self._lane_slots)(*[self._new_event().value for _ in range(self._lane_slots)])
            self._lane_events[self._current] = events
        return lanes.gpu_copy(memcpy_htod=self._entry("cuMemcpyHtoDAsync_v2"), event_record=self._entry("cuEventRecord"),
                              event_sync=self._entry("cuEventSynchronize"), stream=stream, dst=dst,
                              events=ctypes.addressof(events), staging=self._lane_staging,
                              memcpy_dtoh=self._entry("cuMemcpyDtoHAsync_v2"))

    def _drop_lane_staging(self) -> None:
        if self._lane_staging:
            self._lanes.staging_drain(self._lane_staging, self._entry("cuEventSynchronize"))
            self._lanes.staging_free(self._lane_staging)
            self._call("cuMemFreeHost", self._lane_base)
        self._lane_staging, self._lane_base, self._lane_chunk = 0, 0, 0

    def _forget_lane_events(self, ctx: int) -> None:
        """Before a context goes: the slots' copies finish (their events may be its own)."""
        if self._lane_events.pop(ctx, None) is not None and self._lane_staging:
            self._lanes.staging_drain(self._lane_staging, self._entry("cuEventSynchronize"))

    def dtoh_chunks(self, src: int, stream: int, size: int, chunk: int) -> Iterator[memoryview]:
        """Device-to-host through two pinned buffers: copy chunk i+1 while chunk i is sent."""
        self._refuse_capture(stream, "cuMemcpyDtoHAsync")
        if not self._dtoh:
            self._make_staging()
        events = self._context_events()[1]
        chunk = DTOH_CHUNK
        offsets = list(range(0, size, chunk)) or [0]

        def issue(i: int) -> None:
            off = offsets[i]
            n = min(chunk, size - off)
            address, event = self._dtoh[i % 2], events[i % 2]
            if n:
                self._check("cuMemcpyDtoHAsync_v2", address, src + off, n, stream or None)
            self._check("cuEventRecord", event, stream or None)

        issue(0)
        for i, off in enumerate(offsets):
            if i + 1 < len(offsets):
                issue(i + 1)
            address, event = self._dtoh[i % 2], events[i % 2]
            self._check("cuEventSynchronize", event)
            n = min(chunk, size - off)
            if n:
                yield memoryview((ctypes.c_char * n).from_address(address)).cast("B")

    def dtod_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        p = CUDA_MEMCPY2D(srcMemoryType=2, srcDevice=src, srcPitch=spitch, dstMemoryType=2, dstDevice=dst,
                          dstPitch=dpitch, WidthInBytes=width, Height=height)
        self._check("cuMemcpy2DAsync_v2", byref(p), stream or None)

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

    # ------------------------------------------------------------------ arrays, texture objects, copies with arrays

    def array_footprint(self, desc: ArrayDesc, levels: int) -> int:
        """The device memory an array takes: the driver's own figure for a deferred-mapping array of
        the same shape (cuArrayGetMemoryRequirements; nothing is allocated for it), else rgpu's
        estimate of the block-linear layout (arrays.footprint)."""
        probe = ArrayDesc(desc.width, desc.height, desc.depth, desc.format, desc.channels, desc.flags | DEFERRED_MAPPING)
        buf = ctypes.create_string_buffer(probe.pack3d(), 40)
        handle, req = c_void_p(), ctypes.create_string_buffer(32)
        mipmapped = levels > 1
        if mipmapped:
            r = self._call("cuMipmappedArrayCreate", byref(handle), buf, levels)
        else:
            r = self._call("cuArray3DCreate_v2", byref(handle), buf)
        if r == SUCCESS:
            r = self._call("cuMipmappedArrayGetMemoryRequirements" if mipmapped else "cuArrayGetMemoryRequirements",
                           req, handle, 0)
            self._call("cuMipmappedArrayDestroy" if mipmapped else "cuArrayDestroy", handle)
        size = struct.unpack_from("<Q", req.raw, 0)[0] if r == SUCCESS else 0
        return size or footprint(desc, levels)

    def array_create(self, kind: str, desc: ArrayDesc, levels: int) -> int:
        handle = c_void_p()
        if kind == "2d":
            self._check("cuArrayCreate_v2", byref(handle), ctypes.create_string_buffer(desc.pack2d(), 24))
        elif kind == "3d":
            self._check("cuArray3DCreate_v2", byref(handle), ctypes.create_string_buffer(desc.pack3d(), 40))
        else:
            self._check("cuMipmappedArrayCreate", byref(handle), ctypes.create_string_buffer(desc.pack3d(), 40), levels)
        return handle.value or 0

    def array_destroy(self, kind: str, handle: int) -> None:
        self._check("cuMipmappedArrayDestroy" if kind == "mipmapped" else "cuArrayDestroy", handle or None)

    def tex_object_create(self, res: bytes, tex: bytes, view: bytes | None) -> int:
        handle = ctypes.c_ulonglong()
        view_buf = ctypes.create_string_buffer(view, len(view)) if view is not None else None
        self._check("cuTexObjectCreate", byref(handle), ctypes.create_string_buffer(res, len(res)),
                    ctypes.create_string_buffer(tex, len(tex)), view_buf)
        return handle.value

    def _copy_nd(self, kind: int, m: CUDA_MEMCPY3D, stream: int) -> None:
        """kind 2: cuMemcpy3DAsync; 0: cuMemcpy2DAsync; 1: cuMemcpy2DUnaligned (the fields in 3D form)."""
        if kind == 2:
            self._check("cuMemcpy3DAsync_v2", byref(m), stream or None)
            return
        p = CUDA_MEMCPY2D(srcXInBytes=m.srcXInBytes, srcY=m.srcY, srcMemoryType=m.srcMemoryType, srcHost=m.srcHost,
                          srcDevice=m.srcDevice, srcArray=m.srcArray, srcPitch=m.srcPitch,
                          dstXInBytes=m.dstXInBytes, dstY=m.dstY, dstMemoryType=m.dstMemoryType, dstHost=m.dstHost,
                          dstDevice=m.dstDevice, dstArray=m.dstArray, dstPitch=m.dstPitch,
                          WidthInBytes=m.WidthInBytes, Height=m.Height)
        if kind == 1:
            self._check("cuMemcpy2DUnaligned_v2", byref(p))
        else:
            self._check("cuMemcpy2DAsync_v2", byref(p), stream or None)

    def memcpy_array(self, kind: int, desc: bytes, stream: int, data: memoryview, address: int) -> None:
        """A copy whose host side (if any) is the request's data: through the pinned ring, as
        host-to-device copies go (queued, the ring's event tracks its DMA); a piece larger than the
        ring takes (not what rgpu's client sends) is copied from the receive buffer, waited for."""
        m = CUDA_MEMCPY3D.from_buffer_copy(desc)
        if m.srcMemoryType != HOST:
            self._copy_nd(kind, m, stream)
            return
        self._refuse_capture(stream, "a 2D/3D copy from this process's memory")
        n = len(data)
        if n > STAGING_CHUNK:
            m.srcHost = address
            self._copy_nd(kind, m, stream)
            self._check("cuStreamSynchronize", stream or None)
            return
        staging, event = self._stage(n)
        ctypes.memmove(staging, address, n)
        m.srcHost = staging
        try:
            self._copy_nd(kind, m, stream)
        except CudaError:
            self._call("cuStreamSynchronize", stream or None)   # nothing tracks the staged bytes: wait
            raise
        r = self._call("cuEventRecord", event, stream or None)
        if r != SUCCESS:
            self._call("cuStreamSynchronize", stream or None)
            raise CudaError(r)

    def memcpy_array_to_host(self, kind: int, desc: bytes, stream: int) -> memoryview:
        """Into a pinned buffer of the worker's (a piece of at most DTOH_CHUNK, as rgpu's client
        asks for), else a plain one; the handler sends it before the next call may reuse it."""
        self._refuse_capture(stream, "a 2D/3D copy to this process's memory")
        m = CUDA_MEMCPY3D.from_buffer_copy(desc)
        n = m.WidthInBytes * m.Height * (max(m.Depth, 1) if kind == 2 else 1)
        if n <= DTOH_CHUNK:
            if not self._dtoh:
                self._make_staging()
            m.dstHost = self._dtoh[0]
            out: Any = (ctypes.c_char * max(n, 1)).from_address(self._dtoh[0])
        else:
            out = ctypes.create_string_buffer(max(n, 1))
            m.dstHost = ctypes.addressof(out)
        self._copy_nd(kind, m, stream)
        self._check("cuStreamSynchronize", stream or None)
        return memoryview(out).cast("B")[:n]

    # ------------------------------------------------------------------ modules

    def _params(self, handle: int, kernel: bool) -> tuple[int, list[tuple[int, int]]]:
        fn = self.f["cuKernelGetParamInfo" if kernel else "cuFuncGetParamInfo"]
        out: list[tuple[int, int]] = []
        off, size = c_size_t(), c_size_t()
        while True:
            r = fn(handle, len(out), byref(off), byref(size))
            if r == INVALID_VALUE:
                return SUCCESS, out           # past the last parameter
            if r != SUCCESS:
                return r, out
            out.append((off.value, size.value))

    def _fn_info(self, handle: int, kernel: bool = False) -> FnInfo:
        name = ctypes.c_char_p()
        r = self._call("cuKernelGetName" if kernel else "cuFuncGetName", byref(name), handle)
        if r != SUCCESS and not kernel:
            return self._fn_info(handle, kernel=True)  # a CUkernel used as a CUfunction
        if r != SUCCESS:
            raise CudaError(r)
        r, params = self._params(handle, kernel)
        if r != SUCCESS and not kernel:
            self._call("cuFuncLoad", handle)  # lazily loaded: load it, then ask again
            r, params = self._params(handle, kernel)
        if r != SUCCESS:
            raise CudaError(r)
        return FnInfo(handle, (name.value or b"").decode("utf-8", "replace"), tuple(params))

    def _enumerate(self, handle: int, kind: str) -> list[FnInfo]:
        count = c_uint()
        getcount, enum = (("cuLibraryGetKernelCount", "cuLibraryEnumerateKernels") if kind == "library"
                          else ("cuModuleGetFunctionCount", "cuModuleEnumerateFunctions"))
        if self._call(getcount, byref(count), handle) != SUCCESS or count.value == 0:
            return []
        arr = (c_void_p * count.value)()
        if self._call(enum, arr, count.value, handle) != SUCCESS:
            return []
        out: list[FnInfo] = []
        for h in arr:
            try:
                out.append(self._fn_info(h or 0, kernel=(kind == "library")))
            except CudaError:
                continue  # the client asks for it at its first launch and sees the error then
        return out

    def load(self, kind: str, image: bytes | mmap.mmap, options: list[tuple[int, int]],
             lib_options: list[tuple[int, int]], want_table: bool = True) -> LoadResult:
        sizes = {o: v for o, v in options}
        logs: dict[int, Any] = {}
        values = []
        for opt, value in options:
            if opt in (JIT_INFO_LOG_BUFFER, JIT_ERROR_LOG_BUFFER):
                size = max(1, min(sizes.get(opt + 1, 0), 1 << 20))
                logs[opt] = ctypes.create_string_buffer(size)
                values.append(ctypes.addressof(logs[opt]))
            else:
                values.append(value)
        n = len(options)
        opts = (c_int * max(n, 1))(*[o for o, _ in options])
        vals = (c_void_p * max(n, 1))(*values)
        # No copy: ctypes hands the driver a pointer into the bytes, or into the image cache's
        # mapping of its file; the driver keeps its own copy of what it needs (no
        # CU_LIBRARY_BINARY_IS_PRESERVED is passed).
        data = image if isinstance(image, bytes) else (ctypes.c_char * len(image)).from_buffer(image)
        handle = c_void_p()
        if kind == "library":
            # The driver's own copy of each image cost PyTorch's start about 10 ms a library (an
            # image of ~90 MB read through): the image (bytes, or the cache file's mapping) is
            # kept instead, until the library is unloaded, as cudart keeps its fatbins locally.
            lib_options = preserved_library_options(lib_options)
            m = len(lib_options)
            lopts = (c_int * max(m, 1))(*[o for o, _ in lib_options])
            lvals = (c_void_p * max(m, 1))(*[v for _, v in lib_options])
            r = self._call("cuLibraryLoadData", byref(handle), data, opts if n else None, vals if n else None, n,
                           lopts if m else None, lvals if m else None, m)
        else:
            r = self._call("cuModuleLoadDataEx", byref(handle), data, n, opts if n else None, vals if n else None)
        result = LoadResult(code=r, handle=handle.value or 0, option_values=[vals[i] or 0 for i in range(n)],
                            info_log=logs[JIT_INFO_LOG_BUFFER].value if JIT_INFO_LOG_BUFFER in logs else b"",
                            error_log=logs[JIT_ERROR_LOG_BUFFER].value if JIT_ERROR_LOG_BUFFER in logs else b"")
        # The table saves the client a round trip per function. Clients with one slice ask for no
        # library's: cudart registers every fatbin of PyTorch's libraries as a library (tens of
        # thousands of kernels in all) and runs a few hundred of them; asking each kernel's name
        # and parameters here took about half a second per process, and the client asks for the
        # few it launches (rgpuParamInfo, once per kernel).
        if r == SUCCESS and kind == "library":
            self._preserved[result.handle] = (image, data)
        if r == SUCCESS and want_table:
            t0 = time.perf_counter_ns()
            result.functions = self._enumerate(result.handle, kind)
            self.enumerate_ns += time.perf_counter_ns() - t0
        return result

    def get_function(self, module: int, name: str) -> FnInfo:
        fn = c_void_p()
        self._check("cuModuleGetFunction", byref(fn), module, name.encode())
        return self._fn_info(fn.value or 0)

    # ------------------------------------------------------------------ private table 6e163fbe (cuFFT)

    def _private_table(self, uuid: bytes) -> Any:
        """The driver's private table with this UUID as an array of words (word 0: its byte size)."""
        table = c_void_p()
        r = self.lib.cuGetExportTable(byref(table), ctypes.create_string_buffer(uuid, 16))
        if r != SUCCESS or not table.value:
            raise CudaError(NOT_FOUND if r == SUCCESS else r)
        return ctypes.cast(table, P(c_uint64))

    def private_table_size(self, uuid: bytes) -> int:
        return int(self._private_table(uuid)[0])

    def module_nodes(self, ctx: int, module: int) -> list[tuple[int, ...]]:
        """Slot 7 of table 6e163fbe: walk the module's function nodes with a callback, as cuFFT does
        in the client; each node comes back with its owner and the fields the client copies."""
        words = self._private_table(MODULE_NODES_TABLE)
        if words[0] <= 7 * 8 or not words[7]:
            raise CudaError(NOT_FOUND)
        walk = ctypes.CFUNCTYPE(c_uint64, c_uint64, c_uint64, c_uint64, c_uint64, c_uint64, c_uint64)(words[7])
        found: list[tuple[int, int]] = []
        callback = ctypes.CFUNCTYPE(None, c_void_p, c_void_p, c_uint64)(
            lambda _opaque, node, owner: found.append((node or 0, owner)))
        walk(ctx, module, ctypes.cast(callback, c_void_p).value or 0, 0, module, 0)
        nodes: list[tuple[int, ...]] = []
        for node, owner in found:
            word = lambda off, n=node: c_uint64.from_address(n + off).value  # noqa: E731
            nodes.append((node, owner, word(0x0), word(0x10), word(0x18), word(0x28),
                          ctypes.c_uint32.from_address(node + 0x370).value, 0))
        return nodes

    def param_info(self, handle: int) -> FnInfo:
        return self._fn_info(handle)

    def unload(self, kind: str, handle: int) -> None:
        self._check("cuLibraryUnload" if kind == "library" else "cuModuleUnload", handle)
        if kind == "library":
            self._preserved.pop(handle, None)

    def link_create(self, options: list[tuple[int, int]]) -> int:
        link = _Link(options)
        state = c_void_p()
        self._check("cuLinkCreate_v2", link.n, link.opts, link.vals, byref(state))
        self._links[state.value or 0] = link
        return state.value or 0

    def link_add(self, state: int, kind: int, name: str, options: list[tuple[int, int]], data: bytes) -> tuple[int, bytes, bytes]:
        link = self._links.get(state)
        if link is None:
            return INVALID_HANDLE, b"", b""
        buf = ctypes.create_string_buffer(data, len(data))
        link.inputs.append(buf)  # type: ignore[arg-type]
        n = len(options)
        opts = (c_int * max(n, 1))(*[o for o, _ in options])
        vals = (c_void_p * max(n, 1))(*[v for _, v in options])
        r = self._call("cuLinkAddData_v2", state, kind, buf, len(data), name.encode(), n, opts if n else None,
                       vals if n else None)
        return r, link.info.value, link.error.value

    def link_complete(self, state: int) -> tuple[int, bytes, bytes, bytes]:
        link = self._links.get(state)
        if link is None:
            return INVALID_HANDLE, b"", b"", b""
        cubin, size = c_void_p(), c_size_t()
        r = self._call("cuLinkComplete", state, byref(cubin), byref(size))
        image = ctypes.string_at(cubin.value, size.value) if r == SUCCESS and cubin.value else b""
        return r, link.info.value, link.error.value, image

    def link_destroy(self, state: int) -> None:
        self._links.pop(state, None)
        self._check("cuLinkDestroy", state)

    # ------------------------------------------------------------------ launches

    def launch(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int], shmem: int,
               cooperative: bool, attrs: bytes, params: memoryview, params_address: int) -> None:
        n = len(params)
        if n > MAX_PARAM_BYTES:
            raise CudaError(INVALID_VALUE)
        ctypes.memmove(self._param_buf, params_address, n)  # an aligned copy the driver reads
        self._extra[1] = ctypes.addressof(self._param_buf)
        self._param_size.value = n
        if not attrs and not cooperative:
            r = self.f["cuLaunchKernel"](f, grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem,
                                         stream or None, None, self._extra)
        else:
            if cooperative:
                coop = bytearray(72)
                coop[0:4] = LAUNCH_ATTRIBUTE_COOPERATIVE.to_bytes(4, "little")
                coop[8:12] = (1).to_bytes(4, "little")
                attrs = attrs + bytes(coop)
            raw = ctypes.create_string_buffer(attrs, len(attrs))
            config = CUlaunchConfig(grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem, stream or None,
                                    ctypes.addressof(raw), len(attrs) // 72)
            r = self.f["cuLaunchKernelEx"](byref(config), f, None, self._extra)
        if r != SUCCESS:
            raise CudaError(r)

    def launch_entry(self) -> int:
        """The address of the driver's cuLaunchKernel, for the worker's native launch loop."""
        return int(ctypes.cast(self._launch, c_void_p).value or 0)

    def event_entries(self) -> tuple[int, int, int, int, int]:
        """The driver's cuEventCreate, cuEventRecord, cuEventRecordWithFlags, cuStreamWaitEvent and
        cuEventDestroy_v2, by the exact symbols the Python path calls, for the native loop
        (worker/native_loop.py's EventEntries; 0 where the driver lacks one: it stays in Python)."""
        address = self._entry
        return (address("cuEventCreate"), address("cuEventRecord"), address("cuEventRecordWithFlags"),
                address("cuStreamWaitEvent"), address("cuEventDestroy_v2"))

    def copy_entries(self) -> tuple[int, int]:
        """The driver's cuMemcpyDtoHAsync_v2 and cuStreamIsCapturing, for the native loop's small
        device-to-host copies (worker/native_loop.py's CopyEntries; 0: they stay in Python)."""
        return self._entry("cuMemcpyDtoHAsync_v2"), self._entry("cuStreamIsCapturing")

    def _entry(self, name: str) -> int:
        """The address of the driver's `name`, by exact symbol; 0 where the driver lacks it."""
        try:
            return int(ctypes.cast(getattr(self.lib, name), c_void_p).value or 0)
        except AttributeError:
            return 0

    def launch_fast(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int, stream: int,
                    address: int, argsize: int) -> int:
        """A plain launch taken straight from the worker's receive buffer (frames are 8-aligned)."""
        if address & 7 or argsize > MAX_PARAM_BYTES:
            if argsize > MAX_PARAM_BYTES:
                return INVALID_VALUE
            ctypes.memmove(self._param_buf, address, argsize)
            address = ctypes.addressof(self._param_buf)
        self._extra[1] = address
        self._param_size.value = argsize
        return self._launch(f, gx, gy, gz, bx, by, bz, shmem, stream, None, self._extra)

    def max_potential_block_size(self, f: int, smem: int, limit: int, flags: int) -> tuple[int, int]:
        grid, block = c_int(), c_int()
        self._check("cuOccupancyMaxPotentialBlockSizeWithFlags", byref(grid), byref(block), f, None, smem, limit, flags)
        return grid.value, block.value

    def max_active_clusters(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                            shmem: int, attrs: bytes) -> int:
        raw = ctypes.create_string_buffer(attrs, max(len(attrs), 1))
        config = CUlaunchConfig(grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem, stream or None,
                                ctypes.addressof(raw) if attrs else None, len(attrs) // 72)
        clusters = c_int()
        self._check("cuOccupancyMaxActiveClusters", byref(clusters), f, byref(config))
        return clusters.value

    def tensor_map(self, q: TensorMapRequest) -> bytes:
        """The driver's encoding, made in a 64-byte aligned buffer as it requires. The entry points
        are looked up at first use: drivers before CUDA 12.8 lack cuTensorMapEncodeIm2colWide."""
        raw = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
        at = (ctypes.addressof(raw) + 63) & ~63
        u64s, u32s, i32s = c_uint64 * 5, ctypes.c_uint32 * 5, c_int * 5
        dims, strides, elem = u64s(*q.dims), u64s(*q.strides), u32s(*q.element_strides)
        address = q.address or None
        if q.kind == TENSOR_MAP_REPLACE:
            ctypes.memmove(at, q.map, TENSOR_MAP_BYTES)
            r = self._late_fn("cuTensorMapReplaceAddress", [c_void_p, c_void_p])(at, address)
        elif q.kind == TENSOR_MAP_IM2COL:
            r = self._late_fn("cuTensorMapEncodeIm2col", [
                c_void_p, c_int, ctypes.c_uint32, c_void_p, P(c_uint64), P(c_uint64), P(c_int), P(c_int),
                ctypes.c_uint32, ctypes.c_uint32, P(ctypes.c_uint32), c_int, c_int, c_int, c_int])(
                at, q.data_type, q.rank, address, dims, strides, i32s(*q.lower), i32s(*q.upper), q.channels, q.pixels,
                elem, q.interleave, q.swizzle, q.l2_promotion, q.oob_fill)
        elif q.kind == TENSOR_MAP_IM2COL_WIDE:
            r = self._late_fn("cuTensorMapEncodeIm2colWide", [
                c_void_p, c_int, ctypes.c_uint32, c_void_p, P(c_uint64), P(c_uint64), c_int, c_int, ctypes.c_uint32,
                ctypes.c_uint32, P(ctypes.c_uint32), c_int, c_int, c_int, c_int, c_int])(
                at, q.data_type, q.rank, address, dims, strides, q.lower_w, q.upper_w, q.channels, q.pixels, elem,
                q.interleave, q.wide_mode, q.swizzle, q.l2_promotion, q.oob_fill)
        else:
            r = self._late_fn("cuTensorMapEncodeTiled", [
                c_void_p, c_int, ctypes.c_uint32, c_void_p, P(c_uint64), P(c_uint64), P(ctypes.c_uint32),
                P(ctypes.c_uint32), c_int, c_int, c_int, c_int])(
                at, q.data_type, q.rank, address, dims, strides, u32s(*q.box), elem, q.interleave, q.swizzle,
                q.l2_promotion, q.oob_fill)
        if r != SUCCESS:
            raise CudaError(r)
        return ctypes.string_at(at, TENSOR_MAP_BYTES)

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
