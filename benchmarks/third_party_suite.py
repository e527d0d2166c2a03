"""Run a third-party pytest suite (CuPy's own tests) locally and through a whole-GPU rgpu slice, and
compare: how many tests that pass locally also pass through rgpu.

    python benchmarks/third_party_suite.py --root CUPY_CHECKOUT tests/cupy_tests/core_tests ... \\
        [--every 10] [--workers 8] [--time-limit 240]

CuPy's suite has tens of thousands of parametrized cases: --every K keeps every K-th collected
test (by a stable hash of its id, the same subset in both runs). Both runs use pytest-xdist with
--workers processes; through rgpu each worker process opens its own session on the same slice.
A run cut by --time-limit is compared over the tests that ran in both.

CuPy's tests are not in its wheel: take them from its repository at the installed version, e.g.
    git -C cupy archive v14.2.0 tests/conftest.py tests/cupy_tests | tar -x -C CUPY_CHECKOUT
and pass --root CUPY_CHECKOUT with paths such as tests/cupy_tests/core_tests. The GPU node needs
pytest-xdist and pytest-timeout.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_RESULT = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)")
_SAMPLER = '''
import os, zlib
def pytest_collection_modifyitems(config, items):
    every = int(os.environ.get("RGPU_SUITE_EVERY", "1"))
    if every > 1:
        items[:] = [i for i in items if zlib.crc32(i.nodeid.encode()) % every == 0]
'''


def outcomes(text: str) -> dict[str, str]:
    """test id -> outcome, from pytest -v output (xdist's `[gw0] [ 1%] PASSED id` lines too)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        m = _RESULT.search(line)
        if m and m.group(2) not in found:
            found[m.group(2)] = m.group(1)
    return found


def run_suite(env: dict[str, str], root: Path, paths: list[str], workers: int, limit: float, log: Path) -> dict[str, str]:
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "rgpu_suite_sampler",
            "-n", str(workers), "--timeout", "120", *paths]
    started = time.monotonic()
    with open(log, "w") as out:
        try:
            subprocess.run(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            out.write(f"\n[third_party_suite: stopped at the {limit:.0f} s limit]\n")
    result = outcomes(log.read_text(errors="replace"))
    print(f"  {len(result)} tests reported in {time.monotonic() - started:.0f} s ({log})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=240)
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)

    sys.path.insert(0, str(HERE.parent))
    from benchmarks.remoting import local_gpu, slice_env, start_session_server
    from rgpu.remoting.native.build import ensure_built

    plugin_dir = Path(tempfile.mkdtemp(prefix="rgpu-suite-"))
    (plugin_dir / "rgpu_suite_sampler.py").write_text(_SAMPLER)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    base.update(PYTHONPATH=os.pathsep.join(filter(None, [str(plugin_dir), base.get("PYTHONPATH", "")])),
                RGPU_SUITE_EVERY=str(args.every))
    libs = ensure_built()
    gpu = local_gpu()
    secret = os.urandom(32)
    server, address = start_session_server(gpu, secret)
    try:
        remote_env = dict(slice_env(base, libs.folder, secret, address, gpu, "third-party-suite"), RGPU_LOG="error")
        args.logs.mkdir(parents=True, exist_ok=True)
        print(f"local run ({gpu.name})", flush=True)
        local = run_suite(base, args.root, args.paths, args.workers, args.time_limit, args.logs / "suite-local.log")
        print("through rgpu (whole-GPU slice, loopback)", flush=True)
        remote = run_suite(remote_env, args.root, args.paths, args.workers, args.time_limit, args.logs / "suite-rgpu.log")
    finally:
        server.stop()
    both = [t for t in local if t in remote]
    local_pass = [t for t in both if local[t] in ("PASSED", "XFAIL")]
    kept = [t for t in local_pass if remote[t] == local[t]]
    lost = [t for t in local_pass if remote[t] != local[t]]
    gained = [t for t in both if local[t] not in ("PASSED", "XFAIL") and remote[t] == "PASSED"]
    print(f"tests run in both: {len(both)} (local only {len(local) - len(both)}, rgpu only {len(remote) - len(both)})")
    print(f"passing locally: {len(local_pass)}; also passing through rgpu: {len(kept)} "
          f"({100.0 * len(kept) / max(1, len(local_pass)):.2f}%)")
    if gained:
        print(f"failing locally but passing through rgpu: {len(gained)}")
    for t in lost[:60]:
        print(f"  LOST {remote[t]:<7} {t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
