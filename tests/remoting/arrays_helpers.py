"""The array programs (2D, 3D, pieces, texture objects, graphs) and the runner shared by the array tests."""

from __future__ import annotations

import textwrap
from rgpu.remoting.native import build
from tests.remoting.conftest import Server
from tests.remoting.client_helpers import py_client


# Shared by the programs: a deterministic pattern and a pitched host buffer holding it.
PRELUDE = """
import struct
def pattern(n, seed):
    return bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(n))
def buf(data):
    return ctypes.create_string_buffer(bytes(data), max(len(data), 1))
def rows(data, pitch, x, y, width, height, plane=0, z=0, depth=1):
    return b"".join(data[(z + k) * plane + (y + r) * pitch + x:(z + k) * plane + (y + r) * pitch + x + width]
                    for k in range(depth) for r in range(height))
def report(name, ok):
    print(("OK " if ok else "FAIL ") + name, flush=True)
setup()
"""


PROGRAM_2D = """
        # 37 x 19 float texels (148-byte rows), from a host buffer at (4 bytes, row 2) of pitch 200
        W, H = 37 * 4, 19
        src = pattern(200 * 30, 1); hsrc = buf(src)
        r, a = array2d(37, 19, FMT_FLOAT, 1)
        m = MEMCPY2D(srcXInBytes=4, srcY=2, srcMemoryType=HOST, srcHost=ctypes.addressof(hsrc), srcPitch=200,
                     dstMemoryType=ARRAY, dstArray=a, WidthInBytes=W, Height=H)
        check("cuMemcpy2D_v2", ctypes.byref(m))
        expected = rows(src, 200, 4, 2, W, H)
        # array -> pitched device memory at (8 bytes, row 3), then device -> host (pitch 300, offset 12, row 1)
        dptr, pitch = ctypes.c_uint64(), ctypes.c_size_t()
        check("cuMemAllocPitch_v2", ctypes.byref(dptr), ctypes.byref(pitch), ctypes.c_size_t(W + 8), ctypes.c_size_t(H + 3), 4)
        m = MEMCPY2D(srcMemoryType=ARRAY, srcArray=a, dstXInBytes=8, dstY=3, dstMemoryType=DEVICE, dstDevice=dptr.value,
                     dstPitch=pitch.value, WidthInBytes=W, Height=H)
        check("cuMemcpy2DAsync_v2", ctypes.byref(m), None)
        out = buf(bytes(300 * (H + 1)))
        m = MEMCPY2D(srcXInBytes=8, srcY=3, srcMemoryType=DEVICE, srcDevice=dptr.value, srcPitch=pitch.value,
                     dstXInBytes=12, dstY=1, dstMemoryType=HOST, dstHost=ctypes.addressof(out), dstPitch=300,
                     WidthInBytes=W, Height=H)
        check("cuMemcpy2D_v2", ctypes.byref(m))
        report("array to device to host", rows(out.raw, 300, 12, 1, W, H) == expected)
        # a sub-rectangle of the array into another array at an offset (array to array), read back
        r2, b = array2d(50, 40, FMT_FLOAT, 1)
        m = MEMCPY2D(srcXInBytes=8, srcY=5, srcMemoryType=ARRAY, srcArray=a, dstXInBytes=20, dstY=7,
                     dstMemoryType=ARRAY, dstArray=b, WidthInBytes=60, Height=11)
        check("cuMemcpy2DUnaligned_v2", ctypes.byref(m))
        back = buf(bytes(200 * 40))
        m = MEMCPY2D(srcMemoryType=ARRAY, srcArray=b, dstMemoryType=HOST, dstHost=ctypes.addressof(back), dstPitch=200,
                     WidthInBytes=200, Height=40)
        check("cuMemcpy2D_v2", ctypes.byref(m))
        region = rows(back.raw, 200, 20, 7, 60, 11)
        report("array to array", region == rows(expected, W, 8, 5, 60, 11))
        report("untouched stays zero", back.raw[:200 * 7] == bytes(200 * 7))
        # an unaligned X (not a whole element) and a region past the array are refused
        m = MEMCPY2D(srcXInBytes=2, srcMemoryType=ARRAY, srcArray=a, dstMemoryType=HOST, dstHost=ctypes.addressof(back),
                     dstPitch=200, WidthInBytes=8, Height=1)
        report("unaligned x refused", lib.cuMemcpy2D_v2(ctypes.byref(m)) == 1)
        m = MEMCPY2D(srcMemoryType=ARRAY, srcArray=a, srcY=10, dstMemoryType=HOST, dstHost=ctypes.addressof(back),
                     dstPitch=200, WidthInBytes=W, Height=H)
        report("past the end refused", lib.cuMemcpy2D_v2(ctypes.byref(m)) == 1)
        d = ARRAY_DESCRIPTOR(); d3 = ARRAY3D_DESCRIPTOR()
        check("cuArrayGetDescriptor_v2", ctypes.byref(d), ctypes.c_void_p(a))
        check("cuArray3DGetDescriptor_v2", ctypes.byref(d3), ctypes.c_void_p(a))
        print("DESC", d.Width, d.Height, d.Format, d.NumChannels, "3D", d3.Width, d3.Height, d3.Depth, d3.Flags)
        check("cuArrayDestroy", ctypes.c_void_p(a))
        print("AGAIN", lib.cuArrayDestroy(ctypes.c_void_p(a)), lib.cuArrayGetDescriptor_v2(ctypes.byref(d), ctypes.c_void_p(a)))
        print("BOGUS", lib.cuArrayDestroy(ctypes.c_void_p(0x1234)))
        """


PROGRAM_3D = """
        # 13 x 7 x 5 texels of 2 x u16 (4 bytes): 52-byte rows
        W, H, D = 13 * 4, 7, 5
        P, HH = 64, 9                                  # the host box: pitch 64, 9 rows per plane
        src = pattern(P * HH * (D + 1), 2); hsrc = buf(src)
        r, a = array3d(13, 7, 5, FMT_U16, 2)
        m = MEMCPY3D(srcXInBytes=4, srcY=1, srcZ=1, srcMemoryType=HOST, srcHost=ctypes.addressof(hsrc), srcPitch=P,
                     srcHeight=HH, dstMemoryType=ARRAY, dstArray=a, WidthInBytes=W, Height=H, Depth=D)
        check("cuMemcpy3D_v2", ctypes.byref(m))
        expected = rows(src, P, 4, 1, W, H, P * HH, 1, D)
        # array -> device (pitch 128, 10 rows a plane, at (16, 2, 1)) -> host
        size = 128 * 10 * (D + 1)
        r, dev = alloc(size)
        m = MEMCPY3D(srcMemoryType=ARRAY, srcArray=a, dstXInBytes=16, dstY=2, dstZ=1, dstMemoryType=DEVICE, dstDevice=dev,
                     dstPitch=128, dstHeight=10, WidthInBytes=W, Height=H, Depth=D)
        check("cuMemcpy3DAsync_v2", ctypes.byref(m), None)
        out = buf(bytes(size))
        check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(dev), ctypes.c_size_t(size))
        report("3D array to device", rows(out.raw, 128, 16, 2, W, H, 1280, 1, D) == expected)
        # device -> host with a 3D copy (a sub-box), and array -> host
        back = buf(bytes(100 * 8 * 4))
        m = MEMCPY3D(srcXInBytes=20, srcY=3, srcZ=2, srcMemoryType=DEVICE, srcDevice=dev, srcPitch=128, srcHeight=10,
                     dstXInBytes=3, dstY=1, dstZ=1, dstMemoryType=HOST, dstHost=ctypes.addressof(back), dstPitch=100,
                     dstHeight=8, WidthInBytes=24, Height=5, Depth=3)
        check("cuMemcpy3D_v2", ctypes.byref(m))
        report("3D device to host", rows(back.raw, 100, 3, 1, 24, 5, 800, 1, 3) == rows(expected, W, 4, 1, 24, 5, W * H, 1, 3))
        # array -> array (3D, offsets on both sides), then the whole destination to host
        r, b = array3d(20, 9, 6, FMT_U16, 2)
        m = MEMCPY3D(srcXInBytes=8, srcY=2, srcZ=1, srcMemoryType=ARRAY, srcArray=a, dstXInBytes=12, dstY=4, dstZ=2,
                     dstMemoryType=ARRAY, dstArray=b, WidthInBytes=32, Height=5, Depth=4)
        check("cuMemcpy3D_v2", ctypes.byref(m))
        whole = buf(bytes(80 * 9 * 6))
        m = MEMCPY3D(srcMemoryType=ARRAY, srcArray=b, dstMemoryType=HOST, dstHost=ctypes.addressof(whole), dstPitch=80,
                     dstHeight=9, WidthInBytes=80, Height=9, Depth=6)
        check("cuMemcpy3D_v2", ctypes.byref(m))
        report("3D array to array", rows(whole.raw, 80, 12, 4, 32, 5, 720, 2, 4) == rows(expected, W, 8, 2, 32, 5, W * H, 1, 4))
        report("3D outside the box is zero", whole.raw[:720 * 2] == bytes(1440))
        # a 3D copy between two device buffers, no array (cudaMemcpy3D on pitched memory)
        r, dev2 = alloc(size)
        m = MEMCPY3D(srcMemoryType=DEVICE, srcDevice=dev, srcPitch=128, srcHeight=10, dstMemoryType=DEVICE, dstDevice=dev2,
                     dstPitch=128, dstHeight=10, WidthInBytes=128, Height=10, Depth=D + 1)
        check("cuMemcpy3D_v2", ctypes.byref(m))
        out2 = buf(bytes(size))
        check("cuMemcpyDtoH_v2", out2, ctypes.c_uint64(dev2), ctypes.c_size_t(size))
        report("3D device to device", out2.raw == out.raw)
        d3 = ARRAY3D_DESCRIPTOR()
        check("cuArray3DGetDescriptor_v2", ctypes.byref(d3), ctypes.c_void_p(a))
        print("DESC3D", d3.Width, d3.Height, d3.Depth, d3.Format, d3.NumChannels, d3.Flags)
        """


PROGRAM_PIECES = """
        # 1024 x 600 float4 (16 KiB rows, 9.4 MiB): pieces of whole rows both ways
        W, H = 1024 * 16, 600
        src = pattern(W * H, 3); hsrc = buf(src)
        r, a = array2d(1024, 600, FMT_FLOAT, 4)
        m = MEMCPY2D(srcMemoryType=HOST, srcHost=ctypes.addressof(hsrc), srcPitch=W, dstMemoryType=ARRAY, dstArray=a,
                     WidthInBytes=W, Height=H)
        check("cuMemcpy2DAsync_v2", ctypes.byref(m), None)
        back = buf(bytes(W * H))
        m = MEMCPY2D(srcMemoryType=ARRAY, srcArray=a, dstMemoryType=HOST, dstHost=ctypes.addressof(back), dstPitch=W,
                     WidthInBytes=W, Height=H)
        check("cuMemcpy2D_v2", ctypes.byref(m))
        report("9.4 MiB through an array", back.raw == src)
        # a 1D array of 100000 float4 (1.5 MiB: a row wider than a chunk) through the 1D copies
        n = 100000 * 16
        one = pattern(n, 4)
        r, b = array2d(100000, 0, FMT_FLOAT, 4)
        check("cuMemcpyHtoA_v2", ctypes.c_void_p(b), ctypes.c_size_t(0), buf(one), ctypes.c_size_t(n))
        got = buf(bytes(n))
        check("cuMemcpyAtoH_v2", got, ctypes.c_void_p(b), ctypes.c_size_t(0), ctypes.c_size_t(n))
        report("1D HtoA/AtoH", got.raw == one)
        r, dev = alloc(4096)
        check("cuMemcpyAtoD_v2", ctypes.c_uint64(dev), ctypes.c_void_p(b), ctypes.c_size_t(160), ctypes.c_size_t(4096))
        check("cuMemcpyDtoA_v2", ctypes.c_void_p(b), ctypes.c_size_t(n - 4096), ctypes.c_uint64(dev), ctypes.c_size_t(4096))
        r, c = array2d(300, 0, FMT_FLOAT, 4)
        check("cuMemcpyAtoA_v2", ctypes.c_void_p(c), ctypes.c_size_t(32), ctypes.c_void_p(b), ctypes.c_size_t(n - 4096),
              ctypes.c_size_t(4096))
        small = buf(bytes(4096))
        check("cuMemcpyAtoHAsync_v2", small, ctypes.c_void_p(c), ctypes.c_size_t(32), ctypes.c_size_t(4096), None)
        report("1D DtoA/AtoD/AtoA", small.raw == one[160:160 + 4096])
        check("cuMemcpyHtoAAsync_v2", ctypes.c_void_p(c), ctypes.c_size_t(0), buf(b"\\x01" * 16), ctypes.c_size_t(16), None)
        check("cuMemcpyAtoH_v2", small, ctypes.c_void_p(c), ctypes.c_size_t(0), ctypes.c_size_t(16))
        report("1D HtoAAsync", small.raw[:16] == b"\\x01" * 16)
        # a 3D device-to-host copy whose rows (5 MiB) are wider than a read piece
        RW = 5 << 20
        r, big = alloc(RW * 2)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(big), buf(pattern(RW * 2, 5)), ctypes.c_size_t(RW * 2))
        wide = buf(bytes(RW * 2))
        m = MEMCPY3D(srcMemoryType=DEVICE, srcDevice=big, srcPitch=RW, srcHeight=2, dstMemoryType=HOST,
                     dstHost=ctypes.addressof(wide), dstPitch=RW, dstHeight=2, WidthInBytes=RW, Height=2, Depth=1)
        check("cuMemcpy3D_v2", ctypes.byref(m))
        report("rows wider than a piece", wide.raw == pattern(RW * 2, 5))
        """


PROGRAM_OBJECTS = """
        r, a = array2d(64, 32, FMT_FLOAT, 1)
        res = resource_desc(0, struct.pack("<Q", a))
        tex = buf(struct.pack("<3iiIIifff4f", 1, 1, 0, 1, 2, 0, 0, 0.0, 0.0, 0.0, 0.5, 0.25, 0.75, 1.0).ljust(104, b"\\0"))
        t = ctypes.c_ulonglong()
        check("cuTexObjectCreate", ctypes.byref(t), res, tex, None)
        got_res, got_tex, got_view = buf(bytes(144)), buf(bytes(104)), buf(bytes(112))
        check("cuTexObjectGetResourceDesc", got_res, t)
        check("cuTexObjectGetTextureDesc", got_tex, t)
        check("cuTexObjectGetResourceViewDesc", got_view, t)
        report("array texture descriptors", got_res.raw == res.raw and got_tex.raw == tex.raw and got_view.raw == bytes(112))
        # linear and pitch2D memory, with a resource view on the array
        r, dev = alloc(64 * 32 * 4)
        lin = resource_desc(2, struct.pack("<QiIQ", dev, FMT_FLOAT, 1, 64 * 32 * 4))
        t2 = ctypes.c_ulonglong()
        check("cuTexObjectCreate", ctypes.byref(t2), lin, tex, None)
        p2d = resource_desc(3, struct.pack("<QiIQQQ", dev, FMT_U8, 4, 30, 16, 128))
        t3 = ctypes.c_ulonglong()
        check("cuTexObjectCreate", ctypes.byref(t3), p2d, tex, None)
        check("cuTexObjectGetResourceDesc", got_res, t3)
        report("pitch2D descriptor", got_res.raw == p2d.raw)
        view = buf(struct.pack("<i4xQQQIIII", 0x16, 64, 32, 0, 0, 0, 0, 0).ljust(112, b"\\0"))
        t4 = ctypes.c_ulonglong()
        check("cuTexObjectCreate", ctypes.byref(t4), res, tex, view)
        check("cuTexObjectGetResourceViewDesc", got_view, t4)
        report("view descriptor", got_view.raw == view.raw)
        print("VALUES", len({t.value, t2.value, t3.value, t4.value}), all(v.value for v in (t, t2, t3, t4)))
        # refused: a bogus array, memory that is not the device's, a linear range past its allocation
        bad = ctypes.c_ulonglong()
        print("BAD_ARRAY", lib.cuTexObjectCreate(ctypes.byref(bad), resource_desc(0, struct.pack("<Q", 0xdead00)), tex, None))
        print("BAD_PTR", lib.cuTexObjectCreate(ctypes.byref(bad), resource_desc(2, struct.pack("<QiIQ", 0x1000, FMT_FLOAT, 1, 64)), tex, None))
        print("TOO_LONG", lib.cuTexObjectCreate(ctypes.byref(bad), resource_desc(2, struct.pack("<QiIQ", dev, FMT_FLOAT, 1, 1 << 20)), tex, None))
        print("NO_TEXDESC", lib.cuTexObjectCreate(ctypes.byref(bad), res, None, None))
        for h in (t, t2, t3, t4):
            check("cuTexObjectDestroy", h)
        print("DESTROYED", lib.cuTexObjectDestroy(t), lib.cuTexObjectGetResourceDesc(got_res, t))
        # surfaces: only on arrays made for load/store
        s = ctypes.c_ulonglong()
        print("SURF_PLAIN", lib.cuSurfObjectCreate(ctypes.byref(s), res))
        r, sa = array3d(16, 16, 0, FMT_U8, 4, SURFACE_LDST)
        sres = resource_desc(0, struct.pack("<Q", sa))
        check("cuSurfObjectCreate", ctypes.byref(s), sres)
        check("cuSurfObjectGetResourceDesc", got_res, s)
        report("surface descriptor", got_res.raw == sres.raw)
        print("SURF_LINEAR", lib.cuSurfObjectCreate(ctypes.byref(bad), lin))
        check("cuSurfObjectDestroy", s)
        print("SURF_AGAIN", lib.cuSurfObjectDestroy(s))
        # mipmapped arrays: levels halve, belong to their mipmapped array, and can be textured
        mm = ctypes.c_void_p()
        check("cuMipmappedArrayCreate", ctypes.byref(mm), ctypes.byref(ARRAY3D_DESCRIPTOR(64, 32, 0, FMT_FLOAT, 1, 0)), 4)
        lv = ctypes.c_void_p()
        check("cuMipmappedArrayGetLevel", ctypes.byref(lv), mm, 2)
        d3 = ARRAY3D_DESCRIPTOR()
        check("cuArray3DGetDescriptor_v2", ctypes.byref(d3), lv)
        print("LEVEL2", d3.Width, d3.Height, d3.Depth)
        data = pattern(16 * 4 * 8, 6)
        hdata = buf(data)
        m = MEMCPY2D(srcMemoryType=HOST, srcHost=ctypes.addressof(hdata), srcPitch=64, dstMemoryType=ARRAY,
                     dstArray=lv.value, WidthInBytes=64, Height=8)
        check("cuMemcpy2D_v2", ctypes.byref(m))
        back = buf(bytes(len(data)))
        m = MEMCPY2D(srcMemoryType=ARRAY, srcArray=lv.value, dstMemoryType=HOST, dstHost=ctypes.addressof(back), dstPitch=64,
                     WidthInBytes=64, Height=8)
        check("cuMemcpy2D_v2", ctypes.byref(m))
        report("mipmap level round trip", back.raw == data)
        print("LEVEL_PAST", lib.cuMipmappedArrayGetLevel(ctypes.byref(lv), mm, 4))
        print("DESTROY_LEVEL", lib.cuArrayDestroy(lv))
        tm = ctypes.c_ulonglong()
        check("cuTexObjectCreate", ctypes.byref(tm), resource_desc(1, struct.pack("<Q", mm.value)), tex, None)
        check("cuTexObjectDestroy", tm)
        print("TOO_MANY_LEVELS", lib.cuMipmappedArrayCreate(ctypes.byref(lv), ctypes.byref(ARRAY3D_DESCRIPTOR(64, 32, 0, FMT_FLOAT, 1, 0)), 8))
        check("cuMipmappedArrayDestroy", mm)
        print("MM_AGAIN", lib.cuMipmappedArrayDestroy(mm))
        # texture references are gone from CUDA 12 on: refused by name
        print("TEXREF", lib.cuModuleGetTexRef(ctypes.byref(bad), None, b"tex"))
        """


PROGRAM_GRAPHS = """
        W, H = 24, 6
        data = pattern(W * H, 7)
        r, dev = alloc(W * H)
        r, dev2 = alloc(W * H)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(dev), buf(data), ctypes.c_size_t(W * H))
        r, a = array2d(6, 6, FMT_FLOAT, 1)
        # a copy node from device memory into the array, added by hand
        graph = ctypes.c_void_p()
        check("cuGraphCreate", ctypes.byref(graph), 0)
        m = MEMCPY3D(srcMemoryType=DEVICE, srcDevice=dev, srcPitch=W, srcHeight=H, dstMemoryType=ARRAY, dstArray=a,
                     WidthInBytes=W, Height=H, Depth=1)
        node = ctypes.c_void_p()
        check("cuGraphAddMemcpyNode", ctypes.byref(node), graph, None, 0, ctypes.byref(m), None)
        bad = MEMCPY3D(srcMemoryType=DEVICE, srcDevice=dev, srcPitch=W, srcHeight=H, dstMemoryType=ARRAY, dstArray=0xbad00,
                       WidthInBytes=W, Height=H, Depth=1)
        print("BAD_NODE", lib.cuGraphAddMemcpyNode(ctypes.byref(node), graph, None, 0, ctypes.byref(bad), None))
        exe = ctypes.c_void_p()
        check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
        check("cuGraphLaunch", exe, None)
        # captured: the array back into other device memory, then launched
        stream = ctypes.c_void_p()
        check("cuStreamCreate", ctypes.byref(stream), 0)
        check("cuStreamBeginCapture_v2", stream, 0)
        m = MEMCPY3D(srcMemoryType=ARRAY, srcArray=a, dstMemoryType=DEVICE, dstDevice=dev2, dstPitch=W, dstHeight=H,
                     WidthInBytes=W, Height=H, Depth=1)
        check("cuMemcpy3DAsync_v2", ctypes.byref(m), stream)
        host = buf(bytes(W * H))
        hm = MEMCPY3D(srcMemoryType=ARRAY, srcArray=a, dstMemoryType=HOST, dstHost=ctypes.addressof(host), dstPitch=W,
                      dstHeight=H, WidthInBytes=W, Height=H, Depth=1)
        print("HOST_IN_CAPTURE", lib.cuMemcpy3DAsync_v2(ctypes.byref(hm), stream))
        g2 = ctypes.c_void_p()
        check("cuStreamEndCapture", stream, ctypes.byref(g2))
        exe2 = ctypes.c_void_p()
        check("cuGraphInstantiateWithFlags", ctypes.byref(exe2), g2, ctypes.c_ulonglong(0))
        back = buf(bytes(W * H))
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dev2), ctypes.c_size_t(W * H))
        report("nothing copied before the launch", back.raw == bytes(W * H))
        check("cuGraphLaunch", exe2, stream)
        check("cuStreamSynchronize", stream)
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dev2), ctypes.c_size_t(W * H))
        report("device to array to device through graphs", back.raw == data)
        """


def run(libs: build.Libraries, emulated: Server, code: str, limit: int = 1 << 30) -> str:
    done = py_client(libs, emulated.slices(emulated.token(memory_limit=limit)), PRELUDE + textwrap.dedent(code), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout, done.stdout + done.stderr
    return done.stdout + done.stderr
