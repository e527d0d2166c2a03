"""CUDA arrays, 2D/3D copies with array sides, texture and surface objects through rgpu's libcuda.so.1
against a real session server with an emulated GPU: bytes round-trip exactly (odd widths, pitches,
offsets, pieces of the wire's chunk size), descriptors read back, bad handles are refused, and
arrays count against the slice's memory limit."""

from __future__ import annotations


import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import Server
from tests.remoting.arrays_helpers import PROGRAM_2D, PROGRAM_3D, PROGRAM_GRAPHS, PROGRAM_OBJECTS, PROGRAM_PIECES, run

MiB = 1 << 20


def test_2d_array_round_trips_through_host_device_and_another_array(native_libs: build.Libraries,
                                                                     emulated: Server) -> None:
    out = run(native_libs, emulated, PROGRAM_2D)
    assert "OK array to device to host" in out and "OK array to array" in out and "OK untouched stays zero" in out
    assert "OK unaligned x refused" in out and "OK past the end refused" in out
    assert "DESC 37 19 32 1 3D 37 19 0 0" in out
    assert "AGAIN 400 400" in out and "BOGUS 400" in out   # CUDA_ERROR_INVALID_HANDLE


def test_3d_arrays_and_3d_copies_with_every_side(native_libs: build.Libraries, emulated: Server) -> None:
    out = run(native_libs, emulated, PROGRAM_3D)
    for name in ("3D array to device", "3D device to host", "3D array to array", "3D outside the box is zero",
                 "3D device to device"):
        assert f"OK {name}" in out, out
    assert "DESC3D 13 7 5 2 2 0" in out


def test_copies_larger_than_a_wire_chunk_and_1d_arrays(native_libs: build.Libraries, emulated: Server) -> None:
    out = run(native_libs, emulated, PROGRAM_PIECES)
    for name in ("9.4 MiB through an array", "1D HtoA/AtoH", "1D DtoA/AtoD/AtoA", "1D HtoAAsync", "rows wider than a piece"):
        assert f"OK {name}" in out, out


def test_texture_and_surface_objects_keep_their_descriptors(native_libs: build.Libraries, emulated: Server) -> None:
    out = run(native_libs, emulated, PROGRAM_OBJECTS)
    for name in ("array texture descriptors", "pitch2D descriptor", "view descriptor", "surface descriptor",
                 "mipmap level round trip"):
        assert f"OK {name}" in out, out
    assert "VALUES 4 True" in out
    assert "BAD_ARRAY 400" in out and "BAD_PTR 1" in out and "TOO_LONG 1" in out and "NO_TEXDESC 1" in out
    assert "DESTROYED 1 1" in out
    assert "SURF_PLAIN 1" in out and "SURF_LINEAR 1" in out and "SURF_AGAIN 1" in out
    assert "a surface object needs an array created with CUDA_ARRAY3D_SURFACE_LDST" in out
    assert "LEVEL2 16 8 0" in out and "LEVEL_PAST 1" in out and "DESTROY_LEVEL 400" in out
    assert "TOO_MANY_LEVELS 1" in out and "MM_AGAIN 400" in out
    assert "TEXREF 801" in out and "texture references are deprecated since CUDA 12" in out


def test_arrays_count_against_the_slice_and_beyond_it_are_refused(native_libs: build.Libraries,
                                                                  emulated: Server) -> None:
    limit = 64 * MiB
    out = run(native_libs, emulated, f"""
        free0, total = mem_info()
        r, a = array3d(1024, 1024, 8, FMT_U8, 4)      # 32 MiB
        free1, _ = mem_info()
        print("USED", r, free0 - free1)
        r2, b = array2d(8192, 4096, FMT_FLOAT, 1)     # 128 MiB: beyond the slice
        print("BEYOND", r2, b)
        mm = ctypes.c_void_p()
        r3 = lib.cuMipmappedArrayCreate(ctypes.byref(mm), ctypes.byref(ARRAY3D_DESCRIPTOR(4096, 2048, 0, FMT_FLOAT, 1, 0)), 3)
        print("MIPMAP_BEYOND", r3)
        r4, dev = alloc(40 * {MiB})                   # device memory and arrays share the limit
        print("ALLOC_AFTER", r4)
        check("cuArrayDestroy", ctypes.c_void_p(a))
        print("BACK", mem_info()[0] == free0, alloc(40 * {MiB})[0])
        """, limit=limit)
    assert f"USED 0 {32 * MiB}" in out, out
    assert "BEYOND 2 0" in out                      # CUDA_ERROR_OUT_OF_MEMORY, no handle
    assert "MIPMAP_BEYOND 2" in out
    assert "ALLOC_AFTER 2" in out
    assert "BACK True 0" in out
    assert "cuArrayCreate (8192 x 4096 x 0, format 0x20 x 1): allocation of 128.0 MiB refused" in out


@pytest.mark.parametrize("bad", ["format", "cubemap"])
def test_bad_array_descriptors_are_refused(native_libs: build.Libraries, emulated: Server, bad: str) -> None:
    desc = {"format": "ARRAY3D_DESCRIPTOR(16, 16, 0, 0x7f, 1, 0)", "cubemap": "ARRAY3D_DESCRIPTOR(16, 8, 6, 0x20, 1, 4)"}[bad]
    out = run(native_libs, emulated, f"""
        h = ctypes.c_void_p()
        print("CREATE", lib.cuArray3DCreate_v2(ctypes.byref(h), ctypes.byref({desc})), mem_info()[0] == mem_info()[1])
        """)
    assert "CREATE 1 True" in out   # CUDA_ERROR_INVALID_VALUE, nothing held


def test_copies_with_arrays_in_graphs_and_captures(native_libs: build.Libraries, emulated: Server) -> None:
    out = run(native_libs, emulated, PROGRAM_GRAPHS)
    assert "OK nothing copied before the launch" in out and "OK device to array to device through graphs" in out, out
    assert "BAD_NODE 400" in out
    assert "HOST_IN_CAPTURE 900" in out   # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, with a message
    assert "on a capturing stream is not remoted yet" in out
