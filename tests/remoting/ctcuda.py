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


# CUDA arrays, 2D/3D copies, texture and surface objects (CUDA 13 layouts).
class MEMCPY2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


class MEMCPY3D(ctypes.Structure):
    _fields_ = [(f"src{n}", t) for n, t in (("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("Z", ctypes.c_size_t),
                                            ("LOD", ctypes.c_size_t), ("MemoryType", ctypes.c_int), ("Host", ctypes.c_void_p),
                                            ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p), ("reserved", ctypes.c_void_p),
                                            ("Pitch", ctypes.c_size_t), ("Height", ctypes.c_size_t))] + \
                [(f"dst{n}", t) for n, t in (("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("Z", ctypes.c_size_t),
                                             ("LOD", ctypes.c_size_t), ("MemoryType", ctypes.c_int), ("Host", ctypes.c_void_p),
                                             ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p), ("reserved", ctypes.c_void_p),
                                             ("Pitch", ctypes.c_size_t), ("Height", ctypes.c_size_t))] + \
                [("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


class ARRAY3D_DESCRIPTOR(ctypes.Structure):
    _fields_ = [("Width", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t),
                ("Format", ctypes.c_int), ("NumChannels", ctypes.c_uint), ("Flags", ctypes.c_uint)]


class ARRAY_DESCRIPTOR(ctypes.Structure):
    _fields_ = [("Width", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Format", ctypes.c_int),
                ("NumChannels", ctypes.c_uint)]


HOST, DEVICE, ARRAY = 1, 2, 3
FMT_U8, FMT_U16, FMT_FLOAT = 0x01, 0x02, 0x20
SURFACE_LDST = 0x02


def array2d(width: int, height: int, fmt: int, channels: int) -> tuple[int, int]:
    h = ctypes.c_void_p()
    r = lib.cuArrayCreate_v2(ctypes.byref(h), ctypes.byref(ARRAY_DESCRIPTOR(width, height, fmt, channels)))
    return r, h.value or 0


def array3d(width: int, height: int, depth: int, fmt: int, channels: int, flags: int = 0) -> tuple[int, int]:
    h = ctypes.c_void_p()
    r = lib.cuArray3DCreate_v2(ctypes.byref(h), ctypes.byref(ARRAY3D_DESCRIPTOR(width, height, depth, fmt, channels, flags)))
    return r, h.value or 0


def resource_desc(kind: int, words: bytes) -> ctypes.Array:
    """A CUDA_RESOURCE_DESC (144 bytes): resType, then the union's bytes at offset 8, flags 0."""
    import struct
    return ctypes.create_string_buffer(struct.pack("<i4x", kind) + words.ljust(128, b"\0") + bytes(8), 144)


def snapshot(label: bytes) -> None:
    """Write the client's call profile so far as RGPU_CLIENT_STATS.<pid>.<label> (a no-op without it)."""
    write = ctypes.c_void_p()
    check("cuGetProcAddress_v2", b"rgpuClientStatsWrite", ctypes.byref(write), 12000, ctypes.c_uint64(0), None)
    ctypes.CFUNCTYPE(None, ctypes.c_char_p)(write.value)(label)
