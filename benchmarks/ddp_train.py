"""Data-parallel PyTorch (DistributedDataParallel, NCCL backend) through rgpu beside local, same run (issue 27).

    python benchmarks/ddp_train.py [--model mlp|resnet18|gpt2] [--ranks 2] [--steps 30]
        [--shapes per-task,local-rank] [--mib 256] [--fraction 1.0] [--json]

Issue 27's workloads (--model): an MLP of three 4096-wide layers (batch 256 per rank), ResNet-18
(batch 64 per rank) and the GPT-2-small step (batch 8 x 1024 tokens per rank); SGD; one process per rank
(as `torchrun --nproc_per_node N` starts them: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT).
Locally rank r uses GPU r. Through rgpu each GPU r is served by its own session server (as one
dispatcher per GPU node) with a slice of --fraction of it (whole by default), and the job has one of two shapes:
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
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def workload(model_name: str, rank: int, device: Any) -> tuple[Any, Any, int]:
    """(model on `device`, a function of the model giving the step's loss, samples per rank per step):
    issue 27's MLP (three 4096-wide layers, batch 256), torchvision's ResNet-18 (batch 64, 224x224,
    channels-last, bf16 autocast) or the GPT-2-small step of benchmarks/torch_train.py (batch 8 x 1024
    tokens, bf16 autocast). Each rank's data is its own, fixed by its rank."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator(device="cpu").manual_seed(1000 + rank)
    torch.manual_seed(0)   # every rank's model starts equal (DDP also broadcasts rank 0's)
    if model_name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                    torch.nn.ReLU(), torch.nn.Linear(4096, 4096)).to(device)
        x, y = (torch.randn(256, 4096, generator=generator).to(device) for _ in range(2))
        return model, lambda m: F.mse_loss(m(x), y), 256
    if model_name == "resnet18":
        import torchvision
        model = torchvision.models.resnet18(num_classes=1000).to(device).to(memory_format=torch.channels_last)
        x = torch.randn(64, 3, 224, 224, generator=generator).to(device).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), generator=generator).to(device)

        def resnet_loss(m: Any) -> Any:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return F.cross_entropy(m(x).float(), y)
        return model, resnet_loss, 64
    if model_name == "gpt2":
        from torch_train import gpt2_model
        model = gpt2_model().to(device)
        idx = torch.randint(0, 50257, (8, 1024), generator=generator).to(device)

        def gpt_loss(m: Any) -> Any:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = m(idx)
                return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), idx.reshape(-1))
        return model, gpt_loss, 8
    raise SystemExit(f"benchmarks/ddp_train.py: unknown model {model_name!r} (mlp, resnet18, gpt2)")


def rank_main(steps: int, mib: int, model_name: str) -> None:
    """One rank: DDP training steps, then all-reduces; prints one JSON line."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", int(os.environ.get("BENCH_DEVICE", local_rank)))
    torch.cuda.set_device(device)
    started = time.perf_counter()
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_of, batch = workload(model_name, rank, device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    losses: list[float] = []

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(ddp)
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
    print(json.dumps({"rank": rank, "ready_s": ready_s, "samples_s": steps * batch * world / train_s,
                      "allreduce_ms": ms, "busbw_gbs": busbw, "losses": losses}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(envs: list[dict[str, str]], steps: int, mib: int, timeout: float, model: str = "mlp") -> dict[str, object]:
    port = str(free_port())
    procs = []
    for r, env in enumerate(envs):
        env = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(len(envs)), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, LOCAL_WORLD_SIZE=str(len(envs)))
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", "--steps", str(steps), "--mib", str(mib),
                                       "--model", model],
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
    parser.add_argument("--model", default="mlp", choices=("mlp", "resnet18", "gpt2"))
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="each slice's share of its GPU (memory and compute; 0.5: half slices, MPS on the GPU node)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object (for tests)")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(args.steps, args.mib, args.model)
        return 0
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from nccl_allreduce import _remoting_bench, nccl_library

    from rgpu import tokens
    from rgpu.remoting.client.flexrun import library_env
    from rgpu.remoting.native import build

    bench = _remoting_bench()
    libs = build.ensure_built()
    nccl = nccl_library()
    os.environ["RGPU_NCCL_LIBRARY"] = nccl   # the workers' NCCL
    base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_") and k != "CUDA_VISIBLE_DEVICES"}
    results: dict[str, dict[str, object]] = {"local": run_ranks([dict(base)] * args.ranks, args.steps, args.mib,
                                                               args.timeout, args.model)}
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
                memory_limit_bytes=int(gpu.total_memory_bytes * args.fraction),
                compute_percent=max(1, round(100 * args.fraction)), expires_unix=0, issued_unix=time.time()))
            slices.append(f"{address},{token}")
        # flexrun's library environment: PyTorch's libtorch_cuda finds NCCL through its RPATH, ahead of
        # LD_LIBRARY_PATH, so rgpu's libnccl.so.2 is preloaded (one library of that soname is then loaded, rgpu's).
        rgpu_env = dict(base, **library_env(libs.folder, base))
        with tempfile.TemporaryDirectory():
            for shape in args.shapes.split(","):
                if shape == "per-task":
                    envs = [dict(rgpu_env, RGPU_SLICES=s, BENCH_DEVICE="0") for s in slices]
                elif shape == "local-rank":
                    envs = [dict(rgpu_env, RGPU_SLICES=";".join(slices)) for _ in slices]
                else:
                    raise SystemExit(f"benchmarks/ddp_train.py: unknown shape {shape!r} (per-task, local-rank)")
                results[f"rgpu {shape}"] = run_ranks(envs, args.steps, args.mib, args.timeout, args.model)
    finally:
        for server in servers:
            server.stop()
    local = results["local"]
    if args.json:
        print(json.dumps(results))
        return 0
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
