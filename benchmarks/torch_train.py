"""PyTorch training-step throughput, locally and through a whole-GPU rgpu slice, in one run.

    python benchmarks/torch_train.py [--models resnet18,gpt2] [--json OUT]

Starts a session server on this GPU node (loopback, cuda backend), runs each model's training
steps in a child process locally, then in one through rgpu's libcuda.so.1, and prints the ratio:
- resnet18: torchvision's ResNet-18, batch 64, 224x224, bf16 autocast, AdamW (target >= 0.85x)
- gpt2: a GPT-2-small-shaped decoder (12 layers, d 768, 12 heads, vocab 50257), batch 8,
  sequence 1024, bf16 autocast, AdamW (target >= 0.9x)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = {"resnet18": 0.85, "gpt2": 0.9}


def _resnet18():  # type: ignore[no-untyped-def]
    import torch
    import torchvision
    model = torchvision.models.resnet18(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (64,), device="cuda")
    return model, x, y, 64


def _gpt2():  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):  # type: ignore[no-untyped-def]
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(a)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(torch.nn.Module):
        def __init__(self, vocab: int = 50257, seq: int = 1024, d: int = 768, layers: int = 12, heads: int = 12) -> None:
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
            self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, vocab, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, idx):  # type: ignore[no-untyped-def]
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    model = GPT().cuda()
    idx = torch.randint(0, 50257, (8, 1024), device="cuda")
    return model, idx, idx, 8


def child(name: str, warmup: int, steps: int) -> dict[str, float]:
    import torch
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    model, x, y, batch = {"resnet18": _resnet18, "gpt2": _gpt2}[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    return {"samples_per_s": batch * steps / secs, "step_ms": secs / steps * 1000}


def run_child(env: dict[str, str], name: str, warmup: int, steps: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--child", name, "--warmup", str(warmup), "--steps", str(steps)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="resnet18,gpt2")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", type=Path, help="write the client's call profile (RGPU_CLIENT_STATS) and the "
                        "worker's (RGPU_WORKER_PROFILE) for the rgpu runs into this folder, and print the client's")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.warmup, args.steps)))
        return 0

    sys.path.insert(0, str(HERE.parent))
    from benchmarks.remoting import local_gpu, start_session_server
    from rgpu import tokens
    from rgpu.remoting.native.build import ensure_built

    libs = ensure_built()
    gpu = local_gpu()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        os.environ["RGPU_WORKER_PROFILE"] = str(args.profile)   # the session server's workers inherit it
    secret = os.urandom(32)
    server, address = start_session_server(gpu, secret)
    rows = []
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        for name in args.models.split(","):
            token = tokens.sign(secret, tokens.SliceClaims(   # a whole-GPU slice
                job_key=f"bench-{name}", slice_number=0, server=address, gpu_uuid=gpu.uuid, gpu_index=0,
                memory_limit_bytes=gpu.total_memory_bytes, compute_percent=100, expires_unix=0,
                issued_unix=time.time()))
            remote_env = dict(base, LD_LIBRARY_PATH=f"{libs.folder}:{base.get('LD_LIBRARY_PATH', '')}",
                              RGPU_SLICES=f"{address},{token}")
            if args.profile:
                remote_env["RGPU_CLIENT_STATS"] = str(args.profile / f"client-{name}")
            local = run_child(base, name, args.warmup, args.steps)
            remote = run_child(remote_env, name, args.warmup, args.steps)
            ratio = remote["samples_per_s"] / local["samples_per_s"]
            rows.append({"model": name, "local": local, "remote": remote, "ratio": ratio, "target": TARGETS[name],
                         "passed": ratio >= TARGETS[name]})
            print(f"{name}: local {local['samples_per_s']:.1f} samples/s, rgpu {remote['samples_per_s']:.1f} samples/s, "
                  f"ratio {ratio:.3f}", flush=True)
            if args.profile:
                from rgpu.remoting.native import client_stats
                client_stats.main([str(f) for f in sorted(args.profile.glob(f"client-{name}.*"))])
        launch_path = server.status().get("launch_path")
    finally:
        server.stop()
    print(f"rgpu PyTorch training benchmark: {gpu.name}, loopback, whole-GPU slice, worker launches: {launch_path}")
    print(f"{'model':<10} {'local samples/s':>16} {'rgpu samples/s':>16} {'rgpu/local':>11}  target")
    for r in rows:
        print(f"{r['model']:<10} {r['local']['samples_per_s']:>16.1f} {r['remote']['samples_per_s']:>16.1f} "
              f"{r['ratio']:>11.3f}  {'PASS' if r['passed'] else 'FAIL'} (>= {r['target']}x)")
    result = {"gpu": gpu.name, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
