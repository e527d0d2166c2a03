"""No round trip the application did not ask for (issue 24): a C driver-API program's loop of event
create/record/query/destroy, function attribute, occupancy, pointer attribute and stream queries and
asynchronous memsets, run through the client library against an emulated worker, makes no round trip
per iteration (RGPU_CLIENT_STATS of runs with different iteration counts are equal) and gets the
worker's own answers; errors the worker meets later surface at the next synchronising call."""

from __future__ import annotations

import struct

from pathlib import Path

import pytest
from rgpu.remoting.native import build, client_stats

from tests.remoting.conftest import EXAMPLES, Server, calls_between, run_client
from tests.remoting.client_helpers import py_client


def _profile(path: Path) -> dict[str, client_stats.OpProfile]:
    files = sorted(path.parent.glob(path.name + ".*"))
    assert len(files) == 1, files
    return {p.name: p for p in client_stats.parse(files[0].read_text())[0].values()}


def _loop(native_libs: build.Libraries, emulated: Server, binary: Path, n: int,
          stats: Path) -> dict[str, client_stats.OpProfile]:
    done = run_client(native_libs, emulated.slices(emulated.token()), [str(binary), str(EXAMPLES / "vecadd.ptx"),
                      "loop", str(n)], RGPU_CLIENT_STATS=str(stats))
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0
    assert done.stderr == "", done.stderr   # nothing printed when nothing is wrong
    return _profile(stats)


def test_a_loop_of_queries_events_and_memsets_makes_no_round_trip_per_iteration(
        native_libs: build.Libraries, emulated: Server, loop_binary: Path, tmp_path: Path) -> None:
    few = _loop(native_libs, emulated, loop_binary, 3, tmp_path / "few")
    many = _loop(native_libs, emulated, loop_binary, 300, tmp_path / "many")
    round_trips = {name: (few[name].sync_calls if name in few else 0, p.sync_calls) for name, p in many.items()
                   if p.sync_calls}
    assert all(a == b for a, b in round_trips.values()), round_trips
    # The first answers travelled once each; the loop's events, memsets and destructions are pipelined.
    assert many["cuFuncGetAttribute"].sync_calls == 10   # after cuFuncSetAttribute, the value set answers
    for name in ("cuCtxGetFlags", "cuCtxGetApiVersion", "cuCtxGetId", "cuCtxGetStreamPriorityRange",
                 "cuCtxGetCacheConfig", "cuStreamGetFlags", "cuStreamGetPriority"):
        assert many[name].sync_calls == (2 if name == "cuCtxGetFlags" else 1), name   # flags: again after a set
    assert many["cuPointerGetAttribute"].sync_calls == 6
    assert "cuPointerGetAttributes" not in many   # the single queries' answers serve the plural one
    assert many["cuOccupancyAvailableDynamicSMemPerBlock"].sync_calls == 1
    assert "cuEventCreate" not in many
    assert many["rgpuEventCreate"].async_calls == 300 + 1 and many["rgpuEventCreate"].sync_calls == 0
    assert many["cuEventDestroy_v2"].async_calls == 300 + 1
    assert many["cuMemsetD32Async"].async_calls == 300
    assert "cuStreamCreate" not in many and "cuStreamCreateWithPriority" not in many
    assert many["rgpuStreamCreate"].async_calls == 300 + 1 and many["cuStreamDestroy_v2"].async_calls == 300 + 1
    # Only the query of an event recorded again after the loop's last synchronisation travelled.
    assert many["cuEventQuery"].sync_calls == 1
    assert "cuEventSynchronize" not in many or many["cuEventSynchronize"].sync_calls == 0
    total = sum(p.sync_calls for p in many.values())
    print("round trips, 3 iterations:", sum(p.sync_calls for p in few.values()), "300 iterations:", total)
    print(client_stats.render({i: p for i, p in enumerate(many.values())}, 0))


def test_destroyed_events_and_streams_are_refused_and_the_session_goes_on(
        native_libs: build.Libraries, emulated: Server, loop_binary: Path) -> None:
    done = run_client(native_libs, emulated.slices(emulated.token()), [str(loop_binary), str(EXAMPLES / "vecadd.ptx"),
                      "destroyed"])
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert "HANDLES differ" in done.stdout and "ELAPSED ok" in done.stdout and "PRIORITY -3" in done.stdout
    # Work queued on a destroyed stream fails late, and the line names the call.
    assert "rgpu: worker: cuMemsetD8Async: stream 0x7d" in done.stderr, done.stderr
    assert "does not exist (destroyed, or made by another process or slice)" in done.stderr


def test_an_event_the_worker_could_not_create_fails_the_next_synchronising_call(
        native_libs: build.Libraries, emulated: Server, loop_binary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_EMULATED_MAX_EVENTS", "2")   # the session server's workers inherit it
    done = run_client(native_libs, emulated.slices(emulated.token()), [str(loop_binary), str(EXAMPLES / "vecadd.ptx"),
                      "no-room"])
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    # The synchronising call names the call that failed, and the later use of its handle says why.
    assert "rgpu: worker: cuEventCreate (event 0x7e" in done.stderr, done.stderr
    assert "failed on the GPU server with CUDA_ERROR_OUT_OF_MEMORY" in done.stderr
    assert "cuEventQuery: event 0x7e" in done.stderr and "its cuEventCreate failed with CUDA_ERROR_OUT_OF_MEMORY" in done.stderr


def test_kept_pointer_attributes_follow_allocations_that_come_and_go(
        native_libs: build.Libraries, emulated: Server, loop_binary: Path, tmp_path: Path) -> None:
    done = run_client(native_libs, emulated.slices(emulated.token()), [str(loop_binary), str(EXAMPLES / "vecadd.ptx"),
                      "realloc"], RGPU_CLIENT_STATS=str(tmp_path / "p"))
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert _profile(tmp_path / "p")["cuPointerGetAttribute"].sync_calls == 3 * 2   # twice per allocation


@pytest.mark.parametrize("mode", [["loop", "50"], ["destroyed"]], ids=["loop", "destroyed"])
def test_the_real_gpu_backend_serves_client_made_events_and_streams(native_libs: build.Libraries, loop_binary: Path,
                                                                    chained: Server,  # noqa: F811
                                                                    mode: list[str]) -> None:
    # backends/cuda.py's event and stream creation and the generated calls' translation, with rgpu's
    # own libcuda (talking to an emulated worker) as "the driver" (test_cuda_backend_chained.py).
    done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)),
                      [str(loop_binary), str(EXAMPLES / "vecadd.ptx"), *mode])
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr


def test_launch_attributes_translate_events_and_leave_cluster_dimensions_alone() -> None:
    # cuBLAS launches with CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (4) = (1, 7, 1): read as a u64 its
    # value looks like a client handle, and taking it for one failed every PyTorch convolution.
    from rgpu.remoting.datapath.worker.client_handles import ClientEvents
    from rgpu.remoting.datapath.worker.codecs import LAUNCH_ATTR_SIZE

    def attribute(attr_id: int, *words: int) -> bytes:
        value = b"".join(struct.pack("<I", w) for w in words)
        return struct.pack("<II", attr_id, 0) + value.ljust(LAUNCH_ATTR_SIZE - 8, b"\0")

    events = ClientEvents()
    events.created(0x700000001, 0xAAAA)
    cluster = attribute(4, 1, 7, 1)
    programmatic = attribute(7, 0x00000001, 0x7, 1)    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_EVENT: event 0x700000001
    completion = attribute(12, 0x00000001, 0x7, 0)     # CU_LAUNCH_ATTRIBUTE_LAUNCH_COMPLETION_EVENT
    out = events.launch_attrs(cluster + programmatic + completion, LAUNCH_ATTR_SIZE)
    assert out[:LAUNCH_ATTR_SIZE] == cluster
    for at in (LAUNCH_ATTR_SIZE, 2 * LAUNCH_ATTR_SIZE):
        assert struct.unpack_from("<Q", out, at + 8)[0] == 0xAAAA
        assert out[at + 16:at + LAUNCH_ATTR_SIZE] == (programmatic if at == LAUNCH_ATTR_SIZE else completion)[16:]
    assert events.launch_attrs(cluster, LAUNCH_ATTR_SIZE) == cluster


def test_pointer_queries_about_pageable_memory_make_no_round_trip(native_libs: build.Libraries, emulated: Server,
                                                                  tmp_path: Path) -> None:
    """PyTorch's DataLoader asks is_pinned (cudaPointerGetAttributes) of every batch it receives, in
    pageable shared memory: the client answers as CUDA does for memory it does not know (success,
    default zero values) without asking the worker about an address of another process. Device
    memory is still the worker's to describe."""
    stats = tmp_path / "prof"
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        setup()
        r, dev = alloc(4096)
        pageable = ctypes.create_string_buffer(1 << 16)
        ids = (ctypes.c_int * 3)(2, 1, 9)                          # MEMORY_TYPE, CONTEXT, DEVICE_ORDINAL
        def ask(ptr):
            vals = [ctypes.c_uint64(0xFFFFFFFFFFFFFFFF) for _ in range(3)]
            slots = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in vals))
            check("cuPointerGetAttributes", 3, ids, slots, ctypes.c_uint64(ptr))
            return [hex(v.value) for v in vals]
        snapshot(b"start")
        answers = [ask(ctypes.addressof(pageable) + 100 * i) for i in range(20)]
        snapshot(b"end")
        print("PAGEABLE", answers[0], len(set(map(tuple, answers))))
        print("DEVICE", ask(dev)[0])
        """, RGPU_CLIENT_STATS=str(stats))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "PAGEABLE ['0x0', '0x0', '0x0'] 1" in out, out + done.stderr
    assert "DEVICE 0xffffffff00000002" in out, out          # CU_MEMORYTYPE_DEVICE, 4 bytes written
    between = calls_between(tmp_path, "start", "end")
    assert {name: p.sync_calls for name, p in between.items() if p.sync_calls} == {}, between
