"""The worker's C loop runs the pipelined event operations beside launches (worker_launch.c,
worker_events.c): rgpuEventCreate, cuEventRecord, cuEventRecordWithFlags, cuStreamWaitEvent and
cuEventDestroy_v2, which cuDNN's RNNs send about twice per launch.

CI has no driver, so ctypes callbacks with the driver's C signatures stand in for NVIDIA's entry
points (RecordingEventDriver, a test double); the C loop is the package's own build, the frames are
encoded as the client library encodes them, and a Worker serves them over a real socket pair. The
Python path stays the reference: the same frames served with the event operations left to Python
must give the same driver calls and the same late error lines. The last test runs the C loop on
real function pointers: backends/cuda.py over rgpu's own libcuda.so.1 (the chained backend).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.base import CudaError
from rgpu.remoting.datapath.backends.emulated import EmulatedBackend
from rgpu.remoting.native import build
from rgpu.remoting.datapath.worker.client_handles import EVENT_FAILED
from rgpu.remoting.datapath.worker.native_loop import EventEntries, NativeLaunches
from rgpu.remoting.datapath.worker.spec import SessionSpec

from tests.remoting.conftest import EXAMPLES, Server, run_client
from tests.remoting.native_launches_helpers import (Buffer, CallLog, CTX, LAUNCH_FN, LAUNCH_OP, SYNC_OP, Served,
                                                    admitting, launch_frame, serve_worker, session_spec)
from tests.remoting.native_events_helpers import EVENT, STREAM, frame

OP = api_gen.OPCODES
CREATE_OP, RECORD_OP, RECORD_FLAGS_OP = OP["rgpuEventCreate"], OP["cuEventRecord"], OP["cuEventRecordWithFlags"]
WAIT_OP, DESTROY_OP, QUERY_OP = OP["cuStreamWaitEvent"], OP["cuEventDestroy_v2"], OP["cuEventQuery"]
STREAM_CREATE_OP = OP["rgpuStreamCreate"]
OUT_OF_MEMORY, INVALID_HANDLE, LAUNCH_FAILED = 2, 400, 719

CREATE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WITH_FLAGS_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
DESTROY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


@dataclass
class RecordingEventDriver(CallLog):
    """Test double for the driver's cuLaunchKernel and event entry points: records every call, in
    order, as ("launch", f, stream), ("create", flags), ("record", event, stream), ("record_flags",
    event, stream, flags), ("wait", stream, event, flags), ("destroy", event). Events it makes are
    0xE000, 0xE001, ...; `fail` maps (kind, n) (the kind's n-th call, 0-based) to an error code."""

    fail: dict[tuple[str, int], int] = field(default_factory=dict)
    calls: list[tuple[int | str, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.made = 0
        self.counts: dict[str, int] = {}

        def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):  # type: ignore[no-untyped-def]
            return self.call("launch", f or 0, stream or 0)

        def create(out, flags):  # type: ignore[no-untyped-def]
            code = self.call("create", flags)
            if not code:
                out[0] = 0xE000 + self.made
                self.made += 1
            return code

        self.callbacks = (LAUNCH_FN(launch), CREATE_FN(create),
                          RECORD_FN(lambda e, s: self.call("record", e or 0, s or 0)),
                          WITH_FLAGS_FN(lambda e, s, flags: self.call("record_flags", e or 0, s or 0, flags)),
                          WITH_FLAGS_FN(lambda s, e, flags: self.call("wait", s or 0, e or 0, flags)),
                          DESTROY_FN(lambda e: self.call("destroy", e or 0)))

    @property
    def event_entries(self) -> EventEntries:
        return EventEntries(*(self.address(i) for i in range(1, 6)))


def create(handle: int, flags: int = 2, ctx: int = CTX) -> bytes:
    return frame(CREATE_OP, "<QI", handle, flags, ctx=ctx)


def record(event: int, stream: int = 0, ctx: int = CTX) -> bytes:
    return frame(RECORD_OP, "<QQ", event, stream, ctx=ctx)


def record_flags(event: int, stream: int, flags: int) -> bytes:
    return frame(RECORD_FLAGS_OP, "<QQI", event, stream, flags)


def wait(stream: int, event: int, flags: int = 0) -> bytes:
    return frame(WAIT_OP, "<QQI", stream, event, flags)


def destroy(event: int, ctx: int = CTX) -> bytes:
    return frame(DESTROY_OP, "<Q", event, ctx=ctx)


def native_loop(library: str, driver: RecordingEventDriver) -> NativeLaunches:
    native = admitting(NativeLaunches(library, driver.launch_entry, driver.event_entries), 0xF00)
    native.set_stream(STREAM, 0x5000)
    return native


# ------------------------------------------------------------------------- the C loop alone

def test_launches_and_event_operations_run_in_one_call_with_handles_translated(worker_library: str) -> None:
    driver = RecordingEventDriver()
    native = native_loop(worker_library, driver)
    second = EVENT + 1
    frames = [create(EVENT), launch_frame(0xF00, b"\0" * 8, stream=STREAM), record(EVENT, STREAM),
              create(second, 0), wait(STREAM, EVENT), wait(0, second, 0), record_flags(second, 1, 1),
              launch_frame(0xF00, b"\0" * 8), destroy(EVENT), destroy(second)]
    buf = Buffer(b"".join(frames) + protocol.pack_frame(SYNC_OP, b"", seq=9, ctx=CTX))

    used, error = native.run(buf.address, buf.size, CTX)

    assert (used, error) == (sum(map(len, frames)), 0)   # stops before the sync frame, leaving it whole
    assert driver.calls == [("create", 2), ("launch", 0xF00, 0x5000), ("record", 0xE000, 0x5000), ("create", 0),
                            ("wait", 0x5000, 0xE000, 0), ("wait", 0, 0xE001, 0), ("record_flags", 0xE001, 1, 1),
                            ("launch", 0xF00, 0), ("destroy", 0xE000), ("destroy", 0xE001)]
    assert native.event_counts() == {"rgpuEventCreate": 2, "cuEventRecord": 1, "cuEventRecordWithFlags": 1,
                                     "cuStreamWaitEvent": 2, "cuEventDestroy_v2": 2}
    assert native.launched.value == 2 and native.last_op == DESTROY_OP and native.ran_events == 8
    assert (native.events.get(EVENT), native.events.get(second), len(native.events)) == (None, None, 0)


def test_the_event_table_holds_many_events_through_creation_and_destruction(worker_library: str) -> None:
    # cuDNN creates and destroys ~170 events a step: the table must not fill with what is gone.
    driver = RecordingEventDriver()
    native = native_loop(worker_library, driver)
    table = native.events
    handles = [EVENT + (i << 32) + i for i in range(5000)]
    for i, h in enumerate(handles):
        table.put(h, 0x1000 + i)
    assert len(table) == 5000 and all(table.get(h) == 0x1000 + i for i, h in enumerate(handles))
    for h in handles[::2]:
        assert table.take(h) is not None
    assert len(table) == 2500
    assert all(table.get(h) == (None if i % 2 == 0 else 0x1000 + i) for i, h in enumerate(handles))
    for round_ in range(200):   # a step's events made and destroyed, in C
        batch = [EVENT + ((10_000 + round_ * 8 + k) << 32) for k in range(8)]
        data = b"".join(create(h) for h in batch) + b"".join(destroy(h) for h in batch)
        buf = Buffer(data)
        assert native.run(buf.address, buf.size, CTX) == (buf.size, 0)
    assert len(table) == 2500 and table.get(handles[1]) == 0x1001


def test_the_event_table_answers_as_a_dict_through_growth_and_crowded_deletions(worker_library: str) -> None:
    # Deletion moves later entries of a probe run back (no tombstones): every key must stay findable.
    import random
    table = native_loop(worker_library, RecordingEventDriver()).events
    model: dict[int, int] = {}
    rng = random.Random(24)
    keys = [EVENT + (rng.randrange(1 << 24) << 32) + rng.randrange(1, 1 << 20) for _ in range(3000)]
    for step in range(60_000):
        key = rng.choice(keys)
        if rng.random() < 0.55:
            table.put(key, step + 1)
            model[key] = step + 1
        else:
            assert table.take(key) == model.pop(key, None)
        if step % 5000 == 0:
            assert all(table.get(k) == model.get(k) for k in keys) and len(table) == len(model)
    assert all(table.get(k) == model.get(k) for k in keys) and len(table) == len(model)


def test_a_failed_creation_ends_the_run_and_leaves_the_handle_marked(worker_library: str) -> None:
    driver = RecordingEventDriver(fail={("create", 1): OUT_OF_MEMORY, ("launch", 0): LAUNCH_FAILED})
    native = native_loop(worker_library, driver)
    first = [launch_frame(0xF00, b"\0" * 8), create(EVENT), create(EVENT + 1)]
    rest = [record(EVENT + 1), record(EVENT)]
    buf = Buffer(b"".join(first + rest))

    used, error = native.run(buf.address, buf.size, CTX)

    # The launch's error comes first (the worker defers it first); the creation's the worker words.
    assert (used, error) == (sum(map(len, first)), LAUNCH_FAILED)
    assert native.failed_creation == (EVENT + 1, OUT_OF_MEMORY) and native.errors == 1
    assert native.events.get(EVENT + 1) == EVENT_FAILED | OUT_OF_MEMORY
    # A use of the failed handle stops the run: the Python worker says why.
    rest_buf = Buffer(b"".join(rest))
    assert native.run(rest_buf.address, rest_buf.size, CTX) == (0, 0) and native.failed_creation is None


DECLINED = {
    "an unknown event": record(EVENT + 7),
    "a destroyed event": record(EVENT + 1),
    "a NULL event": record(0),
    "an unknown stream": record(EVENT, STREAM + 1),
    "a wait on an unknown stream": wait(STREAM + 1, EVENT),
    "a wait for an unknown event": wait(0, EVENT + 7),
    "a destruction of an unknown event": destroy(EVENT + 7),
    "a creation of the NULL handle": create(0),
    "another context": record(EVENT, ctx=CTX + 1),
    "a creation in another context": create(EVENT + 5, ctx=CTX + 1),
    "a frame shorter than its operation": protocol.pack_frame(WAIT_OP, struct.pack("<QQ", 0, EVENT), seq=1, ctx=CTX),
    "a synchronising event call": frame(QUERY_OP, "<Q", EVENT),
}


@pytest.mark.parametrize("why, declined", list(DECLINED.items()), ids=list(DECLINED))
def test_event_frames_the_loop_cannot_run_plainly_are_left_to_the_python_worker(worker_library: str, why: str,
                                                                                declined: bytes) -> None:
    driver = RecordingEventDriver()
    native = native_loop(worker_library, driver)
    setup = create(EVENT) + create(EVENT + 1) + destroy(EVENT + 1)
    buf = Buffer(setup + declined + record(EVENT))

    used, error = native.run(buf.address, buf.size, CTX)

    assert (used, error) == (len(setup), 0), why
    assert [c[0] for c in driver.calls] == ["create", "create", "destroy"]


def test_without_the_limiters_turn_only_creations_and_destructions_run(worker_library: str) -> None:
    # The compute limiter gates launches, records and waits (GPU work), never creations or destructions.
    driver = RecordingEventDriver()
    native = native_loop(worker_library, driver)
    head = create(EVENT) + destroy(EVENT) + create(EVENT + 1)
    for work in (launch_frame(0xF00, b"\0" * 8), record(EVENT + 1), wait(0, EVENT + 1)):
        buf = Buffer(head + work)
        assert native.run(buf.address, buf.size, CTX, gpu_work=False) == (len(head), 0)
        head = create(EVENT + 2) + destroy(EVENT + 2)
    buf = Buffer(record(EVENT + 1))
    assert native.run(buf.address, buf.size, CTX, events=False) == (0, 0)
    assert native.run(buf.address, buf.size, CTX) == (buf.size, 0)


def test_a_driver_without_an_entry_point_leaves_that_operation_to_python(worker_library: str) -> None:
    driver = RecordingEventDriver()
    entries = driver.event_entries._replace(record_with_flags=0)
    native = NativeLaunches(worker_library, driver.launch_entry, entries)
    assert RECORD_FLAGS_OP not in native.ops and RECORD_OP in native.ops
    first = create(EVENT)
    buf = Buffer(first + record_flags(EVENT, 0, 1))
    assert native.run(buf.address, buf.size, CTX) == (len(first), 0)
    assert NativeLaunches(worker_library, driver.launch_entry).ops == {LAUNCH_OP}   # no entries: launches only


# ------------------------------------------------------------------------- through a real Worker

class RecordingEventBackend(EmulatedBackend):
    """Test double: the emulated device, whose launches and event operations go to a
    RecordingEventDriver, from the C loop (`native_events`) or from the Python path alike (as a
    real backend's go to NVIDIA's entry points either way)."""

    def __init__(self, spec: SessionSpec, driver: RecordingEventDriver, native_events: bool) -> None:
        super().__init__(spec)
        self.driver = driver
        self.native_events = native_events

    def launch_entry(self) -> int:
        return self.driver.launch_entry

    def event_entries(self) -> EventEntries:
        return self.driver.event_entries if self.native_events else EventEntries(0, 0, 0, 0, 0)

    def launch_fast(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int, stream: int,
                    address: int, argsize: int) -> int:
        return self.driver.call("launch", f, stream)

    def event_create(self, flags: int) -> int:
        out = (ctypes.c_void_p * 1)()
        code = self.driver.callbacks[1](out, flags)
        if code:
            raise CudaError(code)
        return int(out[0] or 0)

    def cuEventRecord(self, e: int, s: int) -> tuple[int]:
        return (self.driver.call("record", e, s),)

    def cuEventRecordWithFlags(self, e: int, s: int, flags: int) -> tuple[int]:
        return (self.driver.call("record_flags", e, s, flags),)

    def cuStreamWaitEvent(self, s: int, e: int, flags: int) -> tuple[int]:
        return (self.driver.call("wait", s, e, flags),)

    def cuEventDestroy_v2(self, e: int) -> tuple[int]:
        return (self.driver.call("destroy", e),)

    def cuEventQuery(self, e: int) -> tuple[int]:
        return (self.driver.call("query", e),)


def serve(worker_library: str, driver: RecordingEventDriver, native_events: bool) -> Iterator[Served[RecordingEventDriver]]:
    spec = session_spec(worker_library)
    yield from serve_worker(spec, RecordingEventBackend(spec, driver, native_events), driver)


def lstm_step(step: int, stream: int) -> list[bytes]:
    """What cuDNN's RNN sends around its launches: events made, recorded, waited for, destroyed."""
    out = []
    for k in range(4):
        e = EVENT + ((step * 4 + k) << 32)
        out += [create(e), launch_frame(0x7000 + k, struct.pack("<Q", step * 4 + k), stream=stream), record(e, stream),
                wait(0, e), launch_frame(0x7004, struct.pack("<Q", k)), destroy(e)]
    return out


def test_a_storm_of_launches_and_event_operations_stays_in_c_with_exact_results(worker_library: str) -> None:
    results = {}
    for native_events in (True, False):
        for s in serve(worker_library, RecordingEventDriver(), native_events):
            assert s.worker.native_launches is not None
            assert s.sync(1) == (0, "")   # makes the context current
            s.send(frame(STREAM_CREATE_OP, "<QIi", STREAM, 1, 0))
            steps = 300
            stream = b"".join(b"".join(lstm_step(i, STREAM)) for i in range(steps))
            for at in range(0, len(stream), 65521):   # uneven writes split frames across receives, as TCP does
                s.sock.sendall(stream[at:at + 65521])
            assert s.sync(2) == (0, "")
            native, calls_in_python = s.worker.native_launches, s.worker.calls
            results[native_events] = (s.driver.calls, native.event_counts(), calls_in_python)
    in_c, in_python = results[True], results[False]
    assert in_c[0] == in_python[0]   # the same driver calls, in the same order, with the same handles
    assert len(in_c[0]) == 300 * 4 * 6
    per = 300 * 4
    assert in_c[1] == {"rgpuEventCreate": per, "cuEventRecord": per, "cuEventRecordWithFlags": 0,
                       "cuStreamWaitEvent": per, "cuEventDestroy_v2": per}
    assert in_python[1] == dict.fromkeys(in_c[1], 0)
    # In C, Python saw only the syncs, the stream's creation and each kernel's first launch (its admission).
    assert in_c[2] <= 2 + 1 + 5 + 10, in_c[2]
    assert in_python[2] >= 4 * per


SCENARIOS = {
    "a failed creation names cuEventCreate": (
        {("create", 1): OUT_OF_MEMORY},
        [create(EVENT), create(EVENT + 1), record(EVENT), record(EVENT + 1), destroy(EVENT)],
        ["cuEventCreate (event 0x7e00000100000002) failed on the GPU server with CUDA_ERROR_OUT_OF_MEMORY",
         "cuEventRecord: event 0x7e00000100000002 does not exist (its cuEventCreate failed with "
         "CUDA_ERROR_OUT_OF_MEMORY)"]),
    "a destroyed event names the call": (
        {},
        [create(EVENT), destroy(EVENT), wait(0, EVENT)],
        ["cuStreamWaitEvent: event 0x7e00000100000001 does not exist (destroyed, or made by another process or slice)"]),
    "an unknown event destroyed": (
        {},
        [create(EVENT), record(EVENT), destroy(EVENT + 9)],
        ["cuEventDestroy_v2: event 0x7e0000010000000a does not exist (destroyed, or made by another process or slice)"]),
    "a launch error comes before a later failed creation": (
        {("launch", 1): LAUNCH_FAILED, ("create", 0): OUT_OF_MEMORY},
        [launch_frame(0x7000, b"\0" * 8), launch_frame(0x7000, b"\0" * 8) + create(EVENT), record(EVENT)],
        ["", "cuEventRecord: event 0x7e00000100000001 does not exist (its cuEventCreate failed with "
             "CUDA_ERROR_OUT_OF_MEMORY)"]),
    "a record's driver error is deferred": (
        {("record", 0): INVALID_HANDLE},
        [create(EVENT), record(EVENT), destroy(EVENT)],
        [""]),
}


@pytest.mark.parametrize("name", list(SCENARIOS), ids=list(SCENARIOS))
def test_late_errors_of_event_operations_read_as_the_python_paths(worker_library: str, name: str) -> None:
    fail, frames, lines = SCENARIOS[name]
    answers = {}
    for native_events in (True, False):
        for s in serve(worker_library, RecordingEventDriver(fail=dict(fail)), native_events):
            assert s.sync(1) == (0, "")
            got = []
            for i, f in enumerate(frames):   # a sync after each group of frames: each deferred error surfaces once
                s.send(f)
                got.append(s.sync(10 + i))
            got.append(s.sync(99))
            answers[native_events] = (got, s.driver.calls)
            if native_events:
                assert sum(s.worker.native_launches.event_counts().values()) > 0
    assert answers[True] == answers[False], name
    errors = [(code, message) for code, message in answers[True][0] if code]
    assert len(errors) == len(lines), errors
    for (_code, message), line in zip(errors, lines):
        assert message.removeprefix("rgpu: worker: ")[:len(line)] == line, (message, line)
        assert message.startswith("rgpu: worker: ") or not line
    assert answers[True][0][-1] == (0, "")   # the session goes on


def test_frames_the_loop_leaves_still_run_in_python(worker_library: str, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))
    for s in serve(worker_library, RecordingEventDriver(), True):
        assert s.sync(1) == (0, "")
        s.send(create(EVENT), record(EVENT), frame(QUERY_OP, "<Q", EVENT))   # a query is synchronising
        (_l, _op, _f, seq, _a, _c), payload = protocol.recv_frame(s.sock)
        assert struct.unpack_from("<i", payload)[0] == 0
        s.send(destroy(EVENT), record(EVENT + 5))   # unknown: Python words it
        code, message = s.sync(2)
        assert code == INVALID_HANDLE and "cuEventRecord: event 0x7e00000100000006 does not exist" in message
        profile = s.worker.profile
        assert profile is not None
        python_ops = {api_gen.OPS.get(op, op): n for op, (n, _ns) in profile.items()}
        assert python_ops["cuEventQuery"] == 1 and python_ops["cuEventRecord"] == 1   # the unknown one
        assert "rgpuEventCreate" not in python_ops and "cuEventDestroy_v2" not in python_ops
        counts = s.worker.native_launches.event_counts()
        assert (counts["rgpuEventCreate"], counts["cuEventRecord"], counts["cuEventDestroy_v2"]) == (1, 1, 1)
    deadline = time.monotonic() + 10
    while not (files := list(tmp_path.glob("worker-*.json"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    report = json.loads(files[0].read_text())
    assert report["native_event_ops"]["rgpuEventCreate"] == 1 and report["ops"]["cuEventQuery"]["calls"] == 1


def test_events_of_another_context_run_in_python(worker_library: str) -> None:
    for s in serve(worker_library, RecordingEventDriver(), True):
        assert s.sync(1) == (0, "")
        other = s.worker.backend.ctx_create(0)
        s.send(create(EVENT, ctx=other), record(EVENT, ctx=other), destroy(EVENT, ctx=other))
        assert s.sync(2) == (0, "")
        assert [c[0] for c in s.driver.calls] == ["create", "record", "destroy"]
        # The first frame of another context is Python's (it makes that context current); the C
        # loop then runs the rest, in the context now current.
        counts = s.worker.native_launches.event_counts()
        assert counts["rgpuEventCreate"] == 0 and counts["cuEventRecord"] + counts["cuEventDestroy_v2"] == 2


# ------------------------------------------------------------------------- real function pointers

def test_the_chained_real_gpu_backend_runs_client_events_in_the_c_loop(
        native_libs: build.Libraries, loop_binary: Path, chained: Server,  # noqa: F811
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # backends/cuda.py hands the C loop rgpu's own libcuda's cuEventCreate, cuEventRecord,
    # cuStreamWaitEvent and cuEventDestroy_v2 (talking to an emulated worker): the loop's calls
    # through real function pointers, and the same answers the Python path gave.
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))
    for mode in (["loop", "50"], ["destroyed"]):
        done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)),
                          [str(loop_binary), str(EXAMPLES / "vecadd.ptx"), *mode])
        assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    deadline = time.monotonic() + 20
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        reports = [json.loads(p.read_text()) for p in tmp_path.glob("worker-*.json")]
        counts = {}
        for report in reports:
            for name, n in report.get("native_event_ops", {}).items():
                counts[name] = counts.get(name, 0) + n
        if counts.get("cuEventDestroy_v2", 0) >= 50:
            break
        time.sleep(0.1)
    assert counts.get("rgpuEventCreate", 0) >= 50 and counts.get("cuEventRecord", 0) >= 50, counts
    assert counts.get("cuStreamWaitEvent", 0) >= 50 and counts.get("cuEventDestroy_v2", 0) >= 50, counts


def test_the_gpu_tiers_in_process_check_passes_on_the_chained_backend(native_libs: build.Libraries,
                                                                      emulated: Server) -> None:
    # test_gpu_native_events.py's first test drives the C loop with backends/cuda.py's entry points
    # in its own process; here "the driver" is rgpu's libcuda talking to an emulated worker.
    inner = emulated.slices(emulated.token(memory_limit=4 << 30, job_key="inner"))
    env = dict(os.environ, LD_LIBRARY_PATH=str(native_libs.folder), RGPU_SLICES=inner,
               RGPU_WORKER_ALLOW_RGPU_LIBCUDA="1", RGPU_LOG="error")
    code = ("from pathlib import Path\nfrom rgpu.remoting.native import build\n"
            "from tests.remoting.test_gpu_native_events import "
            "test_the_c_loop_creates_records_waits_for_and_destroys_events_on_nvidias_driver as check\n"
            f"check(build.Libraries(Path({str(native_libs.folder)!r})))\nprint('CHECKED')\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False, cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and "CHECKED" in done.stdout, done.stdout + done.stderr
