"""Launches whose arguments come in cuLaunchKernel's `extra` buffer (CU_LAUNCH_PARAM_BUFFER_POINTER /
_SIZE, as NVIDIA's driver-API samples pass them), and function lookups on a created context,
against an emulated worker. The emulated device checks the parameter byte count, then refuses
the launch: the right byte count shows as CUDA_ERROR_NOT_SUPPORTED at the next synchronising
call, a wrong one as CUDA_ERROR_INVALID_VALUE."""

from __future__ import annotations

from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, Server
from tests.remoting.client_helpers import py_client


def test_extra_buffer_launch_carries_the_callers_bytes(native_libs: build.Libraries, emulated: Server) -> None:
    done = py_client(native_libs, emulated.slices(emulated.token()), f"""
        check("cuInit", 0)
        ctx = ctypes.c_void_p()
        check("cuCtxCreate_v4", ctypes.byref(ctx), None, 0, 0)   # as vectorAddDrv and matrixMulDrv do
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod, fn, again = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(fn), mod, b"vecadd")
        check("cuModuleGetFunction", ctypes.byref(again), mod, b"vecadd")
        print("SAME", fn.value == again.value)
        def launch(nbytes):
            buf = (ctypes.c_char * 64)()
            size = ctypes.c_size_t(nbytes)
            extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
            r = lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, None, extra)
            return r, lib.cuCtxSynchronize()
        # vecadd(const float*, const float*, float*, int): 28 bytes.
        print("RIGHT", launch(28))
        print("WRONG", launch(24))
        both = (ctypes.c_void_p * 1)(0)
        print("BOTH", lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, both, (ctypes.c_void_p * 1)(0)))
        check("cuCtxDestroy_v2", ctx)
        print("DONE")
        """)
    assert "SAME True" in done.stdout, done.stdout + done.stderr
    assert "RIGHT (0, 801)" in done.stdout    # accepted, refused by the emulated device at the sync
    assert "WRONG (0, 1)" in done.stdout      # CUDA_ERROR_INVALID_VALUE: the worker saw 24 bytes
    assert "BOTH 1" in done.stdout            # kernelParams and extra together are invalid
    assert "DONE" in done.stdout
