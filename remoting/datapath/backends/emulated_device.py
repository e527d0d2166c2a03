"""The emulated GPU's state, and what every part of it needs: the current context, finding an
allocation by address, and recording an operation on a capturing stream as a graph node.

The emulated backend (emulated.py) is this device plus its parts, one module each: contexts and
device queries, memory, arrays, streams and events, modules and launches, graphs.
"""

from __future__ import annotations

import bisect
import os
import signal
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

from rgpu.remoting.datapath.backends.emulated_mps import EMULATED_MPS_FAULT
from rgpu.remoting.datapath.backends.base import (
    INVALID_CONTEXT,
    INVALID_VALUE,
    SUCCESS,
    CudaError,
    FnInfo,
    enums,
)
from rgpu.remoting.datapath.backends.emulated_objects import _ChildNode, _EmuArray, _Handles, _HostNode, _StreamOrderedPool

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
ILLEGAL_ADDRESS = 700
NODE_TYPE_HOST = 3
NODE_TYPE_MEMSET, NODE_TYPE_MEMCPY = 2, 1


def _uuid_bytes(gpu_uuid: str) -> bytes:
    text = gpu_uuid.removeprefix("GPU-").removeprefix("MIG-")
    try:
        return uuidlib.UUID(text).bytes
    except ValueError:
        return uuidlib.uuid5(uuidlib.NAMESPACE_URL, gpu_uuid).bytes


class EmulatedDevice:
    """One emulated GPU for one session (device 0 of the worker): its state."""

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

    def total_mem(self) -> int:
        return self.total

    def capture_open(self) -> bool:
        return bool(self.capturing)

    def _locate(self, ptr: int, size: int) -> tuple[bytearray, int]:
        i = bisect.bisect_right(self.bases, ptr) - 1
        if i >= 0:
            base = self.bases[i]
            buf = self.allocs[base]
            off = ptr - base
            if off + size <= len(buf):
                return buf, off
        raise CudaError(INVALID_VALUE)

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

    def _refuse_capture(self, stream: int, what: str) -> None:
        if stream in self.capturing:
            raise CudaError(900, f"rgpu: worker: {what} on a capturing stream (a host-memory copy node of a CUDA "
                                 "graph) is not remoted yet")

    def close(self) -> None:
        self.allocs.clear()
