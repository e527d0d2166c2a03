"""NCCL on the emulated GPU (named as emulated in every line it says): the slices' workers run the
collectives on their devices' host memory among themselves, over TCP (nccl_mesh.py), with the
reductions of nccl_ops.py. A mixin of EmulatedBackend: the generated handlers call these methods by
the names in nccl.spec.

Each collective runs when its frame arrives, in the order of the slice's other work (the emulated
GPU runs everything at once). A failed exchange (a peer's worker died, or sent nothing for
RGPU_NCCL_TIMEOUT_S) fails the operation with one line naming the peer; the communicator keeps that
error (ncclCommGetAsyncError: ncclRemoteError) and refuses later operations with it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from rgpu.remoting.datapath.backends import nccl_ops
from rgpu.remoting.datapath.backends.base import INVALID_VALUE, NOT_SUPPORTED, CudaError
from rgpu.remoting.datapath.backends.nccl_mesh import Mesh, MeshError, Rendezvous, timeout_from_env

FAILED = 999   # CUDA_ERROR_UNKNOWN for the next synchronising call (not a sticky fault: the context lives on)


@dataclass
class _Comm:
    nranks: int
    rank: int
    joined: threading.Event = field(default_factory=threading.Event)
    mesh: Mesh | None = None
    error: str = ""           # why the join or an operation failed
    code: int = nccl_ops.SUCCESS


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

    def _comm(self, handle: int, call: str, code: int = nccl_ops.INVALID_ARGUMENT) -> _Comm:
        """`code`: NCCL's for a call answered now, CUDA's for a pipelined one (it answers a later call)."""
        comm = self._comms().get(handle)
        if comm is None:
            raise CudaError(code, f"rgpu: worker: {call}: no such communicator on this emulated GPU")
        return comm

    def rgpuNcclCommReady(self, handle: int) -> tuple[int]:
        comm = self._comm(handle, "ncclCommInitRank")
        if not comm.joined.wait(timeout_from_env() + 5):
            comm.error, comm.code = "the join did not finish", nccl_ops.SYSTEM_ERROR
        if comm.code != nccl_ops.SUCCESS:
            raise CudaError(comm.code, f"rgpu: worker: ncclCommInitRank (emulated NCCL): {comm.error}")
        return (nccl_ops.SUCCESS,)

    def rgpuNcclCommDestroy(self, handle: int, abort: int) -> tuple[int]:
        comm = self._comms().pop(handle, None)
        if comm is not None and comm.mesh is not None:
            comm.mesh.close()
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

    def ncclAllReduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            n = count * nccl_ops.element_size(dtype)
            self._write(recv, nccl_ops.reduce(self._gather(mesh, self._read(send, n)), dtype, op))
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
            self._write(recv, nccl_ops.reduce(parts, dtype, op))
        return self._run("ncclReduce", comm, stream, body)

    def ncclAllGather(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            n = count * nccl_ops.element_size(dtype)
            self._write(recv, b"".join(self._gather(mesh, self._read(send, n))))
        return self._run("ncclAllGather", comm, stream, body)

    def ncclReduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int,
                          stream: int) -> tuple[int]:
        def body(mesh: Mesh) -> None:
            n = count * nccl_ops.element_size(dtype)
            whole = self._read(send, n * mesh.nranks)
            for peer in mesh.peers:
                mesh.send(peer, whole[peer * n:(peer + 1) * n])
            mine = mesh.rank * n
            parts = [whole[mine:mine + n] if r == mesh.rank else mesh.recv(r, n) for r in range(mesh.nranks)]
            self._write(recv, nccl_ops.reduce(parts, dtype, op))
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
