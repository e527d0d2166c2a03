"""The copy list and operations shared by the shared-pinned-buffer tests (emulated and real GPU)."""

from __future__ import annotations

from pathlib import Path

from rgpu.remoting.native import client_stats
from rgpu.remoting.native.generated import api_gen


# 8 MiB of page-locked memory, filled, copied to the device synchronously and back; a sub-range at an
# odd offset asynchronously; prints what came back.
COPIES = """
    setup()
    n = 8 << 20
    host = ctypes.c_void_p()
    check("cuMemHostAlloc", ctypes.byref(host), ctypes.c_size_t(n), 0)
    pattern = bytes(range(251)) * (n // 251 + 1)
    ctypes.memmove(host, pattern, n)
    r, dev = alloc(n)
    check("cuMemcpyHtoD_v2", ctypes.c_uint64(dev), host, ctypes.c_size_t(n))
    ctypes.memset(host, 0, n)
    check("cuMemcpyDtoH_v2", host, ctypes.c_uint64(dev), ctypes.c_size_t(n))
    print("SYNC", ctypes.string_at(host.value, n) == pattern[:n])
    off, k = 12345, 3 << 20
    ctypes.memset(host.value + off, 0xAB, k)
    check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dev + 7), ctypes.c_void_p(host.value + off), ctypes.c_size_t(k), None)
    check("cuCtxSynchronize")
    ctypes.memset(host, 0, n)
    check("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(host.value + 1), ctypes.c_uint64(dev), ctypes.c_size_t(k + 7), None)
    check("cuCtxSynchronize")
    got = ctypes.string_at(host.value + 1, k + 7)
    print("ASYNC", got == pattern[:7] + bytes([0xAB]) * k)
    check("cuMemFreeHost", host)
"""


def _ops(prefix: Path) -> dict[str, int]:
    """The client's operations by name and count (sync + async), from its call profile."""
    files = list(prefix.parent.glob(prefix.name + ".*"))
    assert len(files) == 1, files
    ops, _ = client_stats.parse(files[0].read_text())
    return {api_gen.OPS.get(op, str(op)): p.sync_calls + p.async_calls for op, p in ops.items()}
