"""The pool's own work per allocate + release, without gRPC: PoolCore on a real SQLite file, in one
process or in several processes sharing the file as `rgpu-poold --processes N` does. Prints pairs
per second, CPU per pair, and (shared mode) how the processes' changes serialize on the file's lock.

    python benchmarks/pool_logic.py [--servers 64] [--gpus-per-server 8] [--processes 1,2] [--seconds 5]

What it separates from benchmarks/pool_alloc.py: the pool's rules, placement, SQLite commits and
token HMACs, measured alone; pool_alloc adds grpcio's server and the clients.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rgpu.model import GpuInfo, ServerInfo  # noqa: E402
from rgpu.remoting.pool.rules import AllocationRequest, PoolCore  # noqa: E402
from rgpu.remoting.pool.store import Store  # noqa: E402

GiB = 2**30
SECRET = b"b" * 32


def open_core(path: Path, shared: bool) -> PoolCore:
    return PoolCore(store=Store(path, shared=shared), secret=SECRET, down_after_seconds=1e6)


def fill(path: Path, shared: bool, servers: int, gpus_per_server: int, prefill: int) -> None:
    core = open_core(path, shared)
    for n in range(servers):
        core.register(ServerInfo(address=f"10.1.{n // 250}.{n % 250 + 1}:55001", hostname=f"gpu{n:04d}",
                                 driver_version="580", cuda_version="13.0",
                                 gpus=tuple(GpuInfo(f"GPU-{n:04d}-{i}", i, "NVIDIA H100 80GB HBM3", 80 * GiB,
                                                    80 * GiB, "9.0") for i in range(gpus_per_server))))
    for i in range(prefill):
        core.allocate(AllocationRequest(job_key=f"prefill-{i}", user="prefill", count=1, percent=50))
    core.store.close()


def worker(path: str, shared: bool, number: int, seconds: float, start_at: float,
           out: "mp.Queue[tuple[int, float, int]]") -> None:
    core = open_core(Path(path), shared)
    rng = random.Random(number)
    while time.time() < start_at:
        time.sleep(0.001)
    pairs, cpu, deadline = 0, time.process_time(), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        key = f"bench-{number}-{pairs}"
        core.allocate(AllocationRequest(job_key=key, user=f"user{number}", count=rng.choice([1, 1, 2, 4]),
                                        percent=rng.choice([25, 50, 100])))
        core.token_for(core.get_lease(key), 0)   # what the daemon's reply signs
        core.release(key)
        pairs += 1
    out.put((pairs, time.process_time() - cpu, core.full_reloads))
    core.store.close()


def run(processes: int, shared: bool, args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="rgpu-logic-") as tmp:
        path = Path(tmp) / "state.db"
        fill(path, shared, args.servers, args.gpus_per_server, args.prefill)
        ctx = mp.get_context("spawn")
        queue: mp.Queue[tuple[int, float, int]] = ctx.Queue()
        start_at = time.time() + 2.0   # every process opened and loaded before the clock starts
        procs = [ctx.Process(target=worker, args=(str(path), shared, n, args.seconds, start_at, queue))
                 for n in range(processes)]
        for p in procs:
            p.start()
        done = [queue.get(timeout=args.seconds + 120) for _ in procs]
        for p in procs:
            p.join()
    pairs = sum(n for n, _, _ in done)
    return {"processes": processes, "shared": shared, "servers": args.servers, "gpus_per_server": args.gpus_per_server,
            "pairs_per_second": round(pairs / args.seconds, 1),
            "cpu_ms_per_pair": round(1000 * sum(c for _, c, _ in done) / pairs, 3),
            "full_reloads": sum(r for _, _, r in done), "cpus": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=64)
    parser.add_argument("--gpus-per-server", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=256, help="leases of half a GPU held during the run")
    parser.add_argument("--processes", default="1,2", help="process counts to run in shared mode, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    results = [run(1, False, args)] + [run(int(n), True, args) for n in args.processes.split(",") if n.strip()]
    for r in results:
        mode = "shared file" if r["shared"] else "one process alone"
        print(f"pool_logic ({mode}, {r['processes']} process(es), {r['servers']} x {r['gpus_per_server']} GPUs): "
              f"{r['pairs_per_second']} pairs/s, {r['cpu_ms_per_pair']} ms CPU per pair, "
              f"{r['full_reloads']} full reloads")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
