"""The real-GPU backend's driver bindings: hand-written entry points (symbol, argtypes), the
driver structures rgpu fills, constants, and the check that the loaded libcuda.so.1 is NVIDIA's."""

from __future__ import annotations

import ctypes
import os

from rgpu.remoting.datapath.backends.base import NOT_SUPPORTED, CudaError, cu

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


# The client library's default lane chunk (RGPU_LANE_CHUNK_BYTES): the staging's slots are counted for it.
DEFAULT_LANE_CHUNK_BYTES = 2 << 20


def staging_slots(configured: int, chunk: int) -> int:
    """Slots of a session's striped-copy staging for chunks of `chunk` bytes: `configured`
    (RGPU_LANE_SLOTS), fewer where chunks are larger than the client library's default, so that the
    page-locked memory stays what the GPU node's admin configured (16 slots of 2 MiB: 32 MiB). The
    chunk size is the client's choice (up to 64 MiB): without the bound, one session had its worker
    ask the driver for 1 GiB (16 x 64 MiB, by the code; not run). Two at least, so that a chunk
    lands while the other's DMA runs."""
    return max(2, min(configured, configured * DEFAULT_LANE_CHUNK_BYTES // max(chunk, 1)))


MAX_PARAM_BYTES = 32768

JIT_INFO_LOG_BUFFER = 3
LIBRARY_BINARY_IS_PRESERVED = 1   # CUlibraryOption: the driver reads the image where it lies, no copy
JIT_INFO_LOG_BUFFER_SIZE = 4
JIT_ERROR_LOG_BUFFER = 5
JIT_ERROR_LOG_BUFFER_SIZE = 6
MEMHOSTALLOC_PORTABLE = 1
MEMHOSTALLOC_DEVICEMAP = 2
STREAM_NON_BLOCKING = 1
STREAM_WAIT_VALUE_GEQ = 0
MEMHOSTREGISTER_PORTABLE = 1
MODULE_NODES_TABLE = bytes.fromhex("6e163fbeb958444d835ce182aff1991e")
LAUNCH_ATTRIBUTE_COOPERATIVE = cu("CU_LAUNCH_ATTRIBUTE_COOPERATIVE")


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
    "cuEventQuery": [c_void_p],
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

