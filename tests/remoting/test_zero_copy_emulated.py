"""Zero-copy through a remote GPU: a kernel handed a pointer into the application's page-locked
memory (cudaHostGetDevicePointer, or a host-set flag the kernel spins on, as NVIDIA's
UnifiedMemoryPerf does) would fault on the GPU node, and under MPS end every session there. The
client refuses such a launch before it leaves, with one line naming the argument; the session
goes on."""

from __future__ import annotations

from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, Server
from tests.remoting.test_client_emulated import py_client


def test_a_launch_with_a_pinned_host_pointer_is_refused_in_the_client(native_libs: build.Libraries,
                                                                      emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        setup()
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(fn), mod, b"vecadd")
        host = ctypes.c_void_p()
        check("cuMemAllocHost_v2", ctypes.byref(host), ctypes.c_size_t(1 << 20))
        r, dev = alloc(1 << 20)
        a, b = ctypes.c_uint64(dev), ctypes.c_uint64(host.value + 4096)     # b: inside the pinned block
        c, n = ctypes.c_uint64(dev), ctypes.c_int(16)
        params = (ctypes.c_void_p * 4)(*(ctypes.addressof(x) for x in (a, b, c, n)))
        print("LAUNCH", lib.cuLaunchKernel(fn, 1, 1, 1, 16, 1, 1, 0, None, params, None))
        print("SYNC", lib.cuCtxSynchronize())                               # the session goes on
        out = ctypes.create_string_buffer(64)
        check("cuMemsetD8_v2", ctypes.c_uint64(dev), 7, ctypes.c_size_t(64))
        check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(dev), ctypes.c_size_t(64))
        print("AFTER", out.raw == bytes([7]) * 64)
        b.value = dev                                                         # device pointers only: sent
        print("DEVICE_ONLY", lib.cuLaunchKernel(fn, 1, 1, 1, 16, 1, 1, 0, None, params, None), lib.cuCtxSynchronize())
        """)
    out, err = done.stdout, done.stderr
    assert "LAUNCH 801" in out, out + err
    assert "SYNC 0" in out and "AFTER True" in out
    assert "argument at byte 8 is a pointer into page-locked host memory" in err
    # The launch with device pointers reached the worker (which emulates, and refuses to run kernels:
    # its answer comes at the next synchronisation).
    assert "DEVICE_ONLY 0 801" in out and "kernel launch refused" in err
    assert err.count("page-locked host memory") == 1


def test_a_pipelined_memset_of_pinned_host_memory_fails_late_naming_the_memset(native_libs: build.Libraries,
                                                                               emulated: Server) -> None:
    """XLA's autotuner zeroes a pinned host word with cuMemsetD32Async before its redzone kernel
    (issue 24's JAX failure). The memset travels pipelined; the worker's driver refuses the address,
    and the error surfaces at the next synchronising call, whose line names the memset (before, the
    line was empty and the refusal looked like the later call's own)."""
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        setup()
        host = ctypes.c_void_p()
        check("cuMemAllocHost_v2", ctypes.byref(host), ctypes.c_size_t(4096))
        print("MEMSET", lib.cuMemsetD32Async(ctypes.c_uint64(host.value), 0, ctypes.c_size_t(2), None))
        print("SYNC", lib.cuCtxSynchronize())
        print("AGAIN", lib.cuCtxSynchronize())                               # reported once
        """)
    out, err = done.stdout, done.stderr
    assert "MEMSET 0" in out, out + err
    assert "SYNC 1" in out and "AGAIN 0" in out, out + err
    assert "rgpu: worker: cuMemsetD32Async failed with CUDA_ERROR_INVALID_VALUE; reported at this later call" in err, err
