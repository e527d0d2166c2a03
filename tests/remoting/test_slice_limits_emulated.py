"""A slice's memory limit holds on every path (emulated GPU, real session server, rgpu's libcuda):
pitched allocations count the pitch, every session opened with one token shares one budget, each
session's context is charged up front and shown in cuMemGetInfo, and a worker's host memory stays
bounded after huge copies and frames."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from rgpu.remoting.datapath.worker.frames import WORKER_MAX_FRAME
from rgpu.remoting.native import build
from tests.remoting.conftest import PY, Server, client_env, run_client

HERE = Path(__file__).parent
MiB = 1 << 20
GiB = 1 << 30
OUT_OF_MEMORY = 2

PRELUDE = f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ctcuda import *\nimport ctypes\n"


def py_client(libs: build.Libraries, slices: str, code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_client(libs, slices, [PY, "-c", PRELUDE + textwrap.dedent(code)], timeout=timeout)


def start_client(libs: build.Libraries, slices: str, code: str) -> subprocess.Popen[str]:
    """A client that holds its session until a line arrives on its stdin."""
    return subprocess.Popen([PY, "-c", PRELUDE + textwrap.dedent(code)], env=client_env(libs, slices),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_pitch_beyond_the_slice_is_refused(native_libs: build.Libraries, emulated: Server) -> None:
    # A 1-byte-wide, 16 Mi-row request: width x height is 16 MiB, but the GPU reserves pitch x
    # height (8 GiB at a 512-byte pitch), far beyond a 1 GiB slice.
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), """
        setup()
        ptr, pitch = ctypes.c_uint64(), ctypes.c_size_t()
        r = lib.cuMemAllocPitch_v2(ctypes.byref(ptr), ctypes.byref(pitch), ctypes.c_size_t(1), ctypes.c_size_t(16 << 20), 4)
        print("HUGE", r)
        r = lib.cuMemAllocPitch_v2(ctypes.byref(ptr), ctypes.byref(pitch), ctypes.c_size_t(1), ctypes.c_size_t(1024), 4)
        print("SMALL", r, pitch.value)
        free, total = mem_info()
        print("INFO", free, total)
        """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"HUGE {OUT_OF_MEMORY}" in done.stdout, done.stdout + done.stderr
    assert ("cuMemAllocPitch (1 B wide x 16777216 rows at a pitch of at least 512 B): allocation of 8.0 GiB refused "
            "(the slice's memory limit is 1.0 GiB, shared by all of its sessions") in done.stderr, done.stderr
    # What fits is accounted at the pitch the GPU chose.
    assert "SMALL 0 512" in done.stdout, done.stdout
    assert f"INFO {GiB - 512 * 1024} {GiB}" in done.stdout, done.stdout


def test_many_sessions_with_one_token_share_one_budget(native_libs: build.Libraries, emulated: Server) -> None:
    token = emulated.token(memory_limit=GiB)
    slices = emulated.slices(token)
    # Four sessions at once, each asking 300 MiB of a 1 GiB slice: three fit, the fourth is refused.
    code = """
        setup()
        r, ptr = alloc(300 << 20)
        free, total = mem_info()
        print("ALLOC", r, free, flush=True)
        sys.stdin.readline()
        """
    clients = [start_client(native_libs, slices, code) for _ in range(4)]
    try:
        results = []
        for c in clients:
            assert c.stdout is not None
            line = c.stdout.readline()
            assert line.startswith("ALLOC"), line + (c.stderr.read() if c.stderr else "")
            results.append(int(line.split()[1]))
        assert sorted(results) == [0, 0, 0, OUT_OF_MEMORY], results
        sessions = emulated.wait_sessions(4)
        assert len(sessions) == 4
        # A fifth session sees what the other four hold.
        done = py_client(native_libs, slices, """
            setup()
            free, total = mem_info()
            print("FREE", free, total)
            r, _ = alloc(200 << 20)
            print("OVER", r)
            r, _ = alloc(100 << 20)
            print("FITS", r)
            """)
        assert f"FREE {GiB - 900 * MiB} {GiB}" in done.stdout, done.stdout + done.stderr
        assert f"OVER {OUT_OF_MEMORY}" in done.stdout and "FITS 0" in done.stdout, done.stdout + done.stderr
        assert "shared by all of its sessions, and 900.0 MiB are in use" in done.stderr, done.stderr
    finally:
        for c in clients:
            c.communicate("\n", timeout=60)
    # Once they are gone, the whole slice is free again.
    done = py_client(native_libs, slices, """
        setup()
        r, _ = alloc(1000 << 20)
        print("ALL", r)
        """)
    assert "ALL 0" in done.stdout, done.stdout + done.stderr


def test_a_killed_session_gives_its_share_back(native_libs: build.Libraries, emulated: Server) -> None:
    slices = emulated.slices(emulated.token(memory_limit=GiB))
    holder = start_client(native_libs, slices, """
        setup()
        r, ptr = alloc(700 << 20)
        print("HELD", r, flush=True)
        sys.stdin.readline()
        """)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().split() == ["HELD", "0"]
        (session,) = emulated.wait_sessions(1)
        done = py_client(native_libs, slices, "setup()\nprint('OVER', alloc(700 << 20)[0])\n")
        assert f"OVER {OUT_OF_MEMORY}" in done.stdout, done.stdout + done.stderr
        os.kill(session["pid"], signal.SIGKILL)   # no chance to remove its usage file
        deadline = time.monotonic() + 10
        while Path(f"/proc/{session['pid']}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        done = py_client(native_libs, slices, "setup()\nprint('FITS', alloc(900 << 20)[0])\n")
        assert "FITS 0" in done.stdout, done.stdout + done.stderr
    finally:
        holder.kill()
        holder.communicate(timeout=60)


def test_context_reservation_is_charged_and_shown(native_libs: build.Libraries, emulated: Server,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_SESSION_CONTEXT_RESERVE", "100MiB")   # read by each worker the dispatcher starts
    token = emulated.token(memory_limit=GiB)
    # One slice: its session's context is charged.
    done = py_client(native_libs, emulated.slices(token), """
        setup(0)
        print("ONE", *mem_info())
        r, _ = alloc(950 << 20)
        print("TOO_MUCH", r)
        """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"ONE {GiB - 100 * MiB} {GiB}" in done.stdout, done.stdout + done.stderr
    assert f"TOO_MUCH {OUT_OF_MEMORY}" in done.stdout, done.stdout
    assert "100.0 MiB of them this session's context" in done.stderr, done.stderr
    # The token twice in one process: two sessions (opened at cuInit), two contexts charged.
    done = py_client(native_libs, emulated.slices(token, token), """
        setup(1)
        print("TWO", *mem_info())
        """)
    assert f"TWO {GiB - 200 * MiB} {GiB}" in done.stdout, done.stdout + done.stderr
    # A slice too small for one more context refuses the session with a clear message.
    small = emulated.token(memory_limit=250 * MiB)
    done = py_client(native_libs, emulated.slices(small, small), """
        setup(1)
        print("TWO OPEN", *mem_info(), flush=True)
        """)
    assert f"TWO OPEN {50 * MiB} {250 * MiB}" in done.stdout, done.stdout + done.stderr
    done = py_client(native_libs, emulated.slices(small, small, small), """
        setup(0)
        print("THREE OPEN", flush=True)
        """)
    assert "THREE OPEN" not in done.stdout, done.stdout
    assert ("session refused (each session's CUDA context takes 100.0 MiB of the slice's 250.0 MiB, and the slice's "
            "other sessions hold 200.0 MiB") in done.stderr, done.stderr


def elf_image(size: int) -> str:
    """Python source for a `size`-byte 64-bit ELF image (one empty section header at its end),
    so the client sends it whole in one module-load frame."""
    return textwrap.dedent(f"""
        import struct
        size = {size}
        image = ctypes.create_string_buffer(size)
        header = bytearray(64)
        header[0:6] = b"\\x7fELF\\x02\\x01"   # 64-bit, little-endian, as a cubin
        struct.pack_into("<Q", header, 0x28, size - 64)       # e_shoff
        struct.pack_into("<HHH", header, 0x3A, 64, 1, 0)      # e_shentsize, e_shnum, e_shstrndx
        ctypes.memmove(image, bytes(header), 64)
        """)


def test_worker_host_memory_stays_bounded(native_libs: build.Libraries, emulated: Server) -> None:
    """A 512 MiB copy in and out, a module image just under the worker's frame limit and one above
    it: the worker's resident memory afterwards stays within 32 MiB of where it started, and the
    frame above the limit is refused with a clear error while the session goes on."""
    below, above = WORKER_MAX_FRAME - MiB, WORKER_MAX_FRAME + 16 * MiB
    code = textwrap.dedent("""
        setup()
        print("STEP", flush=True); sys.stdin.readline()
        size = 512 << 20
        r, ptr = alloc(size)
        assert r == 0, r
        host = ctypes.create_string_buffer(size)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(ptr), host, ctypes.c_size_t(size))
        check("cuMemcpyDtoH_v2", host, ctypes.c_uint64(ptr), ctypes.c_size_t(size))
        check("cuMemFree_v2", ctypes.c_uint64(ptr))
        del host
        print("STEP", flush=True); sys.stdin.readline()
    """) + elf_image(below) + textwrap.dedent("""
        module = ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(module), image)
        check("cuModuleUnload", module)
        del image
        print("STEP", flush=True); sys.stdin.readline()
    """) + elf_image(above) + textwrap.dedent("""
        print("LOAD", lib.cuModuleLoadData(ctypes.byref(module), image), flush=True)
        del image
        r, ptr = alloc(1 << 20)
        print("AFTER", r, flush=True)
        print("STEP", flush=True); sys.stdin.readline()
        """)
    client = start_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), code)
    assert client.stdout is not None and client.stdin is not None
    try:
        def step() -> str:
            out = ""
            while True:
                line = client.stdout.readline()
                if not line:
                    raise AssertionError(out + (client.stderr.read() if client.stderr else ""))
                if line.startswith("STEP"):
                    return out
                out += line

        step()
        pid = emulated.wait_sessions(1)[0]["pid"]
        time.sleep(0.2)
        baseline = rss_bytes(pid)
        measured = []
        outputs = []
        for _ in range(3):
            client.stdin.write("\n")
            client.stdin.flush()
            outputs.append(step())
            measured.append(rss_bytes(pid))
        print("WORKER RSS MiB", baseline >> 20, [m >> 20 for m in measured])
        assert "LOAD 2" in outputs[2] and "AFTER 0" in outputs[2], outputs
        assert all(m <= baseline + 32 * MiB for m in measured), (baseline, measured)
    finally:
        _, err = client.communicate("\n", timeout=60)
    assert f"rgpu: worker: a request of {above // MiB}.0 MiB refused (a worker takes frames of at most {WORKER_MAX_FRAME // MiB}.0 MiB into memory" in err, err


IMAGES = HERE / "data" / "module_images"


def test_module_variables_count_against_the_slice(native_libs: build.Libraries, emulated: Server) -> None:
    # globals.cu (compiled by nvcc, zstd-compressed fatbin) declares a 1 GiB __device__ array: in a
    # 1 GiB slice its load is refused before the driver reserves it. A PTX module with a 256 MiB
    # array fits, shows in cuMemGetInfo, and its unload gives the memory back.
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), f"""
        setup()
        module = ctypes.c_void_p()
        image = open({str(IMAGES / "globals.zstd.fatbin")!r}, "rb").read()
        print("BIG", lib.cuModuleLoadData(ctypes.byref(module), image))
        ptx = b".version 8.8\\n.target sm_90\\n.address_size 64\\n.global .align 1 .b8 buffer[268435456];\\n\\0"
        check("cuModuleLoadData", ctypes.byref(module), ptx)
        free, total = mem_info()
        print("LOADED", free, total)
        r, _ = alloc(800 << 20)
        print("OVER", r)
        check("cuModuleUnload", module)
        print("UNLOADED", mem_info()[0])
        r, _ = alloc(800 << 20)
        print("FITS", r)
        """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"BIG {OUT_OF_MEMORY}" in done.stdout, done.stdout + done.stderr
    assert "rgpu: worker: cuModuleLoadData (the module's __device__ and __constant__ variables take 1.0 GiB): " \
           "allocation of 1.0 GiB refused (the slice's memory limit is 1.0 GiB" in done.stderr, done.stderr
    assert f"LOADED {GiB - 256 * MiB} {GiB}" in done.stdout, done.stdout
    assert f"OVER {OUT_OF_MEMORY}" in done.stdout, done.stdout
    assert f"UNLOADED {GiB}" in done.stdout and "FITS 0" in done.stdout, done.stdout + done.stderr


def test_a_module_whose_variables_cannot_be_counted_is_refused(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), """
        setup()
        module = ctypes.c_void_p()
        cubin = b"\\x7fELF\\x02\\x02" + bytes(58)   # big-endian: no cubin is
        print("LOAD", lib.cuModuleLoadData(ctypes.byref(module), cubin))
        r, _ = alloc(1 << 20)
        print("AFTER", r)
        """)
    assert "LOAD 200" in done.stdout and "AFTER 0" in done.stdout, done.stdout + done.stderr   # INVALID_IMAGE
    assert "rgpu: worker: cuModuleLoadData refused: the memory its variables take cannot be counted" in done.stderr


POOL_PRELUDE = """
    setup()
    pool = ctypes.c_void_p()
    check("cuDeviceGetDefaultMemPool", ctypes.byref(pool), 0)

    def alloc_async(size):
        ptr = ctypes.c_uint64()
        return lib.cuMemAllocAsync(ctypes.byref(ptr), ctypes.c_size_t(size), None), ptr.value
    """


def test_memory_a_stream_ordered_pool_keeps_counts_against_the_slice(native_libs: build.Libraries,
                                                                     emulated: Server) -> None:
    # With the release threshold raised, memory freed with cuMemFreeAsync stays in the pool: it is
    # still the slice's, so a plain allocation of the same size no longer fits, and cuMemGetInfo
    # says so. Async allocations reuse it; trimming the pool gives it back.
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), POOL_PRELUDE + """
    check("cuMemPoolSetAttribute", pool, 4, ctypes.byref(ctypes.c_uint64(2**64 - 1)))
    r, ptr = alloc_async(600 << 20)
    assert r == 0, r
    check("cuMemFreeAsync", ctypes.c_uint64(ptr), None)
    check("cuStreamSynchronize", None)
    print("KEPT", mem_info()[0])
    r, _ = alloc(600 << 20)
    print("PLAIN", r)
    r, ptr = alloc_async(600 << 20)
    print("REUSED", r)
    check("cuMemFreeAsync", ctypes.c_uint64(ptr), None)
    check("cuMemPoolTrimTo", pool, ctypes.c_size_t(0))
    print("TRIMMED", mem_info()[0])
    r, _ = alloc(600 << 20)
    print("PLAIN", r)
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"KEPT {GiB - 600 * MiB}" in done.stdout, done.stdout + done.stderr
    assert f"PLAIN {OUT_OF_MEMORY}" in done.stdout and "REUSED 0" in done.stdout, done.stdout + done.stderr
    assert "600.0 MiB kept by the stream-ordered memory pool after cuMemFreeAsync" in done.stderr, done.stderr
    assert f"TRIMMED {GiB}" in done.stdout and "PLAIN 0" in done.stdout, done.stdout + done.stderr


def test_a_pool_that_keeps_nothing_gives_freed_memory_back(native_libs: build.Libraries, emulated: Server) -> None:
    # The default release threshold (0): what cuMemFreeAsync frees is the slice's again.
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), POOL_PRELUDE + """
    r, ptr = alloc_async(600 << 20)
    assert r == 0, r
    check("cuMemFreeAsync", ctypes.c_uint64(ptr), None)
    check("cuStreamSynchronize", None)
    r, _ = alloc(600 << 20)
    print("PLAIN", r, mem_info()[0])
    """)
    assert f"PLAIN 0 {GiB - 600 * MiB}" in done.stdout, done.stdout + done.stderr


def test_stack_and_heap_limits_count_against_the_slice(native_libs: build.Libraries, emulated: Server) -> None:
    # The driver reserves the stack for every thread the GPU can hold (132 SMs x 2,048 on the
    # emulated H100, as on a real one): 8 KiB per thread is 1.8 GiB, beyond a 1 GiB slice; 2 KiB
    # (264 MiB more than the default 1 KiB) fits. A 2 GiB malloc heap does not fit, 512 MiB does.
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), """
        setup()
        print("STACK8K", lib.cuCtxSetLimit(0, ctypes.c_size_t(8192)))
        print("STACK2K", lib.cuCtxSetLimit(0, ctypes.c_size_t(2048)), mem_info()[0])
        print("HEAP2G", lib.cuCtxSetLimit(2, ctypes.c_size_t(2 << 30)))
        print("HEAP512M", lib.cuCtxSetLimit(2, ctypes.c_size_t(512 << 20)), mem_info()[0])
        print("HEAP8M", lib.cuCtxSetLimit(2, ctypes.c_size_t(8 << 20)), mem_info()[0])
        """)
    threads = 132 * 2048
    assert f"STACK8K {OUT_OF_MEMORY}" in done.stdout, done.stdout + done.stderr
    assert "cuCtxSetLimit(CU_LIMIT_STACK_SIZE): 8.0 KiB of local memory per thread, which the GPU reserves for each " \
           "of the 270336 threads it can hold resident: allocation of 1.8 GiB refused" in done.stderr, done.stderr
    stack = 1024 * threads
    assert f"STACK2K 0 {GiB - stack}" in done.stdout, done.stdout + done.stderr
    assert f"HEAP2G {OUT_OF_MEMORY}" in done.stdout, done.stdout + done.stderr
    assert f"HEAP512M 0 {GiB - stack - 504 * MiB}" in done.stdout, done.stdout + done.stderr
    assert f"HEAP8M 0 {GiB - stack}" in done.stdout, done.stdout + done.stderr


LOCAL_ARRAYS_PTX = """.version 8.8
.target sm_90
.address_size 64
.visible .entry small_local(.param .u64 out)
{
    .local .align 4 .b8 __local_depot0[2048];
    ret;
}
.visible .entry big_local(.param .u64 out)
{
    .local .align 4 .b8 __local_depot1[16384];
    ret;
}
"""


def test_kernel_local_memory_counts_at_its_first_launch(native_libs: build.Libraries, emulated: Server) -> None:
    # A kernel with 16 KiB of local memory per thread makes the driver reserve 16 KiB for each of
    # the GPU's 270,336 resident threads (4.15 GB measured on an H100): in a 1 GiB slice that
    # launch is refused (reported at the next synchronising call) and nothing runs; one with
    # 2 KiB fits and is charged once, at its first launch.
    image = LOCAL_ARRAYS_PTX.encode() + bytes(1)
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), f"""
        setup()
        module = ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(module), {image!r})
        def launch(name):
            fn = ctypes.c_void_p()
            check("cuModuleGetFunction", ctypes.byref(fn), module, name)
            out = ctypes.c_uint64(0)
            args = (ctypes.c_void_p * 1)(ctypes.addressof(out))
            lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, args, None)
            return lib.cuCtxSynchronize()
        print("BIG", launch(b"big_local"))
        print("SMALL", launch(b"small_local"), mem_info()[0])
        print("AGAIN", launch(b"small_local"), mem_info()[0])
        """)
    charged = (2048 - 1024) * 132 * 2048
    assert f"BIG {OUT_OF_MEMORY}" in done.stdout, done.stdout + done.stderr
    assert "kernel launch: 16.0 KiB of local memory per thread, which the GPU reserves for each of the 270336 " \
           "threads it can hold resident: allocation of 3.9 GiB refused" in done.stderr, done.stderr
    # (The emulated device runs no kernels: it answers the launch itself with NOT_SUPPORTED, 801,
    # after the worker charged what a real driver would have reserved.)
    assert f"SMALL 801 {GiB - charged}" in done.stdout and f"AGAIN 801 {GiB - charged}" in done.stdout, \
        done.stdout + done.stderr


def test_a_kernel_graph_node_counts_its_local_memory_as_a_launch_does(native_libs: build.Libraries,
                                                                      emulated: Server) -> None:
    # A graph's kernel node launches its kernel whenever the graph does: the worker charges the
    # kernel's local memory when the node is added, and refuses the node when it cannot fit.
    image = LOCAL_ARRAYS_PTX.encode() + bytes(1)
    done = py_client(native_libs, emulated.slices(emulated.token(memory_limit=GiB)), f"""
        setup()
        module = ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(module), {image!r})
        class KernelNodeParams(ctypes.Structure):
            _fields_ = [("func", ctypes.c_void_p)] + [(n, ctypes.c_uint) for n in
                        ("gx", "gy", "gz", "bx", "by", "bz", "shmem")] + [("params", ctypes.c_void_p), ("extra", ctypes.c_void_p)]
        graph = ctypes.c_void_p()
        check("cuGraphCreate", ctypes.byref(graph), 0)
        out = ctypes.c_uint64(0)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(out))
        def add(name):
            fn = ctypes.c_void_p()
            check("cuModuleGetFunction", ctypes.byref(fn), module, name)
            p = KernelNodeParams(fn, 1, 1, 1, 32, 1, 1, 0, ctypes.cast(args, ctypes.c_void_p), None)
            node = ctypes.c_void_p()
            return lib.cuGraphAddKernelNode(ctypes.byref(node), graph, None, ctypes.c_size_t(0), ctypes.byref(p))
        print("BIG", add(b"big_local"))
        print("SMALL", add(b"small_local"), mem_info()[0])
        """)
    charged = (2048 - 1024) * 132 * 2048
    assert f"BIG {OUT_OF_MEMORY}" in done.stdout, done.stdout + done.stderr
    assert f"SMALL 0 {GiB - charged}" in done.stdout, done.stdout + done.stderr


def test_an_emulated_allocation_the_host_cannot_hold_is_out_of_memory_in_one_line() -> None:
    """The emulated GPU keeps its "device" memory in the worker's host RAM: a size the host cannot
    hold is CUDA_ERROR_OUT_OF_MEMORY with a line saying why, not "internal error ... please report
    it" (issue 29; 2**62 bytes fails on any host)."""
    from rgpu.remoting.datapath.backends.base import OUT_OF_MEMORY, CudaError
    from rgpu.remoting.datapath.backends.emulated_objects import device_bytes

    with pytest.raises(CudaError) as refused:
        device_bytes(1 << 62)
    assert refused.value.code == OUT_OF_MEMORY
    assert "keeps its device memory in this host's RAM" in refused.value.message
    assert len(device_bytes(4096)) == 4096


def test_making_the_current_memory_pool_current_again_succeeds_and_any_other_pool_is_refused(
        native_libs: build.Libraries, emulated: Server) -> None:
    """CuPy's MemoryAsyncPool starts with cudaDeviceSetMemPool(device, cudaDeviceGetMemPool(device)):
    18 of CuPy's TestMemoryAsyncPool cases failed with cudaErrorNotSupported through rgpu on an H200
    (2026-11-28). rgpu creates no pool, so the current pool is the default one for good."""
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        setup()
        pool, default = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuDeviceGetMemPool", ctypes.byref(pool), 0)
        check("cuDeviceGetDefaultMemPool", ctypes.byref(default), 0)
        print("SAME", pool.value == default.value)
        print("SET", lib.cuDeviceSetMemPool(0, pool), lib.cuDeviceSetMemPool(0, default))
        print("OTHER", lib.cuDeviceSetMemPool(0, ctypes.c_void_p(pool.value + 64)))
        print("NULL", lib.cuDeviceSetMemPool(0, None))
        ptr = ctypes.c_uint64()
        check("cuMemAllocAsync", ctypes.byref(ptr), ctypes.c_size_t(4096), None)
        check("cuMemFreeAsync", ptr, None)
        check("cuStreamSynchronize", None)
        print("ALLOC OK")
        """)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, out + err
    assert "SAME True" in out and "SET 0 0" in out and "ALLOC OK" in out, out + err
    assert "OTHER 801" in out and "NULL 1" in out, out + err
    assert "cuDeviceSetMemPool: pool" in err and "not device 0's current pool" in err, err
