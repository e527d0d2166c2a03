"""The emulated GPU's objects: handles, the stream-ordered pool, arrays and the nodes of a graph.

Plain state the emulated device (emulated_device.py) keeps and its parts (emulated_*.py) work on.
"""

from __future__ import annotations

from typing import Any, Protocol

from rgpu.remoting.datapath.backends.arrays import ArrayDesc
from rgpu.remoting.datapath.backends.base import (
    MEMPOOL_RELEASE_THRESHOLD,
    MEMPOOL_RESERVED_CURRENT,
    MEMPOOL_RESERVED_HIGH,
    MEMPOOL_USED_CURRENT,
    MEMPOOL_USED_HIGH,
    OUT_OF_MEMORY,
    SUCCESS,
    CudaError,
)


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


class _RunsHostCalls(Protocol):
    host_calls: Any    # the worker's HostCalls (worker/hostcalls.py), set by the worker


class _HostNode:
    """A host node: asks the client to run its function (worker/hostcalls.py) and waits for it;
    the emulated device runs a graph's nodes in order, so its dependencies have finished."""

    def __init__(self, backend: _RunsHostCalls, node: int, fn_id: int, regions: list[tuple[int, int, bool]]) -> None:
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
