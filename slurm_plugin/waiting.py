"""Jobs that wait for the pool, and starting them as soon as it can place them.

The license admits a job by GPU percent; the pool places slices on distinct GPUs, so a job the
license admitted can still find no GPU with room (fragmentation, leases made outside Slurm, a
dispatcher that went away). Its PrologSlurmctld then fails and Slurm requeues it, and Slurm 22.05
holds a requeued job for about two minutes (reason BeginTime). Here:

- the prolog marks the job: its admin comment becomes `<record> | rgpu: waiting: <why>`, which
  the user sees in `scontrol show job` (AdminComment=) and `squeue --json` (22.05's `squeue -O`
  has no admin comment field); a job that then gets its slices has the mark removed;
- `start_waiting_jobs` (run by EpilogSlurmctld after it released a job's slices, and by the
  pool's reconciler on every pass) sets `StartTime=now` on marked pending jobs the pool can place
  now, oldest first, counting each against the free capacity, so none is started only to fail
  again (each retry is a requeue: a restart, a new lease key, log lines).

`jobs_to_start` is pure; the rest runs scontrol.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rgpu.slurm_plugin.proc import run_command
from rgpu.slurm_plugin.request import (
    RECORD_SEPARATOR,
    WAITING_MARK,
    RequestRecord,
    parse_record,
)

from rgpu.errors import RgpuError
from rgpu.model import isolation_allows


@dataclass
class GpuRoom:
    """Free room on one GPU of an up, undrained server."""

    free_percent: int
    free_memory_bytes: int
    usable_memory_bytes: int
    sharing: str = "mps"        # rgpu.model.SHARING_MODES


def rooms(gpu_statuses: Iterable[Any], *, empty: bool = False) -> list[GpuRoom]:
    """From ListGpus records (pool client) or the pool core's gpu_statuses(). empty: every GPU
    of the pool as if nothing were allocated and every server up (what could ever be placed)."""
    out = []
    for g in gpu_statuses:
        if not empty and getattr(g, "server_state", "up") != "up":
            continue
        usable = int(g.gpu.usable_memory_bytes)
        sharing = str(getattr(g.gpu, "sharing", "") or "mps")
        if empty:
            out.append(GpuRoom(100, usable, usable, sharing))
        else:
            out.append(GpuRoom(100 - int(g.allocated_percent), usable - int(g.allocated_memory_bytes), usable, sharing))
    return out


def _slice_need(record: RequestRecord, room: GpuRoom) -> tuple[int, int] | None:
    """(percent, bytes) one slice of `record` takes on this GPU; None: it can never go there
    (the pool's placement rules: isolation, whole GPUs only on exclusive ones, memory)."""
    req = record.request
    if not isolation_allows(req.isolation, room.sharing):
        return None
    if req.memory_bytes:
        if req.memory_bytes > room.usable_memory_bytes:
            return None
        need = max(1, min(100, -(-100 * req.memory_bytes // room.usable_memory_bytes))), req.memory_bytes
    else:
        need = record.percent, room.usable_memory_bytes * record.percent // 100
    if room.sharing == "exclusive" and need[0] != 100:
        return None
    return need


def take(record: RequestRecord, gpus: list[GpuRoom]) -> bool:
    """Place every node's slices (each node's on distinct GPUs), emptiest-fit last; True and
    `gpus` reduced when the whole job fits, else False and `gpus` unchanged. Pure."""
    trial = [replace(g) for g in gpus]
    for _ in range(record.nodes):
        fitting = []
        for i, room in enumerate(trial):
            need = _slice_need(record, room)
            if need and room.free_percent >= need[0] and room.free_memory_bytes >= need[1]:
                fitting.append((room.free_percent, i, need))
        if len(fitting) < record.request.count:
            return False
        for _, i, (percent, memory) in sorted(fitting)[:record.request.count]:   # binpack: fullest first
            trial[i].free_percent -= percent
            trial[i].free_memory_bytes -= memory
    gpus[:] = trial
    return True


def never_fits(record: RequestRecord, gpu_statuses: Iterable[Any]) -> bool:
    """True when no GPU of the pool could hold the request even with nothing else allocated
    (isolation=strict and no isolated or exclusive GPU; more memory than any GPU has; more
    slices per node than there are GPUs that suit them): waiting would never end. A pool that
    lists no GPU yet (just restarted, dispatchers not back) says nothing. Pure."""
    every = rooms(gpu_statuses, empty=True)
    return bool(every) and not take(record, every)


def waiting_record(admin_comment: str) -> RequestRecord | None:
    """The request of a job marked as waiting for the pool, else None."""
    record, sep, note = admin_comment.partition(RECORD_SEPARATOR)
    if not sep or not note.startswith(WAITING_MARK):
        return None
    try:
        return parse_record(record)
    except RgpuError:
        return None


# Slurm holds a batch job after repeated launch failures (reason JobHoldMaxRequeue). On 22.05 a
# PrologSlurmctld failure was not counted (12 failed starts in a row, no hold); should another
# version count them, a held job that waited for the pool is released when it fits.
MAX_REQUEUE_HOLD = "JobHoldMaxRequeue"


def jobs_to_start(jobs: Iterable[Any], gpu_statuses: Iterable[Any]) -> list[tuple[int, bool]]:
    """(id, held) of marked pending jobs the pool can place now, oldest first, each counted
    against the free room; held: Slurm holds it after repeated requeues (release it first).
    `jobs`: SlurmJob records (squeue.py). Pure."""
    free = rooms(gpu_statuses)
    chosen = []
    for job in sorted(jobs, key=lambda j: j.job_id):
        if job.state != "PENDING":
            continue
        record = waiting_record(job.admin_comment)
        if record is not None and take(record, free):
            chosen.append((job.job_id, job.reason == MAX_REQUEUE_HOLD))
    return chosen


def mark_command(job_id: int, admin_comment: str) -> list[str]:
    return ["scontrol", "update", f"jobid={int(job_id)}", f"admincomment={admin_comment}"]


def start_command(job_id: int) -> list[str]:
    return ["scontrol", "update", f"jobid={int(job_id)}", "starttime=now"]


def release_command(job_id: int) -> list[str]:
    return ["scontrol", "release", str(int(job_id))]


QUOTA_MARK = "rgpu: waiting for quota:"


def waiting_comment(record_text: str, why: str) -> str:
    """The admin comment of a job the pool refused. A quota refusal gets its own mark: room on
    the GPUs says nothing about the quota, so such a job is not started early (it retries after
    Slurm's requeue delay)."""
    why = " ".join(why.replace("|", "/").split())[:300]   # one line
    mark = QUOTA_MARK if "quota of " in why else WAITING_MARK
    return f"{record_text}{RECORD_SEPARATOR}{mark} {why}"


REFUSED_MARK = "rgpu: refused:"


def refused_comment(record_text: str, why: str) -> str:
    """The admin comment of a job no GPU of the pool can ever serve (it is cancelled, not woken)."""
    why = " ".join(why.replace("|", "/").split()).removeprefix("rgpu: ")[:400]
    return f"{record_text}{RECORD_SEPARATOR}{REFUSED_MARK} {why}"


def mark_waiting(job_id: int, record_text: str, why: str, *, env: Mapping[str, str] | None = None,
                 timeout: float = 4.0) -> None:
    run_command(mark_command(job_id, waiting_comment(record_text, why)), env=env, timeout=timeout)


def clear_mark(job_id: int, admin_comment: str, *, env: Mapping[str, str] | None = None, timeout: float = 4.0) -> bool:
    record, sep, _ = admin_comment.partition(RECORD_SEPARATOR)
    if not sep:
        return False
    run_command(mark_command(job_id, record), env=env, timeout=timeout)
    return True


def start_waiting_jobs(jobs: Sequence[Any], gpu_statuses: Iterable[Any], log: logging.Logger | logging.LoggerAdapter[Any],
                       *, env: Mapping[str, str] | None = None, timeout: float = 4.0) -> list[int]:
    """StartTime=now for every waiting job the pool can place now; returns their ids."""
    started = []
    for job_id, held in jobs_to_start(jobs, gpu_statuses):
        try:
            if held:
                run_command(release_command(job_id), env=env, timeout=timeout)
            run_command(start_command(job_id), env=env, timeout=timeout)
            started.append(job_id)
        except RgpuError as exc:
            log.warning("rgpu: slurm: could not start waiting job %s: %s", job_id, exc)
    if started:
        log.info("rgpu: slurm: the pool can place waiting job(s) %s now: StartTime=now", ", ".join(map(str, started)))
    return started
