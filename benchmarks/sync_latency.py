"""Small synchronous calls from a C driver-API program, locally and through rgpu, in one run.

    python benchmarks/sync_latency.py [--iterations 5000]

Builds benchmarks/sync_latency.c with the node's C compiler (CUDA's headers, linked against
rgpu's libcuda.so.1 for its symbols; which library runs is LD_LIBRARY_PATH's choice), starts a
session server on this GPU node (loopback, whole-GPU slice) and runs the program against NVIDIA's
driver, then through rgpu. Targets (issue 24): idle synchronize <= 15 us median, the `.item()`
pattern (launch + 4-byte copy to the host + synchronize) <= 35 us median.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PTX = HERE.parent / "examples" / "cuda" / "vecadd.ptx"
TARGETS = {"idle_sync_us_median": 15.0, "item_us_median": 35.0}


def build(libs_folder: Path, out: Path) -> Path:
    include = next((p for p in ("/usr/local/cuda/include", "/usr/include") if Path(p, "cuda.h").exists()), None)
    if include is None:
        raise SystemExit("sync_latency: no cuda.h (install the CUDA toolkit's headers)")
    exe = out / "sync_latency"
    subprocess.run([os.environ.get("CC", "cc"), "-O2", f"-I{include}", str(HERE / "sync_latency.c"), "-o", str(exe),
                    f"-L{libs_folder}", "-l:libcuda.so.1"], check=True)
    return exe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=5000)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.remoting import local_gpu, slice_env, start_session_server
    from rgpu.remoting.native.build import ensure_built

    libs = ensure_built()
    exe = build(Path(libs.folder), Path(tempfile.mkdtemp(prefix="rgpu-sync-latency-")))
    gpu = local_gpu()
    secret = os.urandom(32)
    server, address = start_session_server(gpu, secret)
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        remote = slice_env(base, libs.folder, secret, address, gpu, "bench-sync")
        local_env = dict(base, LD_LIBRARY_PATH=":".join(p for p in base.get("LD_LIBRARY_PATH", "").split(":")
                                                        if p and Path(p).resolve() != Path(libs.folder).resolve()))
        results = {}
        for name, env in (("local", local_env), ("rgpu", remote)):
            done = subprocess.run([str(exe), str(PTX), str(args.iterations)], env=env, capture_output=True, text=True,
                                  timeout=300, check=False)
            if done.returncode != 0:
                raise SystemExit(f"sync_latency ({name}) failed: {done.stderr.strip()}")
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
    print(f"rgpu small synchronous calls (C driver-API program): {gpu.name}, loopback, whole-GPU slice")
    print(f"{'call':<22} {'local median':>13} {'rgpu median':>12} {'rgpu p99':>9}  target")
    for key, target in TARGETS.items():
        name = key.removesuffix("_us_median")
        r = results["rgpu"]
        print(f"{name:<22} {results['local'][key]:>11.1f}us {r[key]:>10.1f}us {r[name + '_us_p99']:>7.1f}us  "
              f"{'PASS' if r[key] <= target else 'FAIL'} (<= {target:.0f} us)")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
