"""Stream capture, CUDA graphs and virtual memory management through rgpu's libcuda.so.1,
against an emulated worker (which records a capturing stream's memsets and device copies as
the graph's nodes and runs them when the executable graph is launched), and again through the
real-GPU backend's code chained to it (the `chained` fixture in conftest.py)."""

from __future__ import annotations

from pathlib import Path

from rgpu.remoting.native import build, client_stats

import pytest

from tests.remoting.conftest import EXAMPLES, Server
from tests.remoting.client_helpers import py_client


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
        # Copies between this process's memory and the device on a capturing stream become copy
        # nodes: the host data as it is at each launch goes in, the results come back after it.
        check("cuStreamBeginCapture_v2", s, 0)
        src, dst = (ctypes.c_uint32 * 4)(1, 2, 3, 4), (ctypes.c_uint32 * 4)()
        check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(a), src, 16, s)
        check("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(b), ctypes.c_uint64(a), 16, s)
        check("cuMemcpyDtoHAsync_v2", dst, ctypes.c_uint64(b), 16, s)
        print("CAPTURED", list(dst))
        check("cuStreamEndCapture", s, ctypes.byref(graph))
        check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
        src[0] = 10
        check("cuGraphLaunch", exe, s)
        check("cuStreamSynchronize", s)
        print("REPLAY1", list(dst))
        src[1] = 20
        check("cuGraphLaunch", exe, s)
        check("cuStreamSynchronize", s)
        print("REPLAY2", list(dst))
        print("DONE")
        """)
    out = done.stdout
    assert "BEFORE 0" in out, out + done.stderr
    assert "DURING 1 True 0" in out
    assert "OTHER 0" in out
    assert "CAPTURED [0, 0, 0, 0]" in out   # nothing ran during capture
    assert "REPLAY1 [10, 2, 3, 4]" in out
    assert "REPLAY2 [10, 20, 3, 4]" in out
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


def test_graph_built_node_by_node(native_libs: build.Libraries, worker: Server) -> None:
    mib = 1 << 20
    done = py_client(native_libs, worker.slices(worker.token(memory_limit=64 * mib)), f"""
        setup()
        r, b = alloc(16384)
        graph = ctypes.c_void_p()
        check("cuGraphCreate", ctypes.byref(graph), 0)
        class AllocParams(ctypes.Structure):
            _fields_ = [("pool", ctypes.c_char * 88), ("descs", ctypes.c_void_p), ("ndescs", ctypes.c_size_t),
                        ("bytesize", ctypes.c_size_t), ("dptr", ctypes.c_uint64)]
        pool = bytearray(88); pool[0] = 1; pool[8] = 1   # pinned, on a device (0)
        ap = AllocParams(bytes(pool), None, 0, 8 * (1 << 20), 0)
        node_alloc, node_set, node_copy, node_free, node_host = (ctypes.c_void_p() for _ in range(5))
        check("cuGraphAddMemAllocNode", ctypes.byref(node_alloc), graph, None, 0, ctypes.byref(ap))
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        print("GRAPHMEM", ap.dptr != 0, (total.value - free.value) // (1 << 20))
        class Memset(ctypes.Structure):
            _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                        ("elem", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]
        ms = Memset(ap.dptr, 0, 0x5A5A5A5A, 4, 1024, 1)
        deps = (ctypes.c_void_p * 1)(node_alloc)
        check("cuGraphAddMemsetNode", ctypes.byref(node_set), graph, deps, 1, ctypes.byref(ms), None)
        copy = (ctypes.c_uint64 * 25)()   # CUDA_MEMCPY3D as 25 words
        copy[4] = 2; copy[6] = ap.dptr            # src: device
        copy[15] = 2; copy[17] = b               # dst: device
        copy[22] = 4096; copy[23] = 1; copy[24] = 1
        deps[0] = node_set
        check("cuGraphAddMemcpyNode", ctypes.byref(node_copy), graph, deps, 1, copy, None)
        # A copy node into this process's memory: its data arrives after each launch.
        host = (ctypes.c_uint32 * 1024)()
        copy[15] = 1; copy[16] = ctypes.addressof(host)
        check("cuGraphAddMemcpyNode", ctypes.byref(node_host), graph, deps, 1, copy, None)
        copy[23] = 2   # two rows with a host side: not remoted
        print("HOST2D", lib.cuGraphAddMemcpyNode(ctypes.byref(ctypes.c_void_p()), graph, deps, 1, copy, None))
        # and one from this process's memory, refreshed before each launch
        src = (ctypes.c_uint32 * 16)(*range(16))
        up = (ctypes.c_uint64 * 25)()
        up[4] = 1; up[5] = ctypes.addressof(src); up[15] = 2; up[17] = b + 8192; up[22] = 64; up[23] = 1; up[24] = 1
        node_up = ctypes.c_void_p()
        check("cuGraphAddMemcpyNode", ctypes.byref(node_up), graph, None, 0, up, None)
        deps[0] = node_copy
        check("cuGraphAddMemFreeNode", ctypes.byref(node_free), graph, deps, 1, ctypes.c_uint64(ap.dptr))
        check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        print("FREED", (total.value - free.value) // (1 << 20))
        n = ctypes.c_size_t(0)
        check("cuGraphGetNodes", graph, None, ctypes.byref(n))
        exe = ctypes.c_void_p()
        check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
        src[0] = 77   # after the node was added: the launch must carry it
        check("cuGraphLaunch", exe, None)
        print("HOSTSIDE", hex(host[0]), hex(host[1023]))
        check("cuCtxSynchronize")
        out = (ctypes.c_uint32 * 1024)()
        check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(b), 4096)
        print("COPIED", hex(out[0]), hex(out[1023]))
        up_back = (ctypes.c_uint32 * 16)()
        check("cuMemcpyDtoH_v2", up_back, ctypes.c_uint64(b + 8192), 64)
        print("UPLOADED", list(up_back)[:3])
        # A kernel node: its arguments are packed as a launch packs them; the emulated device
        # refuses to run it when the graph is launched.
        ptx = open({str(EXAMPLES / "vecadd.ptx")!r}, "rb").read() + b"\\0"
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(fn), mod, b"vecadd")
        g2, kn, exe2 = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check("cuGraphCreate", ctypes.byref(g2), 0)
        a_, b_, c_, n_ = ctypes.c_uint64(b), ctypes.c_uint64(b), ctypes.c_uint64(b), ctypes.c_int(16)
        args = (ctypes.c_void_p * 4)(*(ctypes.addressof(x) for x in (a_, b_, c_, n_)))
        class KP(ctypes.Structure):
            _fields_ = [("func", ctypes.c_void_p)] + [(f, ctypes.c_uint) for f in ("gx", "gy", "gz", "bx", "by", "bz", "shmem")] + [
                ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]
        kp = KP(fn, 1, 1, 1, 32, 1, 1, 0, ctypes.addressof(args), None, None, None)
        check("cuGraphAddKernelNode_v2", ctypes.byref(kn), g2, None, 0, ctypes.byref(kp))
        check("cuGraphInstantiateWithFlags", ctypes.byref(exe2), g2, ctypes.c_ulonglong(0))
        check("cuGraphExecKernelNodeSetParams_v2", exe2, kn, ctypes.byref(kp))
        print("KERNEL", lib.cuGraphLaunch(exe2, None), lib.cuCtxSynchronize())
        print("NODES", n.value, "DONE")
        """)
    out = done.stdout
    assert "GRAPHMEM True 8" in out, out + done.stderr
    assert "HOST2D 801" in out
    assert "cuGraphAddMemcpyNode: this copy node" in done.stderr
    assert "HOSTSIDE 0x5a5a5a5a 0x5a5a5a5a" in out
    assert "UPLOADED [77, 1, 2]" in out
    assert "FREED 0" in out
    assert "COPIED 0x5a5a5a5a 0x5a5a5a5a" in out
    assert "KERNEL 0 801" in out
    assert " DONE" in out


def test_repeated_queries_are_answered_in_the_client_and_stay_exact(native_libs: build.Libraries, emulated: Server,
                                                                 tmp_path: Path) -> None:
    # PyTorch asks cuCtxGetDevice, cuDevicePrimaryCtxGetState and cuKernelGetAttribute thousands
    # of times per training step (trace mode): cached in the client, emptied by what changes them.
    done = py_client(native_libs, emulated.slices(emulated.token()), """
        ctx = setup()
        dev, flags, active, sms = ctypes.c_int(9), ctypes.c_uint(), ctypes.c_int(), ctypes.c_int()
        for _ in range(20000):
            check("cuCtxGetDevice", ctypes.byref(dev))
            check("cuDevicePrimaryCtxGetState", 0, ctypes.byref(flags), ctypes.byref(active))
            check("cuDeviceGetAttribute", ctypes.byref(sms), 16, 0)
        print("CACHED", dev.value, active.value, sms.value)
        check("cuDevicePrimaryCtxRelease_v2", 0)
        check("cuDevicePrimaryCtxGetState", 0, ctypes.byref(flags), ctypes.byref(active))
        print("RELEASED", active.value)
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
        check("cuDevicePrimaryCtxGetState", 0, ctypes.byref(flags), ctypes.byref(active))
        print("RETAINED", active.value)
        check("cuDevicePrimaryCtxSetFlags_v2", 0, 4)
        check("cuDevicePrimaryCtxGetState", 0, ctypes.byref(flags), ctypes.byref(active))
        print("FLAGS", flags.value)
        heap = ctypes.c_size_t()
        check("cuCtxGetLimit", ctypes.byref(heap), 2)            # CU_LIMIT_MALLOC_HEAP_SIZE
        check("cuCtxGetLimit", ctypes.byref(heap), 2)
        check("cuCtxSetLimit", 2, ctypes.c_size_t(heap.value + (1 << 20)))
        after = ctypes.c_size_t()
        check("cuCtxGetLimit", ctypes.byref(after), 2)
        print("LIMIT", after.value - heap.value)
        """, RGPU_CLIENT_STATS=str(tmp_path / "client"))
    out = done.stdout
    assert "CACHED 0 1 132" in out, out + done.stderr
    (profile,) = tmp_path.glob("client.*")
    trips = {p.name: p.sync_calls for p in client_stats.parse(profile.read_text())[0].values()}
    # 20,000 rounds of each query: at most the first of each (and the re-reads after changes) travel.
    assert trips.get("cuCtxGetDevice", 0) == 0 and trips.get("cuDeviceGetAttribute", 0) <= 1, trips
    assert trips.get("cuDevicePrimaryCtxGetState", 0) <= 4, trips
    assert "RELEASED 0" in out
    assert "RETAINED 1" in out
    assert "FLAGS 4" in out
    assert "LIMIT 1048576" in out
