"""The mixed batch of issue 10 on the real 3-node test cluster: 20 rgpu jobs submitted at once,
fractions 0.25 / 0.5 / 1.0, one and two slices per job, each sleeping a few seconds, on a pool of
4 GPUs. Prints the batch's total time (first submit to last job finished), how many jobs were
requeued, the reasons pending jobs showed, and the ideal: how many rounds a scheduler that starts
every job the moment the pool can place it needs (`ideal_rounds`: the jobs in submission order,
each started as soon as it fits, on 4 empty GPUs, every job as long as the others), times the
mean time one job of this batch ran (Slurm's StartTime to EndTime, prologs and epilogs
included). Needs root and Slurm (like `pytest -m slurm`).

    python benchmarks/slurm_mixed_batch.py [--sleep 5] [--keep-room-for-head] [--slurm-version 22.05]
        [--scheduler-parameters bf_interval=1,batch_sched_delay=1] [--trace] [--epilog-admission-wait 0]

`--trace` also prints, for each job a lease's end let go, when each step of the hand-over
happened (the ended job's EpilogSlurmctld and Epilog, the pool's release of the lease and of the
held job, Slurm's start of it; `slurm_batch_trace.py`).

`--scheduler-parameters` is the cluster's SchedulerParameters line (default: the test cluster's,
`ClusterConfig.scheduler_parameters`); compare runs of two lines in the same sitting.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.daemons import RgpuCluster  # noqa: E402
from rgpu.slurm_plugin.slurmroot import VERSIONS, host_version, install_for  # noqa: E402
from tests.slurm.cluster import ClusterConfig, SlurmCluster, missing_requirements, wait_until  # noqa: E402
from tests.slurm.conftest import pool_ready, slurm_config, start_pool  # noqa: E402

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
FRACTIONS = ("0.25", "0.5", "1.0")


def batch() -> list[tuple[int, str]]:
    """20 (slices, fraction) shapes: every fraction with one and two slices."""
    return [(1 + (i // 3) % 2, FRACTIONS[i % 3]) for i in range(20)]


def ideal_rounds(shapes: list[tuple[int, str]], gpus: int = 4) -> int:
    """Rounds of equal-length jobs a perfect scheduler needs: in submission order, each job starts
    as soon as its slices fit (each on a distinct GPU, `take` binpack), a round ends when all its
    jobs do. Pure."""
    from rgpu.slurm_plugin.request import parse_record
    from rgpu.slurm_plugin.waiting import GpuRoom, take

    records = [parse_record(f"rgpu:v1 nodes=1 count={n} percent={round(100 * float(f))} "
                            f"units={n * round(100 * float(f))}") for n, f in shapes]
    waiting, rounds = list(records), 0
    while waiting:
        room = [GpuRoom(100, 100, 100) for _ in range(gpus)]
        started = [r for r in waiting if take(r, room)]
        if not started:
            raise ValueError("a job fits on no GPU of an empty pool")
        waiting = [r for r in waiting if not any(r is s for s in started)]
        rounds += 1
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sleep", type=float, default=5.0, help="seconds each job runs")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--logs", type=Path, help="copy the cluster's and the pool's logs here at the end")
    parser.add_argument("--keep-room-for-head", action="store_true",
                        help="run the pool with slurm_keep_room_for_head = true (backfill off the oldest waiting job's GPUs)")
    parser.add_argument("--slurm-version", choices=VERSIONS,
                        help="run on this Slurm (the host's where it is that version, else Debian's in a cached root); "
                             "default: the host's")
    parser.add_argument("--trace", action="store_true",
                        help="time the prolog/epilog scripts and print where each hand-over's time goes")
    parser.add_argument("--scheduler-parameters", default=ClusterConfig.scheduler_parameters,
                        help="the cluster's SchedulerParameters (default: %(default)s)")
    parser.add_argument("--epilog-admission-wait", type=float,
                        help="the pool's slurm_epilog_admission_wait_seconds (default: the setting's; 0: the node "
                             "Epilog does not wait for the pool's admission)")
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        print(f"skipped: {reason}")
        return 0
    install = install_for(args.slurm_version or host_version())
    reason = missing_requirements(install)
    if reason:
        print(f"skipped: {reason}")
        return 0
    root = Path(tempfile.mkdtemp(prefix="rgpu-slurm-bench-"))
    root.chmod(0o755)
    pool = RgpuCluster(root / "pool")
    slurm = None
    try:
        start_pool(pool, slurm_conf=root / "slurm" / "etc" / "slurm.conf", install=install)
        (root / "slurm").mkdir()
        config = slurm_config(pool, root / "run-rgpu", install)
        config.scheduler_parameters = args.scheduler_parameters
        trace_file = root / "slurm" / "log" / "trace.txt"
        if args.trace:
            from benchmarks.slurm_batch_trace import trace_wrapper

            config.scripts = {key: trace_wrapper(key, list(argv), str(trace_file)) if key != "TaskProlog" else argv
                              for key, argv in config.scripts.items()}
        slurm = SlurmCluster(config, root=root / "slurm")
        slurm.start()
        # As the test session does: rgpu-poold restarted now that slurm.conf exists runs its Slurm
        # integration (reconciler; starting jobs that wait for the pool), as it does by default.
        assert pool.pool is not None
        pool.pool.stop()
        toml = pool.root / "rgpu.toml"
        if args.keep_room_for_head:
            toml.write_text(toml.read_text() + "slurm_keep_room_for_head = true\n")
        if args.epilog_admission_wait is not None:     # read by the node Epilogs (RGPU_CONFIG)
            toml.write_text(toml.read_text() + f"slurm_epilog_admission_wait_seconds = {args.epilog_admission_wait:g}\n")
        pool.start_pool(env=pool.env(**slurm.client_env))
        wait_until("4 GPUs registered again", lambda: pool_ready(pool, 400), 30)
        shapes = batch()
        started = time.monotonic()
        jobs = [slurm.submit([f"--gres=rgpu:{n}", f"--comment=fraction={f}"], f"sleep {args.sleep}\n", user="nobody")
                for n, f in shapes]
        reasons: dict[str, set[str]] = collections.defaultdict(set)
        done: dict[str, str] = {}

        def all_done() -> bool:
            # One squeue for the batch per look: a `scontrol show job` per job, 20 processes every
            # half second, loaded the 2-core host beside the scripts being measured.
            out = slurm.command(["squeue", "--noheader", "--states=all", f"--jobs={','.join(jobs)}",
                                 "--format=%i %T %r"]).stdout
            for line in out.splitlines():
                job, state, reason = (line.split(None, 2) + ["", ""])[:3]
                if job not in jobs or job in done:
                    continue
                if state in FINISHED:
                    done[job] = state
                elif state == "PENDING":
                    reasons[reason.strip()].add(job)
            return len(done) == len(jobs)

        wait_until("the batch to finish", all_done, args.timeout, interval=0.5)
        elapsed = time.monotonic() - started
        shown = [slurm.show_job(j) for j in jobs]
        restarts = sum(int(info.get("Restarts", "0") or 0) for info in shown)
        ran = sorted(_seconds(info["EndTime"]) - _seconds(info["StartTime"]) for info in shown)
        mean = sum(ran) / len(ran)       # Slurm's times are whole seconds: a mean of 20 is finer than one
        rounds = ideal_rounds(shapes)
        states = collections.Counter(done.values())
        print(f"Slurm {install.version or 'of the host'}, SchedulerParameters={args.scheduler_parameters}"
              + ("" if args.epilog_admission_wait is None else
                 f", slurm_epilog_admission_wait_seconds={args.epilog_admission_wait:g}"))
        print(f"mixed batch{' (room kept for the head job)' if args.keep_room_for_head else ''}: {len(jobs)} jobs ({', '.join(f'{n}x{f}' for n, f in shapes)}), sleep {args.sleep:g} s each")
        print(f"total {elapsed:.1f} s; states {dict(states)}; requeues {restarts}")
        print(f"ideal {rounds * mean:.1f} s: {rounds} rounds x {mean:.2f} s, the mean job's StartTime to EndTime "
              f"(jobs ran {ran[0]:.0f}-{ran[-1]:.0f} s); total/ideal {elapsed / (rounds * mean):.2f}")
        print("pending reasons seen: " + ", ".join(f"{r} ({len(j)} jobs)" for r, j in sorted(reasons.items())))
        if args.trace:
            _print_trace(root / "slurm" / "log" / "slurmctld.log", pool.root / "poold.log", trace_file)
        return 0 if states == {"COMPLETED": len(jobs)} else 1
    finally:
        if slurm is not None:
            slurm.stop()
        pool.stop_all()
        if args.logs:
            shutil.copytree(root / "slurm" / "log", args.logs / "slurm", dirs_exist_ok=True)
            for log in (root / "pool").glob("*.log"):
                shutil.copy(log, args.logs)
        shutil.rmtree(root, ignore_errors=True)


def _print_trace(slurmctld_log: Path, pool_log: Path, trace_file: Path) -> None:
    from benchmarks.slurm_batch_trace import parse, report, transitions

    def lines(path: Path) -> list[str]:
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    print(report(transitions(parse(lines(slurmctld_log), lines(pool_log), lines(trace_file)))))


def _seconds(stamp: str) -> float:
    """Slurm's StartTime/EndTime (2026-11-27T20:48:06) as seconds since the epoch."""
    import datetime

    return datetime.datetime.fromisoformat(stamp).timestamp()


if __name__ == "__main__":
    sys.exit(main())
