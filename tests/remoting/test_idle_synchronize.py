"""Synchronisations the client answers itself (issue 24: an idle synchronize and `.item()`'s
synchronize after its copy cost no round trip), against a real session server with an emulated
GPU: a stream or context a finished synchronisation left idle, with nothing sent since, is idle
still; anything sent since (work, a failing call, a destruction) sends the next one out."""

from __future__ import annotations

from pathlib import Path

from rgpu.remoting.native import build, client_stats

from tests.remoting.conftest import Server
from tests.remoting.client_helpers import py_client


def _profile(stats: Path) -> dict[str, client_stats.OpProfile]:
    (found,) = stats.parent.glob(stats.name + ".*")
    return {p.name: p for p in client_stats.parse(found.read_text())[0].values()}


PROGRAM = """
    setup()
    stream = ctypes.c_void_p()
    check("cuStreamCreate", ctypes.byref(stream), 1)
    r, buf = alloc(4)
    assert r == 0
    host = ctypes.c_uint32()
    for i in range(50):                       # the .item() pattern: work, a 4-byte copy, a synchronize
        check("cuMemsetD32Async", ctypes.c_uint64(buf), i, ctypes.c_size_t(1), stream)
        check("cuMemcpyDtoHAsync_v2", ctypes.byref(host), ctypes.c_uint64(buf), ctypes.c_size_t(4), stream)
        check("cuStreamSynchronize", stream)
        assert host.value == i, host.value
    for _ in range(20):                       # an idle torch.cuda.synchronize()
        check("cuCtxSynchronize")
        check("cuStreamSynchronize", stream)
    print("IDLE DONE")
    # Work that fails after the last synchronisation: the next synchronize goes out and reports it.
    check("cuMemFree_v2", ctypes.c_uint64(buf))
    check("cuMemsetD32Async", ctypes.c_uint64(buf), 1, ctypes.c_size_t(1), stream)
    print("LATE", lib.cuStreamSynchronize(stream))
    print("AGAIN", lib.cuStreamSynchronize(stream))
    # PyTorch's .item() on its default stream: a copy on the legacy (NULL) stream, then its synchronize.
    r, other = alloc(4)
    check("cuMemcpyDtoH_v2", ctypes.byref(host), ctypes.c_uint64(other), ctypes.c_size_t(4))
    print("NULL", lib.cuStreamSynchronize(None))
    # The per-thread default stream is one handle for a stream per thread: always asked.
    check("cuMemcpyDtoHAsync_v2", ctypes.byref(host), ctypes.c_uint64(other), ctypes.c_size_t(4), ctypes.c_void_p(2))
    print("PER_THREAD", lib.cuStreamSynchronize(ctypes.c_void_p(2)))
    """


def test_idle_synchronizations_and_item_synchronizes_cost_no_round_trip(native_libs: build.Libraries,
                                                                       emulated: Server, tmp_path: Path) -> None:
    stats = tmp_path / "prof"
    done = py_client(native_libs, emulated.slices(emulated.token()), PROGRAM, RGPU_CLIENT_STATS=str(stats))
    assert "IDLE DONE" in done.stdout, done.stdout + done.stderr
    assert "LATE 1" in done.stdout, done.stdout + done.stderr   # CUDA_ERROR_INVALID_VALUE, at the next synchronize
    assert "AGAIN 0" in done.stdout                               # reported once, then idle again
    assert "NULL 0" in done.stdout
    ops = _profile(stats)
    assert "PER_THREAD 0" in done.stdout
    assert ops["cuMemcpyDtoHAsync_v2"].sync_calls == 50 + 2   # cuMemcpyDtoH_v2 travels as the same operation
    # The 50 .item() synchronizes, 20 idle ones and the NULL stream's are answered here; the 3 that
    # went out: after the failing memset, its repeat (the memset's frame was the last one sent, but
    # its synchronize failed), and the per-thread stream's.
    assert ops["cuStreamSynchronize"].sync_calls == 3, ops["cuStreamSynchronize"]
    assert ops["cuCtxSynchronize"].sync_calls == 1
