"""The frameworks users bring, locally and through a whole-GPU rgpu slice, in one run on one GPU.

    python benchmarks/frameworks.py [--programs jax,transformers,timm,lightning] [--runs 20] [--local-runs 2]

Each program trains a small model from a fixed seed for a few steps and prints its losses:
- jax: a jit'ed MLP training step (grad + SGD) on a 2048x2048 matmul chain, which XLA autotunes
  (its redzone checks, and Hopper's tensor maps where XLA uses them);
- transformers: a 4-layer GPT-2 built from its config (no weights downloaded), AdamW, 8 steps;
- timm: ResNet-50 (random init), bf16 autocast, batch 32, SGD, 8 steps;
- lightning: a Lightning fit of an MLP fed from a pinned two-worker DataLoader (issue 24 saw an
  "invalid device context" race here once in six runs).
Every program runs `--local-runs` times locally, then `--runs` times in a row through rgpu (the
programs side by side, each its own sequence); a run passes when it exits 0 and its losses equal
the first local run's within `--rtol` (XLA and cuDNN may pick other kernels between processes,
locally as well: the local runs' own spread is printed beside). Prints one line per program:
passes, failures with their last stderr line, and the largest loss difference seen.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROGRAMS = ("jax", "transformers", "timm", "lightning")


# ------------------------------------------------------------------------------ the programs

def _jax() -> list[float]:
    import jax
    import jax.numpy as jnp
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = {"w1": jax.random.normal(k1, (2048, 2048)) * 0.02, "w2": jax.random.normal(k2, (2048, 10)) * 0.02}
    x = jax.random.normal(k3, (512, 2048))
    y = jax.random.randint(k4, (512,), 0, 10)

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        h = jax.nn.relu(x @ p["w1"])
        logits = h @ p["w2"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(y.shape[0]), y])

    @jax.jit
    def step(p, x, y):  # type: ignore[no-untyped-def]
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss

    losses = []
    for _ in range(10):
        params, loss = step(params, x, y)
        losses.append(float(loss))
    return losses


def _transformers() -> list[float]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=256, vocab_size=8192)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.randint(0, 8192, (8, 256), device="cuda")
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _timm() -> list[float]:
    import timm
    import torch
    torch.manual_seed(0)
    model = timm.create_model("resnet50", pretrained=False, num_classes=100).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    y = torch.randint(0, 100, (32,), device="cuda")
    losses = []
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _lightning() -> list[float]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 4, (4096,)))
    losses: list[float] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

        def training_step(self, batch, _):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(data, batch_size=128, num_workers=2, pin_memory=True, shuffle=False)
    trainer = L.Trainer(max_epochs=2, accelerator="gpu", devices=1, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Model(), loader)
    return losses


def child(name: str) -> dict[str, Any]:
    started = time.time()
    losses = {"jax": _jax, "transformers": _transformers, "timm": _timm, "lightning": _lightning}[name]()
    return {"losses": losses, "seconds": time.time() - started}


# ------------------------------------------------------------------------------ the driver

def run_child(env: dict[str, str], name: str) -> dict[str, Any]:
    started = time.time()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True,
                              timeout=600, check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": "timed out after 600 s", "wall_s": 600.0}
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    if done.returncode != 0 or not done.stdout.strip():
        why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        return {"ok": False, "why": f"exit {done.returncode}: {why.strip()[:300]}", "wall_s": time.time() - started,
                "stderr_tail": lines[-40:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(ok=True, wall_s=time.time() - started, rgpu_lines=[ln for ln in lines if "rgpu" in ln][:5])
    return result


def largest_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)), default=0.0)


def run_program(name: str, local_env: dict[str, str], remote_env: dict[str, str], runs: int, local_runs: int,
                rtol: float) -> dict[str, Any]:
    local = [run_child(local_env, name) for _ in range(local_runs)]
    if not local or not local[0]["ok"]:
        return {"program": name, "local_failed": local[0].get("why") if local else "no local run"}
    reference = local[0]["losses"]
    local_spread = max((largest_difference(reference, r["losses"]) for r in local[1:] if r["ok"]), default=0.0)
    remote = []
    for _ in range(runs):
        r = run_child(remote_env, name)
        if r["ok"]:
            r["difference"] = largest_difference(reference, r["losses"])
            r["ok"] = r["difference"] <= rtol
            if not r["ok"]:
                r["why"] = f"losses differ by {r['difference']:.2e} (first run {r['losses'][:3]}, local {reference[:3]})"
        remote.append(r)
    return {"program": name, "local": local, "rgpu": remote, "local_spread": local_spread,
            "passes": sum(r["ok"] for r in remote),
            "largest_difference": max((r.get("difference", 0.0) for r in remote), default=0.0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"any of {','.join(PROGRAMS)}")
    parser.add_argument("--runs", type=int, default=20, help="runs through rgpu, in a row, per program")
    parser.add_argument("--local-runs", type=int, default=2)
    parser.add_argument("--rtol", type=float, default=1e-3, help="largest relative loss difference that passes")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    names = [n for n in args.programs.split(",") if n]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        parser.error(f"unknown program {unknown[0]!r}: choose from {', '.join(PROGRAMS)}")

    sys.path.insert(0, str(HERE.parent))
    from benchmarks.remoting import local_gpu, slice_env, start_session_server
    from rgpu.remoting.native.build import ensure_built

    libs = ensure_built()
    gpu = local_gpu()
    secret = os.urandom(32)
    server, address = start_session_server(gpu, secret)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    base.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX side by side with the others on one GPU
    try:
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            results = list(pool.map(lambda n: run_program(
                n, base, slice_env(base, libs.folder, secret, address, gpu, f"frameworks-{n}"), args.runs,
                args.local_runs, args.rtol), names))
    finally:
        server.stop()
    print(f"\nrgpu frameworks: {gpu.name}, loopback, whole-GPU slice; {args.runs} rgpu runs in a row per program, "
          f"losses within rtol {args.rtol:g} of the first local run")
    for r in results:
        if "local_failed" in r:
            print(f"{r['program']:<13} local run failed: {r['local_failed']}")
            continue
        def wall(k: str) -> float:
            return sorted(x["wall_s"] for x in r[k])[len(r[k]) // 2]
        print(f"{r['program']:<13} {r['passes']}/{len(r['rgpu'])} passed; largest loss difference "
              f"{r['largest_difference']:.1e} (local runs among themselves {r['local_spread']:.1e}); "
              f"median wall local {wall('local'):.1f} s, rgpu {wall('rgpu'):.1f} s")
        for x in r["rgpu"]:
            if not x["ok"]:
                print(f"    failed: {x['why']}")
        lines = {ln for x in r["rgpu"] for ln in x.get("rgpu_lines", [])}
        for ln in sorted(lines)[:5]:
            print(f"    rgpu said: {ln[:200]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(r.get("passes") == args.runs for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
