"""The recording driver, frames and session spec shared by the tests of the worker's native launch path."""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.loop import Worker
from rgpu.remoting.datapath.worker.native_loop import NativeLaunches
from rgpu.remoting.datapath.worker.spec import SessionSpec


LAUNCH_OP = api_gen.OPCODES["cuLaunchKernel"]


SYNC_OP = api_gen.OPCODES["cuCtxSynchronize"]


LAUNCH = struct.Struct("<QQ12I")


CTX = 0x9000_0000


LAUNCH_ERROR = 719  # CUDA_ERROR_LAUNCH_FAILED


LAUNCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                             ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))


class CallLog:
    """What the recording drivers of the C loop's tests share: every call appended to `calls` in
    order and counted by kind, `fail` mapping (kind, n) (the kind's n-th call, 0-based) to the code
    it returns, and the entry points, by index into `callbacks` (ctypes callbacks kept alive here;
    index 0 is cuLaunchKernel)."""

    fail: dict[tuple[str, int], int]
    calls: list[tuple[int | str, ...]]
    counts: dict[str, int]
    callbacks: tuple[Any, ...]

    def call(self, kind: str, *args: int) -> int:
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        self.calls.append((kind, *args))
        return self.fail.get((kind, n), 0)

    def address(self, i: int) -> int:
        return int(ctypes.cast(self.callbacks[i], ctypes.c_void_p).value or 0)

    @property
    def launch_entry(self) -> int:
        return self.address(0)


@dataclass
class Launch:
    f: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shmem: int
    stream: int
    params: bytes
    params_address: int


@dataclass
class RecordingDriver:
    """Test double for the driver's cuLaunchKernel: records each launch, reading the parameter
    block through the CU_LAUNCH_PARAM_BUFFER_* array as the driver does."""

    fail_on: set[int] = field(default_factory=set)   # call numbers (0-based) that return LAUNCH_ERROR
    launches: list[Launch] = field(default_factory=list)

    def __post_init__(self) -> None:
        def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):  # type: ignore[no-untyped-def]
            assert params is None
            assert (extra[0], extra[2], extra[4]) == (1, 2, None)
            size = ctypes.cast(extra[3], ctypes.POINTER(ctypes.c_size_t))[0]
            self.launches.append(Launch(f or 0, (gx, gy, gz), (bx, by, bz), shmem, stream or 0,
                                        ctypes.string_at(extra[1], size), extra[1]))
            return LAUNCH_ERROR if len(self.launches) - 1 in self.fail_on else 0
        self.callback = LAUNCH_FN(launch)

    @property
    def entry(self) -> int:
        return int(ctypes.cast(self.callback, ctypes.c_void_p).value or 0)


def launch_frame(f: int, params: bytes, *, ctx: int = CTX, grid: tuple[int, int, int] = (1, 1, 1),
                 block: tuple[int, int, int] = (32, 1, 1), shmem: int = 0, stream: int = 0, coop: int = 0,
                 nattrs: int = 0, argsize: int | None = None) -> bytes:
    body = LAUNCH.pack(f, stream, *grid, *block, shmem, coop, nattrs,
                       len(params) if argsize is None else argsize, 0, 0) + params
    body += b"\0" * (-len(body) % 8)
    return protocol.pack_frame(LAUNCH_OP, body, seq=1, ctx=ctx)


class Buffer:
    """Frames in a ctypes buffer, optionally starting `shift` bytes past an 8-byte boundary."""

    def __init__(self, data: bytes, shift: int = 0) -> None:
        self.raw = (ctypes.c_uint64 * ((len(data) + shift) // 8 + 2))()
        self.address = ctypes.addressof(self.raw) + shift
        ctypes.memmove(self.address, data, len(data))
        self.size = len(data)


def admitting(native: NativeLaunches, *kernels: int) -> NativeLaunches:
    """The loop with these kernels admitted, as the worker admits each before its first launch."""
    for f in kernels:
        native.admit(f)
    return native


def session_spec(launch_library: str) -> SessionSpec:
    return SessionSpec(mode="cuda", backend="emulated", gpu_uuid="GPU-0", gpu_index=0, gpu_name="NVIDIA H200",
                       gpu_total_memory=1 << 30, compute_capability="9.0", memory_limit=1 << 30,
                       compute_percent=100, job_key="native-launch-test", slice_number=0, usage_dir="",
                       server="127.0.0.1:1", compute_enforcement="time-slicing", client={},
                       launch_library=launch_library)


D = TypeVar("D")


@dataclass
class Served(Generic[D]):
    """A Worker serving one end of a socket pair on a thread of its own, its backend's driver a
    recording test double; the test holds the other end."""
    sock: socket.socket
    worker: Worker
    driver: D

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def sync(self, seq: int) -> tuple[int, str]:
        """cuCtxSynchronize: (result, message), the message of a deferred error included."""
        self.sock.sendall(protocol.pack_frame(SYNC_OP, b"", seq=seq, ctx=CTX))
        (_length, op, flags, reply_seq, _aux, _ctx), payload = protocol.recv_frame(self.sock)
        assert (op, reply_seq) == (protocol.OP_REPLY, seq)
        (code,) = struct.unpack_from("<i", payload)
        message = ""
        if flags & protocol.REPLY_HAS_MESSAGE:
            (n,) = struct.unpack_from("<I", payload, 4)
            message = bytes(payload[8:8 + n]).decode()
        return code, message


def serve_worker(spec: SessionSpec, backend: Any, driver: D) -> Iterator[Served[D]]:
    """`backend` served by a Worker (its primary context is CTX) until the generator is closed."""
    client, server = socket.socketpair()
    assert backend.primary_ctx_retain() == CTX   # as the client's cuDevicePrimaryCtxRetain would
    worker = Worker(server, backend, spec, None)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        yield Served(client, worker, driver)
    finally:
        client.close()
        thread.join(timeout=10)
        server.close()
