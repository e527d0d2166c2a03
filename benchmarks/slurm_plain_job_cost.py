"""What rgpu's prologs and epilogs cost a job that asked for no rgpu (issue 23): each script Slurm
runs for every job, run as Slurm runs it (a fresh interpreter, the environment Slurm gives a plain
job), against the real 3-node test cluster and a real pool. Prints the median and p90 wall time per
script, and the same for `true` (what any configured script costs at least; a cluster without rgpu
runs none). `--compare DIR` times another checkout's prolog/ scripts beside this one's (e.g. the
code before the fast path). Needs root and Slurm (like `pytest -m slurm`).

    python benchmarks/slurm_plain_job_cost.py [--runs 30] [--compare /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.daemons import RgpuCluster
from tests.slurm.cluster import SlurmCluster, missing_requirements, wait_until
from tests.slurm.conftest import slurm_config, start_pool

SCRIPTS = ("rgpu-prolog-slurmctld", "rgpu-prolog", "rgpu-task-prolog", "rgpu-epilog", "rgpu-epilog-slurmctld")


# pyproject.toml's package-dir: the import package `rgpu` is assembled from top-level folders.
PACKAGE_DIRS = {"remoting": "remoting", "slurm_plugin": "slurm_plugin", "prolog": "prolog", "templates": "templates",
                "site": "site"}


def import_tree(repo: Path, into: Path) -> Path:
    """A folder whose `rgpu` package is `repo`'s, so PYTHONPATH runs that checkout's code whatever
    the interpreter's editable install points at."""
    package = into / "rgpu"
    package.mkdir(parents=True)
    for entry in (repo / "rgpu").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        (package / name).symlink_to(repo / folder)
    return into


def plain_job_env(script_env: dict[str, str], job_id: str, repo: Path) -> dict[str, str]:
    """What Slurm hands the scripts of a plain job (22.05; SLURM_JOB_LICENSES unset: no license)."""
    env = {k: v.replace("${SLURMD_NODENAME}", "c1") for k, v in script_env.items()}
    env.update(PYTHONPATH=str(repo), SLURM_CLUSTER_NAME="rgputest", SLURM_JOB_ID=job_id, SLURM_JOBID=job_id,
               SLURM_JOB_USER="nobody", SLURM_JOB_UID="65534", SLURM_JOB_GID="65534", SLURM_JOB_ACCOUNT="(null)",
               SLURM_JOB_RESTART_COUNT="0", SLURM_JOB_NODELIST="c1", SLURM_NODELIST="c1", SLURMD_NODENAME="c1",
               SLURM_JOB_PARTITION="cpu")
    return env


def time_runs(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=60)
        times.append((time.perf_counter() - started) * 1000)
    return times


def row(name: str, times: list[float]) -> str:
    p90 = sorted(times)[int(0.9 * (len(times) - 1))]
    return f"  {name:<24} median {statistics.median(times):7.1f} ms   p90 {p90:7.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--compare", type=Path, help="another checkout whose prolog/ scripts to time too")
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        print(f"skipped: {reason}")
        return 0
    root = Path(tempfile.mkdtemp(prefix="rgpu-slurm-bench-"))
    root.chmod(0o755)
    pool = RgpuCluster(root / "pool")
    slurm = None
    try:
        start_pool(pool)
        (root / "slurm").mkdir()
        config = slurm_config(pool, root / "run-rgpu")
        slurm = SlurmCluster(config, root=root / "slurm")
        slurm.start()
        job = slurm.submit([], "true\n", user="nobody")      # a real plain job for the scripts to look up
        wait_until("the plain job to end", lambda: slurm.job_state(job) == "COMPLETED", 30)
        script_env = {"SLURM_CONF": str(slurm.conf), **config.script_env}
        checkouts = [("this checkout", REPO)] + ([("compared", args.compare.resolve())] if args.compare else [])
        print(f"prolog/epilog wall time for a plain job (no rgpu license, no size word in its comment), "
              f"{args.runs} runs each, Python {sys.version.split()[0]}:")
        print(row("true (any script)", time_runs(["true"], plain_job_env(script_env, job, REPO), args.runs)))
        for n, (label, repo) in enumerate(checkouts):
            print(f" {label} ({repo}):")
            env = plain_job_env(script_env, job, import_tree(repo, root / f"tree{n}"))
            total = 0.0
            for script in SCRIPTS:
                path = repo / "prolog" / script
                argv = [str(path)] if script == "rgpu-task-prolog" else [sys.executable, str(path)]
                times = time_runs(argv, env, args.runs)
                total += statistics.median(times)
                print(row(script, times))
            print(f"  {'all five, per job':<24} median sum {total:7.1f} ms")
        return 0
    finally:
        if slurm is not None:
            slurm.stop()
        pool.stop_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
