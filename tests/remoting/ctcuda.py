"""A tiny ctypes view of the driver API for test programs that run under rgpu's libcuda.so.1.

Imported by the small programs the tests start in subprocesses (with LD_LIBRARY_PATH and
RGPU_SLICES set), so each test reads like the application it stands for.
"""

from __future__ import annotations

import ctypes
import sys

lib = ctypes.CDLL("libcuda.so.1")


def call(name: str, *args: object) -> int:
    return getattr(lib, name)(*args)


def check(name: str, *args: object) -> None:
    r = call(name, *args)
    if r != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(r, ctypes.byref(text))
        print(f"{name} failed: {text.value.decode() if text.value else r}", flush=True)
        sys.exit(10)


def setup(device: int = 0) -> ctypes.c_void_p:
    """cuInit, retain the device's primary context and make it current."""
    check("cuInit", 0)
    ctx = ctypes.c_void_p()
    check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
    check("cuCtxSetCurrent", ctx)
    return ctx


def alloc(size: int) -> tuple[int, int]:
    ptr = ctypes.c_uint64()
    r = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
    return r, ptr.value


def mem_info() -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value
