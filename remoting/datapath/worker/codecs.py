"""Encoding helpers shared by the worker's handlers: length-prefixed strings, option lists,
function parameter layouts, and the fixed request layouts."""

from __future__ import annotations

import struct

from rgpu.remoting.datapath import protocol

from rgpu.remoting.datapath.backends.base import FnInfo

U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
# rgpuModuleNodes, per node: node, owner, the node's words at 0x0, 0x10, 0x18, 0x28, and its u32 at 0x370
MODULE_NODE = struct.Struct("<QQQQQQII")
MAX_MODULE_NODES = 64
I32 = struct.Struct("<i")
LAUNCH = struct.Struct("<QQ12I")      # f, stream, grid[3], block[3], shmem, coop, nattrs, argsize, pad, pad
COPY = struct.Struct("<QQQ")          # address, stream, size
ALLOC = struct.Struct("<QQQQI")       # size, a, b, height, elem
LAUNCH_ATTR_SIZE = 72
HEADER = protocol.HEADER


def launch_shape(payload: memoryview | bytes) -> str:
    """What kind of launch a cuLaunchKernel request is (RGPU_WORKER_PROFILE says which launches
    the fast paths left to the generic one): plain, cooperative, or its attribute ids."""
    if len(payload) < LAUNCH.size:
        return "short"
    coop, nattrs = LAUNCH.unpack_from(payload, 0)[9:11]
    if nattrs:
        ids = sorted({U32.unpack_from(payload, LAUNCH.size + i * LAUNCH_ATTR_SIZE)[0] for i in range(nattrs)
                      if LAUNCH.size + (i + 1) * LAUNCH_ATTR_SIZE <= len(payload)})
        return "attributes " + ",".join(map(str, ids)) + (" cooperative" if coop else "")
    return "cooperative" if coop else "plain"


def lp(data: bytes) -> bytes:
    return U32.pack(len(data)) + data


def take_str(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = U32.unpack_from(buf, off)
    off += 4
    return bytes(buf[off:off + n]).decode("utf-8", "replace"), off + n


def fn_bytes(fn: FnInfo) -> bytes:
    name = fn.name.encode()
    out = [U64.pack(fn.handle), U32.pack(len(name)), name, U32.pack(len(fn.params))]
    out.extend(struct.pack("<II", o, s) for o, s in fn.params)
    return b"".join(out)


def fn_without_handle(fn: FnInfo) -> bytes:
    return fn_bytes(fn)[8:]


def read_options(buf: memoryview, off: int) -> tuple[list[tuple[int, int]], int]:
    (n,) = U32.unpack_from(buf, off)
    off += 4
    out = []
    for _ in range(n):
        opt, value = struct.unpack_from("<iQ", buf, off)
        off += 12
        out.append((opt, value))
    return out, off

