"""The worker's C loop answers small device-to-host copies itself (worker_copies.c): what
`tensor.item()` does, a launch then a copy of a few bytes the client waits for.

CI has no driver, so ctypes callbacks with the C signatures of cuMemcpyDtoHAsync_v2 and
cuStreamIsCapturing stand in for NVIDIA's (CopyDriver, a test double); the C loop is the package's
own build and its replies travel on a real socket pair. The last tests run the loop on real
function pointers: backends/cuda.py over rgpu's own libcuda.so.1 (the chained backend), where the
copy is a real one through an emulated worker.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.datapath import protocol
from rgpu.remoting.native import build
from rgpu.remoting.datapath.worker.native_loop import SMALL_DTOH_MAX, CopyEntries, NativeLaunches

from tests.remoting.conftest import PY, Server, run_client
from tests.remoting.native_launches_helpers import Buffer, CTX, LAUNCH_ERROR, RecordingDriver, admitting, launch_frame
from tests.remoting.small_copies_helpers import item_program
from tests.remoting.worker_profiles import profile_total

DTOH_OP = api_gen.OPCODES["cuMemcpyDtoHAsync_v2"]
STREAM = 0x7D00_0001_0000_0001
ILLEGAL_ADDRESS = 700

MEMCPY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
CAPTURING_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


@dataclass
class CopyDriver:
    """Test double for cuMemcpyDtoHAsync_v2 and cuStreamIsCapturing: a copy fills the host buffer
    with the low byte of its device address, repeated; `capturing` lists the streams in capture;
    `fail` is the code every copy returns."""

    capturing: set[int] = field(default_factory=set)
    fail: int = 0
    copies: list[tuple[int, int, int]] = field(default_factory=list)   # (device address, size, stream)

    def __post_init__(self) -> None:
        def memcpy(dst, src, n, stream):  # type: ignore[no-untyped-def]
            self.copies.append((src, n, stream or 0))
            if not self.fail:
                ctypes.memset(dst, src & 0xFF, n)
            return self.fail

        def is_capturing(stream, status):  # type: ignore[no-untyped-def]
            status[0] = 1 if (stream or 0) in self.capturing else 0
            return 0
        self.callbacks = (MEMCPY_FN(memcpy), CAPTURING_FN(is_capturing))

    @property
    def entries(self) -> CopyEntries:
        return CopyEntries(*(int(ctypes.cast(c, ctypes.c_void_p).value or 0) for c in self.callbacks))


def dtoh(src: int, size: int, stream: int = 0, seq: int = 7, ctx: int = CTX) -> bytes:
    return protocol.pack_frame(DTOH_OP, struct.pack("<QQQ", src, stream, size), seq=seq, ctx=ctx)


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    client, server = socket.socketpair()
    client.settimeout(5)
    yield client, server
    client.close()
    server.close()


def loop(library: str, driver: CopyDriver, sock: socket.socket, launches: RecordingDriver | None = None) -> NativeLaunches:
    launches = launches or RecordingDriver()
    native = admitting(NativeLaunches(library, launches.entry, None, driver.entries, sock.fileno()), 0xF00)
    native.set_stream(STREAM, 0x5000)
    native.keep = (launches, driver)   # type: ignore[attr-defined]   (the callbacks must outlive the loop)
    return native


def reply_of(sock: socket.socket) -> tuple[bytes, int, int]:
    """(data, reply seq, result) of a copy answered on `sock`."""
    (_n, op, _flags, _seq, _aux, _ctx), data = protocol.recv_frame(sock)
    assert op == protocol.OP_DATA
    (_n, op, flags, seq, _aux, _ctx), payload = protocol.recv_frame(sock)
    assert (op, flags) == (protocol.OP_REPLY, 0)
    return bytes(data), seq, struct.unpack_from("<i", payload)[0]


def test_a_small_copy_is_answered_from_c_with_its_data_and_reply(worker_library: str, pair) -> None:  # type: ignore[no-untyped-def]
    client, server = pair
    driver = CopyDriver()
    native = loop(worker_library, driver, server)
    frames = launch_frame(0xF00, b"12345678", stream=STREAM) + dtoh(0xD0000A5, 4, STREAM, seq=41)
    buf = Buffer(frames)
    used, error = native.run(buf.address, buf.size, CTX)
    assert (used, error, native.failed_copy, native.send_error) == (len(frames), 0, None, 0)
    assert driver.copies == [(0xD0000A5, 4, 0x5000)]   # on the driver's stream, after the launch
    assert reply_of(client) == (b"\xa5" * 4, 41, 0)
    assert (native.copies, native.ran_copies, native.sent) == (1, 1, 2 * 24 + 4 + 4)


def test_the_largest_small_copy_is_answered_and_one_byte_more_is_left_to_python(worker_library: str, pair) -> None:  # type: ignore[no-untyped-def]
    client, server = pair
    native = loop(worker_library, CopyDriver(), server)
    buf = Buffer(dtoh(0x11, SMALL_DTOH_MAX, seq=1) + dtoh(0x22, SMALL_DTOH_MAX + 1, seq=2))
    used, _ = native.run(buf.address, buf.size, CTX)
    assert used == len(dtoh(0x11, 1))
    assert reply_of(client) == (b"\x11" * SMALL_DTOH_MAX, 1, 0)


@pytest.mark.parametrize("why", ["capturing stream", "unknown stream", "empty copy", "truncated frame",
                                 "another context", "no limiter turn", "replies not allowed",
                                 "an error waits to be reported"])
def test_copies_the_loop_cannot_answer_plainly_are_left_to_the_python_worker(worker_library: str, pair, why: str) -> None:  # type: ignore[no-untyped-def]
    client, server = pair
    driver = CopyDriver(capturing={0x5000} if why == "capturing stream" else set())
    launches = RecordingDriver(fail_on={0} if why == "an error waits to be reported" else set())
    native = loop(worker_library, driver, server, launches)
    frame = {"unknown stream": dtoh(0x33, 4, stream=STREAM + 1), "empty copy": dtoh(0x33, 0),
             "another context": dtoh(0x33, 4, ctx=CTX + 1)}.get(why, dtoh(0x33, 4, stream=STREAM))
    if why == "truncated frame":
        frame = protocol.pack_frame(DTOH_OP, struct.pack("<QQ", 0x33, STREAM), seq=7, ctx=CTX)
    before = launch_frame(0xF00, b"") if why == "an error waits to be reported" else b""
    buf = Buffer(before + frame)
    used, error = native.run(buf.address, buf.size, CTX, gpu_work=why != "no limiter turn",
                             replies=why != "replies not allowed")
    assert used == len(before) and native.ran_copies == 0
    assert error == (LAUNCH_ERROR if before else 0)
    assert driver.copies == []
    server.setblocking(False)
    client.setblocking(False)
    with pytest.raises(BlockingIOError):
        client.recv(1)   # nothing was sent


def test_a_copy_the_driver_refuses_ends_the_run_unanswered_for_the_worker_to_reply(worker_library: str, pair) -> None:  # type: ignore[no-untyped-def]
    client, server = pair
    native = loop(worker_library, CopyDriver(fail=ILLEGAL_ADDRESS), server)
    frames = dtoh(0x44, 8, seq=9) + launch_frame(0xF00, b"")
    buf = Buffer(frames)
    used, error = native.run(buf.address, buf.size, CTX)
    assert used == len(dtoh(0x44, 8)) and error == 0   # the launch after it waits for the next run
    assert native.failed_copy == (9, ILLEGAL_ADDRESS)
    client.setblocking(False)
    with pytest.raises(BlockingIOError):
        client.recv(1)
    used, _ = native.run(buf.address + used, buf.size - used, CTX)
    assert native.failed_copy is None and used == len(launch_frame(0xF00, b""))


def test_a_closed_socket_ends_the_run_and_the_session(worker_library: str, pair) -> None:  # type: ignore[no-untyped-def]
    client, server = pair
    native = loop(worker_library, CopyDriver(), server)
    client.close()
    buf = Buffer(dtoh(0x55, 4) + dtoh(0x56, 4))
    used, _ = native.run(buf.address, buf.size, CTX)
    assert native.send_error != 0 and used == len(dtoh(0x55, 4))


def test_a_copy_larger_than_the_socket_buffer_is_sent_whole_on_a_non_blocking_socket(worker_library: str, pair) -> None:  # type: ignore[no-untyped-def]
    # Python's socket timeouts make the socket non-blocking underneath: the loop waits for room.
    client, server = pair
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server.settimeout(10)
    native = loop(worker_library, CopyDriver(), server)
    buf = Buffer(dtoh(0x66, SMALL_DTOH_MAX, seq=3))
    import threading
    out: list[tuple[bytes, int, int]] = []
    reader = threading.Thread(target=lambda: (time.sleep(0.2), out.append(reply_of(client))))
    reader.start()
    used, _ = native.run(buf.address, buf.size, CTX)
    reader.join(10)
    assert native.send_error == 0 and out == [(b"\x66" * SMALL_DTOH_MAX, 3, 0)]


# ------------------------------------------------------------------------- real function pointers


@pytest.mark.parametrize("spin_us", ["0", "100"])
def test_item_pattern_through_the_chained_real_gpu_backend_is_answered_in_c(
        native_libs: build.Libraries, chained: Server, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, spin_us: str) -> None:
    # backends/cuda.py hands the C loop rgpu's own libcuda's cuMemcpyDtoHAsync_v2 (talking to an
    # emulated worker); with the client and the worker polling for their next frame (as on a GPU
    # node with many CPUs) and without.
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))
    monkeypatch.setenv("RGPU_WORKER_SPIN_US", spin_us)
    done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)), [PY, "-c", item_program(60)],
                      RGPU_REPLY_SPIN_US=spin_us)
    assert "BAD 0 BIG True" in done.stdout and "AFTER True" in done.stdout, done.stdout + done.stderr
    assert int(done.stdout.split("WILD")[1].split()[0]) != 0, done.stdout
    assert profile_total(tmp_path, "native_small_dtoh", 61) >= 61
