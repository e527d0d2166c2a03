"""Where the mixed batch's time goes between one job's end and the start of the job its room let
go (`slurm_mixed_batch.py --trace`). Reads slurmctld's log, rgpu-poold's log and a trace file in
which the prolog/epilog wrappers wrote `<script> start|end <job id> <epoch seconds>` lines, and
prints one row per job the pool released when a lease ended. Pure parsing apart from `report`.
"""

from __future__ import annotations

import datetime
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

_SLURM_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)\] (.*)$")
_POOL_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) (.*)$")
_DONE = re.compile(r"_job_complete: JobId=(\d+) done")
_HOLD_RELEASED = re.compile(r"release hold on JobId=(\d+)")
_STARTED = re.compile(r"(?:Started JobId=|sched: Allocate JobId=)(\d+)\b")
_LEASE_RELEASED = re.compile(r"released lease slurm:[^:]+:(\d+):")
_JOBS_RELEASED = re.compile(r"the pool can place waiting job\(s\) ([\d, ]+) now: released")


@dataclass
class JobTimes:
    done: float | None = None             # slurmctld: _job_complete ... done (Slurm's EndTime)
    hold_released: float | None = None    # slurmctld: the pool's `scontrol release`
    started: float | None = None          # slurmctld: Started / Allocate
    lease_released: float | None = None   # rgpu-poold: the lease ended (first node's)
    pool_released: float | None = None    # rgpu-poold: the admission pass that let the job go
    scripts: dict[str, dict[str, float]] = field(default_factory=dict)   # script -> start/end


def _slurm_seconds(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).timestamp()


def parse(slurmctld_log: Iterable[str], pool_log: Iterable[str], trace: Iterable[str]) -> dict[int, JobTimes]:
    jobs: dict[int, JobTimes] = {}

    def job(job_id: str) -> JobTimes:
        return jobs.setdefault(int(job_id), JobTimes())

    for line in slurmctld_log:
        m = _SLURM_STAMP.match(line)
        if not m:
            continue
        at, text = _slurm_seconds(m.group(1)), m.group(2)
        for pattern, name in ((_DONE, "done"), (_HOLD_RELEASED, "hold_released"), (_STARTED, "started")):
            hit = pattern.search(text)
            if hit and getattr(job(hit.group(1)), name) is None:
                setattr(job(hit.group(1)), name, at)
    for line in pool_log:
        m = _POOL_STAMP.match(line)
        if not m:
            continue
        at, text = _slurm_seconds(m.group(1)) + int(m.group(2)) / 1000, m.group(3)
        hit = _LEASE_RELEASED.search(text)
        if hit and job(hit.group(1)).lease_released is None:
            job(hit.group(1)).lease_released = at
        hit = _JOBS_RELEASED.search(text)
        if hit:
            for job_id in hit.group(1).split(","):
                job(job_id.strip()).pool_released = at
    for line in trace:
        fields = line.split()
        if len(fields) == 4 and fields[1] in ("start", "end") and fields[2].isdigit():
            job(fields[2]).scripts.setdefault(fields[0], {}).setdefault(fields[1], float(fields[3]))
    return jobs


@dataclass(frozen=True)
class Transition:
    """The job `released` let go when `ended`'s lease ended; seconds from `ended`'s EndTime."""

    ended: int
    released: int
    stages: dict[str, float]


STAGES = ("EpilogSlurmctld start", "lease released", "job released", "EpilogSlurmctld end", "Epilog end",
          "job started")


def transitions(jobs: dict[int, JobTimes]) -> list[Transition]:
    """For each job the pool let go after the first pass: the last lease that ended before that
    pass, and when each step of the hand-over happened, counted from that lease's job's end."""
    ends = sorted((t.lease_released, job_id) for job_id, t in jobs.items() if t.lease_released is not None)
    out = []
    for job_id, times in sorted(jobs.items()):
        # 26.05 logs no line for a job its backfill pass starts: its PrologSlurmctld's start then.
        started = times.started or times.scripts.get("PrologSlurmctld", {}).get("start")
        if times.pool_released is None or started is None:
            continue
        before = [e for e in ends if e[0] <= times.pool_released]
        if not before:
            continue                     # released by the first pass, not by a lease's end
        ended = jobs[before[-1][1]]
        if ended.done is None:
            continue
        scripts = ended.scripts
        points = {
            "EpilogSlurmctld start": scripts.get("EpilogSlurmctld", {}).get("start"),
            "lease released": ended.lease_released,
            # slurmctld's `release hold` line; the pool logs its own after unmarking the jobs.
            "job released": times.hold_released or times.pool_released,
            "EpilogSlurmctld end": scripts.get("EpilogSlurmctld", {}).get("end"),
            "Epilog end": scripts.get("Epilog", {}).get("end"),
            "job started": started,
        }
        out.append(Transition(before[-1][1], job_id,
                              {k: v - ended.done for k, v in points.items() if v is not None}))
    return out


def report(found: list[Transition]) -> str:
    lines = ["hand-overs (seconds after the ended job's EndTime): ended -> released job: "
             + ", ".join(STAGES)]
    for t in found:
        lines.append(f"  {t.ended:>3} -> {t.released:>3}: "
                     + ", ".join(f"{t.stages[s]:.2f}" if s in t.stages else "-" for s in STAGES))
    for stage in STAGES:
        values = [t.stages[stage] for t in found if stage in t.stages]
        if values:
            lines.append(f"  {stage}: median {statistics.median(values):.2f}, max {max(values):.2f} s")
    return "\n".join(lines)


def trace_wrapper(key: str, argv: list[str], trace_file: str) -> list[str]:
    """`argv` run by sh, with `<key> start|end $SLURM_JOB_ID <epoch>` lines appended to
    `trace_file` around it (its exit status kept)."""
    note = f'echo "{key} $stage $SLURM_JOB_ID $(date +%s.%N)" >> "{trace_file}"'
    return ["/bin/sh", "-c", f'stage=start; {note}; "$0" "$@"; rc=$?; stage=end; {note}; exit $rc', *argv]
