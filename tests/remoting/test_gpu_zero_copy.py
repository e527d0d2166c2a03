"""Zero-copy on NVIDIA's driver through rgpu (zero_copy.c): a kernel reads and writes page-locked
memory of the application's process, and a memset fills it, as XLA's autotuner does with its redzone
word (issue 24's JAX failure). Each page-locked allocation lies at an address the worker reserved; the
GPU's first use backs it with device memory there, and its bytes move at launches and synchronisation.

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_zero_copy.py -v -s
(CPU-only CI skips it; tests/remoting/test_zero_copy_emulated.py covers the client's side.)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.remoting.conftest import EXAMPLES, PY, Server
from tests.remoting.gpu_helpers import flexrun
from rgpu.remoting.native import build

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent

# vecadd(a, b, c, n): c[i] = a[i] + b[i] over floats. `a` and `c` are page-locked host memory (cuMemHostAlloc,
# mapped), `b` device memory; a memset of `c` first, then the kernel writes it; rounds repeat with new values.
PROGRAM = textwrap.dedent(f"""
    import sys; sys.path.insert(0, {str(HERE)!r})
    from ctcuda import *
    setup()
    n = 4096
    ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuModuleLoadData", ctypes.byref(mod), ptx)
    check("cuModuleGetFunction", ctypes.byref(fn), mod, b"vecadd")
    a, c = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuMemHostAlloc", ctypes.byref(a), ctypes.c_size_t(4 * n), 2)
    check("cuMemHostAlloc", ctypes.byref(c), ctypes.c_size_t(4 * n), 2)
    ha = (ctypes.c_float * n).from_address(a.value)
    hc = (ctypes.c_float * n).from_address(c.value)
    r, b = alloc(4 * n)
    hb = (ctypes.c_float * n)(*[2.0 * i for i in range(n)])
    check("cuMemcpyHtoD_v2", ctypes.c_uint64(b), hb, ctypes.c_size_t(4 * n))
    bad = 0
    for round_ in range(5):
        for i in range(n):
            ha[i] = float(i + round_)
        check("cuMemsetD32Async", ctypes.c_uint64(c.value), 0x7FC00000, ctypes.c_size_t(n), None)   # NaN
        check("cuCtxSynchronize")
        bad += sum(hc[i] == hc[i] for i in range(n))          # NaN != NaN: every word was set
        pa, pb, pc, pn = ctypes.c_uint64(a.value), ctypes.c_uint64(b), ctypes.c_uint64(c.value), ctypes.c_int(n)
        params = (ctypes.c_void_p * 4)(*(ctypes.addressof(x) for x in (pa, pb, pc, pn)))
        check("cuLaunchKernel", fn, (n + 255) // 256, 1, 1, 256, 1, 1, 0, None, params, None)
        check("cuCtxSynchronize")
        bad += sum(hc[i] != float(i + round_) + 2.0 * i for i in range(n))
    check("cuMemFreeHost", a)
    check("cuMemFreeHost", c)
    print("BAD", bad)
    """)


def test_a_kernel_and_a_memset_read_and_write_page_locked_memory(native_libs: build.Libraries,  # noqa: F811
                                                                  gpu_server: Server, tmp_path: Path) -> None:
    done = flexrun(native_libs, gpu_server, tmp_path, [PY, "-c", PROGRAM], name="zero-copy",
                   extra_env={"RGPU_ZERO_COPY": "1"})
    assert "BAD 0" in done.stdout, done.stdout + done.stderr
    # No launch or memset was refused (the info log, RGPU_LOG=info here, names the backed allocations).
    assert "is a pointer into page-locked host memory" not in done.stderr, done.stderr
    assert "is now backed on the GPU" in done.stderr, done.stderr
