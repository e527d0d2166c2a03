"""The worker's C loop runs the pipelined 1-D memsets beside launches (worker_launch.c):
cuMemsetD8Async, cuMemsetD16Async and cuMemsetD32Async, with which PyTorch zeroes gradients and
workspaces (~22 per ResNet-18 training step; through the generic Python handler each cost 10-15 us
and ended the loop's run).

CI has no driver, so ctypes callbacks with the driver's C signatures stand in for NVIDIA's entry
points (RecordingMemsetDriver, a test double); the C loop is the package's own build, the frames are
encoded as the client library encodes them (unpadded, so the frames after one lie misaligned), and
a Worker serves them over a real socket pair. The Python path stays the reference: the same frames
served with the memsets left to Python must give the same driver calls and the same late errors.
The last test runs the C loop on real function pointers: backends/cuda.py over rgpu's own
libcuda.so.1 (the chained backend), with a C program checking the bytes each memset set.
"""

from __future__ import annotations

import ctypes
import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.emulated import EmulatedBackend
from rgpu.remoting.native import build
from rgpu.remoting.datapath.worker.native_loop import MemsetEntries, NativeLaunches
from rgpu.remoting.datapath.worker.spec import SessionSpec

from tests.remoting.conftest import HERE, Server, driver_api_program, run_client
from tests.remoting.native_launches_helpers import (Buffer, CallLog, CTX, LAUNCH_FN, SYNC_OP, Served, admitting,
                                                    launch_frame, serve_worker, session_spec)
from tests.remoting.native_events_helpers import STREAM, frame
from tests.remoting.worker_profiles import profile_total

OP = api_gen.OPCODES
D8_OP, D16_OP, D32_OP = OP["cuMemsetD8Async"], OP["cuMemsetD16Async"], OP["cuMemsetD32Async"]
STREAM_CREATE_OP = OP["rgpuStreamCreate"]
INVALID_VALUE, INVALID_HANDLE, LAUNCH_FAILED = 1, 400, 719
# The generated handlers' payloads (api_gen.py): dst, value, count, stream, packed.
LAYOUT = {8: "<QBQQ", 16: "<QHQQ", 32: "<QIQQ"}

D8_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p)
D16_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_ushort, ctypes.c_size_t, ctypes.c_void_p)
D32_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p)


@dataclass
class RecordingMemsetDriver(CallLog):
    """Test double for the driver's cuLaunchKernel, cuMemsetD8Async, cuMemsetD16Async and
    cuMemsetD32Async: records every call, in order, as ("launch", f, stream) or ("D8" | "D16" |
    "D32", dst, value, count, stream); `fail` maps (kind, n) (the kind's n-th call, 0-based) to an
    error code."""

    fail: dict[tuple[str, int], int] = field(default_factory=dict)
    calls: list[tuple[int | str, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts: dict[str, int] = {}

        def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):  # type: ignore[no-untyped-def]
            return self.call("launch", f or 0, stream or 0)

        self.callbacks = (LAUNCH_FN(launch),
                          D8_FN(lambda dst, value, n, s: self.call("D8", dst, value, n, s or 0)),
                          D16_FN(lambda dst, value, n, s: self.call("D16", dst, value, n, s or 0)),
                          D32_FN(lambda dst, value, n, s: self.call("D32", dst, value, n, s or 0)))

    @property
    def memset_entries(self) -> MemsetEntries:
        return MemsetEntries(self.address(1), self.address(2), self.address(3))


def memset(width: int, dst: int, value: int, count: int, stream: int = 0, ctx: int = CTX) -> bytes:
    """A cuMemsetD<width>Async frame as the client library sends it (its payload unpadded)."""
    return protocol.pack_frame(OP[f"cuMemsetD{width}Async"], struct.pack(LAYOUT[width], dst, value, count, stream),
                               seq=1, ctx=ctx)


def native_loop(library: str, driver: RecordingMemsetDriver, entries: MemsetEntries | None = None) -> NativeLaunches:
    native = admitting(NativeLaunches(library, driver.launch_entry,
                                      memset_entries=driver.memset_entries if entries is None else entries), 0xF00)
    native.set_stream(STREAM, 0x5000)
    native.keep = driver   # type: ignore[attr-defined]  # the callbacks must outlive the loop
    return native


# ------------------------------------------------------------------------- the C loop alone

def test_memsets_of_each_width_run_in_one_call_among_launches_with_streams_translated(worker_library: str) -> None:
    driver = RecordingMemsetDriver()
    native = native_loop(worker_library, driver)
    assert {D8_OP, D16_OP, D32_OP} <= native.ops and {D8_OP, D16_OP, D32_OP} <= native.gpu_work_ops
    frames = [memset(8, 0xD000, 0xAB, 100, STREAM), launch_frame(0xF00, b"\0" * 8, stream=STREAM),
              memset(16, 0xD100, 0xBEEF, 50), memset(32, 0xD200, 0xDEADBEEF, 1 << 33, 1),
              launch_frame(0xF00, b"\0" * 8), memset(8, 0xD300, 0, 7, 2)]
    buf = Buffer(b"".join(frames) + protocol.pack_frame(SYNC_OP, b"", seq=9, ctx=CTX))

    used, error = native.run(buf.address, buf.size, CTX)

    assert (used, error) == (sum(map(len, frames)), 0)   # stops before the sync frame, leaving it whole
    assert driver.calls == [("D8", 0xD000, 0xAB, 100, 0x5000), ("launch", 0xF00, 0x5000),
                            ("D16", 0xD100, 0xBEEF, 50, 0), ("D32", 0xD200, 0xDEADBEEF, 1 << 33, 1),
                            ("launch", 0xF00, 0), ("D8", 0xD300, 0, 7, 2)]
    assert (native.memsets, native.ran_memsets, native.launched.value, native.last_op) == (4, 4, 2, D8_OP)


DECLINED = {
    "an unknown stream": memset(32, 0xD000, 1, 4, STREAM + 1),
    "another context": memset(8, 0xD000, 1, 4, STREAM, ctx=CTX + 1),
    **{f"a cuMemsetD{w}Async frame shorter than its layout": protocol.pack_frame(
        OP[f"cuMemsetD{w}Async"], struct.pack(LAYOUT[w], 0xD000, 1, 4, 0)[:-1], seq=1, ctx=CTX) for w in LAYOUT},
    "a 2-D memset": frame(OP["cuMemsetD2D8Async"], "<QQBQQQ", 0xD000, 64, 1, 64, 4, 0),
}


@pytest.mark.parametrize("why, declined", list(DECLINED.items()), ids=list(DECLINED))
def test_memset_frames_the_loop_cannot_run_are_left_to_the_python_worker(worker_library: str, why: str,
                                                                         declined: bytes) -> None:
    # Python then runs the frame, or words its error (an unknown stream: INVALID_HANDLE; a short
    # frame: malformed, INVALID_VALUE) at the next synchronising call.
    driver = RecordingMemsetDriver()
    native = native_loop(worker_library, driver)
    first = memset(16, 0xD000, 7, 8, STREAM)
    buf = Buffer(first + declined + first)

    used, error = native.run(buf.address, buf.size, CTX)

    assert (used, error) == (len(first), 0), why
    assert driver.calls == [("D16", 0xD000, 7, 8, 0x5000)] and native.memsets == 1


def test_a_memset_on_a_destroyed_stream_stops_the_run_unconsumed(worker_library: str) -> None:
    driver = RecordingMemsetDriver()
    native = native_loop(worker_library, driver)
    native.set_stream(STREAM, 0)
    buf = Buffer(memset(8, 0xD000, 1, 4, STREAM))
    assert native.run(buf.address, buf.size, CTX) == (0, 0) and not driver.calls


def test_without_the_limiters_turn_the_run_stops_before_a_memset(worker_library: str) -> None:
    # A memset is GPU work: the compute limiter gates it as it gates launches.
    driver = RecordingMemsetDriver()
    native = native_loop(worker_library, driver)
    for width in LAYOUT:
        buf = Buffer(memset(width, 0xD000, 1, 4, STREAM))
        assert native.run(buf.address, buf.size, CTX, gpu_work=False) == (0, 0)
        assert native.run(buf.address, buf.size, CTX) == (buf.size, 0)
    assert [c[0] for c in driver.calls] == ["D8", "D16", "D32"]


def test_a_failing_memsets_error_is_kept_first_and_later_frames_still_run(worker_library: str) -> None:
    driver = RecordingMemsetDriver(fail={("D16", 0): INVALID_VALUE, ("launch", 0): LAUNCH_FAILED})
    native = native_loop(worker_library, driver)
    frames = [memset(8, 0xD000, 1, 4), memset(16, 0xD100, 2, 4), launch_frame(0xF00, b"\0" * 8),
              memset(32, 0xD200, 3, 4)]
    buf = Buffer(b"".join(frames))

    used, error = native.run(buf.address, buf.size, CTX)

    assert (used, error) == (buf.size, INVALID_VALUE)
    assert (native.first_error_op, native.errors) == (D16_OP, 2)
    assert [c[0] for c in driver.calls] == ["D8", "D16", "launch", "D32"]   # the driver decides what an error means
    assert native.run(buf.address, 0, CTX) == (0, 0)   # reported once


def test_without_memset_entry_points_memsets_are_left_to_python(worker_library: str) -> None:
    driver = RecordingMemsetDriver()
    launch = launch_frame(0xF00, b"\0" * 8)
    none = NativeLaunches(worker_library, driver.launch_entry)
    none.admit(0xF00)
    assert not {D8_OP, D16_OP, D32_OP} & none.ops
    buf = Buffer(launch + memset(8, 0xD000, 1, 4) + launch)
    assert none.run(buf.address, buf.size, CTX) == (len(launch), 0)
    # A driver lacking one width: that one stays in Python, the others run in C.
    some = native_loop(worker_library, driver, driver.memset_entries._replace(d16=0))
    assert D16_OP not in some.ops and {D8_OP, D32_OP} <= some.ops and D16_OP not in some.gpu_work_ops
    head = memset(8, 0xD000, 1, 4) + memset(32, 0xD000, 1, 4)
    buf = Buffer(head + memset(16, 0xD000, 1, 4))
    assert some.run(buf.address, buf.size, CTX) == (len(head), 0)
    assert [c[0] for c in driver.calls] == ["launch", "D8", "D32"]


# ------------------------------------------------------------------------- through a real Worker

class RecordingMemsetBackend(EmulatedBackend):
    """Test double: the emulated device, whose launches and memsets go to a RecordingMemsetDriver,
    from the C loop (`native_memsets`) or from the Python path alike (as a real backend's go to
    NVIDIA's entry points either way)."""

    def __init__(self, spec: SessionSpec, driver: RecordingMemsetDriver, native_memsets: bool) -> None:
        super().__init__(spec)
        self.driver = driver
        self.native_memsets = native_memsets

    def launch_entry(self) -> int:
        return self.driver.launch_entry

    def memset_entries(self) -> MemsetEntries:
        return self.driver.memset_entries if self.native_memsets else MemsetEntries(0, 0, 0)

    def launch_fast(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int, stream: int,
                    address: int, argsize: int) -> int:
        return self.driver.call("launch", f, stream)

    def cuMemsetD8Async(self, dst: int, value: int, n: int, stream: int) -> tuple[int]:
        return (self.driver.call("D8", dst, value, n, stream),)

    def cuMemsetD16Async(self, dst: int, value: int, n: int, stream: int) -> tuple[int]:
        return (self.driver.call("D16", dst, value, n, stream),)

    def cuMemsetD32Async(self, dst: int, value: int, n: int, stream: int) -> tuple[int]:
        return (self.driver.call("D32", dst, value, n, stream),)


def serve(worker_library: str, driver: RecordingMemsetDriver, native_memsets: bool) -> Iterator[Served[RecordingMemsetDriver]]:
    spec = session_spec(worker_library)
    yield from serve_worker(spec, RecordingMemsetBackend(spec, driver, native_memsets), driver)


def training_step(step: int) -> list[bytes]:
    """What PyTorch sends around a step's kernels: gradients and workspaces zeroed, on its stream."""
    out = []
    for k in range(4):
        out += [memset(8, 0xD000 + k, 0, 4096, STREAM), launch_frame(0x7000 + k, struct.pack("<Q", step), stream=STREAM),
                memset(32, 0xE000 + k, 0x3F800000, 1024, STREAM), memset(16, 0xF000 + k, 0xFFFF, 64)]
    return out


def test_memsets_served_in_c_give_the_python_paths_driver_calls_and_late_errors(
        worker_library: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    answers = {}
    for native_memsets in (True, False):
        monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path / str(native_memsets)))
        (tmp_path / str(native_memsets)).mkdir()
        driver = RecordingMemsetDriver(fail={("D32", 5): INVALID_VALUE, ("D8", 7): LAUNCH_FAILED})
        for s in serve(worker_library, driver, native_memsets):
            assert s.worker.native_launches is not None
            assert s.sync(1) == (0, "")   # makes the context current
            s.send(frame(STREAM_CREATE_OP, "<QIi", STREAM, 1, 0))
            data = b"".join(b"".join(training_step(i)) for i in range(100))
            for at in range(0, len(data), 65521):   # uneven writes split frames across receives, as TCP does
                s.sock.sendall(data[at:at + 65521])
            got = [s.sync(2), s.sync(3)]
            s.send(memset(8, 0xD000, 0, 16, STREAM + 1))   # an unknown stream: Python words it
            got += [s.sync(4), s.sync(5)]
            answers[native_memsets] = (got, driver.calls, s.worker.native_launches.memsets, s.worker.calls)
    in_c, in_python = answers[True], answers[False]
    assert in_c[:2] == in_python[:2]   # the same answers, driver calls in the same order, same handles
    assert len(in_c[1]) == 100 * 4 * 4
    assert in_c[0][0] == (INVALID_VALUE, "rgpu: worker: cuMemsetD32Async failed with CUDA_ERROR_INVALID_VALUE; "
                                         "reported at this later call, as CUDA reports errors of asynchronous work")
    assert in_c[0][1] == (0, "") and in_c[0][3] == (0, "")
    assert in_c[0][2][0] == INVALID_HANDLE and "cuMemsetD8Async: stream 0x7d00000100000002 does not exist" in in_c[0][2][1]
    assert (in_c[2], in_python[2]) == (100 * 4 * 3, 0)
    # In C, Python saw only the syncs, the stream's creation, each kernel's first launch and the unknown stream's memset.
    assert in_c[3] <= 5 + 1 + 4 + 1 + 2, in_c[3]
    assert in_python[3] >= 100 * 4 * 3
    deadline = time.monotonic() + 10
    while not (files := list((tmp_path / "True").glob("worker-*.json"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    report = json.loads(files[0].read_text())
    assert report["native_memsets"] == 100 * 4 * 3 and report["ops"]["cuMemsetD8Async"]["calls"] == 1


# ------------------------------------------------------------------------- real function pointers

ROUNDS = 200


def test_the_chained_real_gpu_backend_runs_memsets_in_the_c_loop(native_libs: build.Libraries, chained: Server,
                                                                  tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # backends/cuda.py hands the C loop rgpu's own libcuda's cuMemsetD8Async, cuMemsetD16Async and
    # cuMemsetD32Async (talking to an emulated worker): the loop's calls through real function
    # pointers, checked byte by byte (tests/remoting/memsets.c; test_gpu_memsets.py runs it on a GPU).
    program = driver_api_program(native_libs, HERE / "memsets.c", tmp_path / "memsets")
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))
    done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)), [str(program), str(ROUNDS)])
    assert done.returncode == 0 and "RESULT OK" in done.stdout, done.stdout + done.stderr
    assert profile_total(tmp_path, "native_memsets", 3 * ROUNDS + 1) >= 3 * ROUNDS + 1   # every one, the NULL stream's first included
