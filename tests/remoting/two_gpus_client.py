"""A driver-API application for issue 16's two-device checks (run locally and through `flexrun -n 2`).

For each device: name, UUID, total memory, an allocation, copies and a vecadd kernel; then what
cuDeviceCanAccessPeer / cuDeviceGetP2PAttribute answer across the two devices, 64 MiB copied each
way with cuMemcpyPeer and cuMemcpyPeerAsync, and an allocation one MiB past each device's total
memory (a slice's limit through rgpu). Prints one `RESULT {json}` line; exit 0 unless a call that
must work failed.

    python two_gpus_client.py VECADD_PTX
"""
from __future__ import annotations

import ctypes
import json
import sys

from ctcuda import alloc, check, lib, mem_info

MiB = 1 << 20
PTX = open(sys.argv[1], "rb").read() + b"\0"
P2P_ACCESS_SUPPORTED = 2   # CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED


def error_name(code: int) -> str:
    text = ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(text))
    return text.value.decode() if text.value else str(code)


def device_checks(ordinal: int, ctx: ctypes.c_void_p) -> dict[str, object]:
    check("cuCtxSetCurrent", ctx)
    name = ctypes.create_string_buffer(256)
    check("cuDeviceGetName", name, 256, ordinal)
    uuid = ctypes.create_string_buffer(16)
    check("cuDeviceGetUuid_v2", uuid, ordinal)
    total = ctypes.c_size_t()
    check("cuDeviceTotalMem_v2", ctypes.byref(total), ordinal)
    free, ctx_total = mem_info()
    n = 1 << 20
    fa = (ctypes.c_float * n)(*(float(i % 1000 + ordinal) for i in range(n)))
    fb = (ctypes.c_float * n)(*(float(i % 7) * 0.5 for i in range(n)))
    ptrs = []
    for _ in range(3):
        r, p = alloc(4 * n)
        assert r == 0, r
        ptrs.append(ctypes.c_uint64(p))
    check("cuMemcpyHtoD_v2", ptrs[0], fa, ctypes.c_size_t(4 * n))
    check("cuMemcpyHtoD_v2", ptrs[1], fb, ctypes.c_size_t(4 * n))
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuModuleLoadData", ctypes.byref(mod), PTX)
    check("cuModuleGetFunction", ctypes.byref(fn), mod, b"vecadd")
    count = ctypes.c_uint32(n)
    params = (ctypes.c_void_p * 4)(*(ctypes.addressof(x) for x in (*ptrs, count)))
    check("cuLaunchKernel", fn, (n + 255) // 256, 1, 1, 256, 1, 1, 0, None, params, None)
    out = (ctypes.c_float * n)()
    check("cuMemcpyDtoH_v2", out, ptrs[2], ctypes.c_size_t(4 * n))
    kernel_ok = all(out[i] == fa[i] + fb[i] for i in range(0, n, 997))
    for p in ptrs:
        check("cuMemFree_v2", p)
    over, ptr = alloc(total.value + MiB)
    if over == 0:
        check("cuMemFree_v2", ctypes.c_uint64(ptr))
    return {"name": name.value.decode(), "uuid": uuid.raw.hex(), "total_memory": total.value,
            "ctx_total": ctx_total, "free": free, "kernel_ok": kernel_ok,
            "over_total_alloc": error_name(over)}


def peer_checks(ctxs: list[ctypes.c_void_p]) -> dict[str, object]:
    can01, can10, attr = ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_int(-1)
    check("cuDeviceCanAccessPeer", ctypes.byref(can01), 0, 1)
    check("cuDeviceCanAccessPeer", ctypes.byref(can10), 1, 0)
    check("cuDeviceGetP2PAttribute", ctypes.byref(attr), P2P_ACCESS_SUPPORTED, 0, 1)
    size = 64 * MiB
    src = bytes((i * 13) % 255 for i in range(size))
    bufs = []
    for ordinal, ctx in enumerate(ctxs):
        check("cuCtxSetCurrent", ctx)
        r, p = alloc(size)
        assert r == 0, r
        bufs.append(ctypes.c_uint64(p))
    check("cuCtxSetCurrent", ctxs[0])
    check("cuMemcpyHtoD_v2", bufs[0], src, ctypes.c_size_t(size))
    check("cuMemcpyPeer", bufs[1], ctxs[1], bufs[0], ctxs[0], ctypes.c_size_t(size))     # 0 -> 1
    check("cuCtxSetCurrent", ctxs[1])
    back = ctypes.create_string_buffer(size)
    check("cuMemcpyDtoH_v2", back, bufs[1], ctypes.c_size_t(size))
    forward_ok = back.raw == src
    check("cuCtxSetCurrent", ctxs[0])
    check("cuMemsetD8_v2", bufs[0], 0, ctypes.c_size_t(size))
    stream = ctypes.c_void_p()
    check("cuStreamCreate", ctypes.byref(stream), 0)
    check("cuMemcpyPeerAsync", bufs[0], ctxs[0], bufs[1], ctxs[1], ctypes.c_size_t(size), stream)   # 1 -> 0
    check("cuStreamSynchronize", stream)
    check("cuMemcpyDtoH_v2", back, bufs[0], ctypes.c_size_t(size))
    return {"can_access_peer_0_1": can01.value, "can_access_peer_1_0": can10.value,
            "p2p_access_supported": attr.value, "peer_copy_0_to_1": forward_ok,
            "peer_copy_async_1_to_0": back.raw == src}


def main() -> None:
    check("cuInit", 0)
    count = ctypes.c_int()
    check("cuDeviceGetCount", ctypes.byref(count))
    ctxs = []
    for ordinal in range(count.value):
        ctx = ctypes.c_void_p()
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), ordinal)
        ctxs.append(ctx)
    result: dict[str, object] = {"devices": count.value,
                                 "per_device": [device_checks(i, c) for i, c in enumerate(ctxs)]}
    if count.value >= 2:
        result.update(peer_checks(ctxs[:2]))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
