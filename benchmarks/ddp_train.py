"""Data-parallel PyTorch (DistributedDataParallel, NCCL backend) through rgpu beside local, same run (issue 27).

    python benchmarks/ddp_train.py [--ranks 2] [--steps 30] [--shapes per-task,local-rank] [--mib 256]

Issue 27's workload: an MLP of three 4096-wide layers, batch 256 per rank, SGD, one process per rank
(as `torchrun --nproc_per_node N` starts them: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT).
Locally rank r uses GPU r. Through rgpu each GPU r is served by its own session server (as one
dispatcher per GPU node) with a whole-GPU slice, and the job has one of two shapes:
- per-task: each rank sees only its own slice, as device 0 (`srun -n N flexrun -- python train.py`);
- local-rank: every rank sees all N slices and picks device LOCAL_RANK (`flexrun -n N -- torchrun ...`).
Each configuration prints samples/s over the timed steps, the mean all-reduce time of --mib MiB with
its bus bandwidth (2(n-1)/n x bytes / time), and the loss after each step (rank 0), so rgpu's losses can
be compared with local's. Reported, never asserted. Needs torch with CUDA and, for the workers, a real
NCCL (RGPU_NCCL_LIBRARY, else the nvidia-nccl wheel's library).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def rank_main(steps: int, mib: int) -> None:
    """One rank: DDP training steps, then all-reduces; prints one JSON line."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", int(os.environ.get("BENCH_DEVICE", local_rank)))
    torch.cuda.set_device(device)
    started = time.perf_counter()
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    generator = torch.Generator(device="cpu").manual_seed(1000 + rank)
    inputs = torch.randn(256, 4096, generator=generator).to(device)
    targets = torch.randn(256, 4096, generator=generator).to(device)
    losses: list[float] = []

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in range(3):
        losses.append(float(step()))
    torch.cuda.synchronize()
    ready_s = time.perf_counter() - started
    t0 = time.perf_counter()
    timed = [step() for _ in range(steps)]
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    losses += [float(v) for v in timed]
    buffer = torch.ones(mib << 18, dtype=torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(buffer)
    torch.cuda.synchronize()
    iters = 20
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / iters
    busbw = 2 * (world - 1) / world * (mib << 20) / (ms / 1e3) / 1e9
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "ready_s": ready_s, "samples_s": steps * 256 * world / train_s,
                      "allreduce_ms": ms, "busbw_gbs": busbw, "losses": losses}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(envs: list[dict[str, str]], steps: int, mib: int, timeout: float) -> dict[str, object]:
    port = str(free_port())
    procs = []
    for r, env in enumerate(envs):
        env = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(len(envs)), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, LOCAL_WORLD_SIZE=str(len(envs)))
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", "--steps", str(steps), "--mib", str(mib)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    started = time.perf_counter()
    outs = [p.communicate(timeout=timeout) for p in procs]
    wall = time.perf_counter() - started
    failed = [(p.returncode, err) for p, (_, err) in zip(procs, outs) if p.returncode]
    if failed:
        return {"failed": f"exit {failed[0][0]}: " + "\n".join(failed[0][1].strip().splitlines()[-12:])}
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return {"wall_s": wall, "ready_s": max(r["ready_s"] for r in results),
            "samples_s": min(r["samples_s"] for r in results), "allreduce_ms": max(r["allreduce_ms"] for r in results),
            "busbw_gbs": min(r["busbw_gbs"] for r in results), "losses": results[0]["losses"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--shapes", default="per-task,local-rank")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(args.steps, args.mib)
        return 0
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from nccl_allreduce import _remoting_bench, nccl_library

    from rgpu import tokens
    from rgpu.remoting.native import build

    bench = _remoting_bench()
    libs = build.ensure_built()
    nccl = nccl_library()
    os.environ["RGPU_NCCL_LIBRARY"] = nccl   # the workers' NCCL
    base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_") and k != "CUDA_VISIBLE_DEVICES"}
    results: dict[str, dict[str, object]] = {"local": run_ranks([dict(base)] * args.ranks, args.steps, args.mib,
                                                               args.timeout)}
    servers, slices = [], []
    try:
        for r in range(args.ranks):
            os.environ["CUDA_VISIBLE_DEVICES"] = str(r)
            gpu = bench.local_gpu()
            os.environ.pop("CUDA_VISIBLE_DEVICES")
            secret = os.urandom(32)
            server, address = bench.start_session_server(gpu, secret, "cuda")
            servers.append(server)
            token = tokens.sign(secret, tokens.SliceClaims(
                job_key=f"ddp-bench-{r}", slice_number=0, server=address, gpu_uuid=gpu.uuid, gpu_index=gpu.index,
                memory_limit_bytes=gpu.total_memory_bytes, compute_percent=100, expires_unix=0, issued_unix=time.time()))
            slices.append(f"{address},{token}")
        # As flexrun does: PyTorch's libtorch_cuda finds NCCL through its RPATH, ahead of LD_LIBRARY_PATH,
        # so rgpu's libnccl.so.2 is preloaded (one library of that soname is then loaded, rgpu's).
        rgpu_env = dict(base, LD_LIBRARY_PATH=f"{libs.folder}:{base.get('LD_LIBRARY_PATH', '')}",
                        LD_PRELOAD=" ".join(filter(None, [f"{libs.folder}/libnccl.so.2", base.get("LD_PRELOAD", "")])))
        with tempfile.TemporaryDirectory():
            for shape in args.shapes.split(","):
                if shape == "per-task":
                    envs = [dict(rgpu_env, RGPU_SLICES=s, BENCH_DEVICE="0") for s in slices]
                elif shape == "local-rank":
                    envs = [dict(rgpu_env, RGPU_SLICES=";".join(slices)) for _ in slices]
                else:
                    raise SystemExit(f"benchmarks/ddp_train.py: unknown shape {shape!r} (per-task, local-rank)")
                results[f"rgpu {shape}"] = run_ranks(envs, args.steps, args.mib, args.timeout)
    finally:
        for server in servers:
            server.stop()
    local = results["local"]
    for name, r in results.items():
        if "failed" in r:
            print(f"{name:18s} FAILED {r['failed']}")
            continue
        line = (f"{name:18s} ready {r['ready_s']:.1f} s, {r['samples_s']:,.0f} samples/s, all-reduce {args.mib} MiB "
                f"{r['allreduce_ms']:.3f} ms ({r['busbw_gbs']:.1f} GB/s), wall {r['wall_s']:.1f} s")
        if name != "local" and "failed" not in local:
            diff = max(abs(a - b) for a, b in zip(r["losses"], local["losses"]))   # type: ignore[call-overload]
            line += (f"; vs local: samples {r['samples_s'] / local['samples_s']:.3f}x, "   # type: ignore[operator]
                     f"bus bandwidth {r['busbw_gbs'] / local['busbw_gbs']:.3f}x, largest loss difference {diff:.2e}")  # type: ignore[operator]
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
