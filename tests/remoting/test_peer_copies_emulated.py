"""Copies between two slices (issue 16's devices 0 and 1, which may sit on different servers): they
go through the client's memory, with cuMemcpyPeer, cuMemcpyPeerAsync and a unified cuMemcpy, and
cuDeviceCanAccessPeer says honestly that the GPUs cannot reach each other."""

from __future__ import annotations

from rgpu.remoting.native import build

from tests.remoting.conftest import EMULATED_GPU_2, Server
from tests.remoting.test_client_emulated import py_client


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
