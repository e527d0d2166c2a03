"""The host-node program head and copy sizes shared by the host-node tests (emulated and real GPU)."""

from __future__ import annotations

HOST_PROGRAM_HEAD = """
    setup()
    HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    order = []

    @HOSTFN
    def mark(user):
        order.append(user or 0)

    s = ctypes.c_void_p()
    check("cuStreamCreate", ctypes.byref(s), 1)
    r, a = alloc(1024)
    r2, b = alloc(1024)
    out = (ctypes.c_uint32 * 256)()
"""

# A graph waits in its host node while a copy larger than the worker's receive buffer and staging
# ring is queued behind it on the same stream.
LARGE_COPY = """
    import os
    n = 48 << 20
    data = os.urandom(n)
    r3, big = alloc(n)
    check("cuStreamBeginCapture_v2", s, 0)
    check("cuMemsetD32Async", ctypes.c_uint64(a), 1, 256, s)
    check("cuLaunchHostFunc", s, mark, ctypes.c_void_p(7))
    graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuStreamEndCapture", s, ctypes.byref(graph))
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
    check("cuGraphLaunch", exe, s)
    check("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(big), data, ctypes.c_size_t(n), s)
    check("cuStreamSynchronize", s)
    back = ctypes.create_string_buffer(n)
    check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(big), ctypes.c_size_t(n))
    print("ORDER", order, "SAME", back.raw == data)
    """
# The client dies inside a host function: the worker's host node must give up.
DYING = """
    import os

    @HOSTFN
    def die(user):
        print("DYING", flush=True)
        os._exit(3)

    check("cuStreamBeginCapture_v2", s, 0)
    check("cuLaunchHostFunc", s, die, None)
    graph, exe = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuStreamEndCapture", s, ctypes.byref(graph))
    check("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
    check("cuGraphLaunch", exe, s)
    check("cuStreamSynchronize", s)
    print("NOT REACHED")
    """
