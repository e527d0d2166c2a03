"""Copies between two slices (issue 16's devices 0 and 1, which may sit on different servers): they
go through the client's memory, with cuMemcpyPeer, cuMemcpyPeerAsync and a unified cuMemcpy, and
cuDeviceCanAccessPeer says honestly that the GPUs cannot reach each other."""

from __future__ import annotations

from rgpu.remoting.native import build

from tests.remoting.conftest import EMULATED_GPU_2, EXAMPLES, Server
from tests.remoting.client_helpers import py_client


def test_copies_between_two_slices_go_through_the_client(native_libs: build.Libraries, emulated: Server) -> None:
    slices = emulated.slices(emulated.token(), emulated.token(gpu=EMULATED_GPU_2))
    done = py_client(native_libs, slices, """
        check("cuInit", 0)
        n = (8 << 20) + 12345                                   # more than one chunk
        ctx0, ctx1 = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx0), 0)
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx1), 1)
        can = ctypes.c_int(7)
        check("cuDeviceCanAccessPeer", ctypes.byref(can), 0, 1)
        print("PEER", can.value)
        attr = ctypes.c_int(7)
        check("cuDeviceGetP2PAttribute", ctypes.byref(attr), 2, 0, 1)          # ACCESS_SUPPORTED
        print("P2P_ATTR", attr.value, lib.cuDeviceGetP2PAttribute(ctypes.byref(attr), 2, 0, 0))
        a, b, c = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        check("cuCtxSetCurrent", ctx0); check("cuMemAlloc_v2", ctypes.byref(a), ctypes.c_size_t(n))
        src = bytes(i % 253 for i in range(n))
        check("cuMemcpyHtoD_v2", a, src, ctypes.c_size_t(n))
        check("cuCtxSetCurrent", ctx1); check("cuMemAlloc_v2", ctypes.byref(b), ctypes.c_size_t(n))
        check("cuMemAlloc_v2", ctypes.byref(c), ctypes.c_size_t(n))
        check("cuMemcpyPeer", b, ctx1, a, ctx0, ctypes.c_size_t(n))            # device 0 -> device 1
        out = ctypes.create_string_buffer(n)
        check("cuMemcpyDtoH_v2", out, b, ctypes.c_size_t(n))
        print("PEER_COPY", out.raw == src)
        check("cuMemsetD8_v2", c, 0, ctypes.c_size_t(n))
        check("cuMemcpy", c, a, ctypes.c_size_t(n))                          # unified, current context: device 1
        check("cuMemcpyDtoH_v2", out, c, ctypes.c_size_t(n))
        print("UNIFIED_COPY", out.raw == src)
        s = ctypes.c_void_p()
        check("cuStreamCreate", ctypes.byref(s), 0)
        check("cuMemsetD8_v2", c, 0, ctypes.c_size_t(n))
        check("cuMemcpyPeerAsync", c, ctx1, a, ctx0, ctypes.c_size_t(n), s)
        check("cuStreamSynchronize", s)
        check("cuMemcpyDtoH_v2", out, c, ctypes.c_size_t(n))
        print("ASYNC_COPY", out.raw == src)
        print("BAD_CTX", lib.cuMemcpyPeer(b, None, a, ctx0, ctypes.c_size_t(16)))
        # The runtime's cudaMemcpy(DeviceToDevice) between devices (PyTorch's tensor.to("cuda:1")):
        # device-to-device copies whose sides are in different slices.
        check("cuMemsetD8_v2", c, 0, ctypes.c_size_t(n))
        check("cuMemcpyDtoD_v2", c, a, ctypes.c_size_t(n))
        check("cuMemcpyDtoH_v2", out, c, ctypes.c_size_t(n))
        print("DTOD_COPY", out.raw == src)
        check("cuMemsetD8_v2", c, 0, ctypes.c_size_t(n))
        check("cuMemcpyDtoDAsync_v2", c, a, ctypes.c_size_t(n), s)
        check("cuStreamSynchronize", s)
        check("cuMemcpyDtoH_v2", out, c, ctypes.c_size_t(n))
        print("DTOD_ASYNC_COPY", out.raw == src)
        """)
    out = done.stdout
    assert "PEER 0" in out, out + done.stderr
    assert "P2P_ATTR 0 1" in out                                  # a device with itself: INVALID_VALUE
    assert "PEER_COPY True" in out
    assert "UNIFIED_COPY True" in out
    assert "ASYNC_COPY True" in out
    assert "BAD_CTX 201" in out                                   # CUDA_ERROR_INVALID_CONTEXT
    assert "DTOD_COPY True" in out and "DTOD_ASYNC_COPY True" in out


def test_a_stream_of_one_slice_waits_for_an_event_of_the_other(native_libs: build.Libraries, emulated: Server) -> None:
    # PyTorch's model parallelism: record an event on device 0, make device 1's stream wait for it.
    slices = emulated.slices(emulated.token(), emulated.token(gpu=EMULATED_GPU_2))
    done = py_client(native_libs, slices, """
        check("cuInit", 0)
        ctx0, ctx1 = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx0), 0)
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx1), 1)
        check("cuCtxSetCurrent", ctx0)
        ev0, s0, s1 = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check("cuEventCreate", ctypes.byref(ev0), 0)
        check("cuStreamCreate", ctypes.byref(s0), 0)
        check("cuEventRecord", ev0, s0)
        check("cuCtxSetCurrent", ctx1)
        check("cuStreamCreate", ctypes.byref(s1), 0)
        print("WAIT", lib.cuStreamWaitEvent(s1, ev0, 0), lib.cuStreamSynchronize(s1))
        check("cuCtxSetCurrent", ctx0)
        check("cuEventDestroy_v2", ev0)
        """)
    assert "WAIT 0 0" in done.stdout, done.stdout + done.stderr


def test_a_library_loaded_on_one_slice_serves_the_other(native_libs: build.Libraries, emulated: Server) -> None:
    # The CUDA runtime loads every fatbin once, as a library, and launches its kernels on whichever
    # device is current (PyTorch's cuda:1). Worker 1 never saw the load on device 0: rgpu loads the
    # library on every slice and translates the library and kernel handles per slice.
    slices = emulated.slices(emulated.token(), emulated.token(gpu=EMULATED_GPU_2))
    done = py_client(native_libs, slices, f"""
        check("cuInit", 0)
        ctx0, ctx1 = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx0), 0)
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx1), 1)
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        check("cuCtxSetCurrent", ctx1)
        m1 = ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(m1), ptx)     # worker 1's handles now differ from worker 0's
        check("cuCtxSetCurrent", ctx0)
        lib_ = ctypes.c_void_p()
        check("cuLibraryLoadData", ctypes.byref(lib_), ptx, None, None, 0, None, None, 0)
        k0, k1, f1 = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check("cuLibraryGetKernel", ctypes.byref(k0), lib_, b"vecadd")
        check("cuCtxSetCurrent", ctx1)
        check("cuLibraryGetKernel", ctypes.byref(k1), lib_, b"vecadd")
        print("SAME_KERNEL", k0.value == k1.value)
        check("cuKernelGetFunction", ctypes.byref(f1), k0)
        v = ctypes.c_int()
        check("cuKernelGetAttribute", ctypes.byref(v), 0, k0, 1)      # MAX_THREADS_PER_BLOCK on device 1
        print("ATTR", v.value > 0)
        size = ctypes.c_size_t()
        print("LAUNCH", lib.cuLaunchKernel(k0, 1, 1, 1, 1, 1, 1, 0, None, None, None))
        print("UNLOAD", lib.cuLibraryUnload(lib_))
        print("AFTER", lib.cuKernelGetFunction(ctypes.byref(f1), k0))
        """)
    out = done.stdout
    assert "SAME_KERNEL True" in out, out + done.stderr
    assert "ATTR True" in out
    # The emulated worker knows the kernel on device 1 and refuses to run it (it cannot run
    # kernels): CUDA_ERROR_NOT_SUPPORTED, not INVALID_HANDLE (801, not 400).
    assert "LAUNCH 801" in out or "LAUNCH 1" in out, out + done.stderr
    assert "UNLOAD 0" in out
    assert "AFTER 0" not in out


def test_a_library_loaded_before_the_other_slice_has_a_context_reaches_it_with_its_first_context(
        native_libs: build.Libraries, emulated: Server) -> None:
    # The runtime loads every fatbin at start-up, before the application picks device 1.
    slices = emulated.slices(emulated.token(), emulated.token(gpu=EMULATED_GPU_2))
    done = py_client(native_libs, slices, f"""
        check("cuInit", 0)
        ctx0, ctx1 = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx0), 0)
        check("cuCtxSetCurrent", ctx0)
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        m0 = ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(m0), ptx)     # worker 0's handles now differ from worker 1's
        lib_ = ctypes.c_void_p()
        check("cuLibraryLoadData", ctypes.byref(lib_), ptx, None, None, 0, None, None, 0)
        k0 = ctypes.c_void_p()
        check("cuLibraryGetKernel", ctypes.byref(k0), lib_, b"spin")
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx1), 1)
        check("cuCtxSetCurrent", ctx1)
        f1 = ctypes.c_void_p()
        print("FUNCTION", lib.cuKernelGetFunction(ctypes.byref(f1), k0))
        k1 = ctypes.c_void_p()
        check("cuLibraryGetKernel", ctypes.byref(k1), lib_, b"spin")
        print("SAME_KERNEL", k0.value == k1.value)
        """)
    assert "FUNCTION 0" in done.stdout and "SAME_KERNEL True" in done.stdout, done.stdout + done.stderr
