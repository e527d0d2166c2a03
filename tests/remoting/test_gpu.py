"""Issue 4, item 7: remoting on a real GPU, through flexrun, against a session server on this machine.

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu.py -v -s
(CPU-only CI skips them.) Each application runs in its own process with rgpu's libcuda.so.1 and
libnvidia-ml.so.1 first on LD_LIBRARY_PATH, so it never loads NVIDIA's driver library itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from rgpu.adaptor import AdaptorConf, AdaptorSlice, write_adaptor_conf
from tests.remoting.conftest import EXAMPLES, PY, Server
from tests.remoting.gpu_helpers import GiB, HERE, OUT, flexrun, py, spin_local, spin_program

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("image", ["vecadd.ptx", "vecadd.sm_90.cubin", "vecadd.fatbin"])
def test_driver_api_vector_add(native_libs: build.Libraries, demo_binary: Path, gpu_server: Server,
                               tmp_path: Path, image: str) -> None:
    done = flexrun(native_libs, gpu_server, tmp_path, [str(demo_binary), str(EXAMPLES / image), "expect-launch",
                                                       str(4 * GiB)], name=f"driver-api-{image}")
    assert "DONE 0 failure(s)" in done.stdout
    assert gpu_server.server.status()["launch_path"] == "native"  # the kernels ran through the C launch loop
    maps = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("MAP ")]
    assert maps and all(p.startswith(str(native_libs.folder)) for p in maps), maps
    assert "OPEN /dev/nvidia" not in done.stdout


def test_cuda_python_nvrtc_kernel(native_libs: build.Libraries, gpu_server: Server, tmp_path: Path) -> None:
    done = flexrun(native_libs, gpu_server, tmp_path, py("""
        import ctypes
        import numpy as np
        from cuda.bindings import driver as d, nvrtc
        def ok(res):
            err = res[0]
            assert int(err) == 0, res
            return res[1] if len(res) == 2 else res[1:]
        src = b'''extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
            int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i]; }'''
        ok(d.cuInit(0))
        dev = ok(d.cuDeviceGet(0))
        major = ok(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = ok(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        prog = ok(nvrtc.nvrtcCreateProgram(src, b"saxpy.cu", 0, [], []))
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        r = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert int(r[0]) == 0, r
        size = ok(nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        ok((nvrtc.nvrtcGetCUBIN(prog, cubin)[0], None))
        ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
        ok((d.cuCtxSetCurrent(ctx)[0], None))
        mod = ok(d.cuModuleLoadData(cubin))
        fn = ok(d.cuModuleGetFunction(mod, b"saxpy"))
        n = 1 << 20
        x = np.random.rand(n).astype(np.float32)
        y = np.random.rand(n).astype(np.float32)
        dx = ok(d.cuMemAlloc(x.nbytes)); dy = ok(d.cuMemAlloc(y.nbytes))
        stream = ok(d.cuStreamCreate(0))
        ok((d.cuMemcpyHtoDAsync(dx, x.ctypes.data, x.nbytes, stream)[0], None))
        ok((d.cuMemcpyHtoDAsync(dy, y.ctypes.data, y.nbytes, stream)[0], None))
        args = ((np.float32(2.5), dx, dy, np.int32(n)), (ctypes.c_float, None, None, ctypes.c_int))
        ok((d.cuLaunchKernel(fn, (n + 255) // 256, 1, 1, 256, 1, 1, 0, stream, args, 0)[0], None))
        out = np.empty_like(y)
        ok((d.cuMemcpyDtoHAsync(out.ctypes.data, dy, y.nbytes, stream)[0], None))
        ok((d.cuStreamSynchronize(stream)[0], None))
        print("NVRTC_OK", bool(np.allclose(out, 2.5 * x + y)), flush=True)
        """), name="cuda-python-nvrtc")
    assert "NVRTC_OK True" in done.stdout, done.stderr


def test_numba_kernel(native_libs: build.Libraries, gpu_server: Server, tmp_path: Path) -> None:
    pytest.importorskip("numba")
    done = flexrun(native_libs, gpu_server, tmp_path, py("""
        import numpy as np
        # numba-cuda 0.30 still names np.row_stack, which numpy 2.4 removed: that breaks its
        # import with or without rgpu. Give it the alias it expects.
        np.row_stack = getattr(np, "row_stack", np.vstack)
        from numba import cuda
        @cuda.jit
        def add(a, b, c):
            i = cuda.grid(1)
            if i < c.size:
                c[i] = a[i] + b[i] * 2
        a = np.arange(1 << 20, dtype=np.float32)
        b = np.ones_like(a)
        da, db = cuda.to_device(a), cuda.to_device(b)
        dc = cuda.device_array_like(a)
        add[(a.size + 255) // 256, 256](da, db, dc)
        c = dc.copy_to_host()
        print("NUMBA_OK", bool(np.array_equal(c, a + 2)), cuda.get_current_device().name, flush=True)
        """), name="numba")
    assert "NUMBA_OK True" in done.stdout, done.stderr


def test_rgpu_smi_shows_the_slice(native_libs: build.Libraries, gpu_server: Server, tmp_path: Path) -> None:
    """rgpu's own view, what CPU nodes without NVIDIA's tools get."""
    ours = {"RGPU_SMI": "rgpu"}
    done = flexrun(native_libs, gpu_server, tmp_path, ["nvidia-smi", "--query-gpu=name,memory.total,memory.used",
                                                       "--format=csv,noheader,nounits"], memory=6 * GiB,
                   name="nvidia-smi-query", extra_env=ours)
    assert done.returncode == 0, done.stderr
    name, total, _used = [f.strip() for f in done.stdout.strip().splitlines()[0].split(",")]
    assert name == gpu_server.gpus[0].name and int(total) == 6 * 1024
    full = flexrun(native_libs, gpu_server, tmp_path, ["nvidia-smi"], memory=6 * GiB, name="nvidia-smi",
                   extra_env=ours)
    assert full.returncode == 0 and "6144MiB" in full.stdout and "RGPU-SMI" in full.stdout


def test_nvidias_own_nvidia_smi_binary_shows_the_slice(native_libs: build.Libraries, gpu_server: Server,
                                                       tmp_path: Path) -> None:
    real: dict[str, str] = {}  # the default: NVIDIA's binary, found on PATH, on rgpu's NVML
    done = flexrun(native_libs, gpu_server, tmp_path, ["nvidia-smi", "--query-gpu=name,memory.total,memory.used",
                                                       "--format=csv,noheader,nounits"], memory=6 * GiB,
                   name="real-smi-query", extra_env=real)
    assert done.returncode == 0, done.stdout + done.stderr
    name, total, _used = [f.strip() for f in done.stdout.strip().splitlines()[0].split(",")]
    assert name == gpu_server.gpus[0].name and int(total) == 6 * 1024
    listing = flexrun(native_libs, gpu_server, tmp_path, ["nvidia-smi", "-L"], name="real-smi-list", extra_env=real)
    assert listing.returncode == 0 and gpu_server.gpus[0].uuid in listing.stdout, listing.stdout + listing.stderr
    full = flexrun(native_libs, gpu_server, tmp_path, ["nvidia-smi"], memory=6 * GiB, name="real-smi", extra_env=real)
    assert full.returncode == 0 and "6144MiB" in full.stdout, full.stdout + full.stderr
    assert "NVIDIA-SMI" in full.stdout and "RGPU-SMI" not in full.stdout


def test_out_of_memory_beyond_the_slice_and_the_app_goes_on(native_libs: build.Libraries, gpu_server: Server,
                                                            tmp_path: Path) -> None:
    done = flexrun(native_libs, gpu_server, tmp_path, py("""
        from ctcuda import *
        setup()
        free, total = mem_info()   # free: the slice less this session's context reservation
        r1, a = alloc(free - (256 << 20))
        r2, b = alloc(512 << 20)
        r3, c = alloc(128 << 20)
        print("SLICE", total, r1, r2, r3, flush=True)
        check("cuMemsetD8_v2", ctypes.c_uint64(c), 7, ctypes.c_size_t(128 << 20))
        buf = ctypes.create_string_buffer(16)
        check("cuMemcpyDtoH_v2", buf, ctypes.c_uint64(c), ctypes.c_size_t(16))
        print("AFTER", buf.raw == b"\\x07" * 16, flush=True)
        """), memory=2 * GiB, name="oom")
    assert f"SLICE {2 * GiB} 0 2 0" in done.stdout, done.stderr
    assert "AFTER True" in done.stdout
    assert "refused (the slice's memory limit is 2.0 GiB" in done.stderr


def test_half_slice_runs_at_most_60_percent_of_the_whole_gpu(native_libs: build.Libraries, gpu_server: Server,
                                                             tmp_path: Path) -> None:
    assert gpu_server.server.status()["compute_enforcement"] == "mps", gpu_server.server.status()["mps"]
    iters, launches = 200000, 10
    whole = spin_local(native_libs, iters, launches)
    half = flexrun(native_libs, gpu_server, tmp_path, spin_program(iters, launches), percent=50, name="spin-50")
    full = flexrun(native_libs, gpu_server, tmp_path, spin_program(iters, launches), percent=100, name="spin-100")
    t_half = json.loads(half.stdout.split("SPIN ", 1)[1])["tflops"]
    t_full = json.loads(full.stdout.split("SPIN ", 1)[1])["tflops"]
    result = {"whole_gpu_local_tflops": whole, "slice_100_remote_tflops": t_full, "slice_50_remote_tflops": t_half,
              "ratio_50": t_half / whole, "ratio_100": t_full / whole}
    (OUT / "gpu-compute-share.json").write_text(json.dumps(result, indent=2))
    print("COMPUTE", result)
    assert t_half <= 0.60 * whole


def test_two_sessions_on_one_gpu_each_held_to_its_slice(native_libs: build.Libraries, demo_binary: Path,
                                                        gpu_server: Server, tmp_path: Path) -> None:
    code = py("""
        import time
        from ctcuda import *
        setup()
        free, total = mem_info()
        r1, a = alloc(free - (64 << 20))
        r2, b = alloc(128 << 20)
        time.sleep(2)   # both sessions hold their memory at the same time
        print("HELD", total, r1, r2, flush=True)
        """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env.update({"RGPU_NATIVE_DIR": str(native_libs.folder)})
    procs = []
    for name, memory, percent in (("a", 3 * GiB, 30), ("b", 5 * GiB, 70)):
        conf = write_adaptor_conf(tmp_path / f"{name}.conf", AdaptorConf(job_id=f"job-{name}", user="tester", slices=(
            AdaptorSlice(server=gpu_server.address, gpu_uuid=gpu_server.gpus[0].uuid, gpu_index=0, memory_limit_bytes=memory,
                         compute_percent=percent, token=gpu_server.token(memory_limit=memory, compute_percent=percent)),)))
        procs.append((memory, subprocess.Popen([PY, "-m", "rgpu.remoting.client.flexrun", "-f", str(conf), "--", *code], env=env,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    time.sleep(1.0)
    sessions = gpu_server.server.status()["sessions"]
    outs = [(memory, *p.communicate(timeout=300)) for memory, p in procs]
    (OUT / "gpu-two-sessions.log").write_text(json.dumps({"sessions": sessions, "outputs": outs}, indent=2, default=str))
    for memory, out, err in outs:
        assert f"HELD {memory} 0 2" in out, out + err
    assert sorted(s["compute_percent"] for s in sessions if s["mode"] == "cuda") == [30, 70]


# ---------------------------------------------------------------- issue 13, item 1: the slice's limits on the GPU

def held_client(libs: build.Libraries, server: Server, tmp: Path, code: str, *, tokens: list[str], memory: int,
                name: str) -> subprocess.Popen[str]:
    """flexrun with the given tokens (one slice each); the program holds its sessions until a line
    arrives on its stdin."""
    conf = write_adaptor_conf(tmp / f"{name}.conf", AdaptorConf(job_id=f"job-{name}", user="tester", slices=tuple(
        AdaptorSlice(server=server.address, gpu_uuid=server.gpus[0].uuid, gpu_index=0, memory_limit_bytes=memory,
                     compute_percent=50, token=t) for t in tokens)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env.update({"RGPU_NATIVE_DIR": str(libs.folder), "PYTHONUNBUFFERED": "1"})
    return subprocess.Popen([PY, "-m", "rgpu.remoting.client.flexrun", "-f", str(conf), "--", *py(code)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def gpu_used_bytes() -> int:
    import pynvml
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
    finally:
        pynvml.nvmlShutdown()


def test_pitch_beyond_the_slice_is_refused_on_the_gpu(native_libs: build.Libraries, gpu_server: Server,
                                                      tmp_path: Path) -> None:
    """A 1-byte-wide, 16 Mi-row cuMemAllocPitch (8 GiB on an H100 at its 512-byte pitch) in a 2 GiB
    slice is refused; one that fits is accounted at the pitch the driver chose."""
    done = flexrun(native_libs, gpu_server, tmp_path, py("""
        from ctcuda import *
        setup()
        ptr, pitch = ctypes.c_uint64(), ctypes.c_size_t()
        r = lib.cuMemAllocPitch_v2(ctypes.byref(ptr), ctypes.byref(pitch), ctypes.c_size_t(1), ctypes.c_size_t(16 << 20), 4)
        print("HUGE", r, flush=True)
        before, total = mem_info()
        r = lib.cuMemAllocPitch_v2(ctypes.byref(ptr), ctypes.byref(pitch), ctypes.c_size_t(1), ctypes.c_size_t(1 << 20), 4)
        after, _ = mem_info()
        print("SMALL", r, pitch.value, before - after, flush=True)
        """), memory=2 * GiB, name="pitch")
    assert "HUGE 2" in done.stdout, done.stdout + done.stderr
    assert "cuMemAllocPitch (1 B wide x 16777216 rows at a pitch of at least 512 B)" in done.stderr
    small = done.stdout.split("SMALL ", 1)[1].split()
    assert small[0] == "0" and int(small[2]) == int(small[1]) * (1 << 20), small


def test_sessions_of_one_token_share_the_slice_and_contexts_are_reserved(native_libs: build.Libraries,
                                                                          gpu_server: Server, tmp_path: Path) -> None:
    """Two processes with the same token hold one 4 GiB budget between them; each session's context
    is charged up front (the figure is checked against what the GPU really spent on it)."""
    from rgpu.remoting.datapath.backends.base import CONTEXT_RESERVE_BYTES
    memory = 4 * GiB
    token = gpu_server.token(memory_limit=memory)
    code = """
        from ctcuda import *
        setup()
        free, total = mem_info()
        print("OPEN", free, total, flush=True)
        sys.stdin.readline()
        r, a = alloc(int(sys.argv[1]) if len(sys.argv) > 1 else (2 << 30))
        free, total = mem_info()
        print("ALLOC", r, free, flush=True)
        sys.stdin.readline()
        """
    idle = gpu_used_bytes()
    first = held_client(native_libs, gpu_server, tmp_path, code, tokens=[token], memory=memory, name="share-a")
    second = held_client(native_libs, gpu_server, tmp_path, code, tokens=[token], memory=memory, name="share-b")
    try:
        opened = [p.stdout.readline() for p in (first, second)]   # type: ignore[union-attr]
        with_contexts = gpu_used_bytes()
        for p in (first, second):
            p.stdin.write("\n")   # type: ignore[union-attr]
            p.stdin.flush()        # type: ignore[union-attr]
        allocated = [p.stdout.readline() for p in (first, second)]   # type: ignore[union-attr]
    finally:
        outs = [p.communicate("\n", timeout=120) for p in (first, second)]
    per_context = (with_contexts - idle) / 2
    (OUT / "gpu-slice-budget.json").write_text(json.dumps({
        "opened": opened, "allocated": allocated, "gpu_used_idle": idle, "gpu_used_two_sessions": with_contexts,
        "real_bytes_per_session": per_context, "reserved_bytes_per_session": CONTEXT_RESERVE_BYTES,
        "stderr": [e for _, e in outs]}, indent=2))
    print("BUDGET", opened, allocated, per_context)
    assert all(line.startswith("OPEN") for line in opened), (opened, outs)
    # Both contexts are charged to the one slice, and the charge covers what the GPU really spent.
    # (Whichever session opened second saw both contexts; the processes open in either order, or
    # both after both contexts were charged.)
    first_free, second_free = sorted(int(line.split()[1]) for line in opened)
    assert first_free == memory - 2 * CONTEXT_RESERVE_BYTES, opened
    assert second_free in (memory - CONTEXT_RESERVE_BYTES, memory - 2 * CONTEXT_RESERVE_BYTES), opened
    assert per_context <= CONTEXT_RESERVE_BYTES, per_context
    # 2 GiB each does not fit twice in 4 GiB less two contexts: exactly one is refused.
    codes = sorted(int(line.split()[1]) for line in allocated)
    assert codes == [0, 2], (allocated, outs)


def test_worker_host_memory_stays_bounded_on_the_gpu(native_libs: build.Libraries, gpu_server: Server,
                                                     tmp_path: Path) -> None:
    """After a 1 GiB copy each way and a module image near the frame limit, the worker's resident
    memory is within 64 MiB of where it was when the session had opened."""
    from rgpu.remoting.datapath.worker.frames import WORKER_MAX_FRAME
    code = f"""
        import struct
        from ctcuda import *
        setup()
        print("STEP", flush=True); sys.stdin.readline()
        size = 1 << 30
        r, ptr = alloc(size)
        host = ctypes.create_string_buffer(size)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(ptr), host, ctypes.c_size_t(size))
        check("cuMemcpyDtoH_v2", host, ctypes.c_uint64(ptr), ctypes.c_size_t(size))
        check("cuMemFree_v2", ctypes.c_uint64(ptr))
        del host
        print("STEP", flush=True); sys.stdin.readline()
        size = {WORKER_MAX_FRAME} + (16 << 20)
        image = ctypes.create_string_buffer(size)
        header = bytearray(64)
        header[0:6] = b"\\x7fELF\\x02\\x01"
        struct.pack_into("<Q", header, 0x28, size - 64)
        struct.pack_into("<HHH", header, 0x3A, 64, 1, 0)
        ctypes.memmove(image, bytes(header), 64)
        module = ctypes.c_void_p()
        print("LOAD", lib.cuModuleLoadData(ctypes.byref(module), image), flush=True)
        print("STEP", flush=True); sys.stdin.readline()
        """
    def cuda_pids() -> set[int]:
        return {s["pid"] for s in gpu_server.server.status()["sessions"] if s["mode"] == "cuda"}

    before = cuda_pids()
    client = held_client(native_libs, gpu_server, tmp_path, code, tokens=[gpu_server.token(memory_limit=4 * GiB)],
                         memory=4 * GiB, name="rss")
    assert client.stdout is not None and client.stdin is not None
    seen = []
    try:
        assert client.stdout.readline().startswith("STEP")
        (pid,) = cuda_pids() - before
        rss = []
        for _ in range(2):
            rss.append(int(next(row for row in Path(f"/proc/{pid}/status").read_text().splitlines()
                                if row.startswith("VmRSS:")).split()[1]) * 1024)
            client.stdin.write("\n")
            client.stdin.flush()
            while not (line := client.stdout.readline()).startswith("STEP"):
                assert line, client.stderr.read() if client.stderr else ""
                seen.append(line)
        rss.append(int(next(row for row in Path(f"/proc/{pid}/status").read_text().splitlines()
                            if row.startswith("VmRSS:")).split()[1]) * 1024)
    finally:
        _, err = client.communicate("\n", timeout=120)
    (OUT / "gpu-worker-rss.json").write_text(json.dumps({"rss_bytes": rss, "output": seen, "stderr": err}, indent=2))
    print("RSS", rss)
    assert any(line.startswith("LOAD 2") for line in seen), seen
    assert "a worker takes frames of at most" in err, err
    assert max(rss[1:]) <= rss[0] + 64 * (1 << 20), rss


MODULE_GLOBALS = """
    from ctcuda import *
    setup()
    free0 = mem_info()[0]
    module = ctypes.c_void_p()
    image = open({image!r}, "rb").read()
    r = lib.cuModuleLoadData(ctypes.byref(module), image)
    print("LOAD", r, flush=True)
    if r == 0:
        free1 = mem_info()[0]
        fn = ctypes.c_void_p()
        check("cuModuleGetFunction", ctypes.byref(fn), module, b"touch")
        arg = ctypes.c_int(12345)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
        check("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, None, args, None)
        check("cuCtxSynchronize")
        free2 = mem_info()[0]
        check("cuModuleUnload", module)
        free3 = mem_info()[0]
        print("FREE-DROP", free0 - free1, free0 - free2, free0 - free3, flush=True)
    """


def test_module_variables_count_against_the_slice_on_a_real_gpu(native_libs: build.Libraries, gpu_server: Server,
                                                                tmp_path: Path) -> None:
    """A cubin with a 1 GiB __device__ array (tests/remoting/data/module_images): locally the
    driver takes the GiB at load; through rgpu the load is charged to the slice (cuMemGetInfo
    shows it, unload gives it back), and refused in a slice without room for it."""
    image = str(HERE / "data" / "module_images" / "globals.sm_90.cubin")
    program = py(MODULE_GLOBALS.format(image=image))
    local = subprocess.run(program, capture_output=True, text=True, timeout=120, check=False)
    print("LOCAL", local.stdout, local.stderr[-2000:])
    assert "LOAD 0" in local.stdout, local.stdout + local.stderr
    local_drop = [int(x) for x in local.stdout.split("FREE-DROP ", 1)[1].split()]
    fits = flexrun(native_libs, gpu_server, tmp_path, program, memory=3 * GiB, name="module-globals-fit")
    assert "LOAD 0" in fits.stdout, fits.stdout + fits.stderr
    drop = [int(x) for x in fits.stdout.split("FREE-DROP ", 1)[1].split()]
    refused = flexrun(native_libs, gpu_server, tmp_path, program, memory=GiB + GiB // 2, name="module-globals-refused")
    (OUT / "gpu-module-globals.json").write_text(json.dumps({"local_free_drop": local_drop, "rgpu_free_drop": drop,
                                                            "refused_stderr": refused.stderr[-2000:]}, indent=2))
    # The real driver takes the array at load (rounded to its pages); the first load also grows
    # the context by what stays after the unload (local_drop[2]), which is not the module's.
    assert GiB <= local_drop[0] - local_drop[2] <= GiB + 64 * (1 << 20), local_drop
    # rgpu charges the variables at load, exactly, and gives them back at unload.
    assert GiB < drop[0] == drop[1] <= GiB + 64 * 1024 and drop[2] == 0, drop
    assert "LOAD 2" in refused.stdout, refused.stdout + refused.stderr
    assert "cuModuleLoadData (the module's __device__ and __constant__ variables take 1.0 GiB)" in refused.stderr


POOL_KEEPS = """
    from ctcuda import *
    setup()
    pool = ctypes.c_void_p()
    check("cuDeviceGetDefaultMemPool", ctypes.byref(pool), 0)
    check("cuMemPoolSetAttribute", pool, 4, ctypes.byref(ctypes.c_uint64(2**64 - 1)))
    def alloc_async(size):
        ptr = ctypes.c_uint64()
        return lib.cuMemAllocAsync(ctypes.byref(ptr), ctypes.c_size_t(size), None), ptr.value
    def reserved():
        value = ctypes.c_uint64()
        check("cuMemPoolGetAttribute", pool, 5, ctypes.byref(value))
        return value.value
    r, ptr = alloc_async(1 << 30)
    assert r == 0, r
    check("cuMemFreeAsync", ctypes.c_uint64(ptr), None)
    check("cuStreamSynchronize", None)
    print("KEPT", reserved(), flush=True)
    r, plain = alloc(1 << 30)
    print("PLAIN", r, flush=True)
    if r == 0:
        check("cuMemFree_v2", ctypes.c_uint64(plain))
    r, ptr = alloc_async(1 << 30)
    print("REUSED", r, flush=True)
    check("cuMemFreeAsync", ctypes.c_uint64(ptr), None)
    check("cuStreamSynchronize", None)
    check("cuMemPoolTrimTo", pool, ctypes.c_size_t(0))
    print("TRIMMED", reserved(), flush=True)
    r, plain = alloc(1 << 30)
    print("AFTER-TRIM", r, flush=True)
    """


def test_memory_a_stream_ordered_pool_keeps_counts_on_a_real_gpu(native_libs: build.Libraries, gpu_server: Server,
                                                                 tmp_path: Path) -> None:
    """With the release threshold raised, the driver keeps 1 GiB freed by cuMemFreeAsync (local run:
    RESERVED_MEM_CURRENT); through rgpu in a 2 GiB slice that GiB stays charged, so a plain 1 GiB
    allocation is refused until the pool is trimmed, while the pool itself can reuse it."""
    program = py(POOL_KEEPS)
    local = subprocess.run(program, capture_output=True, text=True, timeout=120, check=False)
    print("LOCAL", local.stdout, local.stderr[-2000:])
    assert int(local.stdout.split("KEPT ", 1)[1].split()[0]) >= 1 << 30, local.stdout + local.stderr
    done = flexrun(native_libs, gpu_server, tmp_path, program, memory=2 * GiB, name="pool-keeps")
    (OUT / "gpu-pool-keeps.json").write_text(json.dumps({"local": local.stdout, "rgpu": done.stdout,
                                                        "stderr": done.stderr[-2000:]}, indent=2))
    assert int(done.stdout.split("KEPT ", 1)[1].split()[0]) >= 1 << 30, done.stdout + done.stderr
    assert "PLAIN 2" in done.stdout and "REUSED 0" in done.stdout, done.stdout + done.stderr
    assert "kept by the stream-ordered memory pool after cuMemFreeAsync" in done.stderr, done.stderr
    assert "TRIMMED 0" in done.stdout and "AFTER-TRIM 0" in done.stdout, done.stdout + done.stderr


CONTEXT_RESERVES = """
    from ctcuda import *
    setup()
    module = ctypes.c_void_p()
    check("cuModuleLoadData", ctypes.byref(module), open({image!r}, "rb").read())
    def launch(name, *args):
        fn = ctypes.c_void_p()
        check("cuModuleGetFunction", ctypes.byref(fn), module, name)
        held = [ctypes.c_uint64(0) if a is None else ctypes.c_int(a) for a in args]
        arr = (ctypes.c_void_p * len(held))(*[ctypes.addressof(h) for h in held])
        lib.cuLaunchKernel(fn, 1024, 1, 1, 256, 1, 1, 0, None, arr, None)
        return lib.cuCtxSynchronize()
    launch(b"trivial", None)   # the context's own first-launch growth, before measuring
    free0 = mem_info()[0]
    r = launch(b"big_local", None, 100)
    print("LOCAL16K", r, free0 - mem_info()[0], flush=True)
    r = lib.cuCtxSetLimit(0, ctypes.c_size_t(65536))
    print("STACK64K", r, free0 - mem_info()[0], flush=True)
    r = lib.cuCtxSetLimit(2, ctypes.c_size_t(1 << 30))
    r2 = launch(b"heap_user", 1024) if r == 0 else -1
    print("HEAP1G", r, r2, free0 - mem_info()[0], flush=True)
    """


def test_stack_local_memory_and_heap_count_against_the_slice_on_a_real_gpu(
        native_libs: build.Libraries, gpu_server: Server, tmp_path: Path) -> None:
    """What the driver reserves for the stack (cuCtxSetLimit), for a kernel's local memory (16 KiB
    per thread, at its first launch) and for the malloc heap, measured locally, is charged to the
    slice through rgpu: refused in a 1.5 GiB slice, charged as the driver takes it in a 40 GiB one."""
    program = py(CONTEXT_RESERVES.format(image=str(HERE / "data" / "module_images" / "local_memory.sm_90.cubin")))
    local = subprocess.run(program, capture_output=True, text=True, timeout=120, check=False)
    # The same program as an MPS client at 50%, as the slice's worker is: the driver then gives the
    # context half the SMs, and reserves local memory for their threads only.
    mps_env = gpu_server.server.mps.client_env(50)
    local_mps = subprocess.run(program, capture_output=True, text=True, timeout=120, check=False,
                               env={**os.environ, **mps_env}) if mps_env else local
    small = flexrun(native_libs, gpu_server, tmp_path, program, memory=GiB + GiB // 2, name="reserves-small")
    large = flexrun(native_libs, gpu_server, tmp_path, program, memory=40 * GiB, name="reserves-large")
    (OUT / "gpu-context-reserves.json").write_text(json.dumps({
        "local": local.stdout, "local_mps_50": local_mps.stdout, "small": small.stdout, "large": large.stdout,
        "small_stderr": small.stderr[-3000:], "large_stderr": large.stderr[-2000:]}, indent=2))

    def row(out: str, name: str) -> list[int]:
        return [int(x) for x in out.split(f"{name} ", 1)[1].split("\n", 1)[0].split()]

    print("LOCAL", local.stdout, "SMALL", small.stdout, "LARGE", large.stdout)
    threads = 132 * 2048 if "H100" in gpu_server.gpus[0].name else None
    # Locally: the kernel's first launch takes (16 KiB - 1 KiB) per resident thread, the 64 KiB
    # stack then (64 KiB - 1 KiB) in all; the heap is taken at its first launch.
    for name, size in (("LOCAL16K", 16384), ("STACK64K", 65536)):
        here = row(local.stdout, name)
        assert here[0] == 0 and (threads is None or here[1] == (size - 1024) * threads), (name, here)
    # In 1.5 GiB (0.97 GiB left after the context): the kernel's local memory is refused (the
    # kernel does not run), the stack and the 1 GiB heap too.
    assert row(small.stdout, "STACK64K")[0] == 2 and row(small.stdout, "LOCAL16K")[0] == 2, small.stdout
    assert row(small.stdout, "HEAP1G")[0] == 2, small.stdout + small.stderr
    assert "16.0 KiB of local memory per thread, which the GPU reserves for each of the" in small.stderr, small.stderr
    # In 40 GiB: everything runs, and what the slice shows gone matches what the driver took for
    # an MPS client of the same share.
    for name in ("STACK64K", "LOCAL16K"):
        here, there = row(local_mps.stdout, name), row(large.stdout, name)
        assert here[0] == there[0] == 0 and there[-1] == here[-1], (name, here, there)
    heap_here, heap_there = row(local_mps.stdout, "HEAP1G"), row(large.stdout, "HEAP1G")
    assert heap_here[:2] == heap_there[:2] == [0, 0], (heap_here, heap_there)
    assert 0 <= heap_here[-1] - heap_there[-1] <= 16 << 20, (heap_here, heap_there)
