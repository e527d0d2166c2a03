"""Stream capture, CUDA graphs and virtual memory management through rgpu's libcuda.so.1,
against an emulated worker (which records a capturing stream's memsets and device copies as
the graph's nodes and runs them when the executable graph is launched), and again through the
real-GPU backend's code chained to it (test_cuda_backend_chained.py's fixture)."""

from __future__ import annotations

from rgpu.remoting.native import build

import pytest

from tests.remoting.conftest import Server
from tests.remoting.test_client_emulated import py_client
from tests.remoting.test_cuda_backend_chained import chained  # noqa: F401 - a fixture, used by name


@pytest.fixture(params=["emulated", "chained"])
def worker(request: pytest.FixtureRequest) -> Server:
    return request.getfixturevalue(request.param)


def test_capture_instantiate_launch_and_exact_capture_status(native_libs: build.Libraries, worker: Server) -> None:
    done = py_client(native_libs, worker.slices(worker.token()), """
        setup()
        s = ctypes.c_void_p()
        check("cuStreamCreate", ctypes.byref(s), 1)
        r, a = alloc(1024)
        r2, b = alloc(1024)
        status, cid = ctypes.c_int(7), ctypes.c_uint64(9)
        # No capture begun: answered in the client, exactly.
        check("cuStreamIsCapturing", s, ctypes.byref(status))
        print("BEFORE", status.value)
        check("cuStreamBeginCapture_v2", s, 0)
        check("cuStreamIsCapturing", s, ctypes.byref(status))
        graph_seen, deps, n = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t(5)
        check("cuStreamGetCaptureInfo_v3", s, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph_seen),
              ctypes.byref(deps), None, ctypes.byref(n))
        print("DURING", status.value, cid.value > 0, n.value)
        other = ctypes.c_int(7)
        check("cuStreamIsCapturing", None, ctypes.byref(other))
        print("OTHER", other.value)
        check("cuMemsetD32Async", ctypes.c_uint64(a), 0x11223344, 256, s)
        check("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(b), ctypes.c_uint64(a), 1024, s)
        graph = ctypes.c_void_p()
        check("cuStreamEndCapture", s, ctypes.byref(graph))
        print("SAMEGRAPH", graph.value == graph_seen.value)
        check("cuStreamIsCapturing", s, ctypes.byref(status))
        print("AFTER", status.value)
        nodes = ctypes.c_size_t(0)
        check("cuGraphGetNodes", graph, None, ctypes.byref(nodes))
        print("NODES", nodes.value)
        exe = ctypes.c_void_p()
        check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
        out = (ctypes.c_uint32 * 256)()
        check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(b), 1024)
        print("NOTRUN", hex(out[0]))
        check("cuGraphLaunch", exe, s)
        check("cuStreamSynchronize", s)
        check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(b), 1024)
        print("RUN", hex(out[0]), hex(out[255]))
        mode = ctypes.c_int(2)
        check("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))
        print("MODE", mode.value)
        check("cuGraphExecDestroy", exe)
        check("cuGraphDestroy", graph)
        # A copy from this process's memory on a capturing stream is refused, naming the call; as
        # any asynchronous error, it answers the next synchronising call.
        check("cuStreamBeginCapture_v2", s, 0)
        host = (ctypes.c_char * 16)()
        print("HTOD", lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(a), host, 16, s), lib.cuStreamEndCapture(s, ctypes.byref(graph)))
        print("DONE")
        """)
    out = done.stdout
    assert "BEFORE 0" in out, out + done.stderr
    assert "DURING 1 True 0" in out
    assert "OTHER 0" in out
    assert "HTOD 0 900" in out      # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert "not remoted yet" in done.stderr
    assert "SAMEGRAPH True" in out
    assert "AFTER 0" in out
    assert "NODES 2" in out
    assert "NOTRUN 0x0" in out      # capture recorded the work, it did not run it
    assert "RUN 0x11223344 0x11223344" in out
    assert "MODE 0" in out
    assert "DONE" in out


def test_virtual_memory_is_counted_against_the_slice(native_libs: build.Libraries, worker: Server) -> None:
    mib = 1 << 20
    done = py_client(native_libs, worker.slices(worker.token(memory_limit=16 * mib)), """
        setup()
        class Prop(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("handleTypes", ctypes.c_int), ("loc_type", ctypes.c_int),
                        ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint64)]
        prop = Prop(1, 0, 1, 0, None, 0)   # pinned, on device 0
        gran = ctypes.c_size_t()
        check("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
        size = 5 * gran.value
        va = ctypes.c_uint64()
        check("cuMemAddressReserve", ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        h = ctypes.c_uint64()
        check("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        print("FREE", free.value // (1 << 20), total.value // (1 << 20))
        too_big = ctypes.c_uint64()
        print("OVER", lib.cuMemCreate(ctypes.byref(too_big), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)))
        check("cuMemMap", va, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0))
        class Access(ctypes.Structure):
            _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]
        acc = Access(1, 0, 3)
        check("cuMemSetAccess", va, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1))
        data = bytes(range(256)) * 16
        check("cuMemcpyHtoD_v2", va, data, len(data))
        back = ctypes.create_string_buffer(len(data))
        check("cuMemcpy", ctypes.c_uint64(ctypes.addressof(back)), va, ctypes.c_size_t(len(data)))
        print("DATA", back.raw == data)
        again = ctypes.c_uint64()
        check("cuMemRetainAllocationHandle", ctypes.byref(again), ctypes.c_void_p(va.value + 4096))
        print("RETAINED", again.value == h.value)
        check("cuMemRelease", h)
        check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        print("STILL", free.value // (1 << 20))
        check("cuMemUnmap", va, ctypes.c_size_t(size))
        check("cuMemRelease", again)
        check("cuMemAddressFree", va, ctypes.c_size_t(size))
        check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        print("AFTER", free.value // (1 << 20))
        print("DONE")
        """)
    out = done.stdout
    assert "FREE 6 16" in out, out + done.stderr
    assert "OVER 2" in out          # CUDA_ERROR_OUT_OF_MEMORY: the slice's limit
    assert "DATA True" in out
    assert "RETAINED True" in out
    assert "STILL 6" in out         # a retained handle keeps the allocation counted
    assert "AFTER 16" in out
    assert "DONE" in out
