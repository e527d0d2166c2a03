"""Data lanes on a real GPU (protocol 12, issue 25 item 2): striped host-to-device copies received into
the worker's pinned slots, each chunk's cuMemcpyHtoDAsync queued as it lands, and device-to-host
copies queued into the slots and sent as each completes (backends/cuda.py, src/lanes.c), byte for byte for sizes around the threshold and chunk boundaries, pageable and pinned;
a lane cut mid-copy on a real GPU, synchronous and asynchronous; an asynchronous copy from
pinned memory received in the background while the session goes on (RGPU_LANES_BACKGROUND=1); a
cudart-shaped program whose first kernel launch follows its first large copy; copies onto an idle
stream through the landing ring (lanes.h, rgpu_lanes_ring_*).

Run on a GPU machine:
    python -m pytest -m gpu tests/remoting/test_gpu_lanes.py -v -s
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, driver_api_program, local_gpu, run_client, serving
from tests.remoting.lanes_helpers import HERE, LANES, LANE_ENV, SIZES, STRIPED, _striped

pytestmark = pytest.mark.gpu


# 8 MiB: more than the landing ring's slots take (copies land whole) and fewer staging slots (4 of 8 MiB).
@pytest.mark.parametrize("chunk", [64 << 10, 2 << 20, 8 << 20], ids=["64KiB-chunks", "2MiB-chunks", "8MiB-chunks"])
def test_striped_copies_of_every_size_arrive_whole_on_a_gpu(lane_copies: Path, native_libs: build.Libraries,  # noqa: F811
                                                            tmp_path: Path, chunk: int) -> None:
    with serving("cuda", [local_gpu()]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(lane_copies), *map(str, SIZES)],
                          timeout=300, RGPU_CLIENT_STATS=str(tmp_path / "p"),
                          **(LANE_ENV | {"RGPU_LANE_CHUNK_BYTES": str(chunk)}))
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert f"transport tcp, {LANES} data lanes)" in done.stderr, done.stderr
    assert _striped(tmp_path / "p") == (STRIPED, STRIPED)


@pytest.mark.parametrize("mode", ["htod", "htod-async"])
def test_a_lane_cut_mid_copy_on_a_gpu_fails_that_copy_and_the_session_goes_on(native_libs: build.Libraries,
                                                                              lane_cut: Path,  # noqa: F811
                                                                              tmp_path: Path, mode: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """htod-async: the copy returns at once (the worker receives it in the background) and its failure
    answers the synchronisation."""
    if mode == "htod-async":
        monkeypatch.setenv("RGPU_LANES_BACKGROUND", "1")   # the workers' environment: the server's
    program = driver_api_program(native_libs, HERE / "lane_failure.c", tmp_path / "lane_failure")
    with serving("cuda", [local_gpu()]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(program), mode], timeout=300,
                          LD_PRELOAD=str(lane_cut), RGPU_TEST_CUT_SENDMSG="5", **LANE_ENV)
    first = "COPY 999\n" if mode == "htod" else "COPY 0\n"
    assert done.returncode == 0 and done.stdout.startswith(first + "SYNC 999\n"), done.stdout + done.stderr
    assert done.stdout.strip().endswith("OK")


def test_an_async_copy_from_pinned_memory_over_lanes_returns_while_its_bytes_travel(native_libs: build.Libraries,
                                                                                    tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 3 on the network path, with RGPU_LANES_BACKGROUND=1: the worker receives the copy
    on a thread of its own while it answers the session's next calls (in its loop, a query waits
    behind the whole copy); the stream's later work runs after the copy and an event recorded after
    it covers its bytes."""
    monkeypatch.setenv("RGPU_LANES_BACKGROUND", "1")
    program = driver_api_program(native_libs, HERE / "lane_overlap.c", tmp_path / "lane_overlap")
    with serving("cuda", [local_gpu()]) as s:
        # 256 MiB: the largest copy a landing takes (a larger one is received in the loop)
        done = run_client(native_libs, s.slices(s.token(memory_limit=2 << 30)), [str(program), "256"], timeout=300,
                          **(LANE_ENV | {"RGPU_LANE_CHUNK_BYTES": str(2 << 20)}))
    print(done.stdout)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
    queries = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("QUERY")]
    events = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("EVENT")]
    assert queries == ["600"] * 3, done.stdout   # CUDA_ERROR_NOT_READY: the copy was still under way
    assert events == ["0"] * 3, done.stdout


@pytest.mark.parametrize("background", ["0", "1"], ids=["loop-receive", "background-receive"])
@pytest.mark.parametrize("loading", ["library", "module"])
def test_a_first_kernel_launch_after_a_large_striped_copy_completes(native_libs: build.Libraries, tmp_path: Path,
                                                                     loading: str, background: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """cudart's shape: 64 MiB inputs copied from pageable memory on the legacy stream, striped (1,024
    chunks), then the kernel's first launch, which makes the driver load its code (lazy loading may
    synchronise the context), then the result back. convolutionSeparable, histogram,
    cudaTensorCoreGemm and graphMemoryNodes from cuda-samples hung at this point on an H100 while the
    background receive queued its DMAs from the receiving thread (2026-12-07); that thread now makes
    no driver call."""
    monkeypatch.setenv("RGPU_LANES_BACKGROUND", background)
    program = driver_api_program(native_libs, HERE / "lane_first_launch.c", tmp_path / "lane_first_launch")
    with serving("cuda", [local_gpu()]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)),
                          [str(program), loading, str(EXAMPLES / "vecadd.ptx"), "64"], timeout=120,
                          RGPU_CLIENT_STATS=str(tmp_path / "p"), **LANE_ENV)
    assert done.returncode == 0 and "FAIL" not in done.stdout and "RESULT OK" in done.stdout, done.stdout + done.stderr
    assert _striped(tmp_path / "p")[0] == 2   # both inputs went over the lanes


@pytest.mark.parametrize("ring_slots", ["2", "0"], ids=["landing-ring", "ring-off"])
def test_copies_onto_an_idle_stream_go_through_the_landing_ring_on_a_gpu(lane_copies: Path,  # noqa: F811
                                                                         native_libs: build.Libraries, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         ring_slots: str) -> None:
    """The landing ring (lanes.h, cuda_copies.py's _ring_receive): each lane's two slots are filled many
    times over by a 32 MiB copy in 64 KiB chunks while the GPU copies out of them, bytes whole; with
    RGPU_LANE_RING_SLOTS=0 the same copies land whole first."""
    import json
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(profiles))   # the workers' environment: the server's
    monkeypatch.setenv("RGPU_LANE_RING_SLOTS", ring_slots)
    with serving("cuda", [local_gpu()]) as s:
        done = run_client(native_libs, s.slices(s.token(memory_limit=1 << 30)), [str(lane_copies), *map(str, SIZES)],
                          timeout=300, **LANE_ENV)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    (profile,) = profiles.glob("worker-*.json")
    ring_copies = json.loads(profile.read_text())["lane_ring_copies"]
    assert (ring_copies > 0) if ring_slots == "2" else (ring_copies == 0), ring_copies
