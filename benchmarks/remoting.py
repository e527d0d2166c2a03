"""Remoting benchmark (issue 4, item 8): the same application run locally and through rgpu.

    python benchmarks/remoting.py [--json results.json] [--backend cuda|emulated]

On a GPU machine it starts a session server with the real-GPU backend on a loopback port, then
runs one workload (a cuda-python driver-API program, this file with --child) twice: against
NVIDIA's libcuda.so.1, and through rgpu's libcuda.so.1 with a whole-GPU slice. It prints a
table and JSON. Targets over loopback: sync round trip <= 60 us median; pipelined launch rate
>= 50% of native; 256 MiB copies >= 2 GB/s; compute-bound loop >= 90% of native.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PTX = HERE.parent / "examples" / "cuda" / "vecadd.ptx"
MiB = 1 << 20


# ---------------------------------------------------------------------------------- the workload

def child(iterations: int) -> dict[str, float]:
    import numpy as np
    from cuda.bindings import driver as d

    def ok(res):  # type: ignore[no-untyped-def]
        assert int(res[0]) == 0, res
        return res[1] if len(res) == 2 else None

    ok(d.cuInit(0))
    dev = ok(d.cuDeviceGet(0))
    ctx = ok(d.cuDevicePrimaryCtxRetain(dev))
    ok(d.cuCtxSetCurrent(ctx))
    mod = ok(d.cuModuleLoadData(PTX.read_bytes() + b"\0"))
    empty = ok(d.cuModuleGetFunction(mod, b"empty"))
    spin = ok(d.cuModuleGetFunction(mod, b"spin"))
    sms = ok(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
    stream = ok(d.cuStreamCreate(0))
    out: dict[str, float] = {}

    # 1. Synchronising call round trip: an idle cuCtxSynchronize.
    samples = []
    for i in range(iterations + 200):
        t0 = time.perf_counter_ns()
        d.cuCtxSynchronize()
        if i >= 200:
            samples.append(time.perf_counter_ns() - t0)
    out["sync_round_trip_us_median"] = statistics.median(samples) / 1000
    out["sync_round_trip_us_p99"] = sorted(samples)[int(len(samples) * 0.99)] / 1000

    # 2. Pipelined launches: empty kernels that nobody waits for, then one synchronisation.
    launches = iterations * 10
    for _ in range(1000):
        d.cuLaunchKernel(empty, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0)
    ok(d.cuStreamSynchronize(stream))
    # One burst lasts ~0.1 s, so a scheduler hiccup moves it by tens of percent: report the
    # median of five bursts (the same for local and remote).
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(launches):
            d.cuLaunchKernel(empty, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0)
        ok(d.cuStreamSynchronize(stream))
        rates.append(launches / (time.perf_counter() - t0))
    out["launches_per_s"] = statistics.median(rates)
    out["launches_per_s_min"] = min(rates)
    out["launches_per_s_max"] = max(rates)

    # 3. 256 MiB copies from and to pageable host memory (what numpy arrays are).
    n = 256 * MiB
    host = np.random.randint(0, 255, size=n, dtype=np.uint8)
    back = np.empty_like(host)
    dptr = ok(d.cuMemAlloc(n))
    h2d, d2h = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        ok(d.cuMemcpyHtoD(dptr, host.ctypes.data, n))
        ok(d.cuCtxSynchronize())   # a remote host-to-device copy returns before it lands
        h2d.append(n / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        ok(d.cuMemcpyDtoH(back.ctypes.data, dptr, n))
        d2h.append(n / (time.perf_counter() - t0) / 1e9)
    assert np.array_equal(host, back)
    out["h2d_256MiB_GBps"] = statistics.median(h2d)
    out["d2h_256MiB_GBps"] = statistics.median(d2h)
    ok(d.cuMemFree(dptr))

    # 4. A compute-bound kernel loop (FMA chains on every SM).
    result = ok(d.cuMemAlloc(64))
    ptr = ctypes.c_uint64(int(result))
    iters = ctypes.c_int(100000)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(iters))
    grid = sms * 16
    d.cuLaunchKernel(spin, grid, 1, 1, 256, 1, 1, 0, stream, ctypes.addressof(params), 0)
    ok(d.cuStreamSynchronize(stream))
    k = 20
    t0 = time.perf_counter()
    for _ in range(k):
        d.cuLaunchKernel(spin, grid, 1, 1, 256, 1, 1, 0, stream, ctypes.addressof(params), 0)
    ok(d.cuStreamSynchronize(stream))
    dt = time.perf_counter() - t0
    out["compute_loop_tflops"] = 4.0 * grid * 256 * iters.value * k / dt / 1e12
    out["compute_loop_ms_per_launch"] = dt / k * 1000
    return out


# ---------------------------------------------------------------------------------- the driver

TARGETS = {  # metric: (kind, threshold) -- absolute, or relative to local
    "sync_round_trip_us_median": ("max_abs", 60.0),
    "launches_per_s": ("min_rel", 0.50),
    "h2d_256MiB_GBps": ("min_abs", 2.0),
    "d2h_256MiB_GBps": ("min_abs", 2.0),
    "compute_loop_tflops": ("min_rel", 0.90),
}


def run_child(env: dict[str, str], iterations: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--child", "--iterations", str(iterations)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark workload failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_session_server(gpu, secret: bytes, backend: str = "cuda"):  # type: ignore[no-untyped-def]
    """A session server for `gpu` on a loopback port, with no pool beside it: (server, address).
    Its live-lease view starts empty ("no token revoked"): without one, a dispatcher refuses every
    token until the pool first answers (fail closed)."""
    from rgpu.live_leases import LiveLeases
    from rgpu.remoting.dispatcher.sessions import SessionServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    logging.basicConfig(level=logging.WARNING)
    server = SessionServer(listen_socket=sock, advertised=address, gpus=[gpu], secret=secret,
                           port_range=(45201, 46225), backend=backend, log=logging.getLogger("rgpu.bench"))
    server.update_live(LiveLeases.of(0.0, []))
    server.start()
    return server, address


def slice_env(base: dict[str, str], libs_folder: object, secret: bytes, address: str, gpu, job_key: str,  # type: ignore[no-untyped-def]
              memory_limit_bytes: int = 0, compute_percent: int = 100) -> dict[str, str]:
    """`base` with rgpu's client libraries first on LD_LIBRARY_PATH (libnccl.so.2 preloaded, as flexrun does) and one slice of `gpu` served at
    `address` (the whole GPU unless `memory_limit_bytes` says less), its token signed with `secret`
    and never expiring: how the benchmarks run a program through rgpu without a pool."""
    from rgpu import tokens
    token = tokens.sign(secret, tokens.SliceClaims(
        job_key=job_key, slice_number=0, server=address, gpu_uuid=gpu.uuid, gpu_index=0,
        memory_limit_bytes=memory_limit_bytes or gpu.total_memory_bytes, compute_percent=compute_percent,
        expires_unix=0, issued_unix=time.time()))
    from rgpu.remoting.client.flexrun import library_env
    return dict(base, **library_env(Path(str(libs_folder)), base), RGPU_SLICES=f"{address},{token}")


def local_gpu():  # type: ignore[no-untyped-def]
    """The GPU the benchmarks serve: NVML index 0, or the one GPU CUDA_VISIBLE_DEVICES names by index
    (so `CUDA_VISIBLE_DEVICES=1 python benchmarks/...` runs locally and through rgpu on GPU 1)."""
    import pynvml

    from rgpu.model import GpuInfo
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    index = int(visible) if visible.isdigit() else 0
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    def as_text(v: str | bytes) -> str:
        return v.decode() if isinstance(v, bytes) else v
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
    gpu = GpuInfo(uuid=as_text(pynvml.nvmlDeviceGetUUID(h)), index=index, name=as_text(pynvml.nvmlDeviceGetName(h)),
                  total_memory_bytes=pynvml.nvmlDeviceGetMemoryInfo(h).total,
                  usable_memory_bytes=pynvml.nvmlDeviceGetMemoryInfo(h).total, compute_capability=f"{major}.{minor}")
    pynvml.nvmlShutdown()
    return gpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compute-percent", type=int, default=100)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.iterations)))
        return 0

    from rgpu.remoting.native.build import ensure_built


    libs = ensure_built()
    gpu = local_gpu()
    secret = os.urandom(32)
    server, address = start_session_server(gpu, secret)
    try:
        limit = gpu.total_memory_bytes // 2
        base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        local = run_child(base, args.iterations)
        remote_env = slice_env(base, libs.folder, secret, address, gpu, "bench", memory_limit_bytes=limit,
                               compute_percent=args.compute_percent)
        remote = run_child(remote_env, args.iterations)
        status = server.status()
        enforcement, launch_path = status["compute_enforcement"], status["launch_path"]
    finally:
        server.stop()

    rows = []
    for metric in local:
        target = TARGETS.get(metric)
        ratio = remote[metric] / local[metric] if local[metric] else float("nan")
        verdict = ""
        if target:
            kind, value = target
            passed = {"max_abs": remote[metric] <= value, "min_abs": remote[metric] >= value,
                      "min_rel": ratio >= value}[kind]
            verdict = ("PASS" if passed else "FAIL") + f" ({kind.split('_')[0]} {value:g}{' x local' if kind == 'min_rel' else ''})"
        rows.append((metric, local[metric], remote[metric], ratio, verdict))
    width = max(len(r[0]) for r in rows)
    print(f"rgpu remoting benchmark: {gpu.name}, loopback, slice {args.compute_percent}% ({enforcement}), "
          f"worker launches: {launch_path}")
    print(f"{'metric':<{width}}  {'local':>12}  {'remote':>12}  {'remote/local':>12}  target")
    for metric, lv, rv, ratio, verdict in rows:
        print(f"{metric:<{width}}  {lv:>12.3f}  {rv:>12.3f}  {ratio:>12.3f}  {verdict}")
    result = {"gpu": gpu.name, "compute_enforcement": enforcement, "launch_path": launch_path, "local": local, "remote": remote,
              "targets": {k: list(v) for k, v in TARGETS.items()},
              "passed": all("FAIL" not in r[4] for r in rows)}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    raise SystemExit(main())
