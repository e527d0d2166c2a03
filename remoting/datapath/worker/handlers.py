"""The worker's hand-written handlers (contexts, memory, copies, modules, launches, session info).
Each takes (payload, payload address, seq) and returns (CUresult, reply payload), or None for
async operations. Generated handlers live in api_gen; the dispatch table is in loop.py.

Handlers is made of parts, one module each (a mixin over handler_state.HandlerState, the Worker's
attributes they read): handlers_memory.py (allocations, plain copies, pointer attributes, virtual
memory), handlers_transfers.py (UCX, shared page-locked memory, data lanes), handlers_arrays.py,
handlers_modules.py, handlers_launches.py, handlers_graphs.py. This module keeps contexts and the
session's info."""

from __future__ import annotations

import json
import os
import struct

from rgpu.remoting.datapath.backends.base import SUCCESS
from rgpu.remoting.datapath.worker.codecs import U64, lp
from rgpu.remoting.datapath.worker.handlers_arrays import ArrayHandlers
from rgpu.remoting.datapath.worker.handlers_graphs import GraphHandlers
from rgpu.remoting.datapath.worker.handlers_memory import MemoryHandlers
from rgpu.remoting.datapath.worker.handlers_modules import ModuleHandlers
from rgpu.remoting.datapath.worker.handlers_transfers import TransferHandlers


class Handlers(MemoryHandlers, TransferHandlers, ArrayHandlers, ModuleHandlers, GraphHandlers):
    """Mixed into the Worker, which owns the attributes HandlerState names."""

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

    def h_session_info(self, p: memoryview, address: int, seq: int) -> tuple[int, bytes]:
        info = {"memory_limit": self.memory.limit if self.memory else 0,
                "memory_used": self.memory.used if self.memory else 0,
                "compute_percent": self.spec.compute_percent,
                "compute_enforcement": self.spec.compute_enforcement,
                "backend": self.spec.backend, "gpu": self.spec.gpu_name, "pid": os.getpid(),
                "launch_path": "native" if self.native_launches is not None else "python",
                "native_launches": self.native_launches.launched.value if self.native_launches else 0}
        return SUCCESS, lp(json.dumps(info).encode())
