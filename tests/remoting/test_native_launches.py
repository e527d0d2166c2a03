"""The worker's native launch loop (librgpu-worker.so, remoting/native/src/worker_launch.c).

CI has no driver, so a ctypes callback with cuLaunchKernel's C signature stands in for NVIDIA's
cuLaunchKernel (RecordingDriver, a test double). Everything else is real: the C loop compiled by
the package's own build, frames encoded as the client library encodes them, and a Worker serving
them over a real socket pair.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.emulated import EmulatedBackend
from rgpu.remoting.native import build
from rgpu.remoting.datapath.worker.loop import Worker
from rgpu.remoting.datapath.worker.native_loop import NativeLaunches
from rgpu.remoting.datapath.worker.spec import SessionSpec

from tests.remoting.conftest import Server
from tests.remoting.native_launches_helpers import Buffer, CTX, LAUNCH_ERROR, LAUNCH_OP, RecordingDriver, SYNC_OP, admitting, launch_frame, session_spec


def test_a_kernel_the_worker_has_not_admitted_stops_the_run(worker_library: str) -> None:
    # Its first launch is the Python worker's: it charges the kernel's local memory to the slice.
    driver = RecordingDriver()
    native = admitting(NativeLaunches(worker_library, driver.entry), 0xF00)
    known, new = launch_frame(0xF00, b"\0" * 8), launch_frame(0xF01, b"\0" * 8)
    buf = Buffer(known + new + known)
    assert native.run(buf.address, buf.size, CTX) == (len(known), 0)
    native.admit(0xF01)
    rest = Buffer(new + known)
    assert native.run(rest.address, rest.size, CTX) == (rest.size, 0)
    assert [launch.f for launch in driver.launches] == [0xF00, 0xF01, 0xF00]


def test_the_admitted_table_holds_many_kernels_and_stops_growing_when_full(worker_library: str) -> None:
    from rgpu.remoting.datapath.worker.native_loop import ADMITTED_SLOTS
    driver = RecordingDriver()
    native = NativeLaunches(worker_library, driver.entry)
    kernels = [0x7F00_0000_0000 + 0x40 * i for i in range(ADMITTED_SLOTS)]   # aligned, like real handles
    admitting(native, *kernels)
    full = ADMITTED_SLOTS * 3 // 4
    frames = [launch_frame(f, b"\0" * 8) for f in (kernels[0], kernels[full - 1], kernels[full])]
    for frame, runs in zip(frames, (True, True, False)):
        buf = Buffer(frame)
        assert native.run(buf.address, buf.size, CTX)[0] == (buf.size if runs else 0)


CLIENT_STREAM = 0x7D00_0001_0000_0001   # a stream handle as the client library makes them (protocol 8)


def test_a_run_of_plain_launches_goes_to_the_driver_in_one_call(worker_library: str) -> None:
    driver = RecordingDriver()
    native = admitting(NativeLaunches(worker_library, driver.entry), *(0xF00 + i for i in range(3)))
    native.set_stream(CLIENT_STREAM, 0x5000)   # the driver's stream behind the client's handle
    frames = [launch_frame(0xF00 + i, struct.pack("<Qi", 0xD000 + i, i), grid=(i + 1, 2, 3), block=(64, 2, 1),
                           shmem=128 * i, stream=CLIENT_STREAM) for i in range(3)]
    data = b"".join(frames) + protocol.pack_frame(SYNC_OP, b"", seq=9, ctx=CTX)
    buf = Buffer(data)

    used, error = native.run(buf.address, buf.size, CTX)

    assert (used, error) == (sum(map(len, frames)), 0)  # stops before the sync frame, leaving it whole
    assert native.launched.value == 3
    assert [launch.f for launch in driver.launches] == [0xF00, 0xF01, 0xF02]
    assert driver.launches[2].grid == (3, 2, 3) and driver.launches[2].block == (64, 2, 1)
    assert driver.launches[2].shmem == 256 and driver.launches[2].stream == 0x5000
    assert driver.launches[1].params == struct.pack("<Qi", 0xD001, 1)
    assert all(launch.params_address % 8 == 0 for launch in driver.launches)


def test_streams_the_loop_does_not_know_stop_the_run(worker_library: str) -> None:
    # The Python worker then says why (an unknown stream: CUDA_ERROR_INVALID_HANDLE at the next sync).
    from rgpu.remoting.datapath.worker.native_loop import STREAM_SLOTS
    driver = RecordingDriver()
    native = admitting(NativeLaunches(worker_library, driver.entry), 0xF00)
    native.set_stream(CLIENT_STREAM, 0x5000)
    ok, legacy = launch_frame(0xF00, b"\0" * 8, stream=CLIENT_STREAM), launch_frame(0xF00, b"\0" * 8, stream=1)
    unknown = launch_frame(0xF00, b"\0" * 8, stream=CLIENT_STREAM + 1)
    buf = Buffer(ok + legacy + unknown + ok)
    assert native.run(buf.address, buf.size, CTX) == (len(ok) + len(legacy), 0)
    assert [launch.stream for launch in driver.launches] == [0x5000, 1]
    native.set_stream(CLIENT_STREAM, 0)   # destroyed
    buf = Buffer(ok)
    assert native.run(buf.address, buf.size, CTX) == (0, 0)
    # Streams come and go: the table is rebuilt from the live ones instead of filling up.
    for i in range(4 * STREAM_SLOTS):
        native.set_stream(CLIENT_STREAM + 2 + i, 0x6000 + i)
        native.set_stream(CLIENT_STREAM + 2 + i, 0)
    native.set_stream(CLIENT_STREAM, 0x5001)
    assert native.run(buf.address, buf.size, CTX) == (len(ok), 0)
    assert driver.launches[-1].stream == 0x5001


DECLINED = {
    "another context": launch_frame(0xF00, b"\0" * 8, ctx=CTX + 1),
    "cooperative": launch_frame(0xF00, b"\0" * 8, coop=1),
    "launch attributes without cuLaunchKernelEx": launch_frame(0xF00, b"\0" * 80, nattrs=1, argsize=8),
    "parameters longer than the frame": launch_frame(0xF00, b"\0" * 8, argsize=4096),
    "parameters over the driver's limit": launch_frame(0xF00, b"\0" * 8, argsize=1 << 31),
    "a frame shorter than a launch": protocol.pack_frame(LAUNCH_OP, b"\0" * 16, seq=1, ctx=CTX),
    "another operation": protocol.pack_frame(SYNC_OP, b"", seq=1, ctx=CTX),
}


@pytest.mark.parametrize("why, frame", list(DECLINED.items()), ids=list(DECLINED))
def test_everything_but_a_plain_launch_is_left_to_the_python_worker(worker_library: str, why: str,
                                                                    frame: bytes) -> None:
    driver = RecordingDriver()
    native = admitting(NativeLaunches(worker_library, driver.entry), 0xF00)
    first = launch_frame(0xF00, b"\1" * 8)
    buf = Buffer(first + frame + first)

    used, error = native.run(buf.address, buf.size, CTX)

    assert used == len(first), why
    assert len(driver.launches) == 1 and error == 0


def test_a_partial_frame_waits_for_the_rest(worker_library: str) -> None:
    driver = RecordingDriver()
    native = admitting(NativeLaunches(worker_library, driver.entry), 0xF00)
    frame = launch_frame(0xF00, b"\2" * 16)
    for cut in (0, 10, protocol.HEADER_SIZE, len(frame) - 1):
        buf = Buffer(frame + frame[:cut])
        used, _ = native.run(buf.address, buf.size, CTX)
        assert used == len(frame), cut
    assert len(driver.launches) == 4


@pytest.mark.parametrize("shift", [1, 4])
def test_misaligned_parameters_reach_the_driver_aligned_and_intact(worker_library: str, shift: int) -> None:
    driver = RecordingDriver()
    native = admitting(NativeLaunches(worker_library, driver.entry), 0xF00)
    params = bytes(range(40))
    buf = Buffer(launch_frame(0xF00, params), shift=shift)

    used, _ = native.run(buf.address, buf.size, CTX)

    assert used == buf.size
    assert driver.launches[0].params == params and driver.launches[0].params_address % 8 == 0


def test_the_first_launch_error_is_kept_and_later_launches_still_run(worker_library: str) -> None:
    driver = RecordingDriver(fail_on={1, 2})
    native = admitting(NativeLaunches(worker_library, driver.entry), *(0xF00 + i for i in range(4)))
    buf = Buffer(b"".join(launch_frame(0xF00 + i, b"\0" * 8) for i in range(4)))

    used, error = native.run(buf.address, buf.size, CTX)

    assert used == buf.size and error == LAUNCH_ERROR
    assert len(driver.launches) == 4       # the driver itself decides what an error means for later work
    assert native.run(buf.address, 0, CTX) == (0, 0)   # reported once


# ------------------------------------------------------------------- launches with attributes

LAUNCH_EX_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.POINTER(ctypes.c_void_p))
ATTR_SIZE = 72
CLUSTER_DIMENSION, PROGRAMMATIC_STREAM_SERIALIZATION = 4, 6   # CUlaunchAttributeID (cuda.h)


class LaunchConfig(ctypes.Structure):   # CUlaunchConfig, as cuda.h lays it out
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shmem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint)]


class RecordingLaunchEx:
    """Test double for the driver's cuLaunchKernelEx: records the configuration, the attributes
    (72 bytes each) and the parameter block, read as the driver reads them."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, tuple[int, ...], tuple[int, ...], int, int, bytes, bytes]] = []

        def launch(config, f, params, extra):  # type: ignore[no-untyped-def]
            c = LaunchConfig.from_address(config)
            assert params is None and (extra[0], extra[2], extra[4]) == (1, 2, None)
            size = ctypes.cast(extra[3], ctypes.POINTER(ctypes.c_size_t))[0]
            assert c.attrs % 8 == 0 and extra[1] % 8 == 0   # the driver reads both in place
            self.launches.append((f or 0, tuple(c.grid), tuple(c.block), c.shmem, c.stream or 0,
                                  ctypes.string_at(c.attrs, c.nattrs * ATTR_SIZE), ctypes.string_at(extra[1], size)))
            return 0
        self.callback = LAUNCH_EX_FN(launch)
        self.entry = int(ctypes.cast(self.callback, ctypes.c_void_p).value or 0)


def attribute(attr_id: int, *words: int) -> bytes:
    return struct.pack("<II", attr_id, 0) + struct.pack(f"<{len(words)}Q", *words).ljust(ATTR_SIZE - 8, b"\0")


def attributed(f: int, attrs: list[bytes], params: bytes, **kw: object) -> bytes:
    return launch_frame(f, b"".join(attrs) + params, nattrs=len(attrs), argsize=len(params), **kw)  # type: ignore[arg-type]


def test_launches_with_attributes_go_to_cuLaunchKernelEx_with_their_attributes_and_parameters(
        worker_library: str) -> None:
    # cuBLAS and cuDNN launch their Hopper kernels with cluster dimensions and programmatic
    # serialisation; the generic Python path took ~12 us for each (ResNet-18: 34k of 176k launches).
    plain, ex = RecordingDriver(), RecordingLaunchEx()
    native = admitting(NativeLaunches(worker_library, plain.entry, launch_ex_entry=ex.entry), 0xF00, 0xF01)
    native.set_stream(CLIENT_STREAM, 0x5000)
    cluster = attribute(CLUSTER_DIMENSION, (2 << 32) | 2, 1)
    serial = attribute(PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    params = struct.pack("<QQi", 0xD000, 0xD100, 7)
    frames = [attributed(0xF00, [cluster, serial], params, grid=(4, 2, 1), block=(128, 1, 1), shmem=256,
                         stream=CLIENT_STREAM),
              launch_frame(0xF01, b"\0" * 8),
              attributed(0xF01, [serial], b"\5" * 12)]
    buf = Buffer(b"".join(frames), shift=4)   # parameters behind the attributes, misaligned: copied aligned

    used, error = native.run(buf.address, buf.size, CTX)

    assert (used, error) == (buf.size, 0)
    assert ex.launches == [(0xF00, (4, 2, 1), (128, 1, 1), 256, 0x5000, cluster + serial, params),
                           (0xF01, (1, 1, 1), (32, 1, 1), 0, 0, serial, b"\5" * 12)]
    assert len(plain.launches) == 1 and native.launched.value == 3 and native.launched_with_attributes == 2


def test_an_attribute_naming_a_client_event_carries_the_drivers_event(worker_library: str) -> None:
    from rgpu.remoting.datapath.worker.client_handles import event_attributes
    ex = RecordingLaunchEx()
    native = admitting(NativeLaunches(worker_library, RecordingDriver().entry, launch_ex_entry=ex.entry), 0xF00)
    native.events.put(0xE100, 0xABC0)        # the client's event 0xE100 is the driver's 0xABC0
    for attr_id in sorted(event_attributes()):
        buf = Buffer(attributed(0xF00, [attribute(attr_id, 0xE100, 1)], b"\0" * 8))
        assert native.run(buf.address, buf.size, CTX) == (buf.size, 0)
        assert ex.launches[-1][5] == attribute(attr_id, 0xABC0, 1)
    assert len(ex.launches) == 2


UNRUN_ATTRIBUTED = {
    "an event the loop does not know": [attribute(7, 0xE999)],
    "more attributes than the loop takes": [attribute(PROGRAMMATIC_STREAM_SERIALIZATION, 1)] * 17,
}


@pytest.mark.parametrize("attrs", list(UNRUN_ATTRIBUTED.values()), ids=list(UNRUN_ATTRIBUTED))
def test_an_attributed_launch_the_loop_cannot_run_is_left_to_the_python_worker(worker_library: str,
                                                                               attrs: list[bytes]) -> None:
    ex = RecordingLaunchEx()
    native = admitting(NativeLaunches(worker_library, RecordingDriver().entry, launch_ex_entry=ex.entry), 0xF00)
    first = attributed(0xF00, [attribute(PROGRAMMATIC_STREAM_SERIALIZATION, 1)], b"\0" * 8)
    buf = Buffer(first + attributed(0xF00, attrs, b"\0" * 8) + first)
    assert native.run(buf.address, buf.size, CTX) == (len(first), 0)
    assert len(ex.launches) == 1


def test_attributes_and_parameters_overrunning_the_frame_are_left_to_the_python_worker(worker_library: str) -> None:
    ex = RecordingLaunchEx()
    native = admitting(NativeLaunches(worker_library, RecordingDriver().entry, launch_ex_entry=ex.entry), 0xF00)
    # Two attributes claimed, one sent: the parameters the frame claims would lie past its end.
    bad = launch_frame(0xF00, attribute(4, 1) + b"\0" * 8, nattrs=2, argsize=8)
    buf = Buffer(bad)
    assert native.run(buf.address, buf.size, CTX) == (0, 0) and not ex.launches


# ------------------------------------------------------------------------- through a real Worker

class RecordingLaunchBackend(EmulatedBackend):
    """Test double: the emulated device, whose launches go to a RecordingDriver, as a real
    backend's go to NVIDIA's cuLaunchKernel."""

    def __init__(self, spec: SessionSpec, driver: RecordingDriver) -> None:
        super().__init__(spec)
        self.driver = driver

    def launch_entry(self) -> int:
        return self.driver.entry

    def launch_fast(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int, stream: int,
                    address: int, argsize: int) -> int:
        """A kernel's first launch (the worker admits it in Python), to the same recording driver."""
        size = ctypes.c_size_t(argsize)
        extra = (ctypes.c_void_p * 5)(1, address, 2, ctypes.addressof(size), None)
        return int(self.driver.callback(f, gx, gy, gz, bx, by, bz, shmem, stream, None, extra))


@pytest.fixture
def served(worker_library: str) -> Iterator[tuple[socket.socket, Worker, RecordingDriver]]:
    client, server = socket.socketpair()
    spec = session_spec(worker_library)
    driver = RecordingDriver(fail_on={5})
    backend = RecordingLaunchBackend(spec, driver)
    assert backend.primary_ctx_retain() == CTX   # as the client's cuDevicePrimaryCtxRetain would
    worker = Worker(server, backend, spec, None)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        yield client, worker, driver
    finally:
        client.close()
        thread.join(timeout=10)
        server.close()


def call(sock: socket.socket, op: int, seq: int, ctx: int = CTX) -> int:
    sock.sendall(protocol.pack_frame(op, b"", seq=seq, ctx=ctx))
    (_length, reply_op, _flags, reply_seq, _aux, _ctx), payload = protocol.recv_frame(sock)
    assert (reply_op, reply_seq) == (protocol.OP_REPLY, seq)
    return int(struct.unpack_from("<i", payload)[0])


def test_worker_runs_launch_storms_natively_and_reports_their_error_at_the_next_sync(
        served: tuple[socket.socket, Worker, RecordingDriver]) -> None:
    sock, worker, driver = served
    assert worker.native_launches is not None
    assert call(sock, SYNC_OP, 1) == 0           # makes the context current
    # Eight kernels: each one's first launch is admitted in Python, every later one runs natively.
    frames = [launch_frame(0x7000 + i % 8, struct.pack("<Q", i)) for i in range(20000)]
    stream = b"".join(frames)
    # Uneven writes split frames across receive calls, as TCP does.
    for at in range(0, len(stream), 65521):
        sock.sendall(stream[at:at + 65521])

    assert call(sock, SYNC_OP, 2) == LAUNCH_ERROR  # launch 5 failed; the error surfaces here, once
    assert call(sock, SYNC_OP, 3) == 0
    assert [launch.f for launch in driver.launches] == [0x7000 + i % 8 for i in range(20000)]
    assert [launch.params for launch in driver.launches[:3]] == [struct.pack("<Q", i) for i in range(3)]
    assert worker.native_launches.launched.value == 20000 - 8  # frames cut by a receive too


def test_without_the_library_the_worker_runs_launches_in_python(worker_library: str) -> None:
    spec = session_spec("")
    backend = RecordingLaunchBackend(spec, RecordingDriver())
    a, b = socket.socketpair()
    try:
        assert Worker(b, backend, spec, None).native_launches is None
    finally:
        a.close()
        b.close()


def test_session_server_finds_or_builds_the_launch_library(emulated: Server, native_libs: build.Libraries,
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    server = emulated.server
    assert server.status()["launch_path"].startswith("none")   # the emulated device launches nothing

    monkeypatch.setenv("RGPU_NATIVE_DIR", str(native_libs.folder))
    server._find_launch_library()
    assert (server.launch_library, server.launch_path) == (str(native_libs.libworker), "native")

    # A GPU node with no C compiler and no prebuilt copy: launches work, in Python, and it says so.
    monkeypatch.delenv("RGPU_NATIVE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(build, "PACKAGE_LIB", tmp_path / "no-package-lib")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    server.launch_library = ""
    server._find_launch_library()
    assert server.launch_library == ""
    assert server.status()["launch_path"].startswith("python (rgpu: native: cannot run the C compiler")
