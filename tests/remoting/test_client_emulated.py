"""The native client library end to end against a real session server with an emulated GPU:
a C driver-API program compiled against NVIDIA's cuda.h, cuda-python, limits, errors, crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import (EMULATED_GPU, EMULATED_GPU_2, EXAMPLES, PY, Server, client_env, run_client,
                                     start_server)
from tests.daemons import wait_for
from tests.remoting.client_helpers import HERE, py_client

GiB = 1 << 30


def test_c_driver_api_program_runs_against_an_emulated_worker(native_libs: build.Libraries, demo_binary: Path,
                                                              emulated: Server) -> None:
    slices = emulated.slices(emulated.token(memory_limit=GiB))
    done = run_client(native_libs, slices, [str(demo_binary), str(EXAMPLES / "vecadd.ptx"), "expect-refused", str(GiB)])
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0
    # Clear messages for what the worker refused, on the application's stderr.
    assert "kernel launch refused" in done.stderr
    assert "allocation of 1.1 GiB refused (the slice's memory limit is 1.0 GiB" in done.stderr
    assert "cuGraphAddExternalSemaphoresSignalNode is not remoted" in done.stderr
    # Only rgpu's libcuda is mapped, and no /dev/nvidia* is open.
    maps = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("MAP ")]
    assert maps and all(path.startswith(str(native_libs.folder)) for path in maps), maps
    assert "OPEN /dev/nvidia" not in done.stdout


@pytest.mark.parametrize("image", ["vecadd.sm_90.cubin", "vecadd.fatbin"])
def test_module_size_is_read_from_cubin_and_fatbin_headers(native_libs: build.Libraries, emulated: Server,
                                                           image: str) -> None:
    data = (EXAMPLES / image).read_bytes()
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        data = open({str(EXAMPLES / image)!r}, "rb").read()
        mod = ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), data)
        """, RGPU_WORKER_LOG_LEVEL="DEBUG")
    assert done.returncode == 0, done.stdout + done.stderr
    # The worker rejects a short or long image (its header-derived size is checked there too).
    assert len(data) > 1000


def test_launch_packs_parameters_with_the_reported_layout(native_libs: build.Libraries, emulated: Server) -> None:
    # mixed(char, struct{double,int}, short, double*): offsets 0, 8, 24, 32 -> 40 bytes. The emulated
    # worker checks the byte count before refusing the launch, so a wrong layout shows as
    # CUDA_ERROR_INVALID_VALUE rather than CUDA_ERROR_NOT_SUPPORTED.
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(fn), mod, b"mixed")
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        layout = []
        i = 0
        while lib.cuFuncGetParamInfo(fn, ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(size)) == 0:
            layout.append((off.value, size.value)); i += 1
        print("LAYOUT", layout)
        c = ctypes.c_char(b"x"); pair = (ctypes.c_char * 16)(); s = ctypes.c_short(3); out = ctypes.c_uint64(0)
        params = (ctypes.c_void_p * 4)(ctypes.addressof(c), ctypes.addressof(pair), ctypes.addressof(s), ctypes.addressof(out))
        print("LAUNCH", lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, params, None))
        print("SYNC", lib.cuCtxSynchronize())
        print("AGAIN", lib.cuCtxSynchronize())
        """)
    assert "LAYOUT [(0, 1), (8, 16), (24, 2), (32, 8)]" in done.stdout, done.stdout + done.stderr
    assert "LAUNCH 0" in done.stdout
    assert "SYNC 801" in done.stdout          # CUDA_ERROR_NOT_SUPPORTED, at the next sync call
    assert "AGAIN 0" in done.stdout           # reported once; the application goes on


def test_memory_limit_is_exact_and_the_application_continues(native_libs: build.Libraries, emulated: Server) -> None:
    limit = 64 << 20
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=limit)), f"""
        setup()
        print("INFO", mem_info())
        r1, a = alloc({limit} - 4096)
        r2, b = alloc(4096)
        r3, c = alloc(1)
        print("ALLOCS", r1, r2, r3)
        print("FULL", mem_info())
        check("cuMemFree_v2", ctypes.c_uint64(b))
        r4, d = alloc(4096)
        print("AFTER_FREE", r4)
        """)
    assert f"INFO ({limit}, {limit})" in done.stdout, done.stdout + done.stderr
    assert "ALLOCS 0 0 2" in done.stdout      # the byte after the limit is CUDA_ERROR_OUT_OF_MEMORY
    assert f"FULL (0, {limit})" in done.stdout
    assert "AFTER_FREE 0" in done.stdout
    assert "allocation of 1 B refused" in done.stderr


def test_two_sessions_on_one_gpu_are_each_held_to_their_slice(native_libs: build.Libraries, emulated: Server) -> None:
    small, large = 32 << 20, 96 << 20
    code = """
        setup()
        free, total = mem_info()
        r, p = alloc(total)
        r2, q = alloc(1)
        print("SLICE", total, r, r2)
        """
    a = subprocess.Popen([PY, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ctcuda import *\nimport ctypes\n" + textwrap.dedent(code)],
                         env=client_env(native_libs, emulated.slices(emulated.token(memory_limit=small))),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b = py_client(native_libs, emulated.slices(emulated.token(memory_limit=large)), code)
    out_a, _ = a.communicate(timeout=60)
    assert f"SLICE {small} 0 2" in out_a
    assert f"SLICE {large} 0 2" in b.stdout


def test_bad_token_fails_cuinit_with_a_clear_line(native_libs: build.Libraries, emulated: Server) -> None:
    token = emulated.token()
    bad = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    done = py_client(native_libs, emulated.slices(bad), """
        print("INIT", lib.cuInit(0))
        n = ctypes.c_int(-1)
        print("COUNT", lib.cuDeviceGetCount(ctypes.byref(n)))
        """)
    assert "INIT 46" in done.stdout           # CUDA_ERROR_DEVICE_UNAVAILABLE
    assert "rgpu: token: lease token refused (bad signature" in done.stderr
    assert emulated.server.status()["refused"] >= 1


def test_token_for_another_server_is_refused(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token(server="10.0.0.9:55001")), 'print("INIT", lib.cuInit(0))')
    assert "INIT 46" in done.stdout
    assert f"issued for dispatcher 10.0.0.9:55001, not {emulated.address}" in done.stderr


def test_no_slices_gives_no_device(native_libs: build.Libraries) -> None:
    done = py_client(native_libs, "", 'print("INIT", lib.cuInit(0))')
    assert "INIT 100" in done.stdout          # CUDA_ERROR_NO_DEVICE
    assert "RGPU_SLICES is not set; run the application under flexrun" in done.stderr


def test_unreachable_server(native_libs: build.Libraries, emulated: Server) -> None:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    done = py_client(native_libs, f"127.0.0.1:{port},{emulated.token()}", 'print("INIT", lib.cuInit(0))')
    assert "INIT 46" in done.stdout
    assert f"cannot reach GPU server 127.0.0.1:{port}" in done.stderr
    assert "data lane" not in done.stderr, done.stderr   # its lanes, dialled first, failed too: one line says why


def test_calls_before_cuinit_are_not_initialized(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        n = ctypes.c_int(-1)
        print("COUNT", lib.cuDeviceGetCount(ctypes.byref(n)))
        v = ctypes.c_int(0)
        print("VERSION", lib.cuDriverGetVersion(ctypes.byref(v)), v.value)
        """)
    assert "COUNT 3" in done.stdout           # CUDA_ERROR_NOT_INITIALIZED
    assert "VERSION 0 13000" in done.stdout


def _kill_the_worker_of_a_waiting_client(native_libs: build.Libraries, emulated: Server, tmp_path: Path,
                                         job_key: str, sig: int) -> tuple[str, str]:
    """A client that allocates, then waits; its worker gets `sig`; the client then copies and
    synchronises. The client's (stdout, stderr)."""
    go = tmp_path / "go"
    victim = subprocess.Popen(
        [PY, "-c", f"import sys, os, time; sys.path.insert(0, {str(HERE)!r})\nfrom ctcuda import *\nimport ctypes\n" + textwrap.dedent(f"""
            setup()
            r, p = alloc(1 << 20)
            print("READY", flush=True)
            while not os.path.exists({str(go)!r}):
                time.sleep(0.05)
            buf = ctypes.create_string_buffer(16)
            print("COPY", lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(p), ctypes.c_size_t(16)), flush=True)
            print("AGAIN", lib.cuCtxSynchronize(), flush=True)
            """)],
        env=client_env(native_libs, emulated.slices(emulated.token(job_key=job_key))),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert victim.stdout is not None
    assert victim.stdout.readline().strip() == "READY"
    pid = next(s["pid"] for s in emulated.wait_sessions(1) if s["job_key"] == job_key)
    os.kill(pid, sig)
    go.write_text("")
    out, err = victim.communicate(timeout=30)
    assert "COPY 46" in out and "AGAIN 46" in out, out + err
    assert "lost the session with GPU server" in err and "the worker serving this slice ended" in err
    return out, err


def _ended(emulated: Server, job_key: str) -> str:
    """How the session of `job_key` ended, as the session server recorded it."""
    def hows() -> list[str]:
        return [e["how"] for e in emulated.server.status()["recently_ended"] if e["job_key"] == job_key]

    wait_for(lambda: bool(hows()), 10, f"the session of {job_key} among those ended")
    return hows()[0]


def test_worker_crash_ends_only_its_session_with_a_clear_error(native_libs: build.Libraries, emulated: Server,
                                                               tmp_path: Path) -> None:
    survivor_token = emulated.token(job_key="survivor")
    _kill_the_worker_of_a_waiting_client(native_libs, emulated, tmp_path, "victim", signal.SIGKILL)
    # Another session on the same server is unaffected.
    done = py_client(native_libs, emulated.slices(survivor_token), """
        setup()
        r, p = alloc(1 << 20)
        print("ALLOC", r)
        """)
    assert "ALLOC 0" in done.stdout, done.stderr
    assert "signal 9" in _ended(emulated, "victim")


def test_a_worker_ended_by_a_fatal_signal_leaves_its_threads_stacks_in_the_log(
        native_libs: build.Libraries, emulated: Server, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A worker that faults (SIGSEGV in the driver, say) writes each thread's Python stack to the
    dispatcher's log (its stderr, which the worker shares) before it dies; the application gets the
    same clear error as for any ended worker."""
    _kill_the_worker_of_a_waiting_client(native_libs, emulated, tmp_path, "faulting", signal.SIGSEGV)
    log = ""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "run_session" not in log:
        log += capfd.readouterr().err
        time.sleep(0.1)
    assert "Fatal Python error: Segmentation fault" in log, log[-2000:]
    assert "run_session" in log, log[-2000:]    # the stack says where the worker was
    assert "signal 11" in _ended(emulated, "faulting")


def test_session_end_frees_what_it_held(native_libs: build.Libraries, emulated: Server) -> None:
    token = emulated.token(memory_limit=64 << 20, job_key="reuse")
    for _ in range(2):  # the second run would hit the limit if the first run's memory leaked
        done = py_client(native_libs, emulated.slices(token), """
            setup()
            r, p = alloc(60 << 20)
            print("ALLOC", r)
            """)
        assert "ALLOC 0" in done.stdout, done.stderr
    deadline = time.monotonic() + 10
    while emulated.server.status()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert emulated.server.status()["sessions"] == []


def test_two_slices_are_two_devices(native_libs: build.Libraries, emulated: Server) -> None:
    t0 = emulated.token(memory_limit=32 << 20, gpu=emulated.gpus[0])
    t1 = emulated.token(memory_limit=48 << 20, gpu=emulated.gpus[1])
    done = py_client(native_libs, emulated.slices(t0, t1), """
        check("cuInit", 0)
        n = ctypes.c_int()
        check("cuDeviceGetCount", ctypes.byref(n))
        totals = []
        for d in range(n.value):
            size = ctypes.c_size_t()
            check("cuDeviceTotalMem_v2", ctypes.byref(size), d)
            totals.append(size.value)
            ctx = ctypes.c_void_p()
            check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), d)
            check("cuCtxPushCurrent_v2", ctx)
            dev = ctypes.c_int(-1)
            check("cuCtxGetDevice", ctypes.byref(dev))
            print("CTXDEV", d, dev.value)
            check("cuCtxPopCurrent_v2", None)
        print("TOTALS", n.value, totals)
        """)
    assert f"TOTALS 2 [{32 << 20}, {48 << 20}]" in done.stdout, done.stdout + done.stderr
    assert "CTXDEV 0 0" in done.stdout and "CTXDEV 1 1" in done.stdout


def test_fork_child_can_reinitialise(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        import os
        setup()
        pid = os.fork()
        if pid == 0:
            n = ctypes.c_int(-1)
            before = lib.cuDeviceGetCount(ctypes.byref(n))
            r = lib.cuInit(0)
            lib.cuDeviceGetCount(ctypes.byref(n))
            print("CHILD", before, r, n.value, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        r, p = alloc(4096)
        print("PARENT", r)
        """)
    assert "CHILD 3 0 1" in done.stdout, done.stdout + done.stderr
    assert "PARENT 0" in done.stdout


def test_cuda_bindings_through_the_client(native_libs: build.Libraries, emulated: Server) -> None:
    pytest.importorskip("cuda.bindings.driver")
    pytest.importorskip("numpy")
    done = run_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), [PY, "-c", textwrap.dedent("""
        import numpy as np
        from cuda.bindings import driver as d
        OK = d.CUresult.CUDA_SUCCESS
        assert d.cuInit(0)[0] == OK
        err, dev = d.cuDeviceGet(0)
        err, ctx = d.cuDevicePrimaryCtxRetain(dev)
        assert d.cuCtxSetCurrent(ctx)[0] == OK
        err, free, total = d.cuMemGetInfo()
        print("TOTAL", total)
        err, ptr = d.cuMemAlloc(1 << 20)
        a = np.arange(4096, dtype=np.float32)
        b = np.zeros_like(a)
        assert d.cuMemcpyHtoD(ptr, a.ctypes.data, a.nbytes)[0] == OK
        assert d.cuMemcpyDtoH(b.ctypes.data, ptr, a.nbytes)[0] == OK
        print("EQUAL", bool((a == b).all()))
        err, stream = d.cuStreamCreate(0)
        assert d.cuMemsetD32Async(ptr, 7, 16, stream)[0] == OK
        assert d.cuStreamSynchronize(stream)[0] == OK
        err, kind = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        print("KIND", kind)
        print("NAME", d.cuDeviceGetName(64, dev)[1].split(b"\\0")[0].decode())
        assert d.cuMemFree(ptr)[0] == OK
        """)])
    assert f"TOTAL {GiB}" in done.stdout, done.stdout + done.stderr
    assert "EQUAL True" in done.stdout
    assert "KIND 2" in done.stdout
    assert "NAME NVIDIA H200" in done.stdout


def test_large_copies_are_chunked_and_intact(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), """
        import os
        setup()
        n = 9 * (1 << 20) + 123
        data = os.urandom(n)
        r, p = alloc(n)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(p), data, ctypes.c_size_t(n))
        back = ctypes.create_string_buffer(n)
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(p), ctypes.c_size_t(n))
        print("SAME", back.raw == data)
        """)
    assert "SAME True" in done.stdout, done.stdout + done.stderr


def test_slices_on_two_servers_are_one_two_gpu_machine(native_libs: build.Libraries, emulated: Server) -> None:
    """Slice i is device i, whichever dispatcher serves it; each keeps its own limit."""
    other_server, other_address = start_server("emulated", [EMULATED_GPU_2])
    try:
        other = Server(other_server, other_address, [EMULATED_GPU_2])
        small, large = 64 << 20, 192 << 20
        slices = ";".join([emulated.slices(emulated.token(memory_limit=small)),
                           other.slices(other.token(memory_limit=large))])
        done = py_client(native_libs, slices, """
            check("cuInit", 0)
            n = ctypes.c_int()
            check("cuDeviceGetCount", ctypes.byref(n))
            print("DEVICES", n.value)
            for device in range(n.value):
                setup(device)
                free, total = mem_info()
                r, p = alloc(total // 2)
                free_after, _ = mem_info()
                uuid = (ctypes.c_ubyte * 16)()
                check("cuDeviceGetUuid_v2", uuid, device)
                print("DEVICE", device, total, r, total - free_after, bytes(uuid).hex())
            """)
        assert "DEVICES 2" in done.stdout, done.stdout + done.stderr
        assert f"DEVICE 0 {small} 0 {small // 2} " in done.stdout
        assert f"DEVICE 1 {large} 0 {large // 2} " in done.stdout
        uuids = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("DEVICE ")]
        assert uuids == [EMULATED_GPU.uuid[4:].replace("-", ""), EMULATED_GPU_2.uuid[4:].replace("-", "")]
        assert done.returncode == 0, done.stderr
    finally:
        other_server.stop()
