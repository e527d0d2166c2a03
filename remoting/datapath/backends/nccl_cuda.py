"""NCCL on a real GPU: the slice's worker calls NVIDIA's libnccl.so.2 (loaded at first use with dlopen,
so a GPU node without NCCL serves everything else and refuses NCCL with one line). A mixin of
CudaBackend: the generated handlers call these methods by the names in nccl.spec.

The unique id is real NCCL's (ncclGetUniqueId in the worker of the slice that asked), so the ranks'
workers form an ordinary NCCL communicator among themselves: NVLink or PCIe peer access between
GPUs of one node, NCCL's own network transports between nodes. ncclCommInitRank blocks until every
rank has joined, so it runs in a thread (with the session's context current) and rgpuNcclCommReady
waits for it. Collectives are queued by NCCL on the session's stream and return at once, as
launches do; NCCL's errors fail the operation with a line naming the call and NCCL's text.

A peer that dies leaves this rank's NCCL kernels waiting on the GPU; NCCL only reports it through
ncclCommGetAsyncError. So, as PyTorch's watchdog does, a thread per communicator polls it (every
RGPU_NCCL_WATCHDOG_S, default 1 s) and aborts the communicator on an error: the kernels end, the
slice's synchronisation returns, and later operations on it fail with the reason.

RGPU_NCCL_LIBRARY (the dispatcher's environment) names the library to load; default `libnccl.so.2`
from the loader's path (pip's nvidia-nccl-cu13 keeps it in site-packages/nvidia/nccl/lib)."""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from rgpu.remoting.datapath.backends import nccl_ops
from rgpu.remoting.datapath.backends.base import CudaError

FAILED = 999   # CUDA_ERROR_UNKNOWN at the next synchronising call: the context lives on
IN_PROGRESS = 7


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def load_nccl(gpu: str) -> ctypes.CDLL:
    """NVIDIA's libnccl.so.2, or CudaError with the line an application gets."""
    name = os.environ.get("RGPU_NCCL_LIBRARY") or "libnccl.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise CudaError(nccl_ops.SYSTEM_ERROR, f"rgpu: worker: NCCL is not installed on {gpu} (cannot load {name}: {exc}; "
                                               "install NCCL there, e.g. pip install nvidia-nccl-cu13, and point "
                                               "RGPU_NCCL_LIBRARY in the dispatcher's environment at its libnccl.so.2)") from None
    for fn in ("ncclGetErrorString", "ncclGetLastError"):
        getattr(lib, fn).restype = ctypes.c_char_p
    return lib


@dataclass
class _Comm:
    nranks: int
    rank: int
    handle: ctypes.c_void_p = field(default_factory=ctypes.c_void_p)
    joined: threading.Event = field(default_factory=threading.Event)
    code: int = nccl_ops.SUCCESS
    error: str = ""
    closed: threading.Event = field(default_factory=threading.Event)   # destroyed, or aborted by the watchdog
    lock: threading.Lock = field(default_factory=threading.Lock)        # the watchdog's calls vs. destruction
    # Held by an operation's call into NCCL, and by a split from its call until ncclCommSplit returned in
    # its thread: the slice's later operations on the parent reach NCCL after the split, as they were sent.
    busy: threading.Lock = field(default_factory=threading.Lock)


def _watchdog_interval() -> float:
    try:
        return max(float(os.environ.get("RGPU_NCCL_WATCHDOG_S", "") or 1.0), 0.05)
    except ValueError:
        return 1.0


class CudaNccl:
    """Real NCCL for CudaBackend (which provides `spec`, `primary`, `_current` and `_check`)."""

    nccl_host = "127.0.0.1"
    spec: Any
    _nccl_lib: ctypes.CDLL | None = None
    _nccl_comms: dict[int, _Comm]

    def _nccl(self) -> ctypes.CDLL:
        if self._nccl_lib is None:
            self._nccl_lib = load_nccl(f"GPU node {self.spec.server}")
            self._nccl_comms = {}
        return self._nccl_lib

    def _nccl_text(self, code: int, comm: _Comm | None = None) -> str:
        lib = self._nccl()
        text = (lib.ncclGetErrorString(code) or b"").decode(errors="replace")
        last = (lib.ncclGetLastError(comm.handle if comm else None) or b"").decode(errors="replace")
        return f"NCCL error {code}: {text}" + (f"; {last}" if last else "")

    def rgpuNcclGetUniqueId(self, dev: int) -> tuple[int, bytes]:
        uid = _UniqueId()
        code = self._nccl().ncclGetUniqueId(ctypes.byref(uid))
        if code:
            raise CudaError(code, f"rgpu: worker: ncclGetUniqueId: {self._nccl_text(code)}")
        return (nccl_ops.SUCCESS, bytes(uid))   # all 128 bytes (the field's value would stop at the first NUL)

    def rgpuNcclCommJoin(self, comm_id: bytes, nranks: int, rank: int, dev: int) -> tuple[int, int]:
        uid = _UniqueId.from_buffer_copy(comm_id)
        return self._join(nranks, rank, lambda lib, out: lib.ncclCommInitRank(out, nranks, uid, rank))

    def rgpuNcclCommJoinScalable(self, comm_ids: list[bytes], n_id: int, nranks: int, rank: int,
                                 dev: int) -> tuple[int, int]:
        """ncclCommInitRankScalable with every id (NCCL spreads the ranks' bootstrap over the ids' roots)."""
        if n_id < 1 or len(comm_ids) != n_id:
            raise CudaError(nccl_ops.INVALID_ARGUMENT, f"rgpu: worker: ncclCommInitRankScalable: {len(comm_ids)} "
                                                       f"unique id(s) sent for nId {n_id}")
        ids = (_UniqueId * n_id)(*(_UniqueId.from_buffer_copy(b) for b in comm_ids))
        return self._join(nranks, rank, lambda lib, out: lib.ncclCommInitRankScalable(out, nranks, rank, n_id, ids, None))

    def _join(self, nranks: int, rank: int, init: Any) -> tuple[int, int]:
        """`init(lib, out)`, NCCL's blocking initialisation of one rank, in a thread with the session's context."""
        lib = self._nccl()
        comm = _Comm(nranks, rank)
        ctx = getattr(self, "_current", 0) or self.primary.value   # type: ignore[attr-defined]

        def join() -> None:
            try:
                self.lib.cuCtxSetCurrent(ctypes.c_void_p(ctx))   # type: ignore[attr-defined]
                code = init(lib, ctypes.byref(comm.handle))
                if code:
                    comm.code, comm.error = code, self._nccl_text(code)
            finally:
                comm.joined.set()
            if not comm.code:
                self._watch(comm, ctx)
        key = id(comm)
        self._nccl_comms[key] = comm
        threading.Thread(target=join, name="rgpu-nccl-join", daemon=True).start()
        return (nccl_ops.SUCCESS, key)

    def _watch(self, comm: _Comm, ctx: int) -> None:
        """Poll the communicator's asynchronous error until it is destroyed; abort it on one."""
        lib = self._nccl()
        value = ctypes.c_int()
        while not comm.closed.wait(_watchdog_interval()):
            with comm.lock:
                if comm.closed.is_set() or lib.ncclCommGetAsyncError(comm.handle, ctypes.byref(value)) or \
                        value.value in (0, IN_PROGRESS):
                    continue
                comm.code = value.value
                comm.error = f"{self._nccl_text(value.value, comm)}; rgpu aborted the communicator (a peer failed or left)"
                self.lib.cuCtxSetCurrent(ctypes.c_void_p(ctx))   # type: ignore[attr-defined]
                lib.ncclCommAbort(comm.handle)
                comm.closed.set()

    def _comm(self, key: int, call: str, code: int = nccl_ops.INVALID_ARGUMENT) -> _Comm:
        self._nccl()
        comm = self._nccl_comms.get(key)
        if comm is None:
            raise CudaError(code, f"rgpu: worker: {call}: no such communicator on this GPU")
        return comm

    def rgpuNcclCommReady(self, key: int) -> tuple[int, int, int]:
        comm = self._comm(key, "ncclCommInitRank")
        comm.joined.wait()   # NCCL's own bootstrap timeout ends a join whose peers never come
        if comm.code:
            raise CudaError(comm.code, f"rgpu: worker: ncclCommInitRank (rank {comm.rank} of {comm.nranks}): {comm.error}")
        return (nccl_ops.SUCCESS, comm.rank, comm.nranks)

    def rgpuNcclCommSplit(self, key: int, color: int, split_key: int) -> tuple[int, int]:
        """ncclCommSplit (blocking: it waits for every rank of the parent) in a thread, as the join; the
        new communicator inherits the parent's configuration. NCCL_SPLIT_NOCOLOR gives no communicator
        (0 ranks at rgpuNcclCommReady)."""
        return self._derive(key, "ncclCommSplit",
                            lambda lib, parent, out: lib.ncclCommSplit(parent, color, split_key, out, None))

    def rgpuNcclCommShrink(self, key: int, exclude: list[int], count: int, flags: int) -> tuple[int, int]:
        """ncclCommShrink of the ranks that stay (the excluded ones do not call it), as a split; `flags`
        as NCCL's (NCCL_SHRINK_ABORT: the parent's outstanding operations are aborted first)."""
        parent = self._comm(key, "ncclCommShrink")
        try:
            if parent.joined.is_set() and parent.nranks > 0:   # else NCCL checks the list itself
                nccl_ops.shrink_members(parent.nranks, parent.rank, exclude)
        except ValueError as exc:
            raise CudaError(nccl_ops.INVALID_ARGUMENT, f"rgpu: worker: ncclCommShrink: {exc}") from None
        ranks = (ctypes.c_int * max(count, 1))(*exclude)
        return self._derive(key, "ncclCommShrink",
                            lambda lib, parent, out: lib.ncclCommShrink(parent, ranks, count, out, None, flags))

    def _derive(self, key: int, call: str, make: Any) -> tuple[int, int]:
        """A communicator made from another by `make(lib, parent handle, out)` (blocking in NCCL) in a thread."""
        lib = self._nccl()
        parent = self._comm(key, call)
        child = _Comm(nranks=-1, rank=-1)
        ctx = getattr(self, "_current", 0) or self.primary.value   # type: ignore[attr-defined]
        parent.busy.acquire()

        def split() -> None:
            try:
                try:
                    parent.joined.wait()
                    if parent.code or parent.closed.is_set():
                        child.code, child.error = parent.code or nccl_ops.INVALID_USAGE, f"the parent failed ({parent.error})"
                        return
                    self.lib.cuCtxSetCurrent(ctypes.c_void_p(ctx))   # type: ignore[attr-defined]
                    code = make(lib, parent.handle, ctypes.byref(child.handle))
                finally:
                    parent.busy.release()
                if code:
                    child.code, child.error = code, self._nccl_text(code, parent)
                elif not child.handle:
                    child.nranks = 0
                else:
                    rank, count = ctypes.c_int(), ctypes.c_int()
                    lib.ncclCommUserRank(child.handle, ctypes.byref(rank))
                    lib.ncclCommCount(child.handle, ctypes.byref(count))
                    child.rank, child.nranks = rank.value, count.value
            finally:
                child.joined.set()
            if not child.code and child.handle:
                self._watch(child, ctx)
        new = id(child)
        self._nccl_comms[new] = child
        threading.Thread(target=split, name=f"rgpu-nccl-{call}", daemon=True).start()
        return (nccl_ops.SUCCESS, new)

    def ncclCommFinalize(self, key: int) -> tuple[int]:
        comm = self._comm(key, "ncclCommFinalize")
        comm.joined.wait()
        if comm.code or not comm.handle or comm.closed.is_set():
            return (nccl_ops.SUCCESS,)   # failed or aborted: ncclCommDestroy is what is left
        with comm.busy:
            code = self._nccl().ncclCommFinalize(comm.handle)   # blocking: the queued operations complete
        if code:
            raise CudaError(code, f"rgpu: worker: ncclCommFinalize (rank {comm.rank} of {comm.nranks}): "
                                  f"{self._nccl_text(code, comm)}")
        return (nccl_ops.SUCCESS,)

    def rgpuNcclRedOpCreatePreMulSum(self, scalar: int, dtype: int, residence: int, key: int) -> tuple[int, int]:
        comm = self._comm(key, "ncclRedOpCreatePreMulSum")
        comm.joined.wait()
        op = ctypes.c_int()
        value = ctypes.c_uint64(scalar)   # host-immediate: NCCL reads the scalar's bytes now
        where = ctypes.byref(value) if residence == 1 else ctypes.c_void_p(scalar or None)
        code = self._nccl().ncclRedOpCreatePreMulSum(ctypes.byref(op), where, dtype, residence, comm.handle)
        if code:
            raise CudaError(code, f"rgpu: worker: ncclRedOpCreatePreMulSum: {self._nccl_text(code, comm)}")
        return (nccl_ops.SUCCESS, op.value)

    def ncclRedOpDestroy(self, op: int, key: int) -> tuple[int]:
        comm = self._comm(key, "ncclRedOpDestroy")
        code = self._nccl().ncclRedOpDestroy(op, comm.handle)
        if code:
            raise CudaError(code, f"rgpu: worker: ncclRedOpDestroy: {self._nccl_text(code, comm)}")
        return (nccl_ops.SUCCESS,)

    def rgpuNcclCommDestroy(self, key: int, abort: int) -> tuple[int]:
        comm = self._nccl_comms.pop(key, None) if self._nccl_lib is not None else None
        if comm is None or not comm.joined.is_set() or not comm.handle:
            return (nccl_ops.SUCCESS,)   # never formed
        with comm.lock:
            if comm.closed.is_set():
                return (nccl_ops.SUCCESS,)   # aborted by the watchdog
            comm.closed.set()
            lib = self._nccl()
            return ((lib.ncclCommAbort if abort else lib.ncclCommDestroy)(comm.handle),)

    def rgpuNcclCommGetAsyncError(self, key: int) -> tuple[int, int]:
        comm = self._comm(key, "ncclCommGetAsyncError")
        if not comm.joined.is_set():
            return (nccl_ops.SUCCESS, IN_PROGRESS)
        with comm.lock:
            if comm.code or comm.closed.is_set():
                return (nccl_ops.SUCCESS, comm.code)
            value = ctypes.c_int()
            code = self._nccl().ncclCommGetAsyncError(comm.handle, ctypes.byref(value))
        return (code, value.value)

    def rgpuNcclGroupStart(self, dev: int) -> tuple[int]:
        code = self._nccl().ncclGroupStart()
        if code:
            raise CudaError(FAILED, f"rgpu: worker: ncclGroupStart: {self._nccl_text(code)}")
        return (nccl_ops.SUCCESS,)

    def rgpuNcclGroupEnd(self, dev: int) -> tuple[int]:
        code = self._nccl().ncclGroupEnd()   # launches the group's operations on their streams
        if code:
            raise CudaError(FAILED, f"rgpu: worker: ncclGroupEnd: {self._nccl_text(code)}")
        return (nccl_ops.SUCCESS,)

    def _collective(self, call: str, key: int, *args: Any) -> tuple[int]:
        comm = self._comm(key, call, FAILED)
        comm.joined.wait()
        if comm.code:
            raise CudaError(FAILED, f"rgpu: worker: {call} (rank {comm.rank} of {comm.nranks}): the communicator "
                                    f"failed ({comm.error})")
        with comm.busy:
            code = getattr(self._nccl(), call)(*args[:-1], comm.handle, ctypes.c_void_p(args[-1] or None))
        if code:
            raise CudaError(FAILED, f"rgpu: worker: {call} (rank {comm.rank} of {comm.nranks}): {self._nccl_text(code, comm)}")
        return (nccl_ops.SUCCESS,)

    @staticmethod
    def _p(ptr: int) -> ctypes.c_void_p:
        return ctypes.c_void_p(ptr or None)

    def ncclAllReduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> tuple[int]:
        return self._collective("ncclAllReduce", comm, self._p(send), self._p(recv), ctypes.c_size_t(count), dtype, op,
                                stream)

    def ncclBroadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: int, stream: int) -> tuple[int]:
        return self._collective("ncclBroadcast", comm, self._p(send), self._p(recv), ctypes.c_size_t(count), dtype, root,
                                stream)

    def ncclReduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int, comm: int,
                   stream: int) -> tuple[int]:
        return self._collective("ncclReduce", comm, self._p(send), self._p(recv), ctypes.c_size_t(count), dtype, op, root,
                                stream)

    def ncclAllGather(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> tuple[int]:
        return self._collective("ncclAllGather", comm, self._p(send), self._p(recv), ctypes.c_size_t(count), dtype, stream)

    def ncclReduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int,
                          stream: int) -> tuple[int]:
        return self._collective("ncclReduceScatter", comm, self._p(send), self._p(recv), ctypes.c_size_t(count), dtype,
                                op, stream)

    def ncclSend(self, send: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> tuple[int]:
        return self._collective("ncclSend", comm, self._p(send), ctypes.c_size_t(count), dtype, peer, stream)

    def ncclRecv(self, recv: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> tuple[int]:
        return self._collective("ncclRecv", comm, self._p(recv), ctypes.c_size_t(count), dtype, peer, stream)

    def ncclAlltoAll(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> tuple[int]:
        return self._collective("ncclAlltoAll", comm, self._p(send), self._p(recv), ctypes.c_size_t(count), dtype, stream)
