"""The worker's C loop answers small device-to-host copies on NVIDIA's driver (issue 24: the
`tensor.item()` pattern at one round trip plus the GPU's time).

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_small_copies.py -v -s
(CPU-only CI skips them; tests/remoting/test_native_small_copies.py covers the same loop with a
test double for the driver and with rgpu's own libcuda as "the driver".)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.remoting.conftest import Server
from tests.remoting.test_gpu import flexrun, gpu_server, py  # noqa: F401 - the fixture
from rgpu.remoting.native import build

pytestmark = pytest.mark.gpu


def test_item_pattern_values_are_exact_and_answered_in_c(native_libs: build.Libraries, gpu_server: Server,  # noqa: F811
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))   # the session server's workers inherit it
    done = flexrun(native_libs, gpu_server, tmp_path, py("""
        from ctcuda import *
        setup()
        r, p = alloc(1 << 20)
        stream = ctypes.c_void_p()
        check("cuStreamCreate", ctypes.byref(stream), 1)
        value = ctypes.c_uint32(0)
        bad = 0
        for i in range(500):
            check("cuMemsetD32Async", ctypes.c_uint64(p + 4 * (i % 7)), i * 7 + 1, ctypes.c_size_t(1), stream)
            check("cuMemcpyDtoHAsync_v2", ctypes.byref(value), ctypes.c_uint64(p + 4 * (i % 7)), ctypes.c_size_t(4), stream)
            check("cuStreamSynchronize", stream)
            bad += value.value != i * 7 + 1
        big = ctypes.create_string_buffer(65536)
        check("cuMemsetD8Async", ctypes.c_uint64(p), 0x5A, ctypes.c_size_t(65536), None)
        check("cuMemcpyDtoHAsync_v2", big, ctypes.c_uint64(p), ctypes.c_size_t(65536), None)
        check("cuCtxSynchronize")
        print("BAD", bad, "BIG", big.raw == b"\\x5a" * 65536)
        """), name="small-dtoh")
    assert "BAD 0 BIG True" in done.stdout, done.stdout + done.stderr
    deadline = time.monotonic() + 20
    answered = 0
    while time.monotonic() < deadline and answered < 501:
        answered = sum(json.loads(p.read_text()).get("native_small_dtoh", 0) for p in tmp_path.glob("worker-*.json"))
        time.sleep(0.1)
    assert answered >= 501
