"""Run the built cuda-samples, or cuda-python's example scripts, locally and through rgpu, and
compare (on a GPU node).

    python benchmarks/cuda_samples/run.py --built DIR [--out DIR] [--libs DIR[:DIR]] \\
        [--timeout 60] [--samples a,b] [--only-rgpu] [--sharing mps|isolated] [--dry-run]
    python benchmarks/cuda_samples/run.py --python-examples DIR [--python PY] [same options]

--built DIR is build.py's --out. --python-examples DIR is a copy of cuda-python's
`cuda_bindings/examples` folder: every `*.py` under it except helpers (`common/`, `_*`) and
pytest files is one program, run as `PY DIR/<path>` (PY: this interpreter) in its own folder with
DIR on PYTHONPATH and CUDA_BINDINGS_SKIP_EXAMPLE=2, so an example that waives (a capability
missing, e.g. a second GPU) exits 2 and counts as waived, not passed (default --timeout 180).

The script checks that NVML sees a GPU, starts a session server with the real-GPU backend on a
loopback port for GPU 0 (shared as --sharing), runs every program natively (4 at a time), then
each through rgpu with a whole-GPU slice, one at a time (under MPS one client's GPU fault ends
every session on the GPU). Each run has its own time limit (--timeout). A run refused because the
GPU is recovering from the previous program's fault is retried for up to --retry-s.

It prints a table, `local passes N, also through rgpu M (P%)` (with `; waived locally W` when
some waived), each failure and each waiver with its last stderr line; --out gets results.json,
logs/<name>.<local|rgpu>.log and server.log. For --built, LD_LIBRARY_PATH gets --libs (default:
the --rpath build.py recorded) and DIR/cudart. --dry-run prints the programs, their folders and
added environment, and runs nothing (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):
    sys.path.insert(0, str(HERE.parents[1]))

from benchmarks.cuda_samples.outcomes import (  # noqa: E402
    WAIVE_CODE,
    Run,
    failure_lines,
    is_waived,
    last_line,
    should_retry,
    summarize,
    table,
    to_json,
    waived_lines,
)
from benchmarks.cuda_samples.plan import PlanError, python_examples  # noqa: E402

GiB = 1 << 30


@dataclass(frozen=True)
class Program:
    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)   # added to (and overriding) the run's environment
    waive_code: int | None = None                       # the exit code that means "waived"; None: no waiving


class RunError(Exception):
    """A setup problem that stops the run (one line)."""


# ------------------------------------------------------------------------------ pure helpers

def read_list(built: Path) -> list[str]:
    listing = built / "LIST"
    if not listing.is_file():
        raise RunError(f"run: no {listing} (is --built the --out folder of build.py?)")
    return listing.read_text().split()


def choose(names: list[str], wanted: str | None, where: str = "LIST (not built?)") -> list[str]:
    if not wanted:
        return names
    asked = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in asked if n not in names]
    if unknown:
        raise RunError(f"run: not in {where}: {', '.join(unknown)}")
    return [n for n in names if n in asked]


def library_path(parts: list[str], existing: str | None) -> str:
    """LD_LIBRARY_PATH with `parts` first (empty ones dropped), then what was there."""
    return os.pathsep.join([p for p in parts if p] + ([existing] if existing else []))


def program_env(base: dict[str, str], ld_parts: list[str], native: str | None = None, slices: str | None = None) -> dict[str, str]:
    """The environment of one run: native (no RGPU_*), or through rgpu when `native` (rgpu's
    library folder, first on the path) and `slices` are given."""
    env = {k: v for k, v in base.items() if not k.startswith("RGPU_")}
    env["LD_LIBRARY_PATH"] = library_path(([native] if native else []) + ld_parts, env.get("LD_LIBRARY_PATH"))
    if slices:
        env["RGPU_SLICES"] = slices
    return env


def example_env(folder: Path, existing_pythonpath: str | None) -> dict[str, str]:
    """What a cuda-python example's run adds to its environment: the examples folder on PYTHONPATH
    (older examples import `common.helper_cuda` from there) and the waive exit code."""
    return {"PYTHONPATH": library_path([str(folder)], existing_pythonpath),
            "CUDA_BINDINGS_SKIP_EXAMPLE": str(WAIVE_CODE)}


def default_libs(built: Path) -> list[str]:
    try:
        rpath = json.loads((built / "BUILD.json").read_text()).get("rpath")
    except (OSError, ValueError):
        return []
    return [rpath] if rpath else []


# ------------------------------------------------------------------------------ running programs

def execute(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, bool, float, str, str]:
    """(exit code, timed out, seconds, stdout, stderr); a program over its time is killed with its children."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", start_new_session=True)
    except OSError as e:
        return None, False, 0.0, "", f"could not start {argv[0]}: {e}"
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, False, time.monotonic() - started, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, True, time.monotonic() - started, out, err


def write_log(path: Path, argv: list[str], attempt: int, rc: int | None, timed_out: bool, seconds: float,
              out: str, err: str) -> None:
    ended = "killed at its time limit" if timed_out else f"rc={rc}"
    with open(path, "a") as f:
        f.write(f"===== {' '.join(argv)}  attempt {attempt}: {ended}, {seconds:.1f} s\n--- stdout\n{out}\n--- stderr\n{err}\n")


def run_local(p: Program, env: dict[str, str], timeout: float, logs: Path) -> Run:
    rc, timed_out, secs, out, err = execute(p.argv, p.cwd, {**env, **p.env}, timeout)
    write_log(logs / f"{p.name}.local.log", p.argv, 1, rc, timed_out, secs, out, err)
    return Run(p.name, "local", rc, round(secs, 2), last_line(err, out), timed_out,
               waived=is_waived(rc, p.waive_code, err))


class Rgpu:
    """A session server on GPU 0 of this machine, and the slices of each run."""

    def __init__(self, sharing: str | None, memory_bytes: int | None, percent: int) -> None:
        from dataclasses import replace

        from benchmarks.remoting import local_gpu, start_session_server
        from rgpu.remoting.native.build import ensure_built

        self.libs = ensure_built()
        gpu = local_gpu()
        self.gpu = replace(gpu, sharing=sharing) if sharing else gpu
        self.secret = os.urandom(32)
        self.server, self.address = start_session_server(self.gpu, self.secret)
        self.memory = memory_bytes or self.gpu.total_memory_bytes * 9 // 10
        self.percent = percent
        self._count = 0

    def slices(self, name: str) -> str:
        from rgpu import tokens
        self._count += 1
        claims = tokens.SliceClaims(job_key=f"cuda-samples-{self._count}-{name}", slice_number=0, server=self.address,
                                    gpu_uuid=self.gpu.uuid, gpu_index=self.gpu.index, memory_limit_bytes=self.memory,
                                    compute_percent=self.percent, expires_unix=0, issued_unix=time.time())
        return f"{self.address},{tokens.sign(self.secret, claims)}"

    def settled(self) -> bool:
        """No GPU fault waiting to be decided, and the GPU not recovering from one."""
        from rgpu.remoting.datapath.worker.faults import REPORTS
        pending = any((self.server.faults_dir / REPORTS).glob("*.json"))
        return not pending and not self.server.recovering_gpus

    def wait_settled(self, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while not self.settled():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        self.server.stop()

    def about(self) -> dict[str, Any]:
        status = self.server.status()
        return {"gpu": self.gpu.name, "sharing": self.gpu.sharing, "compute_enforcement": status.get("compute_enforcement"),
                "launch_path": status.get("launch_path"), "slice_memory_bytes": self.memory, "compute_percent": self.percent}


def run_rgpu(p: Program, rgpu: Rgpu, ld_parts: list[str], timeout: float, retry_s: float, logs: Path) -> Run:
    waited, attempt = 0.0, 0
    while True:
        attempt += 1
        t = time.monotonic()
        rgpu.wait_settled(max(0.0, retry_s - waited))
        waited += time.monotonic() - t
        env = program_env(dict(os.environ), ld_parts, native=str(rgpu.libs.folder), slices=rgpu.slices(p.name))
        rc, timed_out, secs, out, err = execute(p.argv, p.cwd, {**env, **p.env}, timeout)
        write_log(logs / f"{p.name}.rgpu.log", p.argv, attempt, rc, timed_out, secs, out, err)
        if rc != 0 and should_retry(err, waited, retry_s):
            time.sleep(0.5)
            waited += 0.5
            continue
        if rc != 0:   # let a fault of this program be decided before the next one starts
            time.sleep(0.5)
        return Run(p.name, "rgpu", rc, round(secs, 2), last_line(err, out), timed_out, attempt,
                   waived=is_waived(rc, p.waive_code, err))


# ------------------------------------------------------------------------------ the command

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--built", type=Path, help="build.py's --out folder (with LIST)")
    what.add_argument("--python-examples", type=Path, metavar="DIR",
                      help="a copy of cuda-python's cuda_bindings/examples folder: run its example scripts")
    p.add_argument("--python", default=sys.executable, help="the Python that runs the examples (default: this one)")
    p.add_argument("--out", type=Path, default=Path("cuda-samples-results"), help="results.json and logs go here")
    p.add_argument("--libs", help="folders of the CUDA math libraries on this machine, ':'-separated "
                                   "(default: the --rpath recorded by build.py)")
    p.add_argument("--timeout", type=float, help="seconds per program run (default 60; 180 for --python-examples)")
    p.add_argument("--samples", help="comma-separated names: run only these")
    p.add_argument("--only-rgpu", action="store_true", help="skip the local runs")
    p.add_argument("--sharing", choices=("mps", "isolated"), help="how the session server shares the GPU (default: its default, mps)")
    p.add_argument("--retry-s", type=float, default=10.0, help="how long to retry a run refused by a recovering GPU")
    p.add_argument("--local-workers", type=int, default=4, help="local runs at a time")
    p.add_argument("--memory-gib", type=float, help="slice memory limit (default 90%% of the GPU)")
    p.add_argument("--compute-percent", type=int, default=100, help="slice compute share (default 100)")
    p.add_argument("--dry-run", action="store_true", help="print the programs and how they would run; run nothing")
    return p


def programs(built: Path, names: list[str]) -> list[Program]:
    return [Program(n, [str(built / n / n)], built / n) for n in names]


def python_programs(folder: Path, python: str, wanted: str | None) -> list[Program]:
    """The example scripts under `folder` (see plan.python_examples), each run in its own folder."""
    if not folder.is_dir():
        raise RunError(f"run: no folder {folder} (--python-examples takes a copy of cuda-python's cuda_bindings/examples)")
    rels = [f.relative_to(folder).as_posix() for f in folder.rglob("*.py") if f.is_file()]
    try:
        found = python_examples(rels)
    except PlanError as e:
        raise RunError(f"run: {e}") from e
    if not found:
        raise RunError(f"run: no example scripts (*.py outside common/) under {folder}")
    names = choose([name for name, _ in found], wanted, where=f"the examples under {folder}")
    env = example_env(folder, os.environ.get("PYTHONPATH"))
    return [Program(name, [python, str(folder / rel)], (folder / rel).parent, env, WAIVE_CODE)
            for name, rel in found if name in names]


def require_gpu() -> None:
    """A one-line RunError unless NVML sees a GPU 0 here (the local runs and the session server need one)."""
    try:
        from benchmarks.remoting import local_gpu
        local_gpu()
    except Exception as e:   # noqa: BLE001 - no pynvml, no driver, no GPU: all mean "not a GPU node"
        why = " ".join(str(e).split()) or type(e).__name__
        raise RunError(f"run: no GPU 0 on this machine ({type(e).__name__}: {why}); run this on a GPU node, "
                       f"or add --dry-run to see the plan") from e


def report(names: list[str], local: dict[str, Run], remote: dict[str, Run], out: Path, about: dict[str, Any]) -> None:
    summary = summarize(names, local, remote)
    print("\n".join(table(names, local, remote)))
    print(summary.line())
    for line in failure_lines(summary, local, remote):
        print(f"  FAILED {line}")
    for line in waived_lines(summary, local, remote):
        print(f"  WAIVED {line}")
    (out / "results.json").write_text(json.dumps(to_json(names, local, remote, summary, **about), indent=2) + "\n")
    print(f"results: {out / 'results.json'}, logs: {out / 'logs'}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _main(args)
    except RunError as e:
        print(e, file=sys.stderr)
        return 2


def plan_programs(args: argparse.Namespace) -> tuple[list[Program], list[str], dict[str, Any]]:
    """The programs to run, the LD_LIBRARY_PATH parts they need, and what results.json records of them."""
    if args.python_examples is not None:
        folder = args.python_examples.resolve()
        libs = args.libs.split(os.pathsep) if args.libs else []
        return python_programs(folder, args.python, args.samples), libs, {"python_examples": str(folder),
                                                                           "python": args.python, "libs": libs}
    built = args.built.resolve()
    names = choose(read_list(built), args.samples)
    missing = [n for n in names if not (built / n / n).is_file()]
    if missing:
        raise RunError(f"run: LIST names programs that are not in {built}: {', '.join(missing)} (rebuild with build.py)")
    libs = args.libs.split(os.pathsep) if args.libs else default_libs(built)
    return programs(built, names), [str(built / "cudart")] + libs, {"built": str(built), "libs": libs}


def _main(args: argparse.Namespace) -> int:
    if args.timeout is None:
        args.timeout = 180.0 if args.python_examples is not None else 60.0
    progs, ld_parts, recorded = plan_programs(args)
    names = [p.name for p in progs]
    if args.dry_run:
        for p in progs:
            added = " ".join(f"{k}={v}" for k, v in p.env.items())
            print(f"{p.name}: cd {p.cwd} && {added + ' ' if added else ''}{' '.join(p.argv)}")
        print(f"{len(progs)} programs; LD_LIBRARY_PATH first: {':'.join(ld_parts) or '(nothing added)'}; "
              f"timeout {args.timeout:g} s each")
        return 0
    require_gpu()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("*.log"):
        old.unlink()
    logging.basicConfig(filename=str(args.out / "server.log"), level=logging.INFO)
    local: dict[str, Run] = {}
    if not args.only_rgpu:
        env = program_env(dict(os.environ), ld_parts)
        print(f"local: {len(progs)} programs, {args.local_workers} at a time", flush=True)
        with ThreadPoolExecutor(max(1, args.local_workers)) as pool:
            for r in pool.map(lambda p: run_local(p, env, args.timeout, logs), progs):
                local[r.name] = r
    memory = int(args.memory_gib * GiB) if args.memory_gib else None
    remote: dict[str, Run] = {}
    try:
        rgpu = Rgpu(args.sharing, memory, args.compute_percent)
    except Exception as e:   # noqa: BLE001 - no GPU, no NVML, no compiler for rgpu's libraries
        if local:
            report(names, local, remote, args.out, {"timeout_s": args.timeout, **recorded})
        raise RunError(f"run: could not start a session server on this machine's GPU 0: {e}") from e
    try:
        print(f"through rgpu: {len(progs)} programs, one at a time ({rgpu.gpu.name}, sharing {rgpu.gpu.sharing})", flush=True)
        for i, p in enumerate(progs, 1):
            r = run_rgpu(p, rgpu, ld_parts, args.timeout, args.retry_s, logs)
            remote[p.name] = r
            print(f"[{i}/{len(progs)}] {p.name}: {r.describe()} ({r.seconds:.1f} s)", flush=True)
        about = {**rgpu.about(), "timeout_s": args.timeout, **recorded}
    finally:
        rgpu.stop()
    report(names, local, remote, args.out, about)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
