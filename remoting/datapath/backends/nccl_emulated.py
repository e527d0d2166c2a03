"""NCCL on the emulated GPU (named as emulated in every line it says): the slices' workers run the
collectives on their devices' host memory among themselves, over TCP (nccl_mesh.py), with the
reductions of nccl_ops.py. A mixin of EmulatedBackend: the generated handlers call these methods by
the names in nccl.spec.

Each collective runs when its frame arrives, in the order of the slice's other work (the emulated
GPU runs everything at once). A failed exchange (a peer's worker died, or sent nothing for
RGPU_NCCL_TIMEOUT_S) fails the operation with one line naming the peer; the communicator keeps that
error (ncclCommGetAsyncError: ncclRemoteError) and refuses later operations with it."""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from rgpu.remoting.datapath.backends import nccl_ops
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, NOT_SUPPORTED, CudaError
from rgpu.remoting.datapath.backends.nccl_mesh import ID_BYTES, Mesh, MeshError, Rendezvous, timeout_from_env

FAILED = 999   # CUDA_ERROR_UNKNOWN for the next synchronising call (not a sticky fault: the context lives on)
NOCOLOR = -1   # NCCL_SPLIT_NOCOLOR
FLUSH_S = 10.0   # ncclCommDestroy: how long this rank's last messages may take to reach its peers
HOST_IMMEDIATE = 1   # ncclScalarHostImmediate (else ncclScalarDevice: the scalar's device address)
_COLOR_KEY = struct.Struct("<ii")


@dataclass
class _Comm:
    nranks: int
    rank: int
    joined: threading.Event = field(default_factory=threading.Event)
    mesh: Mesh | None = None
    error: str = ""           # why the join or an operation failed
    code: int = nccl_ops.SUCCESS
    # Held while an operation uses the mesh, and by a split from its call until its exchange over this
    # (the parent's) mesh is done: later operations on the parent wait for it, so the ranks' messages
    # over the parent keep one order.
    busy: threading.Lock = field(default_factory=threading.Lock)
    premul: dict[int, tuple[int, int, int]] = field(default_factory=dict)   # op -> (dtype, residence, scalar)


class EmulatedNccl:
    """The emulated GPU's NCCL. The worker sets `nccl_host` (the address its client reached it at,
    where peers can reach it too)."""

    nccl_host = "127.0.0.1"
    _nccl_comms: dict[int, _Comm]
    _nccl_next: int

    # ------------------------------------------------------------------ communicators

    def _comms(self) -> dict[int, _Comm]:
        if not hasattr(self, "_nccl_comms"):
            self._nccl_comms, self._nccl_next = {}, 0x6e00_0001
        return self._nccl_comms

    def rgpuNcclGetUniqueId(self, dev: int) -> tuple[int, bytes]:
        return (nccl_ops.SUCCESS, Rendezvous(self.nccl_host, timeout_from_env()).id.pack())

    def rgpuNcclCommJoin(self, comm_id: bytes, nranks: int, rank: int, dev: int) -> tuple[int, int]:
        comms = self._comms()
        comm = _Comm(nranks, rank)
        handle = self._nccl_next
        self._nccl_next += 1
        comms[handle] = comm

        def join() -> None:
            try:
                comm.mesh = Mesh(comm_id, nranks, rank, self.nccl_host, timeout_from_env())
            except (MeshError, OSError, ValueError) as exc:
                comm.error, comm.code = f"rank {rank} of {nranks} could not join: {exc}", nccl_ops.SYSTEM_ERROR
            finally:
                comm.joined.set()
        threading.Thread(target=join, name="rgpu-nccl-join", daemon=True).start()
        return (nccl_ops.SUCCESS, handle)

    def rgpuNcclCommJoinScalable(self, comm_ids: list[bytes], n_id: int, nranks: int, rank: int,
                                 dev: int) -> tuple[int, int]:
        """Every rank has the same ids; the first one's rendezvous forms the communicator (a mesh of a
        handful of ranks needs no spreading; the others' rendezvous close after their timeout)."""
        if n_id < 1 or len(comm_ids) != n_id:
            raise CudaError(nccl_ops.INVALID_ARGUMENT, f"rgpu: worker: ncclCommInitRankScalable (emulated NCCL): "
                                                       f"{len(comm_ids)} unique id(s) sent for nId {n_id}")
        return self.rgpuNcclCommJoin(comm_ids[0], nranks, rank, dev)

    def _comm(self, handle: int, call: str, code: int = nccl_ops.INVALID_ARGUMENT) -> _Comm:
        """`code`: NCCL's for a call answered now, CUDA's for a pipelined one (it answers a later call)."""
        comm = self._comms().get(handle)
        if comm is None:
            raise CudaError(code, f"rgpu: worker: {call}: no such communicator on this emulated GPU")
        return comm

    def rgpuNcclCommReady(self, handle: int) -> tuple[int, int, int]:
        comm = self._comm(handle, "ncclCommInitRank")
        if not comm.joined.wait(timeout_from_env() + 5):
            comm.error, comm.code = "the join did not finish", nccl_ops.SYSTEM_ERROR
        if comm.code != nccl_ops.SUCCESS:
            raise CudaError(comm.code, f"rgpu: worker: ncclCommInitRank (emulated NCCL): {comm.error}")
        return (nccl_ops.SUCCESS, comm.rank, comm.nranks)

    def rgpuNcclCommSplit(self, handle: int, color: int, key: int) -> tuple[int, int]:
        """Every rank of the parent sends its (color, key) to every other over the parent's mesh; the ranks
        of one color, ordered by (key, parent rank), form a new mesh (`_derive`). In the background: a
        process with several slices splits each before any waits (ncclGroupStart/End)."""
        def members(mesh: Mesh) -> list[int] | None:
            table = [_COLOR_KEY.unpack(b) for b in self._gather(mesh, _COLOR_KEY.pack(color, key))]
            if color == NOCOLOR:
                return None
            return [r for _, r in sorted((k, r) for r, (c, k) in enumerate(table) if c == color)]
        return self._derive(handle, "ncclCommSplit", "split", members)

    def rgpuNcclCommShrink(self, handle: int, exclude: list[int], count: int, flags: int) -> tuple[int, int]:
        """The parent's ranks but `exclude` (which do not call it) form a new mesh, ranks in the parent's
        order (`_derive`), in the background as a split. The parent's mesh must be whole: one that failed
        (a peer died) was closed, and its ranks cannot shrink it here (real NCCL can, with
        NCCL_SHRINK_ABORT). Nothing is left to abort (`flags`): every operation ran as it came."""
        parent = self._comm(handle, "ncclCommShrink")
        if parent.joined.is_set() and parent.nranks > 0:   # else checked in the background
            try:
                nccl_ops.shrink_members(parent.nranks, parent.rank, exclude)
            except ValueError as exc:
                raise CudaError(nccl_ops.INVALID_ARGUMENT, f"rgpu: worker: ncclCommShrink: {exc}") from None
        return self._derive(handle, "ncclCommShrink", "shrink",
                            lambda mesh: nccl_ops.shrink_members(mesh.nranks, mesh.rank, exclude))

    def _derive(self, handle: int, call: str, verb: str, members_of: Any) -> tuple[int, int]:
        """A communicator of some of the parent's ranks: `members_of(parent mesh)` lists them (parent
        ranks, in their new order; None: this rank is in none, 0 ranks at rgpuNcclCommReady); the first
        opens a rendezvous and names it to the others over the parent's mesh. The parent is held (`busy`)
        until that exchange is done, so the ranks' messages over it keep one order."""
        parent = self._comm(handle, call)
        child = _Comm(nranks=-1, rank=-1)
        new = self._nccl_next
        self._nccl_next += 1
        self._comms()[new] = child
        parent.busy.acquire()

        def derive() -> None:
            uid = b""
            try:
                try:
                    if not parent.joined.wait(timeout_from_env()) or parent.mesh is None or parent.code:
                        raise MeshError(f"the parent communicator is not whole ({parent.error or 'it never formed'})")
                    mesh = parent.mesh
                    members = members_of(mesh)
                    if members is None:
                        child.nranks = 0
                        return
                    child.rank, child.nranks = members.index(mesh.rank), len(members)
                    if mesh.rank == members[0]:
                        uid = Rendezvous(self.nccl_host, timeout_from_env()).id.pack()
                        for r in members[1:]:
                            mesh.send(r, uid)
                    else:
                        uid = mesh.recv(members[0], ID_BYTES)
                finally:
                    parent.busy.release()
                child.mesh = Mesh(uid, child.nranks, child.rank, self.nccl_host, timeout_from_env())
            except (MeshError, OSError, ValueError) as exc:
                child.error = f"rank {parent.rank} of {parent.nranks} could not {verb}: {exc}"
                child.code = (nccl_ops.REMOTE_ERROR if isinstance(exc, MeshError) else
                              nccl_ops.INVALID_ARGUMENT if isinstance(exc, ValueError) else nccl_ops.SYSTEM_ERROR)
            finally:
                child.joined.set()
        threading.Thread(target=derive, name=f"rgpu-nccl-{verb}", daemon=True).start()
        return (nccl_ops.SUCCESS, new)

    def ncclCommFinalize(self, handle: int) -> tuple[int]:
        self._comm(handle, "ncclCommFinalize")   # every operation ran as it came: nothing is left to flush
        return (nccl_ops.SUCCESS,)

    def rgpuNcclRedOpCreatePreMulSum(self, scalar: int, dtype: int, residence: int, handle: int) -> tuple[int, int]:
        comm = self._comm(handle, "ncclRedOpCreatePreMulSum")
        try:
            nccl_ops.element_size(dtype)
        except nccl_ops.Unsupported as exc:
            raise CudaError(nccl_ops.INVALID_ARGUMENT, f"rgpu: worker: ncclRedOpCreatePreMulSum: {exc}") from None
        op = nccl_ops.NUM_OPS + len(comm.premul)
        while op in comm.premul:
            op += 1
        comm.premul[op] = (dtype, residence, scalar)
        return (nccl_ops.SUCCESS, op)

    def ncclRedOpDestroy(self, op: int, handle: int) -> tuple[int]:
        if self._comm(handle, "ncclRedOpDestroy").premul.pop(op, None) is None:
            raise CudaError(nccl_ops.INVALID_ARGUMENT, f"rgpu: worker: ncclRedOpDestroy: operator {op} was not made "
                                                       "by ncclRedOpCreatePreMulSum on this communicator")
        return (nccl_ops.SUCCESS,)

    def _reduce(self, comm: _Comm, parts: list[bytes], dtype: int, op: int) -> bytes:
        """nccl_ops.reduce, with this communicator's PreMulSum operators (a device scalar is read now, in
        the stream's order, as NCCL's kernel reads it)."""
        if op not in comm.premul:
            return nccl_ops.reduce(parts, dtype, op)
        op_dtype, residence, scalar = comm.premul[op]
        if op_dtype != dtype:
            raise nccl_ops.Unsupported(f"PreMulSum operator {op} was made for {nccl_ops.DTYPE_NAMES.get(op_dtype)}, "
                                       f"not {nccl_ops.DTYPE_NAMES.get(dtype)}")
        size = nccl_ops.element_size(dtype)
        raw = scalar.to_bytes(8, "little")[:size] if residence == HOST_IMMEDIATE else self._read(scalar, size)
        return nccl_ops.reduce(parts, dtype, nccl_ops.SUM, scale=nccl_ops.scalar(raw, dtype))

    def rgpuNcclCommDestroy(self, handle: int, abort: int) -> tuple[int]:
        comm = self._comms().pop(handle, None)
        if comm is not None and comm.mesh is not None:
            comm.mesh.close(flush_s=0.0 if abort else FLUSH_S)
        return (nccl_ops.SUCCESS,)

    def rgpuNcclCommGetAsyncError(self, handle: int) -> tuple[int, int]:
        comm = self._comm(handle, "ncclCommGetAsyncError")
        return (nccl_ops.SUCCESS, comm.code if comm.joined.is_set() else 7)   # ncclInProgress while joining

    def rgpuNcclGroupStart(self, dev: int) -> tuple[int]:
        return (nccl_ops.SUCCESS,)   # each operation runs as it comes: a send never waits for its receive

    def rgpuNcclGroupEnd(self, dev: int) -> tuple[int]:
        return (nccl_ops.SUCCESS,)

    # ------------------------------------------------------------------ the collectives

    def _run(self, call: str, handle: int, stream: int, body: Any) -> tuple[int]:
        comm = self._comm(handle, call, INVALID_VALUE)
        with comm.busy:
            return self._run_locked(call, comm, stream, body)

    def _run_locked(self, call: str, comm: _Comm, stream: int, body: Any) -> tuple[int]:
        if stream in getattr(self, "capturing", {}):
            raise CudaError(NOT_SUPPORTED, f"rgpu: worker: {call} on a capturing stream is not supported by the "
                                           "emulated GPU's NCCL")
        where = f"rgpu: worker: {call} (emulated NCCL, rank {comm.rank} of {comm.nranks})"
        if not comm.joined.wait(timeout_from_env()) or comm.mesh is None:
            raise CudaError(FAILED, f"{where}: the communicator never formed ({comm.error or 'timed out'})")
        if comm.code != nccl_ops.SUCCESS:
            raise CudaError(FAILED, f"{where}: the communicator failed earlier ({comm.error})")
        try:
            body(comm.mesh)
        except MeshError as exc:
            comm.error, comm.code = str(exc), nccl_ops.REMOTE_ERROR
            comm.mesh.close()
            raise CudaError(FAILED, f"{where}: {exc}; the communicator is aborted") from None
        except nccl_ops.Unsupported as exc:
            raise CudaError(NOT_SUPPORTED, f"{where}: {exc}") from None
        return (nccl_ops.SUCCESS,)

    def _read(self, ptr: int, n: int) -> bytes:
        buf, off = self._locate(ptr, n)   # type: ignore[attr-defined]
        return bytes(buf[off:off + n])

    def _write(self, ptr: int, data: bytes) -> None:
        buf, off = self._locate(ptr, len(data))   # type: ignore[attr-defined]
        buf[off:off + len(data)] = data

    def _gather(self, mesh: Mesh, mine: bytes) -> list[bytes]:
        """Every rank's `mine`, in rank order."""
        for peer in mesh.peers:
            mesh.send(peer, mine)
        return [mine if r == mesh.rank else mesh.recv(r, len(mine)) for r in range(mesh.nranks)]

    def _exchange_chunks(self, mesh: Mesh, send: int, n: int) -> list[bytes]:
        """Chunk p of `n` bytes of this rank's send buffer goes to rank p; returns the chunks every rank sent
        this one, in rank order (reduce-scatter reduces them, all-to-all lays them side by side)."""
        whole = self._read(send, n * mesh.nranks)
        for peer in mesh.peers:
            mesh.send(peer, whole[peer * n:(peer + 1) * n])
        mine = mesh.rank * n
        return [whole[mine:mine + n] if r == mesh.rank else mesh.recv(r, n) for r in range(mesh.nranks)]

    def ncclAllReduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            n = count * nccl_ops.element_size(dtype)
            self._write(recv, self._reduce(self._comms()[comm], self._gather(mesh, self._read(send, n)), dtype, op))
        return self._run("ncclAllReduce", comm, stream, body)

    def ncclBroadcast(self, send: int, recv: int, count: int, dtype: int, root: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            n = count * nccl_ops.element_size(dtype)
            if mesh.rank == root:
                data = self._read(send, n)
                for peer in mesh.peers:
                    mesh.send(peer, data)
            else:
                data = mesh.recv(root, n)
            self._write(recv, data)
        return self._run("ncclBroadcast", comm, stream, body)

    def ncclReduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int, comm: int,
                   stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            n = count * nccl_ops.element_size(dtype)
            mine = self._read(send, n)
            if mesh.rank != root:
                mesh.send(root, mine)
                return
            parts = [mine if r == root else mesh.recv(r, n) for r in range(mesh.nranks)]
            self._write(recv, self._reduce(self._comms()[comm], parts, dtype, op))
        return self._run("ncclReduce", comm, stream, body)

    def ncclAllGather(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            n = count * nccl_ops.element_size(dtype)
            self._write(recv, b"".join(self._gather(mesh, self._read(send, n))))
        return self._run("ncclAllGather", comm, stream, body)

    def ncclReduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int,
                          stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            parts = self._exchange_chunks(mesh, send, count * nccl_ops.element_size(dtype))
            self._write(recv, self._reduce(self._comms()[comm], parts, dtype, op))
        return self._run("ncclReduceScatter", comm, stream, body)

    def ncclSend(self, send: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            if peer not in mesh.peers:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: ncclSend: peer {peer} is not another rank")
            mesh.send(peer, self._read(send, count * nccl_ops.element_size(dtype)))
        return self._run("ncclSend", comm, stream, body)

    def ncclRecv(self, recv: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            if peer not in mesh.peers:
                raise CudaError(INVALID_VALUE, f"rgpu: worker: ncclRecv: peer {peer} is not another rank")
            self._write(recv, mesh.recv(peer, count * nccl_ops.element_size(dtype)))
        return self._run("ncclRecv", comm, stream, body)

    def ncclAlltoAll(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            self._write(recv, b"".join(self._exchange_chunks(mesh, send, count * nccl_ops.element_size(dtype))))
        return self._run("ncclAlltoAll", comm, stream, body)
