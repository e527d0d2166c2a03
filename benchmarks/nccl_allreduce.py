"""NCCL all-reduce through rgpu (issue 27) beside local NCCL on the same GPUs, measured in the same run.

    python benchmarks/nccl_allreduce.py [--backend cuda|emulated] [--mib 256] [--iters 20] [--ranks 2]

Two ranks (processes), each with a whole-GPU slice of a different GPU of this host (--backend cuda,
one session server per GPU, as one dispatcher per GPU), or of an emulated GPU (CPU only: the
emulated workers' own TCP all-reduce, a check of the path, not a speed anyone should use). Locally
(cuda only) the same program runs on GPUs 0..N-1 with NVIDIA's libcuda and NCCL (RGPU_NCCL_LIBRARY,
else the nvidia-nccl wheel's library, also the workers' NCCL). Prints per configuration the mean time
of one all-reduce and its bus bandwidth (2(n-1)/n x bytes / time), and rgpu's fraction of local.
Issue 27's target: >= 80% of local bus bandwidth for 256 MiB on two GPUs. Reported, never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _remoting_bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("rgpu_bench_remoting", HERE / "remoting.py")
    module = importlib.util.module_from_spec(spec)   # type: ignore[arg-type]
    spec.loader.exec_module(module)   # type: ignore[union-attr]
    return module


def nccl_library() -> str:
    if os.environ.get("RGPU_NCCL_LIBRARY"):
        return os.environ["RGPU_NCCL_LIBRARY"]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "nccl" / "lib" / "libnccl.so.2").exists():
            return str(Path(root) / "nccl" / "lib" / "libnccl.so.2")
    raise SystemExit("benchmarks/nccl_allreduce.py: no NCCL (set RGPU_NCCL_LIBRARY to a libnccl.so.2)")


def build_program(libs_folder: Path, out: Path) -> Path:
    include = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    done = subprocess.run(["cc", "-O2", f"-I{include}", f"-I{ROOT / 'remoting' / 'native' / 'src'}",
                           str(HERE / "nccl_allreduce.c"), "-o", str(out), f"-L{libs_folder}", "-lcuda", "-lnccl"],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"benchmarks/nccl_allreduce.py: cannot compile nccl_allreduce.c:\n{done.stderr}")
    return out


def run_ranks(program: Path, envs: list[dict[str, str]], mib: int, iters: int, folder: Path) -> dict[str, float]:
    idfile = folder / f"id-{time.monotonic_ns()}"
    procs = [subprocess.Popen([str(program), str(r), str(len(envs)), str(idfile), str(mib), str(iters)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, env in enumerate(envs)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"benchmarks/nccl_allreduce.py: a rank failed (exit {p.returncode}):\n{out}\n{err}")
    results = [json.loads(out) for out, _ in outs]
    return {"ms": max(r["ms"] for r in results), "busbw_gbs": min(r["busbw_gbs"] for r in results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("cuda", "emulated"), default="cuda")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from rgpu import tokens
    from rgpu.model import GpuInfo
    from rgpu.remoting.client.flexrun import library_env
    from rgpu.remoting.native import build

    bench = _remoting_bench()
    libs = build.ensure_built()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        program = build_program(libs.folder, folder / "nccl_allreduce")
        if args.backend == "cuda":
            nccl = nccl_library()
            os.environ["RGPU_NCCL_LIBRARY"] = nccl   # the workers' NCCL
            local = [dict(base, CUDA_VISIBLE_DEVICES=str(r), LD_LIBRARY_PATH=f"{Path(nccl).parent}:{base.get('LD_LIBRARY_PATH', '')}")
                     for r in range(args.ranks)]
            results["local"] = run_ranks(program, local, args.mib, args.iters, folder)
        servers, envs = [], []
        try:
            for r in range(args.ranks):
                if args.backend == "cuda":
                    os.environ["CUDA_VISIBLE_DEVICES"] = str(r)
                    gpu = bench.local_gpu()
                    os.environ.pop("CUDA_VISIBLE_DEVICES")
                else:
                    gpu = GpuInfo(uuid=f"GPU-00000000-0000-0000-0000-00000000b{r:03d}", index=0, name="emulated",
                                  total_memory_bytes=64 << 30, usable_memory_bytes=64 << 30, compute_capability="9.0")
                secret = os.urandom(32)
                server, address = bench.start_session_server(gpu, secret, args.backend)
                servers.append(server)
                token = tokens.sign(secret, tokens.SliceClaims(
                    job_key=f"nccl-bench-{r}", slice_number=0, server=address, gpu_uuid=gpu.uuid, gpu_index=gpu.index,
                    memory_limit_bytes=gpu.total_memory_bytes, compute_percent=100, expires_unix=0,
                    issued_unix=time.time()))
                envs.append(dict(base, **library_env(libs.folder, base), RGPU_SLICES=f"{address},{token}"))
            results["rgpu"] = run_ranks(program, envs, args.mib, args.iters, folder)
        finally:
            for server in servers:
                server.stop()
    for name, r in results.items():
        print(f"{name:6s} all-reduce {args.mib} MiB x {args.ranks} ranks ({args.backend}): {r['ms']:.3f} ms, "
              f"bus bandwidth {r['busbw_gbs']:.2f} GB/s")
    if "local" in results:
        print(f"rgpu / local bus bandwidth: {results['rgpu']['busbw_gbs'] / results['local']['busbw_gbs']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
