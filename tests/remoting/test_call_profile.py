"""The call profiles: the client library's RGPU_CLIENT_STATS (round trips and pipelined calls per
operation) and the worker's RGPU_WORKER_PROFILE (time per operation), on a CUDA-runtime program
run through rgpu against the emulated worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rgpu.errors import ConfigError
from rgpu.remoting.datapath.worker.codecs import LAUNCH, LAUNCH_ATTR_SIZE, launch_shape
from rgpu.remoting.native import build, client_stats

from tests.remoting.conftest import EXAMPLES, Server
from tests.remoting.client_helpers import py_client
from tests.remoting.runtime_helpers import _run


def test_profiles_name_the_round_trips_of_a_runtime_program(native_libs: build.Libraries, emulated: Server,
                                                            runtime_demo: tuple[str, Path],  # noqa: F811
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))   # the session server's workers inherit it
    done = _run(native_libs, emulated, runtime_demo[1], RGPU_CLIENT_STATS=str(tmp_path / "client"))
    assert "ROUNDTRIP ok" in done.stdout, done.stdout + done.stderr
    files = sorted(tmp_path.glob("client.*"))
    assert len(files) == 1, files
    ops, sends = client_stats.parse(files[0].read_text())
    by_name = {p.name: p for p in ops.values()}
    # cudaMalloc is a round trip with a measured wait; cudaMemset is pipelined.
    assert by_name["cuMemAlloc_v2"].sync_calls >= 2 and by_name["cuMemAlloc_v2"].sync_wait_ns > 0
    assert by_name["cuMemsetD8_v2"].async_calls >= 1 or by_name["cuMemsetD8Async"].async_calls >= 1
    assert sends >= 1
    table = client_stats.render(ops, sends)
    assert "cuMemAlloc_v2" in table
    # The worker writes its profile when the session ends, just after the client has exited.
    deadline = time.monotonic() + 20
    while not (workers := list(tmp_path.glob("worker-*.json"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers, "the worker wrote no profile"
    report = json.loads(workers[0].read_text())
    assert report["ops"]["cuMemAlloc_v2"]["calls"] >= 2 and report["wall_ns"] > 0
    # Launches no fast path took, by why: the emulated worker has none, so each is the generic one's.
    launches = report["ops"].get("cuLaunchKernel", {}).get("calls", 0)
    assert sum(report["generic_launches"].values()) == launches
    assert set(report["generic_launches"]) <= {"plain", "cooperative", "other context"}


def test_a_launch_request_is_named_by_its_shape() -> None:
    base = dict(f=1, stream=0, grid=(1, 1, 1), block=(32, 1, 1), shmem=0)

    def request(coop: int, attrs: list[int], argsize: int = 8) -> bytes:
        head = LAUNCH.pack(base["f"], base["stream"], *base["grid"], *base["block"], base["shmem"], coop, len(attrs),
                           argsize, 0, 0)
        return head + b"".join(a.to_bytes(4, "little") + bytes(LAUNCH_ATTR_SIZE - 4) for a in attrs) + bytes(argsize)

    assert launch_shape(request(0, [])) == "plain"
    assert launch_shape(request(1, [])) == "cooperative"
    assert launch_shape(request(0, [4, 2, 4])) == "attributes 2,4"
    assert launch_shape(request(1, [7])) == "attributes 7 cooperative"
    assert launch_shape(request(0, [5])[:LAUNCH.size + 10]) == "attributes "   # attributes cut short: none read
    assert launch_shape(b"\0" * 8) == "short"


def test_a_damaged_profile_is_one_line() -> None:
    with pytest.raises(ConfigError, match="line 2 is not"):
        client_stats.parse("# header\n12 x 3 4\n", "p")
    assert client_stats.main(["/nonexistent/profile"]) == 2


def _profile(folder: Path) -> dict[str, client_stats.OpProfile]:
    files = sorted(folder.glob("client.*"))
    assert len(files) == 1, files
    return {p.name: p for p in client_stats.parse(files[0].read_text())[0].values()}


def test_kernel_attributes_cost_one_round_trip_and_setting_one_kernel_keeps_the_others(
        native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    # Libraries set an attribute on one kernel, then another, before each launch (SDPA, cuBLAS).
    # Forgetting every cached answer on each set made every query a round trip (GPT-2 on an H100:
    # ~200 per training step); a set forgets only its own kernel's answers.
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        lib_ = ctypes.c_void_p()
        check("cuLibraryLoadData", ctypes.byref(lib_), ptx, None, None, 0, None, None, 0)
        a, b = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuLibraryGetKernel", ctypes.byref(a), lib_, b"vecadd")
        check("cuLibraryGetKernel", ctypes.byref(b), lib_, b"spin")
        v = ctypes.c_int()
        for step in range(50):
            check("cuKernelSetAttribute", 8, 65536 + (step % 2) * 1024, a, 0)   # A alternates its value
            check("cuKernelSetAttribute", 8, 32768, b, 0)                       # B sets the value it has
            check("cuKernelGetAttribute", ctypes.byref(v), 0, b, 0)             # B's other answers stay
        check("cuKernelGetAttribute", ctypes.byref(v), 8, a, 0)
        print("A", v.value)
        check("cuKernelGetAttribute", ctypes.byref(v), 8, b, 0)
        print("B", v.value)
        fa = ctypes.c_void_p()
        check("cuKernelGetFunction", ctypes.byref(fa), a)
        check("cuFuncSetAttribute", fa, 8, 1024)                                # through the function
        check("cuKernelGetAttribute", ctypes.byref(v), 8, a, 0)
        print("A2", v.value)
        """, RGPU_CLIENT_STATS=str(tmp_path / "client"))
    assert "A 66560" in done.stdout and "B 32768" in done.stdout and "A2 1024" in done.stdout, done.stdout + done.stderr
    ops = _profile(tmp_path)
    # A's 50 changes, B's first set and the set through the function, all pipelined (func_attrs.c).
    assert "cuKernelSetAttribute" not in ops and ops["rgpuSetAttribute"].async_calls == 52
    # Each kernel's static shared memory once (what a set is checked against), B's attribute 0 once,
    # A's after cuFuncSetAttribute.
    assert ops["cuKernelGetAttribute"].sync_calls == 4
    assert ops["cuKernelGetFunction"].sync_calls == 1


def test_setting_a_functions_attribute_to_its_value_is_free_and_keeps_kernel_answers(
        native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    # GPT-2 on an H100: each step set attributes through both calls; a travelling cuFuncSetAttribute
    # on a function the cache did not know as a kernel's forgot every kernel's answers, so the
    # kernels' no-op sets travelled too (~50 round trips per step).
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        lib_, mod = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuLibraryLoadData", ctypes.byref(lib_), ptx, None, None, 0, None, None, 0)
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        k, f = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuLibraryGetKernel", ctypes.byref(k), lib_, b"vecadd")
        check("cuModuleGetFunction", ctypes.byref(f), mod, b"spin")
        for step in range(20):
            check("cuFuncSetAttribute", f, 8, 2048)
            check("cuKernelSetAttribute", 8, 4096, k, 0)
        v = ctypes.c_int()
        check("cuFuncGetAttribute", ctypes.byref(v), 8, f)
        print("F", v.value)
        check("cuKernelGetAttribute", ctypes.byref(v), 8, k, 0)
        print("K", v.value)
        check("cuFuncSetAttribute", f, 8, 1024)                                # a real change is sent
        check("cuFuncGetAttribute", ctypes.byref(v), 8, f)
        print("F2", v.value)
        """, RGPU_CLIENT_STATS=str(tmp_path / "client"))
    assert "F 2048" in done.stdout and "K 4096" in done.stdout and "F2 1024" in done.stdout, done.stdout + done.stderr
    ops = _profile(tmp_path)
    assert "cuFuncSetAttribute" not in ops and "cuKernelSetAttribute" not in ops
    assert ops["rgpuSetAttribute"].async_calls == 3   # the first two sets and the change, pipelined
    # Only the static shared memory the first sets are checked against; the sets' values answer.
    assert ops["cuFuncGetAttribute"].sync_calls == 1 and ops["cuKernelGetAttribute"].sync_calls == 1


def test_a_set_forgets_the_occupancy_answers_of_its_function_only(
        native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    # The carveout changes how many blocks fit: a function's occupancy answers go with a set of its
    # attributes; another function's stay.
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod, f, g = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(f), mod, b"vecadd")
        check("cuModuleGetFunction", ctypes.byref(g), mod, b"spin")
        n = ctypes.c_int()
        for step in range(3):
            for fn in (f, g):
                check("cuOccupancyMaxActiveBlocksPerMultiprocessor", ctypes.byref(n), fn, 128, ctypes.c_size_t(0))
            check("cuFuncSetAttribute", f, 9, 10 + step)   # PREFERRED_SHARED_MEMORY_CARVEOUT
        print("BLOCKS", n.value)
        """, RGPU_CLIENT_STATS=str(tmp_path / "client"))
    assert "BLOCKS 16" in done.stdout, done.stdout + done.stderr
    ops = _profile(tmp_path)
    assert ops["cuOccupancyMaxActiveBlocksPerMultiprocessor"].sync_calls == 3 + 1   # f after each set, g once
    assert ops["rgpuSetAttribute"].async_calls == 3

def test_the_caches_grow_instead_of_forgetting(native_libs: build.Libraries, emulated: Server, tmp_path: Path) -> None:
    # 10,000 distinct occupancy questions (more than the first table holds): each travels once.
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(fn), mod, b"vecadd")
        n = ctypes.c_int()
        for round_ in range(2):
            for smem in range(10000):
                check("cuOccupancyMaxActiveBlocksPerMultiprocessor", ctypes.byref(n), fn, 128, ctypes.c_size_t(smem))
        print("BLOCKS", n.value)
        """, timeout=180, RGPU_CLIENT_STATS=str(tmp_path / "client"))
    assert "BLOCKS 16" in done.stdout, done.stdout + done.stderr
    assert _profile(tmp_path)["cuOccupancyMaxActiveBlocksPerMultiprocessor"].sync_calls == 10000
