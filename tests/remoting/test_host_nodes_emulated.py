"""Host functions inside CUDA graphs through rgpu's libcuda.so.1: host nodes (cuGraphAddHostNode,
and cuLaunchHostFunc on a capturing stream) run the application's function in the client process,
in graph order, while the graph lives on the worker. Against an emulated worker (which runs a
graph's nodes in order and asks the client to run each host node's function), and again through
the real-GPU backend's code chained to one (its driver host nodes call back through rgpu's own
client library)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
from rgpu.remoting.datapath import protocol
from rgpu.remoting.native import build

from tests.remoting.conftest import PY, Server, run_client
from tests.remoting.client_helpers import py_client
from tests.remoting.host_nodes_helpers import DYING, HOST_PROGRAM_HEAD, LARGE_COPY


@pytest.fixture(params=["emulated", "chained"])
def worker(request: pytest.FixtureRequest) -> Server:
    return request.getfixturevalue(request.param)


def test_captured_host_functions_run_in_the_client_in_graph_order(native_libs: build.Libraries, worker: Server) -> None:
    done = py_client(native_libs, worker.slices(worker.token()), HOST_PROGRAM_HEAD + """
    check("cuStreamBeginCapture_v2", s, 0)
    check("cuMemsetD32Async", ctypes.c_uint64(a), 7, 256, s)
    check("cuLaunchHostFunc", s, mark, ctypes.c_void_p(1))
    check("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(b), ctypes.c_uint64(a), 1024, s)
    check("cuLaunchHostFunc", s, mark, ctypes.c_void_p(2))
    check("cuMemsetD32Async", ctypes.c_uint64(a), 9, 1, s)
    graph = ctypes.c_void_p()
    check("cuStreamEndCapture", s, ctypes.byref(graph))
    print("CAPTURED", order)
    nodes = ctypes.c_size_t(0)
    check("cuGraphGetNodes", graph, None, ctypes.byref(nodes))
    print("NODES", nodes.value)
    exe = ctypes.c_void_p()
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
    print("INSTANTIATED", order)
    for i in range(3):
        check("cuGraphLaunch", exe, s)
    check("cuStreamSynchronize", s)
    print("ORDER", order)
    check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(b), 1024)
    print("B", out[0], out[255])
    check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(a), 1024)
    print("A", out[0], out[1])

    # A CUDA call from inside a host function is not permitted (CUDA forbids it; here the calling
    # thread also holds the session the function's request came on).
    seen = []

    @HOSTFN
    def calls_cuda(user):
        p = ctypes.c_uint64()
        seen.append(lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(16)))

    check("cuStreamBeginCapture_v2", s, 0)
    check("cuLaunchHostFunc", s, calls_cuda, None)
    check("cuStreamEndCapture", s, ctypes.byref(graph))
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
    check("cuGraphLaunch", exe, s)
    check("cuStreamSynchronize", s)
    print("INSIDE", seen)

    # A stream callback on a capturing stream is refused, as NVIDIA's driver refuses it.
    CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
    cb = CALLBACK(lambda stream, status, user: order.append(99))
    check("cuStreamBeginCapture_v2", s, 0)
    print("CALLBACK", call("cuStreamAddCallback", s, cb, None, 0))
    call("cuStreamEndCapture", s, ctypes.byref(graph))
    # Outside a capture, both still run after the stream's earlier work, in this process.
    check("cuLaunchHostFunc", s, mark, ctypes.c_void_p(5))
    check("cuStreamAddCallback", s, cb, None, 0)
    print("PLAIN", order[-2:])
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CAPTURED []" in done.stdout          # capture records; it runs nothing
    assert "NODES 5" in done.stdout
    assert "INSTANTIATED []" in done.stdout
    assert "ORDER [1, 2, 1, 2, 1, 2]" in done.stdout
    assert "B 7 7" in done.stdout                 # the copy ran between the two host functions
    assert "A 9 7" in done.stdout
    assert "INSIDE [800]" in done.stdout          # CUDA_ERROR_NOT_PERMITTED
    assert "CALLBACK 900" in done.stdout          # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert "PLAIN [5, 99]" in done.stdout


def test_host_function_sees_and_leaves_the_memory_of_host_copy_nodes(native_libs: build.Libraries,
                                                                     worker: Server) -> None:
    """simpleCudaGraphs' callback reads the result a device-to-host copy node just wrote into this
    process's memory and resets it; a host function may also prepare what a later host-to-device
    copy node reads. Copy nodes with a host side go through worker buffers, so each host call
    brings them into this process's memory and back."""
    done = py_client(native_libs, worker.slices(worker.token()), HOST_PROGRAM_HEAD + """
    res = (ctypes.c_uint32 * 4)()
    inp = (ctypes.c_uint32 * 4)()
    got = (ctypes.c_uint32 * 4)()
    seen = []

    @HOSTFN
    def consume(user):
        seen.append(res[0])
        res[0] = 0
        inp[0] += 100

    check("cuStreamBeginCapture_v2", s, 0)
    check("cuMemsetD32Async", ctypes.c_uint64(a), 5, 4, s)
    check("cuMemcpyDtoHAsync_v2", res, ctypes.c_uint64(a), 16, s)
    check("cuLaunchHostFunc", s, consume, None)
    check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(b), inp, 16, s)
    check("cuMemcpyDtoHAsync_v2", got, ctypes.c_uint64(b), 16, s)
    graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuStreamEndCapture", s, ctypes.byref(graph))
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
    for i in range(3):
        check("cuGraphLaunch", exe, s)
        check("cuStreamSynchronize", s)
    print("SEEN", seen, "RES", res[0], "GOT", got[0], "INP", inp[0])
    """)
    assert "SEEN [5, 5, 5] RES 0 GOT 300 INP 300" in done.stdout, done.stdout + done.stderr


def test_graph_built_with_host_nodes_and_their_parameters(native_libs: build.Libraries, worker: Server) -> None:
    done = py_client(native_libs, worker.slices(worker.token()), HOST_PROGRAM_HEAD + """
    class HOSTPARAMS(ctypes.Structure):
        _fields_ = [("fn", ctypes.c_void_p), ("userData", ctypes.c_void_p)]

    class MEMSET(ctypes.Structure):
        _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                    ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]

    mark_address = ctypes.cast(mark, ctypes.c_void_p).value
    graph = ctypes.c_void_p()
    check("cuGraphCreate", ctypes.byref(graph), 0)
    first, host, last = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check("cuGraphAddMemsetNode", ctypes.byref(first), graph, None, 0,
          ctypes.byref(MEMSET(a, 0, 3, 4, 256, 1)), None)
    check("cuGraphAddHostNode", ctypes.byref(host), graph, ctypes.byref(first), 1,
          ctypes.byref(HOSTPARAMS(mark_address, 10)))
    check("cuGraphAddMemsetNode", ctypes.byref(last), graph, ctypes.byref(host), 1,
          ctypes.byref(MEMSET(a, 0, 4, 4, 1, 1)), None)
    kind = ctypes.c_int(-1)
    check("cuGraphNodeGetType", host, ctypes.byref(kind))
    print("TYPE", kind.value)
    check("cuGraphNodeGetType", first, ctypes.byref(kind))
    print("TYPE_MEMSET", kind.value)
    got = HOSTPARAMS()
    check("cuGraphHostNodeGetParams", host, ctypes.byref(got))
    print("PARAMS", got.fn == mark_address, got.userData)
    print("NOT_HOST", call("cuGraphHostNodeGetParams", first, ctypes.byref(got)))
    print("NULL_FN", call("cuGraphAddHostNode", ctypes.byref(host), graph, None, 0, ctypes.byref(HOSTPARAMS(None, 1))))
    exe = ctypes.c_void_p()
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
    check("cuGraphLaunch", exe, s)
    check("cuStreamSynchronize", s)
    print("RUN1", order)
    # The graph's node changes; the executable graph keeps what it was instantiated with ...
    check("cuGraphHostNodeSetParams", host, ctypes.byref(HOSTPARAMS(mark_address, 11)))
    check("cuGraphLaunch", exe, s)
    check("cuStreamSynchronize", s)
    print("RUN2", order)
    # ... until its own instance is set.
    check("cuGraphExecHostNodeSetParams", exe, host, ctypes.byref(HOSTPARAMS(mark_address, 12)))
    check("cuGraphLaunch", exe, s)
    check("cuStreamSynchronize", s)
    print("RUN3", order)
    check("cuGraphHostNodeGetParams", host, ctypes.byref(got))
    print("GRAPH_NODE", got.userData)
    exe2 = ctypes.c_void_p()
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe2), graph, ctypes.c_ulonglong(0))
    check("cuGraphLaunch", exe2, s)
    check("cuMemcpyDtoH_v2", out, ctypes.c_uint64(a), 1024)   # a blocking copy serves the host node too
    print("RUN4", order, out[0], out[1])
    check("cuGraphExecDestroy", exe)
    check("cuGraphExecDestroy", exe2)
    check("cuGraphDestroy", graph)
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TYPE 3" in done.stdout                # CU_GRAPH_NODE_TYPE_HOST
    assert "TYPE_MEMSET 2" in done.stdout
    assert "PARAMS True 10" in done.stdout
    assert "NOT_HOST 1" in done.stdout            # CUDA_ERROR_INVALID_VALUE
    assert "NULL_FN 1" in done.stdout
    assert "RUN1 [10]" in done.stdout
    assert "RUN2 [10, 10]" in done.stdout
    assert "RUN3 [10, 10, 12]" in done.stdout
    assert "GRAPH_NODE 11" in done.stdout
    assert "RUN4 [10, 10, 12, 11] 4 3" in done.stdout


def test_large_copy_queued_behind_a_waiting_host_node(native_libs: build.Libraries, worker: Server) -> None:
    """A graph waits in its host node while the application queues a copy larger than the worker's
    receive buffer and staging ring on the same stream (the chained worker's copy handler blocks on
    the graph): the host node reads on past the full buffer until the client's answer arrives."""
    done = py_client(native_libs, worker.slices(worker.token(memory_limit=2 << 30)), HOST_PROGRAM_HEAD + LARGE_COPY, timeout=120)
    assert "ORDER [7] SAME True" in done.stdout, done.stdout + done.stderr


def _sessions_end(server: Server) -> list[dict]:
    deadline = time.monotonic() + 30   # a guard against a hung worker, not a speed check
    while server.server.status()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.server.status()["sessions"]


def test_client_exiting_inside_a_host_function_ends_the_worker(native_libs: build.Libraries, worker: Server) -> None:
    """The worker's host node waits for the client's answer; the client dies instead: the node
    gives up when the connection ends and the session closes (no hung worker)."""
    done = py_client(native_libs, worker.slices(worker.token()), HOST_PROGRAM_HEAD + DYING)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "DYING" in done.stdout and "NOT REACHED" not in done.stdout
    assert _sessions_end(worker) == []


def test_client_leaving_a_graph_queued_on_a_host_node_ends_the_worker(native_libs: build.Libraries,
                                                                       worker: Server) -> None:
    """The application launches a graph with a host node and exits without synchronising: its
    function never runs (the process is gone), and the worker's node gives up."""
    done = py_client(native_libs, worker.slices(worker.token()), HOST_PROGRAM_HEAD + """
    check("cuStreamBeginCapture_v2", s, 0)
    check("cuLaunchHostFunc", s, mark, ctypes.c_void_p(1))
    check("cuMemsetD32Async", ctypes.c_uint64(a), 1, 256, s)
    graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuStreamEndCapture", s, ctypes.byref(graph))
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
    check("cuGraphLaunch", exe, s)
    print("LEAVING", order)
    """)
    assert done.returncode == 0 and "LEAVING []" in done.stdout, done.stdout + done.stderr
    assert _sessions_end(worker) == []


class _FakeWorker:
    """A server that speaks the data-path protocol and, before answering the client's first
    call, asks it to run a host function id the client never registered: a hostile or confused
    peer, which only a stand-in can be."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.verdicts: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _read(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            try:
                length = struct.unpack_from("<I", self._read(conn, protocol.HEADER_SIZE))[0]
                self._read(conn, length)
                conn.sendall(protocol.encode_welcome(driver_version=13000, memory_limit_bytes=1 << 30,
                                                     compute_percent=100, flags=protocol.WELCOME_EMULATED,
                                                     description="fake worker"))
                asked = False
                while True:
                    length, op, _flags, seq, _aux, _ctx = protocol.HEADER.unpack(self._read(conn, protocol.HEADER_SIZE))
                    self._read(conn, length)
                    if op == protocol.OP_BYE:
                        return
                    if op == protocol.OP_HOST_DONE:
                        self.verdicts.append(_aux)
                        continue
                    if not asked:
                        asked = True
                        conn.sendall(protocol.pack_frame(protocol.OP_HOST_CALL, seq=77, ctx=0xDEAD_BEEF))
                        length, op, _flags, number, verdict, _ctx = protocol.HEADER.unpack(self._read(conn, protocol.HEADER_SIZE))
                        self._read(conn, length)
                        self.verdicts.append(verdict if op == protocol.OP_HOST_DONE and number == 77 else -1)
                    conn.sendall(protocol.pack_frame(protocol.OP_REPLY, struct.pack("<i", 0) + bytes(64), seq=seq))
            except (EOFError, OSError):
                return


def test_client_refuses_a_host_function_id_it_never_registered(native_libs: build.Libraries) -> None:
    fake = _FakeWorker()
    # RGPU_LANES=1: the fake takes one connection, and a client with data lanes dials those first.
    done = run_client(native_libs, f"{fake.address},token", [PY, "-c", "import ctypes; lib = ctypes.CDLL('libcuda.so.1'); "
                                                             "print('INIT', lib.cuInit(0))"], RGPU_LANES="1")
    fake.thread.join(timeout=30)
    assert "INIT 0" in done.stdout, done.stdout + done.stderr
    assert fake.verdicts[:1] == [protocol.HOST_DONE_UNKNOWN_ID]
    assert "asked to run host function 3735928559, which this process never registered (refused" in done.stderr
