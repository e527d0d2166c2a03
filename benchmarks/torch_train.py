"""PyTorch training, locally and through a whole-GPU rgpu slice, in one run on one GPU.

    python benchmarks/torch_train.py [--models cnn,lstm,resnet18,gpt2] [--rounds 2] [--seconds 10] [--json OUT]

Starts a session server on this GPU node (loopback, cuda backend), then runs each workload in a
fresh child process locally and through rgpu's libcuda.so.1, alternating local and rgpu runs
`--rounds` times. Each run reports, as a user sees it:
- ready_s: from the parent's spawn of the process to the end of its warm-up (imports, CUDA start,
  model set-up, and warm-up steps that run every kernel of the step);
- step_ms: the steady state, measured over at least `--seconds` of steps after the warm-up;
- round trips per steady step (rgpu runs): the client's synchronous calls between a snapshot
  taken at the start and one at the end of the steady state (RGPU_CLIENT_STATS).
Workloads:
- cnn: 2 conv + 2 linear, batch 64, 32x32, AdamW, bf16 autocast, data on the GPU;
- cnn_loader: the same, fed from a DataLoader (2 workers, pinned memory, non_blocking copies);
- lstm: 2-layer LSTM word language model (cuDNN RNN, 200 hidden, batch 20, bptt 35, vocab 33278,
  manual SGD with gradient clipping, `loss.item()` every batch), data on the GPU;
- resnet18: torchvision's ResNet-18, batch 64, 224x224, bf16 autocast, AdamW, data on the GPU;
- resnet18_loader: the same, fed from a pinned two-worker DataLoader;
- gpt2: a GPT-2-small-shaped decoder (12 layers, d 768, 12 heads), batch 8, seq 1024, bf16.
Targets (issue 24): ready_s <= 1.2x local; steady state >= 0.95x (cnn, resnet18, gpt2),
>= 0.85x (lstm); loader-fed workloads are the copies issue's yardstick.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKLOADS = ("cnn", "cnn_loader", "lstm", "resnet18", "resnet18_loader", "gpt2")
STEADY_TARGET = {"cnn": 0.95, "lstm": 0.85, "resnet18": 0.95, "gpt2": 0.95}
READY_TARGET = 1.2


# ------------------------------------------------------------------------------ the workloads

def _loader(make_batch: Any, batches: int) -> Any:  # type: ignore[no-untyped-def]
    """A DataLoader over `batches` CPU batches, two workers, pinned memory (what users write)."""
    import torch

    class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            torch.manual_seed(1)
            self.items = [make_batch() for _ in range(batches)]

        def __len__(self) -> int:
            return 1 << 30

        def __getitem__(self, i: int) -> Any:
            return self.items[i % batches]

    return iter(torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=2, pin_memory=True,
                                            persistent_workers=True, prefetch_factor=4))


def _cnn(feed: str) -> tuple[Any, int]:
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.c2 = torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.Conv2d(32, 64, 3, padding=1)
            self.f1, self.f2 = torch.nn.Linear(64 * 8 * 8, 256), torch.nn.Linear(256, 10)

        def forward(self, x):  # type: ignore[no-untyped-def]
            x = F.max_pool2d(F.relu(self.c1(x)), 2)
            x = F.max_pool2d(F.relu(self.c2(x)), 2)
            return self.f2(F.relu(self.f1(x.flatten(1))))

    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if feed == "gpu":
        x, y = torch.randn(64, 3, 32, 32, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
        def data() -> tuple[Any, ...]:
            return (x, y)
    else:
        it = _loader(lambda: (torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))), 16)
        def data() -> tuple[Any, ...]:
            return tuple(t.cuda(non_blocking=True) for t in next(it))

    def step() -> None:
        x, y = data()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step, 64


def _lstm() -> tuple[Any, int]:
    import torch

    vocab, hidden, batch, bptt = 33278, 200, 20, 35

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = torch.nn.Dropout(0.2)
            self.enc = torch.nn.Embedding(vocab, hidden)
            self.rnn = torch.nn.LSTM(hidden, hidden, 2, dropout=0.2)
            self.dec = torch.nn.Linear(hidden, vocab)

        def forward(self, x, h):  # type: ignore[no-untyped-def]
            out, h = self.rnn(self.drop(self.enc(x)), h)
            return self.dec(self.drop(out)).view(-1, vocab), h

    model = LM().cuda()
    stream = torch.randint(0, vocab, (bptt * 400 + 1, batch), device="cuda")
    state: dict[str, Any] = {"i": 0, "h": None}
    lr = 20.0

    def step() -> None:
        i = state["i"] % (stream.shape[0] - 1 - bptt)
        state["i"] += bptt
        x, y = stream[i:i + bptt], stream[i + 1:i + 1 + bptt].reshape(-1)
        h = state["h"]
        if h is not None:
            h = tuple(t.detach() for t in h)
        model.zero_grad()
        out, state["h"] = model(x, h)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        state["loss"] = loss.item()
    return step, batch


def _resnet18(feed: str) -> tuple[Any, int]:
    import torch
    import torchvision
    model = torchvision.models.resnet18(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if feed == "gpu":
        x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (64,), device="cuda")
        def data() -> tuple[Any, ...]:
            return (x, y)
    else:
        it = _loader(lambda: (torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))), 6)
        def data() -> tuple[Any, ...]:
            return tuple(t.cuda(non_blocking=True) for t in next(it))

    def step() -> None:
        x, y = data()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step, 64


def gpt2_model() -> Any:
    """A GPT-2-small-shaped decoder (12 layers, d 768, 12 heads, vocabulary 50257, context 1024), on the CPU."""
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

    return GPT()


def _gpt2() -> tuple[Any, int]:
    import torch
    import torch.nn.functional as F

    model = gpt2_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 50257, (8, 1024), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(idx)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), idx.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step, 8


def make(name: str) -> tuple[Any, int]:
    return {"cnn": lambda: _cnn("gpu"), "cnn_loader": lambda: _cnn("loader"), "lstm": _lstm,
            "resnet18": lambda: _resnet18("gpu"), "resnet18_loader": lambda: _resnet18("loader"),
            "gpt2": _gpt2}[name]()


def _stats_snapshot(suffix: str) -> None:
    """Ask rgpu's client library for its call profile so far (a no-op locally)."""
    if not os.environ.get("RGPU_CLIENT_STATS"):
        return
    lib = ctypes.CDLL("libcuda.so.1")
    write = ctypes.c_void_p()
    if lib.cuGetProcAddress_v2(b"rgpuClientStatsWrite", ctypes.byref(write), 12000, ctypes.c_uint64(0), None) == 0:
        ctypes.CFUNCTYPE(None, ctypes.c_char_p)(write.value)(suffix.encode())


def child(name: str, spawned: float, warmup: int, seconds: float) -> dict[str, float]:
    import torch
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    step, batch = make(name)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    ready = time.time() - spawned
    _stats_snapshot("steady-start")
    steps, t0 = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        if steps % 5 == 0:
            torch.cuda.synchronize()
            if time.perf_counter() - t0 >= seconds:
                break
    secs = time.perf_counter() - t0
    _stats_snapshot("steady-end")
    return {"ready_s": ready, "step_ms": secs / steps * 1000, "samples_per_s": batch * steps / secs,
            "steps": steps, "pid": os.getpid()}


# ------------------------------------------------------------------------------ the driver

def run_child(env: dict[str, str], name: str, warmup: int, seconds: float) -> dict[str, Any]:
    spawned = time.time()
    done = subprocess.run([sys.executable, __file__, "--child", name, "--spawned", repr(spawned),
                           "--warmup", str(warmup), "--seconds", str(seconds)],
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr_lines"] = [ln for ln in done.stderr.splitlines() if ln.strip()][-5:]
    return result


def steady_round_trips(profile: Path, pid: int, steps: int) -> tuple[float, str]:
    """(round trips per steady step, the steady state's profile as text) from the two snapshots."""
    from rgpu.remoting.native import client_stats
    before, _ = client_stats.parse(Path(f"{profile}.{pid}.steady-start").read_text())
    after, _ = client_stats.parse(Path(f"{profile}.{pid}.steady-end").read_text())
    diff = client_stats.subtract(after, before)
    return sum(p.sync_calls for p in diff.values()) / steps, client_stats.render(diff, 0, top=8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--models", default="cnn,lstm,resnet18,gpt2", help=f"any of {','.join(WORKLOADS)}")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up steps (every kernel of the step runs)")
    parser.add_argument("--seconds", type=float, default=10.0, help="steady state per run, at least")
    parser.add_argument("--rounds", type=int, default=2, help="local and rgpu runs, alternated, per workload")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rgpu-env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in the rgpu runs' environment only (e.g. RGPU_ZERO_COPY=0), repeatable")
    parser.add_argument("--no-prime", action="store_true", help="skip the first rgpu process of each workload, which "
                        "fills the GPU node's module image cache (its start-up is printed apart: a user's first "
                        "process on a node)")
    parser.add_argument("--profile", type=Path, help="keep the client's call profiles (RGPU_CLIENT_STATS) and the "
                        "worker's (RGPU_WORKER_PROFILE) of the rgpu runs in this folder")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.spawned or time.time(), args.warmup, args.seconds)))
        return 0
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")

    sys.path.insert(0, str(HERE.parent))
    import tempfile

    from benchmarks.remoting import local_gpu, slice_env, start_session_server
    from rgpu.remoting.native.build import ensure_built

    libs = ensure_built()
    gpu = local_gpu()
    profile_dir = args.profile or Path(tempfile.mkdtemp(prefix="rgpu-torch-train-"))
    profile_dir.mkdir(parents=True, exist_ok=True)
    if args.profile:
        os.environ["RGPU_WORKER_PROFILE"] = str(args.profile)   # the session server's workers inherit it
    secret = os.urandom(32)
    server, address = start_session_server(gpu, secret)
    rows = []
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        cold: dict[str, float] = {}
        for name in names:
            stats = profile_dir / f"client-{name}"
            remote_env = dict(slice_env(base, libs.folder, secret, address, gpu, f"bench-{name}"),
                              RGPU_CLIENT_STATS=str(stats))
            remote_env.update(dict(item.split("=", 1) for item in args.rgpu_env))
            if not args.no_prime:   # a user's first process of this workload: the image cache fills
                first = run_child(dict(remote_env, RGPU_CLIENT_STATS=str(profile_dir / f"client-prime-{name}")), name, 1, 0.0)
                cold[name] = first["ready_s"]
                print(f"first rgpu process of {name} (images it loads the first time cross the wire): ready in "
                      f"{first['ready_s']:.2f} s", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {"local": [], "rgpu": []}
            for _ in range(args.rounds):
                runs["local"].append(run_child(base, name, args.warmup, args.seconds))
                r = run_child(remote_env, name, args.warmup, args.seconds)
                r["round_trips_per_step"], r["steady_profile"] = steady_round_trips(stats, r["pid"], r["steps"])
                runs["rgpu"].append(r)
            med = {k: {m: statistics.median(x[m] for x in v) for m in ("ready_s", "step_ms")} for k, v in runs.items()}
            row = {"workload": name, "runs": runs, "median": med,
                   "ready_ratio": med["rgpu"]["ready_s"] / med["local"]["ready_s"],
                   "steady_ratio": med["local"]["step_ms"] / med["rgpu"]["step_ms"],
                   "round_trips_per_step": statistics.median(r["round_trips_per_step"] for r in runs["rgpu"])}
            rows.append(row)
            def spread(k: str, m: str) -> str:
                return "/".join(f"{x[m]:.2f}" for x in runs[k])
            print(f"{name}: ready local {spread('local', 'ready_s')} s, rgpu {spread('rgpu', 'ready_s')} s; "
                  f"step local {spread('local', 'step_ms')} ms, rgpu {spread('rgpu', 'step_ms')} ms; "
                  f"round trips/step {row['round_trips_per_step']:.1f}", flush=True)
            print(runs["rgpu"][-1]["steady_profile"], flush=True)
            for line in runs["rgpu"][-1]["stderr_lines"]:
                print(f"  rgpu run stderr: {line}", flush=True)
        launch_path = server.status().get("launch_path")
    finally:
        server.stop()
    print(f"\nrgpu PyTorch training benchmark: {gpu.name}, loopback, whole-GPU slice, worker launches: {launch_path}; "
          f"medians of {args.rounds} alternated runs, steady state >= {args.seconds:.0f} s each")
    print(f"{'workload':<16} {'ready local s':>13} {'ready rgpu s':>13} {'ratio':>6} {'step local ms':>14} "
          f"{'step rgpu ms':>13} {'rgpu/local':>10} {'RT/step':>8}")
    for r in rows:
        m = r["median"]
        print(f"{r['workload']:<16} {m['local']['ready_s']:>13.2f} {m['rgpu']['ready_s']:>13.2f} {r['ready_ratio']:>6.2f} "
              f"{m['local']['step_ms']:>14.2f} {m['rgpu']['step_ms']:>13.2f} {r['steady_ratio']:>10.3f} "
              f"{r['round_trips_per_step']:>8.1f}")
    if cold:
        print("before these, each workload's first rgpu process (filling the image cache): ready in "
              + ", ".join(f"{n} {s:.2f} s" for n, s in cold.items()))
    if args.json:
        args.json.write_text(json.dumps({"gpu": gpu.name, "rows": rows, "first_process_ready_s": cold}, indent=2,
                                        default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
