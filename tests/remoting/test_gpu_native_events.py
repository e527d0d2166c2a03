"""The worker's C loop runs the pipelined event operations on NVIDIA's driver (issue 24, item 5).

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_native_events.py -v -s
(CPU-only CI skips them; tests/remoting/test_native_events.py covers the same loop with a test
double for the driver and with rgpu's own libcuda as "the driver".)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rgpu.remoting.native.generated import api_gen
from rgpu.remoting.native import build
from rgpu.remoting.datapath.worker.client_handles import EVENT_FAILED
from rgpu.remoting.datapath.worker.native_loop import EventEntries, NativeLaunches

from tests.remoting.conftest import EXAMPLES, Server
from tests.remoting.gpu_helpers import flexrun
from tests.remoting.native_events_helpers import EVENT, STREAM, frame
from tests.remoting.native_launches_helpers import Buffer, session_spec

pytestmark = pytest.mark.gpu
OP = api_gen.OPCODES
INVALID_VALUE = 1


def test_the_c_loop_creates_records_waits_for_and_destroys_events_on_nvidias_driver(
        native_libs: build.Libraries) -> None:
    from rgpu.remoting.datapath.backends.cuda import CudaBackend
    backend = CudaBackend(session_spec(str(native_libs.libworker)))
    ctx = int(backend.primary.value or 0)
    backend.set_context(ctx)
    entries = EventEntries(*backend.event_entries())
    assert all(entries), entries
    native = NativeLaunches(str(native_libs.libworker), backend.launch_entry(), entries)
    real_stream = backend.stream_create(1, 0)   # CU_STREAM_NON_BLOCKING
    native.set_stream(STREAM, real_stream)
    first, second, bad = EVENT, EVENT + 1, EVENT + 2
    frames = [frame(OP["rgpuEventCreate"], "<QI", first, 2, ctx=ctx),           # CU_EVENT_DISABLE_TIMING
              frame(OP["cuEventRecord"], "<QQ", first, STREAM, ctx=ctx),
              frame(OP["cuStreamWaitEvent"], "<QQI", 0, first, 0, ctx=ctx),
              frame(OP["rgpuEventCreate"], "<QI", second, 0, ctx=ctx),
              frame(OP["cuEventRecordWithFlags"], "<QQI", second, 1, 0, ctx=ctx),  # the legacy stream
              frame(OP["cuStreamWaitEvent"], "<QQI", STREAM, second, 0, ctx=ctx)]
    buf = Buffer(b"".join(frames))
    assert native.run(buf.address, buf.size, ctx) == (buf.size, 0)
    real_first, real_second = native.events.get(first), native.events.get(second)
    assert real_first and real_second and not (real_first | real_second) & EVENT_FAILED
    assert backend.f["cuCtxSynchronize"]() == 0
    assert backend.cuEventQuery(real_first)[0] == 0 and backend.cuEventQuery(real_second)[0] == 0

    # A creation the driver refuses (INTERPROCESS without DISABLE_TIMING) ends the run; its handle is marked.
    frames = [frame(OP["cuEventDestroy_v2"], "<Q", first, ctx=ctx), frame(OP["rgpuEventCreate"], "<QI", bad, 4, ctx=ctx),
              frame(OP["cuEventRecord"], "<QQ", bad, 0, ctx=ctx)]
    buf = Buffer(b"".join(frames))
    used, error = native.run(buf.address, buf.size, ctx)
    assert (used, error) == (len(frames[0]) + len(frames[1]), 0)
    assert native.failed_creation == (bad, INVALID_VALUE)
    assert native.events.get(bad) == EVENT_FAILED | INVALID_VALUE and native.events.get(first) is None
    rest = Buffer(frames[2])
    assert native.run(rest.address, rest.size, ctx) == (0, 0)   # the worker words that one
    done = Buffer(frame(OP["cuEventDestroy_v2"], "<Q", second, ctx=ctx))
    assert native.run(done.address, done.size, ctx) == (done.size, 0)
    assert native.event_counts() == {"rgpuEventCreate": 3, "cuEventRecord": 1, "cuEventRecordWithFlags": 1,
                                     "cuStreamWaitEvent": 2, "cuEventDestroy_v2": 2}


def test_an_application_s_events_run_in_the_c_loop_on_the_gpu(native_libs: build.Libraries, loop_binary: Path,  # noqa: F811
                                                               gpu_server: Server, tmp_path: Path,  # noqa: F811
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))   # the session server's workers inherit it
    for mode in (["loop", "200"], ["destroyed"]):
        done = flexrun(native_libs, gpu_server, tmp_path, [str(loop_binary), str(EXAMPLES / "vecadd.ptx"), *mode],
                       name=f"native-events-{mode[0]}")
        assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    deadline = time.monotonic() + 20
    counts: dict[str, int] = {}
    while time.monotonic() < deadline:
        counts = {}
        for path in tmp_path.glob("worker-*.json"):
            for name, n in json.loads(path.read_text()).get("native_event_ops", {}).items():
                counts[name] = counts.get(name, 0) + n
        if counts.get("cuEventDestroy_v2", 0) >= 200:
            break
        time.sleep(0.1)
    assert counts.get("rgpuEventCreate", 0) >= 200 and counts.get("cuStreamWaitEvent", 0) >= 200, counts
