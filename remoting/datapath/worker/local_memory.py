"""Device memory a context reserves beyond its allocations, charged to the slice before the driver
takes it: local memory (the per-thread stack) and the device-side malloc heap.

The driver reserves local memory for every thread the GPU can hold resident: the context's stack
size x SMs x threads per SM. The stack grows when cuCtxSetLimit raises CU_LIMIT_STACK_SIZE, and by
itself when a kernel needs more local memory per thread than the stack size (the driver raises the
limit at that launch). Measured on an H100 (132 SMs x 2,048 threads, CUDA 13.0, driver 580): a
64 KiB stack took 17,439,916,032 bytes at cuCtxSetLimit, and the first launch of a kernel with a
16 KiB local array 4,152,360,960 bytes: exactly (size - 1 KiB) x 270,336 threads each time. The
default 1 KiB stack is part of the context's reserve (base.CONTEXT_RESERVE_BYTES). The heap set
with CU_LIMIT_MALLOC_HEAP_SIZE is taken at the first launch after it (1 GiB took 1 GiB + 2 MiB);
its 8 MiB default is left to the context's reserve too. CU_LIMIT_PRINTF_FIFO_SIZE took nothing
from the device (256 MiB, after a launch of a kernel with printf).

A stack charge never shrinks (the driver keeps the high-water mark); a heap charge follows the
last value set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rgpu.remoting.datapath.backends.base import SliceMemory
from rgpu.units import format_bytes

DEFAULT_STACK_BYTES = 1024
DEFAULT_HEAP_BYTES = 8 << 20
LIMIT_STACK_SIZE, LIMIT_MALLOC_HEAP_SIZE = 0, 2
FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
_STACK_KEY, _HEAP_KEY = 5 << 64, 6 << 64


@dataclass
class ContextReserves:
    """The stack and heap charges of one session's contexts against its slice."""

    memory: SliceMemory
    resident_threads: int                                  # SMs x max threads per SM
    stacks: dict[int, int] = field(default_factory=dict)   # context -> per-thread bytes charged
    heaps: dict[int, int] = field(default_factory=dict)    # context -> heap bytes set

    def stack_bytes(self, ctx: int) -> int:
        return self.stacks.get(ctx, DEFAULT_STACK_BYTES)

    def reserve_stack(self, ctx: int, per_thread: int, what: str) -> None:
        """Charge a stack of `per_thread` bytes (raises OUT_OF_MEMORY when it does not fit)."""
        if per_thread <= self.stack_bytes(ctx):
            return
        total = (per_thread - DEFAULT_STACK_BYTES) * self.resident_threads
        self.memory.resize(-_STACK_KEY - ctx, total,
                           f"{what}: {format_bytes(per_thread)} of local memory per thread, which the GPU "
                           f"reserves for each of the {self.resident_threads} threads it can hold resident")
        self.stacks[ctx] = per_thread

    def reserve_heap(self, ctx: int, size: int, what: str) -> int:
        """Charge a malloc heap of `size` bytes; returns the size charged before (to undo with)."""
        before = self.heaps.get(ctx, DEFAULT_HEAP_BYTES)
        self.memory.resize(-_HEAP_KEY - ctx, max(0, size - DEFAULT_HEAP_BYTES), what)
        self.heaps[ctx] = size
        return before
