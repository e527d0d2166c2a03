"""The applications of tests/remoting/test_gpu_isolation.py: driver-API programs (ctypes on rgpu's
libcuda.so.1, through tests/remoting/ctcuda.py) playing one role each.

    python isolation_client.py victim  CUBIN STOP_FILE        verified axpy until STOP_FILE exists
    python isolation_client.py attacker CUBIN                  a wild write, then synchronise
    python isolation_client.py probe   CUBIN                   one verified axpy (a new session)
    python isolation_client.py burn    CUBIN ITERS GO SECONDS  compute-bound kernels from GO for SECONDS
    python isolation_client.py spin    CUBIN                   a kernel that never finishes
Each prints lines the test reads (ROLE ...), flushed.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ctcuda import alloc, check, lib, setup  # noqa: E402

N = 1 << 20


def load(cubin: str, name: str) -> ctypes.c_void_p:
    image = Path(cubin).read_bytes()
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuModuleLoadData", ctypes.byref(mod), image)
    check("cuModuleGetFunction", ctypes.byref(fn), mod, name.encode())
    return fn


def launch(fn: ctypes.c_void_p, grid: int, block: int, *args: ctypes._SimpleCData) -> int:
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    return lib.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, None, params, None)


def victim(cubin: str, stop: str) -> None:
    setup()
    fn = load(cubin, "axpy")
    _, x = alloc(4 * N)
    _, y = alloc(4 * N)
    ones = (ctypes.c_float * N)(*([1.0] * N))
    check("cuMemcpyHtoD_v2", ctypes.c_uint64(x), ones, ctypes.c_size_t(4 * N))
    check("cuMemcpyHtoD_v2", ctypes.c_uint64(y), ones, ctypes.c_size_t(4 * N))
    out = (ctypes.c_float * N)()
    print("VICTIM ready", flush=True)
    done = 0
    while not os.path.exists(stop):
        r = launch(fn, (N + 255) // 256, 256, ctypes.c_float(2.0), ctypes.c_uint64(x), ctypes.c_uint64(y),
                   ctypes.c_int(N))
        r = r or lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(y), ctypes.c_size_t(4 * N))
        if r:
            print(f"VICTIM failed {r} after {done} iterations at {time.time():.3f}", flush=True)
            return
        done += 1
        expected = 1.0 + 2.0 * done
        if out[0] != expected or out[N - 1] != expected:
            print(f"VICTIM wrong {out[0]} {out[N - 1]} expected {expected} after {done}", flush=True)
            return
    print(f"VICTIM ok {done} iterations, results correct", flush=True)


def attacker(cubin: str) -> None:
    setup()
    fn = load(cubin, "wild_write")
    print("ATTACKER launch", launch(fn, 1, 1, ctypes.c_uint64(0x10)), flush=True)
    r = lib.cuCtxSynchronize()
    print(f"ATTACKER sync {r} at {time.time():.3f}", flush=True)


def probe(cubin: str) -> None:
    setup()
    fn = load(cubin, "axpy")
    r1, x = alloc(4 * N)
    r2, y = alloc(4 * N)
    if r1 or r2:
        print(f"PROBE failed alloc {r1 or r2}", flush=True)
        return
    ones = (ctypes.c_float * N)(*([1.0] * N))
    out = (ctypes.c_float * N)()
    r = lib.cuMemcpyHtoD_v2(ctypes.c_uint64(x), ones, ctypes.c_size_t(4 * N))
    r = r or lib.cuMemcpyHtoD_v2(ctypes.c_uint64(y), ones, ctypes.c_size_t(4 * N))
    r = r or launch(fn, (N + 255) // 256, 256, ctypes.c_float(2.0), ctypes.c_uint64(x), ctypes.c_uint64(y),
                    ctypes.c_int(N))
    r = r or lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(y), ctypes.c_size_t(4 * N))
    print("PROBE ok" if r == 0 and out[0] == 3.0 else f"PROBE failed {r}", flush=True)


def burn(cubin: str, iters: int, go: str, seconds: float) -> None:
    setup()
    fn = load(cubin, "burn")
    sms = ctypes.c_int()
    check("cuDeviceGetAttribute", ctypes.byref(sms), 16, 0)   # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    _, out = alloc(64)
    print("BURN ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    start = time.time()
    done: list[float] = []   # completion time of each batch of 4 kernels
    while time.time() - start < seconds:
        for _ in range(4):
            r = launch(fn, sms.value * 8, 256, ctypes.c_uint64(out), ctypes.c_int(iters))
        r = r or lib.cuCtxSynchronize()
        if r:
            print(f"BURN failed {r}", flush=True)
            return
        done.append(time.time())
    print("BURN " + json.dumps({"start": start, "batches": done, "kernels_per_batch": 4}), flush=True)


def spin(cubin: str) -> None:
    setup()
    fn = load(cubin, "spin_forever")
    _, flag = alloc(4)
    check("cuMemsetD32_v2", ctypes.c_uint64(flag), 0, ctypes.c_size_t(1))
    print("SPIN launch", launch(fn, 1, 1, ctypes.c_uint64(flag)), flush=True)
    print("SPIN spinning", flush=True)
    r = lib.cuCtxSynchronize()
    print(f"SPIN sync {r} at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    role, cubin, *rest = sys.argv[1:]
    if role == "victim":
        victim(cubin, rest[0])
    elif role == "attacker":
        attacker(cubin)
    elif role == "probe":
        probe(cubin)
    elif role == "burn":
        burn(cubin, int(rest[0]), rest[1], float(rest[2]))
    elif role == "spin":
        spin(cubin)
    else:
        raise SystemExit(f"unknown role {role}")
