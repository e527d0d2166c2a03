"""The real-GPU backend's code, tested without a GPU: its worker calls "the driver" through
rgpu's own client library, which talks to an emulated worker. Everything but kernel execution
runs: ctypes bindings by exact symbol, pinned staging copies, pointer-attribute widths, module
loads with function tables from cuModuleEnumerateFunctions/cuFuncGetParamInfo."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import (
    EXAMPLES,
    PY,
    Server,
    run_client,
)

HERE = Path(__file__).parent


def test_driver_api_program_through_the_cuda_backend(native_libs: build.Libraries, demo_binary: Path, chained: Server) -> None:
    slices = chained.slices(chained.token(memory_limit=1 << 30))
    done = run_client(native_libs, slices, [str(demo_binary), str(EXAMPLES / "vecadd.ptx"), "expect-refused", str(1 << 30)])
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert chained.server.status()["compute_enforcement"] in ("mps", "time-slicing")


def test_cuda_backend_copies_pointer_attributes_and_modules(native_libs: build.Libraries, chained: Server) -> None:
    done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)), [PY, "-c", textwrap.dedent(f"""
        import sys, os; sys.path.insert(0, {str(HERE)!r})
        from ctcuda import *
        setup()
        n = 5 * (1 << 20) + 7
        data = os.urandom(n)
        r, p = alloc(n)
        stream = ctypes.c_void_p()
        check("cuStreamCreate", ctypes.byref(stream), 1)
        for k in range(3):
            check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(p), data, ctypes.c_size_t(n), stream)
        back = ctypes.create_string_buffer(n)
        check("cuMemcpyDtoHAsync_v2", back, ctypes.c_uint64(p), ctypes.c_size_t(n), stream)
        check("cuStreamSynchronize", stream)
        print("SAME", back.raw == data)
        kind = ctypes.c_uint64(0xFFFFFFFFFFFFFFFF)
        check("cuPointerGetAttribute", ctypes.byref(kind), 2, ctypes.c_uint64(p))
        print("KIND", hex(kind.value))
        # The plural query travels as one (the worker asks its driver for all of them at once).
        ids = (ctypes.c_int * 3)(2, 3, 12)                  # MEMORY_TYPE, DEVICE_POINTER, RANGE_SIZE
        vals = [ctypes.c_uint64(0xFFFFFFFFFFFFFFFF) for _ in range(3)]
        slots = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in vals))
        check("cuPointerGetAttributes", 3, ids, slots, ctypes.c_uint64(p + 16))
        print("PLURAL", [hex(v.value) for v in vals], vals[1].value == p + 16, vals[2].value == n)
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(fn), mod, b"mixed")
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        check("cuFuncGetParamInfo", fn, ctypes.c_size_t(1), ctypes.byref(off), ctypes.byref(size))
        print("PARAM1", off.value, size.value)
        # Libraries are loaded with LIBRARY_BINARY_IS_PRESERVED: the worker keeps each image until
        # its cuLibraryUnload, and a library loaded again after that gets its image again.
        for k in range(2):
            lib, kern = ctypes.c_void_p(), ctypes.c_void_p()
            check("cuLibraryLoadData", ctypes.byref(lib), ptx, None, None, 0, None, None, 0)
            check("cuLibraryGetKernel", ctypes.byref(kern), lib, b"mixed")
            check("cuLibraryUnload", lib)
        print("LIBRARIES", "loaded and unloaded twice")
        """)])
    assert "SAME True" in done.stdout, done.stdout + done.stderr
    # MEMORY_TYPE is 4 bytes: only those were written into the caller's 8-byte variable.
    assert "KIND 0xffffffff00000002" in done.stdout
    assert "PLURAL ['0xffffffff00000002'" in done.stdout and "True True" in done.stdout, done.stdout + done.stderr
    assert "PARAM1 8 16" in done.stdout
    assert "LIBRARIES loaded and unloaded twice" in done.stdout, done.stdout + done.stderr


def test_library_loads_ask_the_driver_to_read_the_image_in_place() -> None:
    from rgpu.remoting.datapath.backends.cuda_driver import LIBRARY_BINARY_IS_PRESERVED, preserved_library_options
    assert preserved_library_options([]) == [(LIBRARY_BINARY_IS_PRESERVED, 1)]
    # the application's own promise is replaced by the worker's (it is the worker's copy that is kept)
    assert preserved_library_options([(LIBRARY_BINARY_IS_PRESERVED, 0), (7, 9)]) == [(7, 9), (LIBRARY_BINARY_IS_PRESERVED, 1)]


@pytest.mark.parametrize("value,asked", [(None, True), ("0", False), (" 0 ", False), ("", True), ("1", True)])
def test_a_worker_receives_striped_copies_in_the_background_unless_told_not_to(monkeypatch: pytest.MonkeyPatch,
                                                                               value: str | None, asked: bool) -> None:
    """On by default since the landing design passed the four cuda-samples its first design hung (H100,
    2026-12-07) and ResNet-18 over the network path ran 0.936x local with it, 0.410x without."""
    from rgpu.remoting.datapath.backends.cuda_copies import lanes_background_asked
    if value is None:
        monkeypatch.delenv("RGPU_LANES_BACKGROUND", raising=False)
    else:
        monkeypatch.setenv("RGPU_LANES_BACKGROUND", value)
    assert lanes_background_asked() is asked


@pytest.mark.parametrize("program", ["PROGRAM_2D", "PROGRAM_3D", "PROGRAM_PIECES", "PROGRAM_OBJECTS", "PROGRAM_GRAPHS"])
def test_arrays_copies_and_texture_objects_through_the_cuda_backend(native_libs: build.Libraries, chained: Server,
                                                                    program: str) -> None:
    # The CUDA backend's array paths (ctypes structs, cuMemcpy2DAsync/2DUnaligned/3DAsync with the
    # host side in the worker's receive buffer or its own buffer, the footprint probe) byte for byte.
    from tests.remoting import arrays_helpers as arrays
    out = arrays.run(native_libs, chained, getattr(arrays, program))
    assert out.count("\nOK ") + out.startswith("OK ") >= 1, out


def test_cuda_backend_charges_the_footprint_the_driver_reports(native_libs: build.Libraries, chained: Server) -> None:
    # The backend asks "the driver" for a deferred-mapping array's memory requirements (here the
    # emulated GPU's exact texel bytes, not rgpu's padded estimate) and charges that, for an array and
    # for each level of a mipmapped array; beyond the slice, refused.
    from tests.remoting import arrays_helpers as arrays
    out = arrays.run(native_libs, chained, """
        free0, total = mem_info()
        r, a = array2d(37, 19, FMT_FLOAT, 1)
        print("USED", r, free0 - mem_info()[0])
        check("cuArrayDestroy", ctypes.c_void_p(a))
        mm = ctypes.c_void_p()
        check("cuMipmappedArrayCreate", ctypes.byref(mm), ctypes.byref(ARRAY3D_DESCRIPTOR(20, 10, 0, FMT_FLOAT, 1, 0)), 3)
        print("MIPMAP", free0 - mem_info()[0])
        r, b = array2d(16384, 16384, FMT_FLOAT, 4)
        print("BEYOND", r)
        """, limit=1 << 30)
    assert "USED 0 2812" in out, out                      # 37 x 19 x 4 bytes (the estimate: 192 x 24)
    assert f"MIPMAP {(20 * 10 + 10 * 5 + 5 * 2) * 4}" in out
    assert "BEYOND 2" in out
