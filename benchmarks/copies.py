"""Copy benchmark (issue 25): host<->device copies through rgpu over UCX shared memory, UCX TCP and
rgpu's own TCP stream, beside the raw single-stream loopback TCP figure of the same machine.

    python benchmarks/copies.py [--backend emulated|cuda] [--sizes 128,256] [--reps 5] [--json out.json]

One run prints, for 128 and 256 MiB pinned (cuMemAllocHost) and pageable (malloc) buffers, host to
device and device to host: GB/s (median of --reps) and the fraction of raw TCP. The emulated
backend (CPU only; the "device" is the worker's memory) measures the data path alone; on a GPU
machine `--backend cuda` adds the PCIe copy behind it. Every configuration starts its own session
server, so UCX_TLS applies to both ends. The CI target: same-host pinned 128 MiB copies over UCX at
>= 2x raw single-stream loopback TCP. Speeds are reported here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 1 << 20

WORKLOAD_C = r"""
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s = %d (line %d)\n", #x, (int)r_, __LINE__); exit(1); } } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    int reps = atoi(argv[1]);
    CUdevice d; CUcontext ctx;
    CK(cuInit(0)); CK(cuDeviceGet(&d, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, d)); CK(cuCtxSetCurrent(ctx));
    printf("{");
    int first = 1;
    for (int a = 2; a < argc; a++) {
        size_t n = (size_t)atoi(argv[a]) << 20;
        CUdeviceptr p; CK(cuMemAlloc(&p, n));
        for (int pinned = 1; pinned >= 0; pinned--) {
            unsigned char *h;
            if (pinned) CK(cuMemAllocHost((void **)&h, n)); else h = malloc(n);
            memset(h, 7, n);
            for (int dir = 0; dir < 2; dir++) {
                double t[64];
                int k = reps < 64 ? reps : 64;
                if (dir == 0) CK(cuMemcpyHtoD(p, h, n)); else CK(cuMemcpyDtoH(h, p, n));   /* warm up */
                for (int i = 0; i < k; i++) {
                    double t0 = now();
                    if (dir == 0) CK(cuMemcpyHtoD(p, h, n)); else CK(cuMemcpyDtoH(h, p, n));
                    CK(cuCtxSynchronize());
                    t[i] = n / (now() - t0) / 1e9;
                }
                qsort(t, k, sizeof *t, cmp);
                printf("%s\"%s_%s_%zuMiB_GBps\": %.3f", first ? "" : ", ", dir ? "d2h" : "h2d",
                       pinned ? "pinned" : "pageable", n >> 20, t[k / 2]);
                first = 0;
            }
            if (pinned) CK(cuMemFreeHost(h)); else free(h);
        }
        CK(cuMemFree(p));
    }
    printf("}\n");
    return 0;
}
"""

# One TCP stream over loopback, in C: what a single socket moves on this machine (the yardstick).
RAW_TCP_C = r"""
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    size_t total = (size_t)atoll(argv[1]) << 20, chunk = 4u << 20;
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1, big = 4 << 20;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    bind(ls, (void *)&a, sizeof a); listen(ls, 1); getsockname(ls, (void *)&a, &al);
    char *buf = malloc(chunk); memset(buf, 1, chunk);
    if (fork() == 0) {
        int s = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(s, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
        connect(s, (void *)&a, sizeof a);
        for (size_t sent = 0; sent < total;) { ssize_t k = send(s, buf, chunk, 0); if (k <= 0) _exit(1); sent += k; }
        close(s); _exit(0);
    }
    int c = accept(ls, NULL, NULL);
    setsockopt(c, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0);
    size_t got = 0; ssize_t k;
    while ((k = recv(c, buf, chunk, 0)) > 0) got += k;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    wait(NULL);
    printf("%.3f\n", got / ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9) / 1e9);
    return got == total ? 0 : 1;
}
"""

CONFIGS = {   # name: (client environment, worker environment: set in this process before its server starts)
    # Shared memory: UCX's posix transport (copy-in/copy-out through a shared segment, pipelined by
    # both processes), and with cma (single-copy process_vm_readv rendezvous, UCX's choice by default
    # when both are allowed; slower than posix alone on some VMs' kernels).
    "ucx-shm": ({"RGPU_TRANSPORT": "ucx", "UCX_TLS": "posix,self"}, {"UCX_TLS": "posix,self"}),
    "ucx-shm-cma": ({"RGPU_TRANSPORT": "ucx", "UCX_TLS": "posix,cma,self"}, {"UCX_TLS": "posix,cma,self"}),
    "ucx-tcp": ({"RGPU_TRANSPORT": "ucx", "UCX_TLS": "tcp"}, {"UCX_TLS": "tcp"}),
    "rgpu-tcp": ({"RGPU_TRANSPORT": "tcp"}, {}),
}


def _cuda_include() -> Path:
    for c in ([Path(os.environ["CUDA_HOME"]) / "include"] if os.environ.get("CUDA_HOME") else []) + \
            [Path("/usr/local/cuda/include")]:
        if (c / "cuda.h").exists():
            return c
    raise SystemExit("benchmarks/copies.py: no cuda.h (set CUDA_HOME or install the CUDA toolkit headers)")


def _compile(source: str, out: Path, *extra: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    cc = shutil.which("gcc") or shutil.which("cc") or "cc"
    done = subprocess.run([cc, "-O2", str(src), "-o", str(out), *extra], capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"benchmarks/copies.py: cannot compile {src.name}:\n{done.stderr}")
    return out


def raw_tcp(binary: Path, mib: int, reps: int) -> float:
    runs = [float(subprocess.run([str(binary), str(mib)], capture_output=True, text=True, check=True,
                                 timeout=300).stdout) for _ in range(reps)]
    return statistics.median(runs)


def _remoting_bench():  # type: ignore[no-untyped-def]
    """benchmarks/remoting.py as a module (its session server and GPU helpers)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("rgpu_bench_remoting", HERE / "remoting.py")
    module = importlib.util.module_from_spec(spec)   # type: ignore[arg-type]
    spec.loader.exec_module(module)   # type: ignore[union-attr]
    return module


def gpu_info(backend: str):  # type: ignore[no-untyped-def]
    from rgpu.model import GpuInfo
    if backend == "cuda":
        return _remoting_bench().local_gpu()
    return GpuInfo(uuid="GPU-00000000-0000-0000-0000-0000000000be", index=0, name="emulated",
                   total_memory_bytes=64 << 30, usable_memory_bytes=64 << 30, compute_capability="9.0")


def run_config(name: str, backend: str, workload: Path, sizes: list[int], reps: int, libs) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from rgpu import tokens
    start_session_server = _remoting_bench().start_session_server
    client_extra, worker_env = CONFIGS[name]
    saved = {k: os.environ.get(k) for k in worker_env}
    os.environ.update(worker_env)
    gpu = gpu_info(backend)
    secret = os.urandom(32)
    server, address = start_session_server(gpu, secret, backend)
    try:
        token = tokens.sign(secret, tokens.SliceClaims(
            job_key=f"bench-{name}", slice_number=0, server=address, gpu_uuid=gpu.uuid, gpu_index=0,
            memory_limit_bytes=max(sizes) * MiB * 2 + (1 << 30), compute_percent=100, expires_unix=0,
            issued_unix=time.time()))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "UCX_"))}
        env.update(client_extra, LD_LIBRARY_PATH=f"{libs.folder}:{env.get('LD_LIBRARY_PATH', '')}",
                   RGPU_SLICES=f"{address},{token}", RGPU_LOG="info")
        done = subprocess.run([str(workload), str(reps), *map(str, sizes)], env=env, capture_output=True, text=True,
                              timeout=900, check=False)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if done.returncode:
        raise SystemExit(f"benchmarks/copies.py: {name} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    want = "transport tcp" if name == "rgpu-tcp" else "transport ucx"
    if want not in done.stderr:
        raise SystemExit(f"benchmarks/copies.py: {name} did not run on {want}:\n{done.stderr}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("emulated", "cuda"), default="emulated")
    parser.add_argument("--sizes", default="128,256", help="MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="of " + ", ".join(CONFIGS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from rgpu.remoting.native.build import ensure_built

    libs = ensure_built()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="rgpu-copies-") as tmp:
        workload = _compile(WORKLOAD_C, Path(tmp) / "copies", f"-I{_cuda_include()}", f"-L{libs.folder}", "-lcuda")
        raw_bin = _compile(RAW_TCP_C, Path(tmp) / "raw_tcp")
        raw = {mib: raw_tcp(raw_bin, mib * 8, args.reps) for mib in sizes}   # 8 buffers' worth per run
        results = {name: run_config(name, args.backend, workload, sizes, args.reps, libs)
                   for name in args.configs.split(",")}
    print(f"rgpu copy benchmark: {args.backend} backend, loopback, {os.cpu_count()} CPUs, median of {args.reps}")
    print("raw single-stream loopback TCP (C): " + ", ".join(f"{raw[m]:.2f} GB/s ({m} MiB x 8)" for m in sizes))
    names = list(results)
    print(f"{'copy':<24}" + "".join(f"{n:>20}" for n in names) + "   (GB/s, and x raw TCP)")
    for metric in next(iter(results.values())):
        mib = int(metric.split("_")[2].removesuffix("MiB"))
        cells = "".join(f"{results[n][metric]:>9.2f} ({results[n][metric] / raw[mib]:>4.2f}x)".rjust(20) for n in names)
        print(f"{metric.removesuffix('_GBps'):<24}{cells}")
    target = results.get("ucx-shm", {}).get("h2d_pinned_128MiB_GBps")
    if target is not None and 128 in raw:
        ratio = min(results["ucx-shm"]["h2d_pinned_128MiB_GBps"], results["ucx-shm"]["d2h_pinned_128MiB_GBps"]) / raw[128]
        print(f"target: same-host pinned 128 MiB over UCX >= 2x raw TCP: {ratio:.2f}x "
              f"({'PASS' if ratio >= 2 else 'FAIL'})")
    out = {"backend": args.backend, "raw_tcp_GBps": raw, "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
