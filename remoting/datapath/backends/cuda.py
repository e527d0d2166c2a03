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

The backend is one class made of parts, one module each (a mixin over CudaDevice's state):
cuda_driver.py (entry points, structures, constants), cuda_device.py (state, allocations, capture
count, virtual memory, pointer attributes), cuda_copies.py, cuda_arrays.py, cuda_graphs.py,
cuda_modules.py (modules and launches); nccl_cuda.py is its NCCL. This module keeps contexts and
device attributes, which touch every part's per-context state.
"""

from __future__ import annotations

from rgpu.remoting.datapath.backends.base import SUCCESS, cu
from rgpu.remoting.datapath.backends.cuda_driver import c_void_p, c_int, byref
from rgpu.remoting.datapath.backends.cuda_arrays import CudaArrays
from rgpu.remoting.datapath.backends.cuda_graphs import CudaGraphs
from rgpu.remoting.datapath.backends.cuda_modules import CudaModules
from rgpu.remoting.datapath.backends.nccl_cuda import CudaNccl

# What a GPU across the network cannot do for this client, whatever the local driver says. Managed
# memory is emulated by the client (native/src/managed.c) without concurrent access: the device
# says MANAGED_MEMORY 1, CONCURRENT_MANAGED_ACCESS 0, as GPUs before Pascal did.
_ATTRIBUTE_OVERRIDES = {cu(f"CU_DEVICE_ATTRIBUTE_{name}"): 0 for name in (
    "CAN_MAP_HOST_MEMORY", "CONCURRENT_MANAGED_ACCESS", "PAGEABLE_MEMORY_ACCESS",
    "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES", "DIRECT_MANAGED_MEM_ACCESS_FROM_HOST",
    "HOST_NATIVE_ATOMIC_SUPPORTED", "CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", "COOPERATIVE_MULTI_DEVICE_LAUNCH",
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "HANDLE_TYPE_FABRIC_SUPPORTED", "IPC_EVENT_SUPPORTED",
    "DMA_BUF_SUPPORTED", "GPU_DIRECT_RDMA_SUPPORTED", "HOST_ALLOC_DMA_BUF_SUPPORTED")}


class CudaBackend(CudaArrays, CudaGraphs, CudaModules, CudaNccl):
    """NVIDIA's driver for one session (device 0 of the worker); its NCCL is nccl_cuda.py."""

    emulated = False

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
