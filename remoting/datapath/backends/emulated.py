"""The emulated backend: a device whose memory lives in the worker's host memory.

It exists so that CI, which has no GPU, tests the real client library, protocol, worker, limits
and error paths end to end: allocations, copies, memsets, memory info, device and context
queries (values from the dispatcher's GpuInfo), streams and events, PTX module loads with
parameter layouts parsed from the PTX, function attributes checked as the driver checks them,
tensor maps. Kernel launches are refused with a clear error, except the fake kernels below.
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
import re
import signal
import struct
import time
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rgpu.remoting.datapath.worker.faults import EMULATED_MPS_FAULT, EMULATED_MPS_LOG
from rgpu.remoting.datapath.backends.arrays import (ARRAY, CHANNEL_BYTES, CUBEMAP, DEFERRED_MAPPING, DEVICE, HOST,
                                                    LAYERED, RESOURCE_ARRAY, RESOURCE_LINEAR, RESOURCE_MIPMAPPED_ARRAY,
                                                    RESOURCE_PITCH2D, SURFACE_LDST, VIEW_DESC_SIZE, ArrayDesc, CopySide,
                                                    parse_copy)
from rgpu.remoting.datapath.backends.nccl_emulated import EmulatedNccl
from rgpu.remoting.datapath.backends.base import (
    INVALID_CONTEXT,
    INVALID_HANDLE,
    INVALID_IMAGE,
    INVALID_VALUE,
    MEMPOOL_RELEASE_THRESHOLD,
    MEMPOOL_RESERVED_CURRENT,
    MEMPOOL_RESERVED_HIGH,
    MEMPOOL_USED_CURRENT,
    MEMPOOL_USED_HIGH,
    NOT_FOUND,
    NOT_SUPPORTED,
    NVML_ERROR_NOT_SUPPORTED,
    OUT_OF_MEMORY,
    SUCCESS,
    TENSOR_MAP_BYTES,
    TENSOR_MAP_IM2COL_WIDE,
    TENSOR_MAP_REPLACE,
    TENSOR_MAP_TILED,
    CudaError,
    FnInfo,
    TensorMapRequest,
    LoadResult,
    cu,
    enums,
    slice_usage,
)

EMULATED_DRIVER_VERSION = 13000
_ALIGN = 512
_BASE_ADDRESS = 0x6000_0000_0000


def _address_base() -> int:
    """Where this worker's allocations start: a random 4 GiB-aligned slot in 16 TiB, as a real
    driver's address space lands wherever the process's mmap puts it. Two sessions of one
    application (devices 0 and 1) then hold different addresses, as they do on real GPUs, so
    copies routed by pointer are tested for real."""
    return _BASE_ADDRESS + (int.from_bytes(os.urandom(2), "little") % 4096 << 32)

# Device attributes an H100/H200-class GPU reports; the rest read 0.
_ATTRIBUTES = {
    "MAX_THREADS_PER_BLOCK": 1024, "MAX_BLOCK_DIM_X": 1024, "MAX_BLOCK_DIM_Y": 1024, "MAX_BLOCK_DIM_Z": 64,
    "MAX_GRID_DIM_X": 2147483647, "MAX_GRID_DIM_Y": 65535, "MAX_GRID_DIM_Z": 65535,
    "MAX_SHARED_MEMORY_PER_BLOCK": 49152, "TOTAL_CONSTANT_MEMORY": 65536, "WARP_SIZE": 32,
    "MAX_PITCH": 2147483647, "MAX_REGISTERS_PER_BLOCK": 65536, "CLOCK_RATE": 1980000,
    "TEXTURE_ALIGNMENT": 512, "GPU_OVERLAP": 1, "MULTIPROCESSOR_COUNT": 132, "CONCURRENT_KERNELS": 1,
    "ECC_ENABLED": 1, "PCI_BUS_ID": 6, "PCI_DEVICE_ID": 0, "PCI_DOMAIN_ID": 0, "MEMORY_CLOCK_RATE": 2619000,
    "GLOBAL_MEMORY_BUS_WIDTH": 5120, "L2_CACHE_SIZE": 52428800, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
    "ASYNC_ENGINE_COUNT": 3, "UNIFIED_ADDRESSING": 1, "STREAM_PRIORITIES_SUPPORTED": 1,
    "MANAGED_MEMORY": 1,   # emulated by the client (native/src/managed.c), without concurrent access
    "GLOBAL_L1_CACHE_SUPPORTED": 1, "LOCAL_L1_CACHE_SUPPORTED": 1,
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472, "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536,
    "COMPUTE_PREEMPTION_SUPPORTED": 1, "COOPERATIVE_LAUNCH": 1, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
    "HOST_REGISTER_SUPPORTED": 1, "MAX_BLOCKS_PER_MULTIPROCESSOR": 32, "MEMORY_POOLS_SUPPORTED": 1,
    "CLUSTER_LAUNCH": 1, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1, "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024,
    "MAX_PERSISTING_L2_CACHE_SIZE": 32505856, "MAX_ACCESS_POLICY_WINDOW_SIZE": 134213632,
    "MEM_SYNC_DOMAIN_COUNT": 4, "TENSOR_MAP_ACCESS_SUPPORTED": 1, "NUMA_ID": -1, "HOST_NUMA_ID": -1,
}

# Devices other than the H100/H200 class, by name (the dispatcher's GpuInfo), so that slices of
# one application can differ as real ones do (an A100's SMs and shared memory).
_MODELS = {
    "A100": {"MULTIPROCESSOR_COUNT": 108, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 166912,
             "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 167936, "L2_CACHE_SIZE": 41943040, "CLUSTER_LAUNCH": 0,
             "TENSOR_MAP_ACCESS_SUPPORTED": 0},
}


def device_attributes(gpu_name: str) -> dict[str, int]:
    """The emulated device's attributes: an H100/H200's, or those of a model named in _MODELS."""
    model = next((m for key, m in _MODELS.items() if key in gpu_name), {})
    return {**_ATTRIBUTES, **model}


# CUfunction_attribute values the emulated functions answer and check.
FUNC_SHARED_SIZE_BYTES = 1
FUNC_MAX_DYNAMIC_SHARED = 8
FUNC_CARVEOUT = 9
FUNC_CLUSTER_SIZE_MUST_BE_SET = 10
FUNC_NON_PORTABLE_CLUSTER = 14
FUNC_SCHEDULING_POLICY = 15
_FUNC_DEFAULTS = {0: 1024, 4: 16, 5: 90, 6: 90, FUNC_MAX_DYNAMIC_SHARED: 49152}

_LAUNCH_REFUSED = ("rgpu: worker: kernel launch refused (this dispatcher emulates its GPU and cannot run "
                   "kernels; run the application against a dispatcher started with --backend cuda on a GPU node)")

# Fake kernels, the only ones the emulated GPU "runs", so that CI can test what a real GPU does to
# sessions (no GPU there). A launch of EMULATED_SPIN never finishes: the session's next
# synchronising call blocks for ever, with SIGTERM ignored, as by a driver call that does not return
# to it (so the dispatcher's SIGKILL is what ends it). A launch of EMULATED_WILD_WRITE is a wild
# write: the context's sticky CUDA_ERROR_ILLEGAL_ADDRESS, and on a GPU shared by MPS every other
# session of that GPU gets it too (the fault domain is a marker file in the GPU's shared folder,
# which the dispatcher clears when it recovers the GPU, as a restarted MPS server would be clean).
EMULATED_SPIN = "rgpu_emulated_spin_forever"
# A kernel the emulated GPU runs: it writes the launch's dynamic shared memory size (u32) to its
# first parameter, a device pointer, so tests see what a launch got.
EMULATED_SHARED_PROBE = "rgpu_emulated_shared_probe"
EMULATED_WILD_WRITE = "rgpu_emulated_wild_write"
ILLEGAL_ADDRESS = 700

_PTX_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.DOTALL)
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.([busf])(8|16|32|64)\s+[\w$]+(?:\[(\d+)\])?")


def ptx_entries(text: str) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """Kernel names and parameter layouts (offset, size) as the driver computes them."""
    out = []
    for m in _PTX_ENTRY.finditer(text):
        offset = 0
        params = []
        for p in _PTX_PARAM.finditer(m.group(2)):
            elem = int(p.group(3)) // 8
            count = int(p.group(4) or 1)
            align = int(p.group(1) or elem)
            offset = (offset + align - 1) // align * align
            params.append((offset, elem * count))
            offset += elem * count
        out.append((m.group(1), tuple(params)))
    return out


def ptx_local_sizes(text: str) -> dict[str, int]:
    """Each kernel's local memory per thread: the size of its `__local_depot` (what the driver
    reports as CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)."""
    starts = [(m.start(), m.group(1)) for m in _PTX_ENTRY.finditer(text)] + [(len(text), "")]
    sizes = {}
    for (at, name), (end, _) in zip(starts, starts[1:]):
        depot = re.search(r"__local_depot\d*\[(\d+)\]", text[at:end])
        if depot:
            sizes[name] = int(depot.group(1))
    return sizes


# CUarray_format values of cuda.h (CUDA 13): what an array may be created with.
_KNOWN_FORMATS = frozenset({0x01, 0x02, 0x03, 0x08, 0x09, 0x0A, 0x10, 0x20, 0x50, 0xB0, *range(0xC0, 0xCC),
                            *range(0x91, 0xA0), *range(0xA1, 0xAA), *range(0xB1, 0xB6)})


# Tensor maps (cuTensorMapEncodeTiled's documentation): element sizes of CUtensorMapDataType 0-12 (the
# packed 4- and 6-bit types 13-15 count as bytes), the largest enumerator of each option.
_TENSOR_ELEMENT_BYTES = (1, 2, 4, 4, 8, 8, 2, 4, 8, 2, 4, 4, 4, 1, 1, 1)
_INTERLEAVE_32B = 2
_CORNER_BITS = {3: 16, 4: 8, 5: 5}   # im2col corners: signed, by rank


def _tensor_map_valid(q: TensorMapRequest) -> bool:
    rank = q.rank
    lowest = 3 if q.kind != TENSOR_MAP_TILED or q.interleave else 1
    if not (lowest <= rank <= 5 and q.data_type < len(_TENSOR_ELEMENT_BYTES) and q.interleave <= 2
            and q.swizzle <= 7 and q.l2_promotion <= 3 and q.oob_fill <= 1):
        return False
    stride_align = 32 if q.interleave == _INTERLEAVE_32B else 16
    if any(not 0 < d <= 1 << 32 for d in q.dims[:rank]) or any(not 1 <= e <= 8 for e in q.element_strides[:rank]):
        return False
    if any(s % stride_align or s >= 1 << 40 for s in q.strides[:rank - 1]):
        return False
    if q.kind == TENSOR_MAP_TILED:
        inner_bytes = q.box[0] * _TENSOR_ELEMENT_BYTES[q.data_type]
        return all(1 <= b <= 256 for b in q.box[:rank]) and (q.interleave or inner_bytes % 16 == 0)
    if not (1 <= q.channels <= 256 and 1 <= q.pixels <= 1024):
        return False
    if q.kind == TENSOR_MAP_IM2COL_WIDE:
        return q.wide_mode <= 1 and -32768 <= q.lower_w <= 32767 and -32768 <= q.upper_w <= 32767
    half = 1 << (_CORNER_BITS[rank] - 1)
    return all(-half <= c < half for c in (*q.lower[:rank - 2], *q.upper[:rank - 2]))


class _EmuArray:
    """An emulated CUDA array: its descriptor and its texels, rows packed."""

    def __init__(self, desc: ArrayDesc, owner: int = 0) -> None:
        self.desc = desc
        self.owner = owner          # the mipmapped array this is a level of (0: none)
        self.data = bytearray(self.size_of(desc))

    @staticmethod
    def size_of(desc: ArrayDesc) -> int:
        return desc.row_bytes * desc.rows * desc.planes


class _StreamOrderedPool:
    """The device's default stream-ordered pool, emulated: memory freed with cuMemFreeAsync stays
    reserved up to the release threshold (as the driver keeps it after its next synchronisation),
    later async allocations reuse it first, and cuMemPoolTrimTo gives back what is above `keep`."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.kept = 0
        self.threshold = 0
        self.reserved_high = self.used_high = 0

    @property
    def used(self) -> int:
        return sum(self.live.values())

    @property
    def reserved(self) -> int:
        return self.used + self.kept

    def allocate(self, ptr: int, size: int) -> None:
        self.kept = max(0, self.kept - size)
        self.live[ptr] = size
        self.used_high = max(self.used_high, self.used)
        self.reserved_high = max(self.reserved_high, self.reserved)

    def free(self, ptr: int) -> None:
        size = self.live.pop(ptr, None)
        if size is not None:
            self.kept = min(self.kept + size, max(0, self.threshold - self.used))

    def trim(self, keep: int) -> None:
        self.kept = min(self.kept, max(0, keep - self.used))

    def attribute(self, attr: int, value: int, set_it: bool) -> int:
        if attr == MEMPOOL_RELEASE_THRESHOLD:
            if set_it:
                self.threshold = value
            return self.threshold
        if set_it:
            if attr == MEMPOOL_RESERVED_HIGH:
                self.reserved_high = self.reserved
            elif attr == MEMPOOL_USED_HIGH:
                self.used_high = self.used
            return value
        return {MEMPOOL_RESERVED_CURRENT: self.reserved, MEMPOOL_RESERVED_HIGH: self.reserved_high,
                MEMPOOL_USED_CURRENT: self.used, MEMPOOL_USED_HIGH: self.used_high}.get(attr, 0)


class _Handles:
    def __init__(self, base: int) -> None:
        self.next = base

    def new(self) -> int:
        self.next += 0x100
        return self.next


# CUgraphNodeType of the node kinds rgpuGraphAddNode builds (cuda_graph.c's NODE_*).
_NODE_TYPES = {0: 5, 1: 0, 2: 2, 3: 1, 4: 10, 5: 11, 6: 1, 7: 3, 8: 4, 9: 7, 10: 6}
NODE_TYPE_HOST = 3
NODE_TYPE_MEMSET, NODE_TYPE_MEMCPY = 2, 1


class _HostNode:
    """A host node: asks the client to run its function (worker/hostcalls.py) and waits for it;
    the emulated device runs a graph's nodes in order, so its dependencies have finished."""

    def __init__(self, backend: "EmulatedBackend", node: int, fn_id: int, regions: list[tuple[int, int, bool]]) -> None:
        self.backend, self.node, self.fn_id = backend, node, fn_id
        self.regions = regions   # the graph's host-copy buffers (shared with the graph)

    def copy(self) -> "_HostNode":
        return _HostNode(self.backend, self.node, self.fn_id, self.regions)

    def __call__(self) -> tuple[int]:
        calls = self.backend.host_calls
        if calls is not None:
            calls.run(self.fn_id, 0, self.regions)
        return (SUCCESS,)


class _ChildNode:
    """A child graph node: runs its own copy of the child graph's operations (CUDA clones the
    child into the node), in order, as the emulated device runs every graph."""

    def __init__(self, node: int, graph: int, ops: list[Any]) -> None:
        self.node, self.graph, self.ops = node, graph, ops

    def copy(self) -> "_ChildNode":
        return _ChildNode(self.node, self.graph, _instance(self.ops))

    def __call__(self) -> tuple[int]:
        for op in self.ops:
            r = op()[0]
            if r != SUCCESS:
                return (r,)
        return (SUCCESS,)


def _instance(ops: list[Any]) -> list[Any]:
    """A graph's operations for a clone or an executable graph: host and child graph nodes get
    their own parameters (setting one graph's node leaves the other's as it was)."""
    return [op.copy() if isinstance(op, (_HostNode, _ChildNode)) else op for op in ops]


def device_bytes(size: int) -> bytearray:
    """An emulated allocation's bytes, which live in the worker's host RAM: a size the host cannot hold
    is the GPU's OUT_OF_MEMORY with one line, not an internal error (issue 29)."""
    try:
        return bytearray(size)
    except (MemoryError, OverflowError):
        raise CudaError(OUT_OF_MEMORY, f"rgpu: worker: the emulated GPU keeps its device memory in this host's RAM, "
                        f"which cannot hold {size} more bytes (RGPU_GPU_DEVICE_MEMORY_LIMIT caps what an emulated "
                        "GPU offers)") from None


class EmulatedBackend(EmulatedNccl):
    """One emulated GPU for one session (device 0 of the worker); its NCCL is nccl_emulated.py."""

    emulated = True
    driver_version = EMULATED_DRIVER_VERSION

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.attr_names = {v: k.removeprefix("CU_DEVICE_ATTRIBUTE_") for k, v in enums()["CUdevice_attribute"].items()}
        major, _, minor = (spec.compute_capability or "9.0").partition(".")
        self.cc = (int(major), int(minor or 0))
        self.total = spec.gpu_total_memory
        self.uuid = _uuid_bytes(spec.gpu_uuid)
        self.primary = 0x9000_0000
        self.primary_refs = 0
        self.primary_flags = 0
        self.contexts: set[int] = set()
        self.ctx_handles = _Handles(0x9100_0000)
        self.current = 0
        self.allocs: dict[int, bytearray] = {}
        self.bases: list[int] = []
        self.next_address = _address_base()
        self.handles = _Handles(0x5000_0000)
        self.streams: dict[int, tuple[int, int]] = {}     # handle -> (flags, priority)
        self.events: dict[int, float | None] = {}
        # The device's room for events: unbounded unless RGPU_EMULATED_MAX_EVENTS (in the worker's
        # environment) says otherwise, so tests can make a creation fail as a full GPU's would.
        self.max_events = int(os.environ.get("RGPU_EMULATED_MAX_EVENTS", "0") or 0)
        self.modules: dict[int, list[FnInfo]] = {}
        self.libraries: dict[int, int] = {}              # library -> its module
        self.functions: dict[int, tuple[int, FnInfo]] = {}  # function or kernel -> (module, info)
        self.links: dict[int, list[bytes]] = {}
        self.limits: dict[int, int] = {}
        self.func_attrs: dict[tuple[int, int], int] = {}   # (function or kernel, attribute) -> value set
        self.attributes = device_attributes(spec.gpu_name)
        # A driver stricter than the device's attributes say (RGPU_EMULATED_REFUSE_SHARED_ABOVE, in the
        # worker's environment): tests make a pipelined attribute set fail on the worker with it.
        self.refuse_shared_above = int(os.environ.get("RGPU_EMULATED_REFUSE_SHARED_ABOVE", "0") or 0)
        self.pools = {0xA000_0000}
        self.pool = _StreamOrderedPool()
        self.capturing: dict[int, tuple[int, int]] = {}  # stream -> (capture id, graph)
        self.capture_seq = 0
        self.capture_mode = 0
        self.graphs: dict[int, list[Any]] = {}            # graph -> its operations
        self.graph_deps: dict[int, dict[int, tuple[int, ...]]] = {}   # graph -> its nodes -> their dependencies
        self.node_ops: dict[int, Any] = {}   # node -> what it runs (to take a node out again)
        self.capture_tail: dict[int, list[int]] = {}      # capturing stream -> what its next node depends on
        self.execs: dict[int, list[Any]] = {}
        self.node_types: dict[int, int] = {}              # nodes added by hand or host nodes -> CUgraphNodeType
        self.host_nodes: dict[int, _HostNode] = {}        # a graph's host nodes
        self.child_nodes: dict[int, _ChildNode] = {}      # child graph nodes
        self.host_calls: Any = None                       # the worker's HostCalls (set by the worker)
        self.graph_regions: dict[int, list[tuple[int, int, bool]]] = {}   # graph -> its host-copy buffers
        self.physical: dict[int, list[Any]] = {}          # handle -> [bytes, references]
        self.graph_host: dict[int, bytearray] = {}        # buffers of copy nodes with a host side
        self.reserved: dict[int, int] = {}
        self.mappings: dict[int, tuple[int, int]] = {}    # address -> (handle, size)
        self.arrays: dict[int, _EmuArray] = {}
        self.mipmaps: dict[int, list[int]] = {}           # mipmapped array -> its levels' arrays
        self.tex_objects: dict[int, tuple[bytes, bytes, bytes]] = {}   # -> resource, texture, view descriptors
        self.surf_objects: dict[int, bytes] = {}
        self.description = f"emulated {spec.gpu_name}"
        self.spinning = False
        self.sticky = 0
        gpu_dir = getattr(spec, "gpu_dir", "")
        self.fault_domain = (Path(gpu_dir) / EMULATED_MPS_FAULT
                             if gpu_dir and getattr(spec, "sharing", "mps") == "mps" else None)

    # ------------------------------------------------------------------ the fake kernels' effects

    def sticky_error(self) -> int:
        """The context's sticky error: its own wild write, or (MPS) another session's on this GPU."""
        if not self.sticky and self.fault_domain is not None and self.fault_domain.exists():
            self.sticky = ILLEGAL_ADDRESS
        return self.sticky

    def _wait_for_kernels(self) -> None:
        if not self.spinning:
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # as a driver call that never returns to it
        while True:
            time.sleep(3600)

    # ------------------------------------------------------------------ contexts

    def _ctx_ok(self, ctx: int) -> bool:
        return ctx == self.primary and self.primary_refs > 0 or ctx in self.contexts

    def set_context(self, ctx: int) -> None:
        self.current = ctx if ctx and self._ctx_ok(ctx) else 0
        if ctx and not self.current:
            raise CudaError(INVALID_CONTEXT)

    def _need_ctx(self) -> None:
        if not self.current or not self._ctx_ok(self.current):
            raise CudaError(INVALID_CONTEXT)

    def primary_ctx_retain(self) -> int:
        self.primary_refs += 1
        return self.primary

    def ctx_create(self, flags: int) -> int:
        ctx = self.ctx_handles.new()
        self.contexts.add(ctx)
        self.current = ctx
        return ctx

    def ctx_destroy(self, ctx: int) -> None:
        if ctx not in self.contexts:
            raise CudaError(INVALID_CONTEXT)
        self.contexts.discard(ctx)
        if self.current == ctx:
            self.current = 0

    def cuDevicePrimaryCtxRelease_v2(self, dev: int) -> tuple[int]:
        if self.primary_refs <= 0:
            return (INVALID_CONTEXT,)
        self.primary_refs -= 1
        return (SUCCESS,)

    def cuDevicePrimaryCtxReset_v2(self, dev: int) -> tuple[int]:
        self.primary_refs = 0
        self.allocs.clear()
        self.bases.clear()
        for table in (self.arrays, self.mipmaps, self.tex_objects, self.surf_objects):
            table.clear()
        return (SUCCESS,)

    def cuDevicePrimaryCtxGetState(self, dev: int) -> tuple[int, int, int]:
        return (SUCCESS, self.primary_flags, int(self.primary_refs > 0))

    def cuDevicePrimaryCtxSetFlags_v2(self, dev: int, flags: int) -> tuple[int]:
        self.primary_flags = flags
        return (SUCCESS,)

    def cuCtxGetDevice(self) -> tuple[int, int]:
        self._need_ctx()
        return (SUCCESS, 0)

    def cuCtxGetDevice_v2(self, ctx: int) -> tuple[int, int]:
        return (SUCCESS, 0) if self._ctx_ok(ctx or self.current) else (INVALID_CONTEXT, 0)

    def cuCtxSynchronize(self) -> tuple[int]:
        self._need_ctx()
        self._wait_for_kernels()
        return (SUCCESS,)

    def cuCtxSynchronize_v2(self, ctx: int) -> tuple[int]:
        return (SUCCESS,) if self._ctx_ok(ctx or self.current) else (INVALID_CONTEXT,)

    def cuCtxGetApiVersion(self, ctx: int) -> tuple[int, int]:
        return (SUCCESS, 13000) if self._ctx_ok(ctx or self.current) else (INVALID_CONTEXT, 0)

    def cuCtxGetFlags(self) -> tuple[int, int]:
        self._need_ctx()
        return (SUCCESS, self.primary_flags)

    def cuCtxSetFlags(self, flags: int) -> tuple[int]:
        self._need_ctx()
        self.primary_flags = flags
        return (SUCCESS,)

    def cuCtxGetId(self, ctx: int) -> tuple[int, int]:
        ctx = ctx or self.current
        return (SUCCESS, ctx & 0xFFFFFF) if self._ctx_ok(ctx) else (INVALID_CONTEXT, 0)

    def cuCtxGetLimit(self, limit: int) -> tuple[int, int]:
        self._need_ctx()
        return (SUCCESS, self.limits.get(limit, 1024))

    def cuCtxSetLimit(self, limit: int, value: int) -> tuple[int]:
        self._need_ctx()
        self.limits[limit] = value
        return (SUCCESS,)

    def cuCtxGetCacheConfig(self) -> tuple[int, int]:
        return (SUCCESS, 0)

    def cuCtxSetCacheConfig(self, config: int) -> tuple[int]:
        return (SUCCESS,)

    def cuCtxGetStreamPriorityRange(self) -> tuple[int, int, int]:
        return (SUCCESS, 0, -5)

    # ------------------------------------------------------------------ device

    def cuDeviceGetName(self, len_: int, dev: int) -> tuple[int, bytes]:
        return (SUCCESS, (self.spec.gpu_name.encode() + b"\0")[:max(len_, 0)])

    def cuDeviceGetUuid(self, dev: int) -> tuple[int, bytes]:
        return (SUCCESS, self.uuid)

    cuDeviceGetUuid_v2 = cuDeviceGetUuid

    def cuDeviceGetAttribute(self, attrib: int, dev: int) -> tuple[int, int]:
        name = self.attr_names.get(attrib)
        if name is None:
            return (INVALID_VALUE, 0)
        if name == "COMPUTE_CAPABILITY_MAJOR":
            return (SUCCESS, self.cc[0])
        if name == "COMPUTE_CAPABILITY_MINOR":
            return (SUCCESS, self.cc[1])
        return (SUCCESS, self.attributes.get(name, 0))

    def cuDeviceComputeCapability(self, dev: int) -> tuple[int, int, int]:
        return (SUCCESS, self.cc[0], self.cc[1])

    def cuDeviceGetPCIBusId(self, len_: int, dev: int) -> tuple[int, bytes]:
        return (SUCCESS, f"0000:{_ATTRIBUTES['PCI_BUS_ID']:02x}:00.0\0".encode()[:max(len_, 0)])

    def cuDeviceGetDefaultMemPool(self, dev: int) -> tuple[int, int]:
        return (SUCCESS, 0xA000_0000)

    cuDeviceGetMemPool = cuDeviceGetDefaultMemPool

    def total_mem(self) -> int:
        return self.total

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

    def capture_open(self) -> bool:
        return bool(self.capturing)

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

    def _locate(self, ptr: int, size: int) -> tuple[bytearray, int]:
        i = bisect.bisect_right(self.bases, ptr) - 1
        if i >= 0:
            base = self.bases[i]
            buf = self.allocs[base]
            off = ptr - base
            if off + size <= len(buf):
                return buf, off
        raise CudaError(INVALID_VALUE)

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
            "IS_MANAGED": b"\0", "DEVICE_ORDINAL": struct.pack("<i", 0), "RANGE_START_ADDR": struct.pack("<Q", base),
            "RANGE_SIZE": struct.pack("<Q", len(buf)), "MAPPED": b"\1", "SYNC_MEMOPS": b"\0",
            "IS_LEGACY_CUDA_IPC_CAPABLE": b"\1", "ACCESS_FLAGS": struct.pack("<I", 3),
        }
        if name not in values:
            raise CudaError(INVALID_VALUE)
        return values[name]

    # ------------------------------------------------------------------ arrays, texture and surface objects
    # An array is its texels in row-major order, rows packed (width x element size bytes), planes
    # after one another; texture and surface objects keep their descriptors, to be read back.

    def _check_desc(self, desc: ArrayDesc, levels: int) -> None:
        if desc.format not in _KNOWN_FORMATS or (desc.format in CHANNEL_BYTES and desc.channels not in (1, 2, 4)):
            raise CudaError(INVALID_VALUE, f"rgpu: worker: array format {desc.format:#x} with {desc.channels} "
                                           "channel(s) is not a CUDA array format")
        if not desc.element_bytes:
            raise CudaError(NOT_SUPPORTED, f"rgpu: worker: the emulated device has no layout for array format "
                                           f"{desc.format:#x} (block-compressed and YUV formats need a real GPU)")
        layered, cube = desc.flags & LAYERED, desc.flags & CUBEMAP
        if (not desc.width or (desc.depth and not desc.height and not layered) or desc.width > 1 << 17
                or desc.height > 1 << 16 or desc.depth > (2048 if layered else 1 << 14)
                or (layered and not desc.depth) or (cube and (desc.width != desc.height or desc.depth % 6))
                or desc.flags & ~0xFF):
            raise CudaError(INVALID_VALUE)
        if not 1 <= levels <= desc.max_levels():
            raise CudaError(INVALID_VALUE)

    def array_footprint(self, desc: ArrayDesc, levels: int) -> int:
        self._need_ctx()
        self._check_desc(desc, levels)
        return sum(_EmuArray.size_of(desc.level(i)) for i in range(levels))

    def array_create(self, kind: str, desc: ArrayDesc, levels: int) -> int:
        self._need_ctx()
        self._check_desc(desc, levels)
        handle = self.handles.new()
        if kind != "mipmapped":
            self.arrays[handle] = _EmuArray(desc)
            return handle
        self.mipmaps[handle] = []
        for i in range(levels):
            level = self.handles.new()
            self.arrays[level] = _EmuArray(desc.level(i), owner=handle)
            self.mipmaps[handle].append(level)
        return handle

    def array_destroy(self, kind: str, handle: int) -> None:
        self._need_ctx()
        if kind == "mipmapped":
            if handle not in self.mipmaps:
                raise CudaError(INVALID_HANDLE)
            for level in self.mipmaps.pop(handle):
                del self.arrays[level]
            return
        array = self.arrays.get(handle)
        if array is None or array.owner:   # a mipmap level goes with its mipmapped array
            raise CudaError(INVALID_HANDLE)
        del self.arrays[handle]

    def cuArrayGetDescriptor_v2(self, array: int) -> tuple[int, bytes]:
        a = self.arrays.get(array)
        return (SUCCESS, a.desc.pack2d()) if a is not None else (INVALID_HANDLE, b"")

    def cuArray3DGetDescriptor_v2(self, array: int) -> tuple[int, bytes]:
        a = self.arrays.get(array)
        return (SUCCESS, a.desc.pack3d()) if a is not None else (INVALID_HANDLE, b"")

    def cuArrayGetMemoryRequirements(self, array: int, device: int) -> tuple[int, bytes]:
        """As the driver: only for arrays made with CUDA_ARRAY3D_DEFERRED_MAPPING."""
        a = self.arrays.get(array)
        if a is None:
            return (INVALID_HANDLE, b"")
        if not a.desc.flags & DEFERRED_MAPPING:
            return (INVALID_VALUE, b"")
        return (SUCCESS, struct.pack("<QQ16x", len(a.data), _ALIGN))

    def cuMipmappedArrayGetMemoryRequirements(self, mipmap: int, device: int) -> tuple[int, bytes]:
        levels = self.mipmaps.get(mipmap)
        if levels is None:
            return (INVALID_HANDLE, b"")
        if not self.arrays[levels[0]].desc.flags & DEFERRED_MAPPING:
            return (INVALID_VALUE, b"")
        return (SUCCESS, struct.pack("<QQ16x", sum(len(self.arrays[lv].data) for lv in levels), _ALIGN))

    def cuMipmappedArrayGetLevel(self, mipmap: int, level: int) -> tuple[int, int]:
        levels = self.mipmaps.get(mipmap)
        if levels is None:
            return (INVALID_HANDLE, 0)
        return (SUCCESS, levels[level]) if level < len(levels) else (INVALID_VALUE, 0)

    def _check_resource(self, res: bytes, surface: bool) -> None:
        kind, flags = struct.unpack_from("<i", res, 0)[0], struct.unpack_from("<I", res, 136)[0]
        if flags:
            raise CudaError(INVALID_VALUE)
        if kind == RESOURCE_ARRAY:
            array = self.arrays.get(struct.unpack_from("<Q", res, 8)[0])
            if array is None:
                raise CudaError(INVALID_HANDLE)
            if surface and not array.desc.flags & SURFACE_LDST:
                raise CudaError(INVALID_VALUE, "rgpu: worker: a surface object needs an array created with "
                                               "CUDA_ARRAY3D_SURFACE_LDST")
            return
        if surface:
            raise CudaError(INVALID_VALUE)
        if kind == RESOURCE_MIPMAPPED_ARRAY:
            if struct.unpack_from("<Q", res, 8)[0] not in self.mipmaps:
                raise CudaError(INVALID_HANDLE)
            return
        if kind not in (RESOURCE_LINEAR, RESOURCE_PITCH2D):
            raise CudaError(INVALID_VALUE)
        ptr, fmt, channels = struct.unpack_from("<QiI", res, 8)
        elem = ArrayDesc(1, 0, 0, fmt, channels).element_bytes
        if not elem or ptr % _ATTRIBUTES["TEXTURE_ALIGNMENT"]:
            raise CudaError(INVALID_VALUE)
        if kind == RESOURCE_LINEAR:
            (size,) = struct.unpack_from("<Q", res, 24)
            extent = size
        else:
            width, height, pitch = struct.unpack_from("<QQQ", res, 24)
            if not width or not height or pitch < width * elem:
                raise CudaError(INVALID_VALUE)
            extent = pitch * (height - 1) + width * elem
        self._locate(ptr, max(extent, 1))

    def tex_object_create(self, res: bytes, tex: bytes, view: bytes | None) -> int:
        self._need_ctx()
        self._check_resource(res, surface=False)
        handle = self.handles.new()
        self.tex_objects[handle] = (res, tex, view or bytes(VIEW_DESC_SIZE))
        return handle

    def cuTexObjectDestroy(self, tex: int) -> tuple[int]:
        return (SUCCESS,) if self.tex_objects.pop(tex, None) is not None else (INVALID_VALUE,)

    def _tex_part(self, tex: int, i: int) -> tuple[int, bytes]:
        entry = self.tex_objects.get(tex)
        return (SUCCESS, entry[i]) if entry is not None else (INVALID_VALUE, b"")

    def cuTexObjectGetResourceDesc(self, tex: int) -> tuple[int, bytes]:
        return self._tex_part(tex, 0)

    def cuTexObjectGetTextureDesc(self, tex: int) -> tuple[int, bytes]:
        return self._tex_part(tex, 1)

    def cuTexObjectGetResourceViewDesc(self, tex: int) -> tuple[int, bytes]:
        return self._tex_part(tex, 2)

    def cuSurfObjectCreate(self, res: bytes) -> tuple[int, int]:
        self._need_ctx()
        self._check_resource(res, surface=True)
        handle = self.handles.new()
        self.surf_objects[handle] = res
        return (SUCCESS, handle)

    def cuSurfObjectDestroy(self, surf: int) -> tuple[int]:
        return (SUCCESS,) if self.surf_objects.pop(surf, None) is not None else (INVALID_VALUE,)

    def cuSurfObjectGetResourceDesc(self, surf: int) -> tuple[int, bytes]:
        res = self.surf_objects.get(surf)
        return (SUCCESS, res) if res is not None else (INVALID_VALUE, b"")

    def _rows(self, side: CopySide, w: int, h: int, d: int, host: Any) -> list[tuple[Any, int]]:
        """(buffer, offset) of each of the h x d rows of w bytes on one side of a copy."""
        if side.kind == ARRAY:
            array = self.arrays.get(side.array)
            if array is None:
                raise CudaError(INVALID_HANDLE)
            desc, elem = array.desc, array.desc.element_bytes
            if (side.lod or side.x % elem or w % elem or side.x + w > desc.row_bytes or side.y + h > desc.rows
                    or side.z + d > desc.planes):
                raise CudaError(INVALID_VALUE)
            row, plane = desc.row_bytes, desc.row_bytes * desc.rows
            return [(array.data, side.x + (side.y + y) * row + (side.z + z) * plane) for z in range(d) for y in range(h)]
        if (h > 1 or d > 1) and side.pitch < w or (d > 1 and side.height < side.y + h):
            raise CudaError(INVALID_VALUE)
        plane = side.pitch * side.height
        last = side.x + (side.y + h - 1) * side.pitch + (side.z + d - 1) * plane   # checked before any row
        if side.kind == HOST:
            if last + w > len(host):
                raise CudaError(INVALID_VALUE)
            return [(host, side.x + (side.y + y) * side.pitch + (side.z + z) * plane) for z in range(d) for y in range(h)]
        if side.kind != DEVICE:
            raise CudaError(INVALID_VALUE)
        self._locate(side.device + last, w)
        return [self._locate(side.device + side.x + (side.y + y) * side.pitch + (side.z + z) * plane, w)
                for z in range(d) for y in range(h)]

    def _copy_nd(self, kind: int, desc: bytes, data: Any, out: bytearray | None) -> None:
        c = parse_copy(desc)
        w, h, d = c.width, c.height, (c.depth if kind == 2 else 1)
        if kind != 2:
            c.src.z = c.dst.z = c.src.lod = c.dst.lod = c.src.height = c.dst.height = 0
        if not w or not h or not d:
            return
        src = self._rows(c.src, w, h, d, data)
        dst = self._rows(c.dst, w, h, d, out)
        rows = [bytes(buf[off:off + w]) for buf, off in src]   # read first: a copy within one array
        for (buf, off), row in zip(dst, rows):
            buf[off:off + w] = row

    def memcpy_array(self, kind: int, desc: bytes, stream: int, data: memoryview, address: int) -> None:
        self._need_ctx()
        if parse_copy(desc).src.kind == HOST:
            self._refuse_capture(stream, "a 2D/3D copy from this process's memory")
            self._copy_nd(kind, desc, data, None)
            return

        def run() -> tuple[int]:
            self._copy_nd(kind, desc, None, None)
            return (SUCCESS,)
        r = self._on_stream(stream, run, NODE_TYPE_MEMCPY)[0]
        if r != SUCCESS:
            raise CudaError(r)

    def memcpy_array_to_host(self, kind: int, desc: bytes, stream: int) -> bytes:
        self._need_ctx()
        self._refuse_capture(stream, "a 2D/3D copy to this process's memory")
        c = parse_copy(desc)
        out = bytearray(c.width * c.height * (max(c.depth, 1) if kind == 2 else 1))
        self._copy_nd(kind, desc, None, out)
        return bytes(out)

    # ------------------------------------------------------------------ streams and events

    def cuStreamCreate(self, flags: int) -> tuple[int, int]:
        self._need_ctx()
        h = self.handles.new()
        self.streams[h] = (flags, 0)
        return (SUCCESS, h)

    def cuStreamCreateWithPriority(self, flags: int, priority: int) -> tuple[int, int]:
        self._need_ctx()
        h = self.handles.new()
        self.streams[h] = (flags, priority)
        return (SUCCESS, h)

    def stream_create(self, flags: int, priority: int) -> int:
        """rgpuStreamCreate: the stream behind a client's handle (worker/client_handles.py)."""
        if flags & ~0x1:
            raise CudaError(INVALID_VALUE)
        r, h = self.cuStreamCreateWithPriority(flags, priority)
        if r != SUCCESS:
            raise CudaError(r)
        return h

    def _stream_ok(self, s: int) -> bool:
        return s in (0, 1, 2) or s in self.streams

    def cuStreamDestroy_v2(self, s: int) -> tuple[int]:
        return (SUCCESS,) if self.streams.pop(s, None) is not None else (INVALID_HANDLE,)

    def cuStreamSynchronize(self, s: int) -> tuple[int]:
        self._need_ctx()
        self._wait_for_kernels()
        return (SUCCESS,) if self._stream_ok(s) else (INVALID_HANDLE,)

    cuStreamQuery = cuStreamSynchronize

    def cuStreamWaitEvent(self, s: int, e: int, flags: int) -> tuple[int]:
        return (SUCCESS,) if self._stream_ok(s) and e in self.events else (INVALID_HANDLE,)

    def cuStreamGetPriority(self, s: int) -> tuple[int, int]:
        return (SUCCESS, self.streams.get(s, (0, 0))[1]) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetFlags(self, s: int) -> tuple[int, int]:
        return (SUCCESS, self.streams.get(s, (0, 0))[0]) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetCtx(self, s: int) -> tuple[int, int]:
        return (SUCCESS, self.current) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetId(self, s: int) -> tuple[int, int]:
        return (SUCCESS, s & 0xFFFFFF) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuStreamGetDevice(self, s: int) -> tuple[int, int]:
        return (SUCCESS, 0) if self._stream_ok(s) else (INVALID_HANDLE, 0)

    def cuEventCreate(self, flags: int) -> tuple[int, int]:
        self._need_ctx()
        if flags & ~0x7 or (flags & 0x4 and not flags & 0x2):   # INTERPROCESS needs DISABLE_TIMING
            return (INVALID_VALUE, 0)
        if self.max_events and len(self.events) >= self.max_events:
            return (OUT_OF_MEMORY, 0)
        h = self.handles.new()
        self.events[h] = None
        return (SUCCESS, h)

    def event_create(self, flags: int) -> int:
        """rgpuEventCreate: the event behind a client's handle (worker/client_handles.py)."""
        r, h = self.cuEventCreate(flags)
        if r != SUCCESS:
            raise CudaError(r)
        return h

    def cuEventRecord(self, e: int, s: int) -> tuple[int]:
        if e not in self.events or not self._stream_ok(s):
            return (INVALID_HANDLE,)
        self.events[e] = time.perf_counter()
        return (SUCCESS,)

    def cuEventRecordWithFlags(self, e: int, s: int, flags: int) -> tuple[int]:
        return self.cuEventRecord(e, s)

    def cuEventQuery(self, e: int) -> tuple[int]:
        return (SUCCESS,) if e in self.events else (INVALID_HANDLE,)

    cuEventSynchronize = cuEventQuery

    def cuEventDestroy_v2(self, e: int) -> tuple[int]:
        return (SUCCESS,) if self.events.pop(e, 0) != 0 else (INVALID_HANDLE,)

    def cuEventElapsedTime(self, start: int, end: int) -> tuple[int, float]:
        a, b = self.events.get(start), self.events.get(end)
        if a is None or b is None:
            return (INVALID_HANDLE, 0.0)
        return (SUCCESS, (b - a) * 1000.0)

    cuEventElapsedTime_v2 = cuEventElapsedTime

    # ------------------------------------------------------------------ modules

    def load(self, kind: str, image: bytes | mmap.mmap, options: list[tuple[int, int]],
             lib_options: list[tuple[int, int]], want_table: bool = True) -> LoadResult:
        self._need_ctx()
        image = bytes(image)   # the image cache hands out mappings of its files
        option_values = [v for _, v in options]
        local_sizes: dict[str, int] = {}
        if image[:4] == b"\x7fELF" or image[:4] == struct.pack("<I", 0xBA55ED50):
            entries: list[tuple[str, tuple[tuple[int, int], ...]]] = []  # accepted: no kernels known
        else:
            text = image.rstrip(b"\0").decode("utf-8", "replace")
            if ".version" not in text or ".target" not in text:
                return LoadResult(code=INVALID_IMAGE, option_values=option_values,
                                  error_log=b"emulated device: not a PTX, cubin or fatbin image")
            entries = ptx_entries(text)
            local_sizes = ptx_local_sizes(text)
        module = self.handles.new()
        fns = []
        for name, params in entries:
            handle = self.handles.new()
            if local_sizes.get(name):
                self.func_attrs[(handle, 3)] = local_sizes[name]   # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
            info = FnInfo(handle, name, params)
            self.functions[handle] = (module, info)
            fns.append(info)
        self.modules[module] = fns
        handle = module
        if kind == "library":
            handle = self.handles.new()
            self.libraries[handle] = module
        info_log = f"emulated device: loaded {len(fns)} kernel(s)".encode()
        return LoadResult(handle=handle, option_values=option_values, info_log=info_log,
                          functions=fns if want_table else [])

    def get_function(self, module: int, name: str) -> FnInfo:
        for fn in self.modules.get(module, ()):
            if fn.name == name:
                return fn
        raise CudaError(NOT_FOUND if module in self.modules else INVALID_HANDLE)

    # Private table 6e163fbe slot 7 (cuFFT's module walk), emulated: every function of the module,
    # owned by the module, with the words 1, 2, 3, 4 and 5 standing in for the real node's fields.
    def private_table_size(self, uuid: bytes) -> int:
        if uuid != bytes.fromhex("6e163fbeb958444d835ce182aff1991e"):
            raise CudaError(NOT_FOUND)
        return 12 * 8

    def module_nodes(self, ctx: int, module: int) -> list[tuple[int, ...]]:
        module = self.libraries.get(module, module)
        if module not in self.modules:
            raise CudaError(INVALID_HANDLE)
        return [(f.handle, module, 1, 2, 3, 4, 5, 0) for f in self.modules[module]]

    def param_info(self, handle: int) -> FnInfo:
        if handle not in self.functions:
            raise CudaError(INVALID_HANDLE)
        return self.functions[handle][1]

    def unload(self, kind: str, handle: int) -> None:
        module = self.libraries.pop(handle, None) if kind == "library" else handle
        if module is None or module not in self.modules:
            raise CudaError(INVALID_HANDLE)
        for fn in self.modules.pop(module):
            self.functions.pop(fn.handle, None)

    def cuModuleGetFunctionCount(self, module: int) -> tuple[int, int]:
        return (SUCCESS, len(self.modules[module])) if module in self.modules else (INVALID_HANDLE, 0)

    def cuModuleEnumerateFunctions(self, n: int, module: int) -> tuple[int, list[int]]:
        if module not in self.modules:
            return (INVALID_HANDLE, [])
        return (SUCCESS, [f.handle for f in self.modules[module]][:n])

    def cuModuleGetGlobal_v2(self, module: int, name: str) -> tuple[int, int, int]:
        return (NOT_FOUND, 0, 0)

    def cuLibraryGetModule(self, library: int) -> tuple[int, int]:
        return (SUCCESS, self.libraries[library]) if library in self.libraries else (INVALID_HANDLE, 0)

    def cuLibraryGetKernel(self, library: int, name: str) -> tuple[int, int]:
        module = self.libraries.get(library)
        if module is None:
            return (INVALID_HANDLE, 0)
        try:
            return (SUCCESS, self.get_function(module, name).handle)
        except CudaError as exc:
            return (exc.code, 0)

    def cuKernelGetFunction(self, kernel: int) -> tuple[int, int]:
        return (SUCCESS, kernel) if kernel in self.functions else (INVALID_HANDLE, 0)

    def cuLibraryGetKernelCount(self, library: int) -> tuple[int, int]:
        module = self.libraries.get(library)
        return (SUCCESS, len(self.modules[module])) if module else (INVALID_HANDLE, 0)

    def cuLibraryEnumerateKernels(self, n: int, library: int) -> tuple[int, list[int]]:
        module = self.libraries.get(library)
        return (SUCCESS, [f.handle for f in self.modules[module]][:n]) if module else (INVALID_HANDLE, [])

    def cuFuncGetModule(self, f: int) -> tuple[int, int]:
        return (SUCCESS, self.functions[f][0]) if f in self.functions else (INVALID_HANDLE, 0)

    def cuFuncGetAttribute(self, attrib: int, f: int) -> tuple[int, int]:
        if f not in self.functions:
            return (INVALID_HANDLE, 0)
        return (SUCCESS, self.func_attrs.get((f, attrib), _FUNC_DEFAULTS.get(attrib, 0)))

    def cuFuncSetAttribute(self, f: int, attrib: int, value: int) -> tuple[int]:
        """The driver's checks (cuFuncSetAttribute's documentation): read-only attributes, the opt-in
        shared memory limit, a carveout in percent or -1, cluster sizes of 8 (16 non-portable)."""
        if f not in self.functions:
            return (INVALID_HANDLE,)
        static = self.cuFuncGetAttribute(FUNC_SHARED_SIZE_BYTES, f)[1]
        if attrib == FUNC_MAX_DYNAMIC_SHARED:
            valid = 0 <= value <= self.attributes["MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"] - static
            if valid and self.refuse_shared_above and value > self.refuse_shared_above:
                valid = False
        elif attrib == FUNC_CARVEOUT:
            valid = -1 <= value <= 100
        elif FUNC_CLUSTER_SIZE_MUST_BE_SET < attrib < FUNC_NON_PORTABLE_CLUSTER:
            portable = self.func_attrs.get((f, FUNC_NON_PORTABLE_CLUSTER), 0) == 0
            valid = 0 <= value <= (8 if portable else 16)
        elif attrib == FUNC_NON_PORTABLE_CLUSTER:
            valid = value in (0, 1)
        elif attrib == FUNC_SCHEDULING_POLICY:
            valid = value in (0, 1, 2)
        else:   # read-only, or unknown
            valid = False
        if not valid:
            return (INVALID_VALUE,)
        self.func_attrs[(f, attrib)] = value
        return (SUCCESS,)

    # The emulated device's kernels are their own functions (cuKernelGetFunction): one attribute set.
    def cuKernelGetAttribute(self, attrib: int, kernel: int, dev: int) -> tuple[int, int]:
        return self.cuFuncGetAttribute(attrib, kernel)

    def cuKernelSetAttribute(self, attrib: int, value: int, kernel: int, dev: int) -> tuple[int]:
        return self.cuFuncSetAttribute(kernel, attrib, value)

    def cuFuncSetCacheConfig(self, f: int, config: int) -> tuple[int]:
        return (SUCCESS,) if f in self.functions else (INVALID_HANDLE,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, f: int, block: int, smem: int) -> tuple[int, int]:
        if f not in self.functions:
            return (INVALID_HANDLE, 0)
        return (SUCCESS, max(0, min(32, 2048 // max(block, 1))))

    def cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(self, f: int, block: int, smem: int, flags: int) -> tuple[int, int]:
        return self.cuOccupancyMaxActiveBlocksPerMultiprocessor(f, block, smem)

    def cuOccupancyAvailableDynamicSMemPerBlock(self, f: int, blocks: int, block_size: int) -> tuple[int, int]:
        if f not in self.functions:
            return (INVALID_HANDLE, 0)
        # The SM's shared memory (228 KiB on an H100), 1 KiB of it reserved per block.
        per_sm = self.attributes["MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"]
        return (SUCCESS, max(0, per_sm // max(blocks, 1) - self.attributes["RESERVED_SHARED_MEMORY_PER_BLOCK"]))

    def max_active_clusters(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                            shmem: int, attrs: bytes) -> int:
        if f not in self.functions:
            raise CudaError(INVALID_HANDLE)
        # Cluster dimension attribute (4): {u32 x, y, z} at offset 8 of each 72-byte attribute.
        size = 1
        for i in range(len(attrs) // 72):
            if int.from_bytes(attrs[i * 72:i * 72 + 4], "little") == 4:
                x, y, z = (int.from_bytes(attrs[i * 72 + 8 + 4 * k:i * 72 + 12 + 4 * k], "little") for k in range(3))
                size = max(1, x * y * z)
        return self.attributes["MULTIPROCESSOR_COUNT"] // size

    def max_potential_block_size(self, f: int, smem: int, limit: int, flags: int) -> tuple[int, int]:
        if f not in self.functions:
            raise CudaError(INVALID_HANDLE)
        block = min(1024, limit) if limit > 0 else 1024
        return self.attributes["MULTIPROCESSOR_COUNT"] * (2048 // block), block

    # ------------------------------------------------------------------ tensor maps

    def tensor_map(self, q: TensorMapRequest) -> bytes:
        """A deterministic 128-byte encoding (the address, then a digest of the rest) after the
        checks cuTensorMapEncodeTiled's documentation lists; ReplaceAddress rewrites the address."""
        if not self.attributes["TENSOR_MAP_ACCESS_SUPPORTED"]:
            raise CudaError(NOT_SUPPORTED, f"rgpu: worker: tensor maps need compute capability 9.0 ({self.spec.gpu_name})")
        align = 32 if q.interleave == _INTERLEAVE_32B else 16
        if q.address % align:
            raise CudaError(INVALID_VALUE)
        if q.kind == TENSOR_MAP_REPLACE:
            return struct.pack("<Q", q.address) + q.map[8:]
        if not _tensor_map_valid(q):
            raise CudaError(INVALID_VALUE)
        digest = hashlib.sha256(TensorMapRequest.WIRE.pack(
            q.kind, q.rank, q.data_type, q.interleave, q.swizzle, q.l2_promotion, q.oob_fill, q.wide_mode, 0,
            q.lower_w, q.upper_w, q.channels, q.pixels, *q.dims, *q.strides, *q.box, *q.element_strides, *q.lower,
            *q.upper, bytes(TENSOR_MAP_BYTES))).digest()
        return (struct.pack("<Q", q.address) + digest).ljust(TENSOR_MAP_BYTES, b"\0")

    def link_create(self, options: list[tuple[int, int]]) -> int:
        self._need_ctx()
        h = self.handles.new()
        self.links[h] = []
        return h

    def link_add(self, state: int, kind: int, name: str, options: list[tuple[int, int]], data: bytes) -> tuple[int, bytes, bytes]:
        if state not in self.links:
            return INVALID_HANDLE, b"", b""
        self.links[state].append(data)
        return SUCCESS, f"emulated linker: added {name or 'input'} ({len(data)} bytes)".encode(), b""

    def link_complete(self, state: int) -> tuple[int, bytes, bytes, bytes]:
        if state not in self.links:
            return INVALID_HANDLE, b"", b"", b""
        # The "linked image" of PTX inputs is their concatenation: loadable by this backend.
        return SUCCESS, b"emulated linker: done", b"", b"\n".join(d.rstrip(b"\0") for d in self.links[state]) + b"\0"

    def link_destroy(self, state: int) -> None:
        if self.links.pop(state, None) is None:
            raise CudaError(INVALID_HANDLE)

    def launch(self, f: int, stream: int, grid: tuple[int, int, int], block: tuple[int, int, int], shmem: int,
               cooperative: bool, attrs: bytes, params: memoryview, params_address: int) -> None:
        self._need_ctx()
        if f not in self.functions:
            raise CudaError(INVALID_HANDLE)
        expected = self.functions[f][1].params
        size = max((o + s for o, s in expected), default=0)
        if len(params) != size:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: launch of {self.functions[f][1].name} carried "
                                           f"{len(params)} parameter bytes, expected {size}")
        self.last_launch = (self.functions[f][1].name, bytes(params))
        limit = self.cuFuncGetAttribute(FUNC_MAX_DYNAMIC_SHARED, f)[1]
        if shmem > limit:   # as the driver refuses it: the function's attribute was not raised enough
            raise CudaError(INVALID_VALUE, f"rgpu: worker: launch of {self.last_launch[0]} asked for {shmem} bytes of "
                                           f"dynamic shared memory; its MAX_DYNAMIC_SHARED_SIZE_BYTES is {limit}")
        if self.last_launch[0] == EMULATED_SHARED_PROBE and len(params) >= 8:
            (out,) = struct.unpack_from("<Q", params, 0)
            self._memset(out, struct.pack("<I", shmem), 1)
            return
        if self.last_launch[0] == EMULATED_SPIN:
            self.spinning = True
            return
        if self.last_launch[0] == EMULATED_WILD_WRITE:
            self.sticky = ILLEGAL_ADDRESS
            if self.fault_domain is not None:
                self.fault_domain.touch()
                with open(self.fault_domain.parent / EMULATED_MPS_LOG, "a") as log:
                    log.write(f"[emulated MPS server] client pid {os.getpid()}: fatal GPU exception (illegal address)\n")
            return
        raise CudaError(NOT_SUPPORTED, _LAUNCH_REFUSED)

    # ------------------------------------------------------------------ stream capture and graphs
    # A capturing stream records its memsets and device copies (the operations this backend runs)
    # as the graph's nodes; a launched executable graph runs them in order.

    def _on_stream(self, stream: int, op: Any, node_type: int = NODE_TYPE_MEMSET) -> tuple[int]:
        if stream in self.capturing:
            self._captured(stream, op, node_type)
            return (SUCCESS,)
        return op()

    def _captured(self, stream: int, op: Any, node_type: int, node: int = 0) -> int:
        """A captured operation: a node of the capture's graph after the stream's last one."""
        graph = self.capturing[stream][1]
        node = self._node(graph, op, self.capture_tail.get(stream, []), node_type, node)
        self.capture_tail[stream] = [node]
        return node

    def _node(self, graph: int, op: Any, deps: list[int], node_type: int, node: int = 0) -> int:
        """A node of `graph` depending on `deps`, running `op` (None: nothing to run)."""
        known = self.graph_deps.setdefault(graph, {})
        if len(set(deps)) != len(deps) or any(d not in known for d in deps):
            raise CudaError(INVALID_VALUE)   # CUDA: a dependency that is not a node of this graph
        node = node or self.handles.new()
        known[node] = tuple(deps)
        self.node_types[node] = node_type
        if op is not None:
            self.graphs[graph].append(op)
            self.node_ops[node] = op
        return node

    def graph_add_edges(self, graph: int, froms: list[int], tos: list[int], edges: bytes, drop_new_node: bool) -> None:
        """cuGraphAddDependencies_v2. The emulated device runs a graph's nodes in the order they were
        added, so an edge may only point to a later node; every port and type then means "after",
        a valid schedule of a programmatic edge too."""
        known = self.graph_deps.get(graph)
        try:
            if known is None or graph not in self.graphs:
                raise CudaError(INVALID_VALUE)
            order = list(known)
            pairs = list(zip(froms, tos))
            for i, (a, b) in enumerate(pairs):
                edge = edges[8 * i:8 * i + 8]
                if a not in known or b not in known or a == b or a in known[b] or pairs.index((a, b)) != i:
                    raise CudaError(INVALID_VALUE)   # CUDA: unknown node, self-edge or an edge that exists
                if edge[2] > 1 or edge[0] > 2 or edge[1] != 0 or any(edge[3:]):
                    raise CudaError(INVALID_VALUE)   # an edge type or port CUDA does not define
                if any(edge) and (self.node_types.get(a) != 0 or self.node_types.get(b) != 0):
                    raise CudaError(INVALID_VALUE)   # CUDA: ports and programmatic edges join kernel nodes only
                if order.index(a) > order.index(b):
                    raise CudaError(NOT_SUPPORTED, "rgpu: worker: the emulated GPU runs a graph's nodes in the order "
                                                   "they were added; an edge to an earlier node is not emulated")
        except CudaError:
            if drop_new_node and tos:
                self.cuGraphDestroyNode(tos[0])
            raise
        for a, b in zip(froms, tos):
            known[b] = known[b] + (a,)

    def _refuse_capture(self, stream: int, what: str) -> None:
        if stream in self.capturing:
            raise CudaError(900, f"rgpu: worker: {what} on a capturing stream (a host-memory copy node of a CUDA "
                                 "graph) is not remoted yet")

    def cuStreamBeginCapture_v2(self, stream: int, mode: int) -> tuple[int]:
        if stream in self.capturing:
            return (401,)   # CUDA_ERROR_ILLEGAL_STATE
        if stream and not self._stream_ok(stream):
            return (INVALID_HANDLE,)
        graph = self.handles.new()
        self.graphs[graph] = []
        self.graph_deps[graph] = {}
        self.capture_seq += 1
        self.capturing[stream] = (self.capture_seq, graph)
        self.capture_tail[stream] = []
        return (SUCCESS,)

    def capture_to_graph(self, stream: int, graph: int, deps: list[int], mode: int) -> None:
        """cuStreamBeginCaptureToGraph: the capture appends to `graph`, after `deps`."""
        if stream in self.capturing:
            raise CudaError(401)   # CUDA_ERROR_ILLEGAL_STATE
        if stream and not self._stream_ok(stream):
            raise CudaError(INVALID_HANDLE)
        known = self.graph_deps.get(graph)
        if graph not in self.graphs or known is None or any(d not in known for d in deps):
            raise CudaError(INVALID_VALUE)
        self.capture_seq += 1
        self.capturing[stream] = (self.capture_seq, graph)
        self.capture_tail[stream] = list(deps)

    def cuStreamEndCapture(self, stream: int) -> tuple[int, int]:
        if stream not in self.capturing:
            return (401, 0)
        _, graph = self.capturing.pop(stream)
        self.capture_tail.pop(stream, None)
        return (SUCCESS, graph)

    def cuThreadExchangeStreamCaptureMode(self, mode: int) -> tuple[int, int]:
        old, self.capture_mode = self.capture_mode, mode
        return (SUCCESS, old)

    def capture_info(self, stream: int, what: int) -> tuple[int, int, int, list[int], list[int]]:
        if stream in self.capturing:
            cid, graph = self.capturing[stream]
            tail = self.capture_tail.get(stream, [])
            return 1, cid, graph, list(tail), [0] * len(tail)
        return 0, 0, 0, [], []

    def cuGraphCreate(self, flags: int) -> tuple[int, int]:
        graph = self.handles.new()
        self.graphs[graph] = []
        self.graph_deps[graph] = {}
        return (SUCCESS, graph)

    def cuGraphDestroy(self, graph: int) -> tuple[int]:
        self.graph_deps.pop(graph, None)
        return (SUCCESS,) if self.graphs.pop(graph, None) is not None else (INVALID_VALUE,)

    def cuGraphClone(self, graph: int) -> tuple[int, int]:
        """The clone keeps the original's node handles (the emulated device's shortcut; CUDA makes
        new ones, found with cuGraphNodeFindInClone, which rgpu does not remote)."""
        if graph not in self.graphs:
            return (INVALID_VALUE, 0)
        clone = self.handles.new()
        self.graphs[clone] = _instance(self.graphs[graph])
        self.graph_deps[clone] = dict(self.graph_deps.get(graph, {}))
        return (SUCCESS, clone)

    def graph_nodes(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        return self._listed(graph, list(self.graph_deps.get(graph, {})), cap, want)

    def graph_roots(self, graph: int, cap: int, want: bool) -> tuple[int, list[int]]:
        """The nodes without dependencies, in the order they were added."""
        return self._listed(graph, [n for n, d in self.graph_deps.get(graph, {}).items() if not d], cap, want)

    def _listed(self, graph: int, nodes: list[int], cap: int, want: bool) -> tuple[int, list[int]]:
        """cuGraphGetNodes' and cuGraphGetRootNodes' answer: the count, or up to `cap` nodes and
        how many were given."""
        if graph not in self.graphs:
            raise CudaError(INVALID_VALUE)
        if not want:
            return len(nodes), []
        return min(cap, len(nodes)), nodes[:cap]

    def graph_add_node(self, kind: int, graph: int, deps: list[int], payload: bytes) -> tuple[int, int]:
        """Nodes built by hand run in the order they were added (a valid order of a chain)."""
        if graph not in self.graphs:
            raise CudaError(INVALID_VALUE)
        known = self.graph_deps.setdefault(graph, {})
        if len(set(deps)) != len(deps) or any(d not in known for d in deps):
            raise CudaError(INVALID_VALUE)   # CUDA: a dependency that is not a node of this graph
        op: Any = None
        node = aux = 0
        if kind == 1:
            name = self.functions.get(struct.unpack_from("<Q", payload, 0)[0], (0, None))[1]
            if name is None:
                raise CudaError(INVALID_HANDLE)

            def refuse() -> tuple[int]:
                raise CudaError(NOT_SUPPORTED, _LAUNCH_REFUSED)
            op = refuse
        elif kind == 2:
            dst, pitch, value, elem, width, height = struct.unpack_from("<QQIIQQ", payload, 0)
            pattern = struct.pack({1: "<B", 2: "<H", 4: "<I"}[elem], value & ((1 << (8 * elem)) - 1))
            op = lambda: self._memset2d(dst, pitch, pattern, width, height)  # noqa: E731
        elif kind == 3 and ARRAY in struct.unpack_from("<i", payload, 32) + struct.unpack_from("<i", payload, 120):
            desc = bytes(payload[:200])
            copy = parse_copy(desc)
            if any(side.kind == ARRAY and side.array not in self.arrays for side in (copy.src, copy.dst)):
                raise CudaError(INVALID_HANDLE)   # when the node is added, as the driver refuses it
            op = lambda: (self._copy_nd(2, desc, None, None), (SUCCESS,))[1]  # noqa: E731
        elif kind == 3:
            src_x, dst_x, width = (struct.unpack_from("<Q", payload, o)[0] for o in (0, 88, 176))
            src, dst = struct.unpack_from("<Q", payload, 48)[0], struct.unpack_from("<Q", payload, 136)[0]
            op = lambda: self.cuMemcpyDtoD_v2(dst + dst_x, src + src_x, width)  # noqa: E731
        elif kind == 4:
            (size,) = struct.unpack_from("<Q", payload, 88)
            aux, _ = self.mem_alloc("plain", size, 0, 0, 0, 0)
        elif kind == 5:
            ptr = struct.unpack_from("<Q", payload, 0)[0]
            op = lambda: (self.mem_free(ptr, 0, True), (SUCCESS,))[1]  # noqa: E731
        elif kind == 7:
            node = self.handles.new()
            op = self.host_nodes[node] = _HostNode(self, node, struct.unpack_from("<Q", payload, 0)[0],
                                                   self.graph_regions.setdefault(graph, []))
        elif kind in (9, 10):   # event record and wait nodes (the emulated device runs in order: a wait has nothing to do)
            (event,) = struct.unpack_from("<Q", payload, 0)
            if event not in self.events:
                raise CudaError(INVALID_HANDLE)
            if kind == 9:
                op = lambda: self.cuEventRecord(event, 0)  # noqa: E731
        elif kind == 8:   # a child graph, cloned into the node as CUDA clones it
            (child,) = struct.unpack_from("<Q", payload, 0)
            code, owned = self.cuGraphClone(child)
            if code != SUCCESS:
                raise CudaError(code)
            self.graph_regions.setdefault(graph, []).extend(self.graph_regions.get(child, []))
            node = self.handles.new()
            op = self.child_nodes[node] = _ChildNode(node, owned, self.graphs[owned])
        elif kind == 6:
            to_host, _, dev, size, _ctx = struct.unpack_from("<IIQQQ", payload, 0)
            aux = self.handles.new()
            buf = self.graph_host[aux] = bytearray(size)
            self.graph_regions.setdefault(graph, []).append((aux, size, bool(to_host)))

            def copy() -> tuple[int]:
                dbuf, off = self._locate(dev, size)
                if to_host:
                    buf[:] = dbuf[off:off + size]
                else:
                    dbuf[off:off + size] = buf
                return (SUCCESS,)
            op = copy
        elif kind != 0:
            raise CudaError(INVALID_VALUE, f"rgpu: worker: unknown graph node kind {kind}")
        return self._node(graph, op, deps, _NODE_TYPES[kind], node), aux

    def cuGraphDestroyNode(self, node: int) -> tuple[int]:
        """The node and every edge to or from it leave its graph."""
        for graph, known in self.graph_deps.items():
            if node in known:
                del known[node]
                for other, deps in known.items():
                    if node in deps:
                        known[other] = tuple(d for d in deps if d != node)
                op = self.node_ops.pop(node, None)
                if op is not None and op in self.graphs.get(graph, []):
                    self.graphs[graph].remove(op)
                self.node_types.pop(node, None)
                return (SUCCESS,)
        return (INVALID_VALUE,)

    def cuGraphNodeGetType(self, node: int) -> tuple[int, int]:
        return (SUCCESS, self.node_types[node]) if node in self.node_types else (INVALID_VALUE, 0)

    def capture_host_func(self, stream: int, kind: int, fn_id: int) -> None:
        """cuLaunchHostFunc on a capturing stream: a host node. cuStreamAddCallback is refused
        there, as NVIDIA's driver refuses it (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)."""
        if stream not in self.capturing:
            raise CudaError(INVALID_VALUE, "rgpu: worker: a captured host function on a stream that is not capturing")
        if kind != 0:
            raise CudaError(900)
        node = self.handles.new()
        graph = self.capturing[stream][1]
        host = self.host_nodes[node] = _HostNode(self, node, fn_id, self.graph_regions.setdefault(graph, []))
        self._captured(stream, host, NODE_TYPE_HOST, node)

    def host_node_params(self, exe: int, node: int, fn_id: int | None) -> int:
        """A host node's function id; with `fn_id`, set it first (on the executable graph's
        instance of the node when `exe` is given)."""
        if exe:
            found = [op for op in self.execs.get(exe, []) if isinstance(op, _HostNode) and op.node == node]
            host = found[0] if found else None
        else:
            host = self.host_nodes.get(node)
        if host is None:
            raise CudaError(INVALID_VALUE)
        if fn_id is not None:
            host.fn_id = fn_id
        return host.fn_id

    def capture_host_copy(self, stream: int, to_host: bool, dev: int, size: int, data: bytes) -> tuple[int, int]:
        if stream not in self.capturing:
            raise CudaError(INVALID_VALUE)
        graph = self.capturing[stream][1]
        buffer = self.handles.new()
        buf = self.graph_host[buffer] = bytearray(data if not to_host else bytes(size))
        self.graph_regions.setdefault(graph, []).append((buffer, size, to_host))

        def copy() -> tuple[int]:
            dbuf, off = self._locate(dev, size)
            if to_host:
                buf[:] = dbuf[off:off + size]
            else:
                dbuf[off:off + size] = buf
            return (SUCCESS,)
        self._captured(stream, copy, NODE_TYPE_MEMCPY)
        return buffer, graph

    def graph_host_write(self, buffer: int, data: memoryview) -> None:
        if len(self.graph_host.get(buffer, b"")) < len(data):
            raise CudaError(INVALID_VALUE)
        self.graph_host[buffer][:len(data)] = data

    def graph_host_peek(self, buffer: int, size: int) -> bytes:
        """A copy node's buffer as it is now (a host node's call, while the graph runs)."""
        return bytes(self.graph_host.get(buffer, b"")[:size])

    def graph_host_poke(self, buffer: int, data: bytes) -> None:
        if len(self.graph_host.get(buffer, b"")) >= len(data):
            self.graph_host[buffer][:len(data)] = data

    def graph_host_read(self, stream: int, pairs: list[tuple[int, int]]) -> bytes:
        if any(len(self.graph_host.get(b, b"")) < n for b, n in pairs):
            raise CudaError(INVALID_VALUE)
        return b"".join(bytes(self.graph_host[b][:n]) for b, n in pairs)

    def cuGraphChildGraphNodeGetGraph(self, node: int) -> tuple[int, int]:
        child = self.child_nodes.get(node)
        return (SUCCESS, child.graph) if child is not None else (INVALID_VALUE, 0)

    def exec_child_set(self, exe: int, node: int, child: int) -> None:
        """cuGraphExecChildGraphNodeSetParams: the executable graph's instance of the node runs a
        copy of `child` from now on; CUDA requires the same topology (checked here as the same
        node count and types, in insertion order)."""
        found = [op for op in self.execs.get(exe, []) if isinstance(op, _ChildNode) and op.node == node]
        if not found or child not in self.graphs:
            raise CudaError(INVALID_VALUE)
        old = self.graph_deps.get(found[0].graph, {})
        new = self.graph_deps.get(child, {})
        if [self.node_types.get(n) for n in old] != [self.node_types.get(n) for n in new]:
            raise CudaError(INVALID_VALUE)
        found[0].ops = _instance(self.graphs[child])

    def kernel_node_set(self, exe: int, node: int, payload: bytes) -> None:
        if exe and exe not in self.execs:
            raise CudaError(INVALID_VALUE)

    def cuGraphInstantiateWithFlags(self, graph: int, flags: int) -> tuple[int, int]:
        if graph not in self.graphs:
            return (INVALID_VALUE, 0)
        exe = self.handles.new()
        self.execs[exe] = _instance(self.graphs[graph])
        return (SUCCESS, exe)

    def cuGraphLaunch(self, exe: int, stream: int) -> tuple[int]:
        if exe not in self.execs:
            return (INVALID_VALUE,)
        for op in self.execs[exe]:
            r = op()[0]
            if r != SUCCESS:
                return (r,)
        return (SUCCESS,)

    def cuGraphUpload(self, exe: int, stream: int) -> tuple[int]:
        return (SUCCESS,) if exe in self.execs else (INVALID_VALUE,)

    def cuGraphExecDestroy(self, exe: int) -> tuple[int]:
        return (SUCCESS,) if self.execs.pop(exe, None) is not None else (INVALID_VALUE,)

    def cuGraphExecUpdate_v2(self, exe: int, graph: int) -> tuple[int, bytes]:
        if exe not in self.execs or graph not in self.graphs:
            return (INVALID_VALUE, b"")
        if len(self.execs[exe]) != len(self.graphs[graph]):
            return (910, b"")   # CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE
        self.execs[exe] = _instance(self.graphs[graph])
        return (SUCCESS, bytes(24))

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
        ptr = self.next_address
        self.next_address += (size + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
        self.reserved[ptr] = size
        return (SUCCESS, ptr)

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

    def close(self) -> None:
        self.allocs.clear()


def _uuid_bytes(gpu_uuid: str) -> bytes:
    text = gpu_uuid.removeprefix("GPU-").removeprefix("MIG-")
    try:
        return uuidlib.UUID(text).bytes
    except ValueError:
        return uuidlib.uuid5(uuidlib.NAMESPACE_URL, gpu_uuid).bytes


class EmulatedNvml:
    """NVML answers for an emulated GPU; memory shows the slice."""

    emulated = True
    driver_version = EMULATED_DRIVER_VERSION

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.description = f"emulated {spec.gpu_name} (NVML)"

    def set_context(self, ctx: int) -> None:
        pass

    def _text(self, text: str, length: int) -> tuple[int, bytes]:
        data = text.encode() + b"\0"
        if len(data) > length:
            return (7, b"")  # NVML_ERROR_INSUFFICIENT_SIZE
        return (SUCCESS, data)

    def _used(self) -> int:
        from pathlib import Path
        return slice_usage(Path(self.spec.usage_dir))

    def nvmlDeviceGetMemoryInfo(self, device: int) -> tuple[int, bytes]:
        total = self.spec.memory_limit
        used = min(self._used(), total)
        return (SUCCESS, struct.pack("<QQQ", total, total - used, used))

    def nvmlDeviceGetMemoryInfo_v2(self, device: int, memory: bytes) -> tuple[int, bytes]:
        total = self.spec.memory_limit
        used = min(self._used(), total)
        return (SUCCESS, struct.pack("<IxxxxQQQQ", struct.unpack_from("<I", memory)[0], total, 0, total - used, used))

    def nvmlSystemGetDriverVersion(self, length: int) -> tuple[int, bytes]:
        return self._text("580.00.00-emulated", length)

    def nvmlDeviceGetName(self, device: int, length: int) -> tuple[int, bytes]:
        return self._text(self.spec.gpu_name, length)

    def nvmlDeviceGetUUID(self, device: int, length: int) -> tuple[int, bytes]:
        return self._text(self.spec.gpu_uuid, length)

    def nvmlDeviceGetPciInfo_v3(self, device: int) -> tuple[int, bytes]:
        bus = b"00000000:06:00.0"
        return (SUCCESS, struct.pack("<16s5I32s", bus, 0, 6, 0, 0x233510DE, 0x17FE10DE, bus))

    def nvmlDeviceGetCudaComputeCapability(self, device: int) -> tuple[int, int, int]:
        major, _, minor = self.spec.compute_capability.partition(".")
        return (SUCCESS, int(major), int(minor or 0))

    def nvmlDeviceGetUtilizationRates(self, device: int) -> tuple[int, bytes]:
        return (SUCCESS, struct.pack("<II", 0, 0))

    def nvmlDeviceGetTemperature(self, device: int, sensor: int) -> tuple[int, int]:
        return (SUCCESS, 35)

    def nvmlDeviceGetPowerUsage(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 70000)

    def nvmlDeviceGetPowerManagementLimit(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 700000)   # milliwatts, as an H200 SXM's

    def nvmlDeviceGetPowerManagementDefaultLimit(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 700000)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, device: int) -> tuple[int, int, int]:
        return (SUCCESS, 200000, 700000)

    def nvmlDeviceGetComputeMode(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 0)

    def nvmlDeviceGetPersistenceMode(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 1)

    def nvmlDeviceGetPerformanceState(self, device: int) -> tuple[int, int]:
        return (SUCCESS, 0)

    def nvmlDeviceGetFanSpeed(self, device: int) -> tuple[int, int]:
        return (NVML_ERROR_NOT_SUPPORTED, 0)

    def close(self) -> None:
        pass
