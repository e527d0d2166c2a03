"""rgpu's compute limiter for isolated GPUs (worker/limiter.py): the share arithmetic with a made-up
clock, and the GPU's turn taken by a real worker on the emulated backend. The shares it reaches on
a real GPU are measured by tests/remoting/test_gpu_isolation.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rgpu.remoting.datapath.worker.limiter import (BURST_S, QUANTUM_S, TURN_FILE, ComputeLimiter, RecentUse,
                                                   TokenBucket, allowance, others_use)
from rgpu.remoting.native import build
from rgpu.errors import InvalidRequest
from rgpu.remoting.datapath.worker.spec import SessionSpec
from rgpu.slice_size import SliceLimits
from tests.remoting.conftest import EMULATED_GPU, Server, client_env, start_server

HERE = Path(__file__).parent


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75, 1.0])
def test_a_greedy_session_gets_its_share_of_wall_time(share: float) -> None:
    """Turns of QUANTUM_S as often as the bucket allows, for 10 s of made-up time."""
    now, busy = 0.0, 0.0
    bucket = TokenBucket(share, now)
    while now < 10.0:
        now += bucket.wait_s(now)
        now += QUANTUM_S
        busy += QUANTUM_S
        bucket.charge(QUANTUM_S, now)
    assert busy / now == pytest.approx(share, abs=0.01)


def test_idle_time_is_saved_only_up_to_the_burst() -> None:
    bucket = TokenBucket(0.5, 0.0)
    assert bucket.wait_s(100.0) == 0.0
    bucket.charge(1.0, 100.0)          # a long kernel: far over the burst
    assert bucket.tokens == pytest.approx(0.5 * BURST_S - 1.0)
    assert bucket.wait_s(100.0) == pytest.approx((1.0 - 0.5 * BURST_S) / 0.5)


def test_lending_gives_what_the_others_leave() -> None:
    assert allowance(0.25, 0.1, lending=False) == 0.25
    assert allowance(0.25, 0.1, lending=True) == pytest.approx(0.9)
    assert allowance(0.25, 0.95, lending=True) == 0.25
    assert allowance(0.5, -0.2, lending=True) == 1.0


def test_recent_use_follows_the_duty_cycle() -> None:
    use, now = RecentUse(span_s=0.5), 0.0
    for _ in range(200):
        now += 0.06
        use.add(0.02, now)             # 20 ms of each 60 ms
    assert use.value == pytest.approx(1 / 3, abs=0.01)


def test_turns_are_exclusive_and_published(tmp_path: Path) -> None:
    fences: list[int] = []
    clock = [0.0]
    first = ComputeLimiter(SliceLimits(1 << 30, 50), str(tmp_path), False, lambda: fences.append(1), clock=lambda: clock[0])
    first.before_submit()
    probe = os.open(tmp_path / TURN_FILE, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)    # the turn is held
    clock[0] += QUANTUM_S
    first.after_op()                                         # the quantum is over: work fenced, turn given back
    assert fences == [1] and first.holding_since is None
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(probe, fcntl.LOCK_UN)
    assert others_use(str(tmp_path), me=-1, now=time.time()) > 0
    first.close()
    assert others_use(str(tmp_path), me=-1, now=time.time()) == 0
    os.close(probe)


def test_an_isolated_session_submits_only_while_it_holds_the_gpus_turn(native_libs: build.Libraries) -> None:
    """A real worker: while another holder keeps the GPU's turn, the session's memset waits."""
    gpu = replace(EMULATED_GPU, sharing="isolated")
    server, address = start_server("emulated", [gpu])
    srv = Server(server, address, [gpu])
    try:
        program = f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ctcuda import *\nimport ctypes\n" + \
            textwrap.dedent("""
            setup()
            r, p = alloc(1 << 20)
            print("READY", flush=True)
            sys.stdin.readline()
            lib.cuMemsetD8Async(ctypes.c_uint64(p), 1, ctypes.c_size_t(1 << 20), None)
            print("SYNC", lib.cuCtxSynchronize(), flush=True)
            """)
        proc = subprocess.Popen([sys.executable, "-c", program], env=client_env(native_libs, srv.slices(srv.token())),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("READY")
        turn_files = list((server.runtime_dir / "gpus").glob(f"*/{TURN_FILE}"))
        assert len(turn_files) == 1                     # the worker's limiter opened the GPU's turn
        holder = os.open(turn_files[0], os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)              # another session holds the GPU
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(0.5)
        assert proc.poll() is None                      # its work waits for the turn
        fcntl.flock(holder, fcntl.LOCK_UN)
        out, err = proc.communicate(timeout=30)
        os.close(holder)
        assert "SYNC 0" in out, out + err
    finally:
        server.stop()


def test_a_turn_held_by_a_kernel_that_runs_on_is_yielded(tmp_path: Path) -> None:
    """A never-ending kernel must not starve the GPU's other isolated sessions."""
    from rgpu.remoting.datapath.worker.limiter import OVERRUN_S

    clock = [0.0]
    limiter = ComputeLimiter(SliceLimits(1 << 30, 50), str(tmp_path), False, lambda: None, clock=lambda: clock[0])
    limiter.before_submit()
    probe = os.open(tmp_path / TURN_FILE, os.O_RDWR)
    clock[0] += OVERRUN_S                     # the worker is stuck in the application's synchronise
    deadline = time.monotonic() + 10
    while limiter.overruns == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)    # another session may take the GPU now
    fcntl.flock(probe, fcntl.LOCK_UN)
    clock[0] += 1.0
    limiter.release()                         # the kernel ended: the whole time is charged
    assert limiter.busy_s == pytest.approx(OVERRUN_S + 1.0)
    limiter.close()
    os.close(probe)


def test_the_session_spec_checks_the_slices_limits_once_and_the_limiter_meters_its_share(tmp_path: Path) -> None:
    fields = dict(mode="cuda", backend="emulated", gpu_uuid="GPU-1", gpu_index=0, gpu_name="NVIDIA H200",
                  gpu_total_memory=1 << 30, compute_capability="9.0", memory_limit=1 << 30, compute_percent=25,
                  job_key="j", slice_number=0, usage_dir="", server="gpu1:7100", compute_enforcement="isolated",
                  client={})
    spec = SessionSpec.from_json(json.dumps(fields))
    limiter = ComputeLimiter(spec.limits, str(tmp_path), False, lambda: None)
    try:
        assert limiter.share == 0.25
    finally:
        limiter.close()
    # A spec the session server should never write (a percent of 0 was metered as 1% before) is one line.
    with pytest.raises(InvalidRequest) as info:
        SessionSpec.from_json(json.dumps({**fields, "compute_percent": 0}))
    assert str(info.value).startswith("rgpu: worker: invalid compute_percent 0 (")
