"""The item program and the in-C answer check shared by the small-copy tests (emulated and real GPU)."""

from __future__ import annotations

import textwrap
from pathlib import Path


HERE = Path(__file__).parent


def item_program(reads: int, big: int = 1 << 20) -> str:
    """A program doing what `tensor.item()` does `reads` times on values that change, then one
    `big` read (Python's chunked path past 64 KiB), a read from an address no allocation holds (its
    error must reach the application at the copy) and one more good read. Prints
    "BAD <wrong values> BIG <bool> WILD <code> AFTER <bool>"."""
    return textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        from ctcuda import *
        setup()
        r, p = alloc(1 << 20)
        stream = ctypes.c_void_p()
        check("cuStreamCreate", ctypes.byref(stream), 1)
        value = ctypes.c_uint32(0)
        bad = 0
        for i in range({reads}):
            at = ctypes.c_uint64(p + 4 * (i % 7))
            check("cuMemsetD32Async", at, i * 7 + 1, ctypes.c_size_t(1), stream)
            check("cuMemcpyDtoHAsync_v2", ctypes.byref(value), at, ctypes.c_size_t(4), stream)
            check("cuStreamSynchronize", stream)
            bad += value.value != i * 7 + 1
        big = ctypes.create_string_buffer({big})
        check("cuMemsetD8Async", ctypes.c_uint64(p), 0x5A, ctypes.c_size_t({big}), stream)
        check("cuMemcpyDtoHAsync_v2", big, ctypes.c_uint64(p), ctypes.c_size_t({big}), stream)
        check("cuStreamSynchronize", stream)
        wild = lib.cuMemcpyDtoHAsync_v2(ctypes.byref(value), ctypes.c_uint64(0x10), ctypes.c_size_t(4), stream)
        check("cuMemsetD32Async", ctypes.c_uint64(p), 99, ctypes.c_size_t(1), stream)
        check("cuMemcpyDtoHAsync_v2", ctypes.byref(value), ctypes.c_uint64(p), ctypes.c_size_t(4), stream)
        check("cuStreamSynchronize", stream)
        print("BAD", bad, "BIG", big.raw == b"\\x5a" * {big}, "WILD", wild, "AFTER", value.value == 99)
        """)
