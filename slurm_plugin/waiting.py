"""Jobs that wait for the pool, and starting them only when it can place them.

The license admits a job by GPU percent; the pool places slices on distinct GPUs, so a job the
license admits can still find no GPU with room (fragmentation: 160 GPU-percent free as 40 on each
of four GPUs holds no half-GPU slice). Started anyway, its PrologSlurmctld fails and Slurm
requeues it. So the pool admits rgpu jobs before Slurm may start them:

- job_submit.lua submits every rgpu job held (priority 0; Slurm shows reason JobHeldUser) and
  marked: its admin comment is `<record> | rgpu: waiting: ...`;
- `start_waiting_jobs` (run by the pool's reconciler on every pass, and at once when a lease
  ends: one thread, and one daemon of the pool at a time (PoolCore.admitting), so two admissions
  never share out the same room) releases the marked held jobs the pool can place now, oldest
  first, each counted against the free room *after* the room of the jobs already released but not
  yet holding their leases (pending, or in PrologSlurmctld), so none is started only to fail; the
  mark goes with the hold (so a later `scontrol hold` of the job is its owner's to release);
- a job that failed anyway (leases made outside Slurm took the room, the pool did not answer) is
  requeued by Slurm, marked by its prolog, and held by Slurm for its requeue delay (reason
  BeginTime; about two minutes in 22.05): it gets `StartTime=now` as soon as it fits.

`jobs_to_start` is pure; the rest runs scontrol.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rgpu.slurm_plugin.jobkey import parse_job_key
from rgpu.slurm_plugin.proc import run_command
from rgpu.slurm_plugin.request import (
    RECORD_SEPARATOR,
    WAITING_MARK,
    RequestRecord,
    is_record,
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
    server: str = ""            # the GPU server it is on (pack=node: a node's slices on one)


def rooms(gpu_statuses: Iterable[Any], *, empty: bool = False) -> list[GpuRoom]:
    """From ListGpus records (pool client) or the pool core's gpu_statuses(). empty: every GPU
    of the pool as if nothing were allocated and every server up (what could ever be placed)."""
    out = []
    for g in gpu_statuses:
        if not empty and getattr(g, "server_state", "up") != "up":
            continue
        usable = int(g.gpu.usable_memory_bytes)
        sharing = str(getattr(g.gpu, "sharing", "") or "mps")
        server = str(getattr(g, "server", ""))
        if empty:
            out.append(GpuRoom(100, usable, usable, sharing, server))
        else:
            out.append(GpuRoom(100 - int(g.allocated_percent), usable - int(g.allocated_memory_bytes), usable, sharing,
                               server))
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
    """Place every node's slices (each node's on distinct GPUs; with pack=node on GPUs of one
    server, the fullest server that holds them), emptiest-fit last; True and `gpus` reduced when the
    whole job fits, else False and `gpus` unchanged. Pure."""
    trial = [replace(g) for g in gpus]
    for _ in range(record.nodes):
        fitting = []
        for i, room in enumerate(trial):
            need = _slice_need(record, room)
            if need and room.free_percent >= need[0] and room.free_memory_bytes >= need[1]:
                fitting.append((room.free_percent, i, need))
        if record.request.pack == "node":
            by_server: dict[str, list[tuple[int, int, tuple[int, int]]]] = {}
            for fit in fitting:
                by_server.setdefault(trial[fit[1]].server, []).append(fit)
            holding = [fits for fits in by_server.values() if len(fits) >= record.request.count]
            fitting = min(holding, key=lambda fits: sum(f[0] for f in fits)) if holding else []
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
# The hold job_submit.lua puts on rgpu jobs: Slurm takes a priority of 0 set by the plugin as the
# user's own (22.05 to 26.05: the reason is JobHeldUser), so rgpu's are told apart by their mark.
ADMISSION_HOLD = "JobHeldUser"
ADMIN_HOLD = "JobHeldAdmin"      # an admin's hold: never released by rgpu
# Reasons of a pending job Slurm may start at its next scheduling pass: a job released by rgpu
# shows these until it starts, and its room is kept for it meanwhile.
STARTABLE_REASONS = frozenset({"", "None", "Priority", "Resources", "Licenses"})

# What to do for a job the pool can place now: reserve its placement in the pool (PoolCore.reserve:
# nothing else may take that room until its PrologSlurmctld claims it), then scontrol release
# (held), then StartTime=now (requeued: Slurm's requeue delay). HOLD: a job let go without a
# reservation (by an admin, or before reservations) that Slurm has not started yet, whose room is
# no longer there (marked again, then `scontrol uhold`: it waits as it was submitted).
RESERVE, RELEASE, START, HOLD = "reserve", "release", "start", "hold"


def _admitted_unleased(job: Any, leased: set[tuple[int, int]]) -> bool:
    """A job rgpu (or an admin) let go that holds no lease yet: pending and startable, or in its
    PrologSlurmctld; its slices are about to be taken from the pool's free room."""
    if (job.job_id, job.restart_count) in leased:
        return False
    if job.state == "PENDING":
        return job.reason in STARTABLE_REASONS and not getattr(job, "dependency", "")
    # In PrologSlurmctld: 22.05's squeue --json says CONFIGURING as the state, 24.x as a flag.
    return job.state == "CONFIGURING" or (job.state == "RUNNING" and ("CONFIGURING" in job.flags or job.reason == "Prolog"))


# One lease's request as the pool's order-proof check takes it: (count, percent or 0,
# memory_bytes or 0, isolation, same_node: pack=node, all on one GPU server).
LeaseRequest = tuple[int, int, int, str, bool]


def lease_requests(record: RequestRecord) -> list[LeaseRequest]:
    """One per node: each node's lease reaches the pool as an Allocate of its own. Pure."""
    req = record.request
    return [(req.count, req.size.percent, req.size.memory_bytes, req.isolation, req.pack == "node")] * record.nodes


def _held_back(let_go: list[tuple[Any, RequestRecord]], fits: Fits | None) -> list[int]:
    """The jobs let go but not started yet to hold again until the others fit in every order: the
    youngest whose hold alone is enough, else the youngest, and so on. Each fitted with those
    before it when it was let go, and a lease that starts keeps that true; one that ends can break
    it: binpack places the next slices on the room it left, which may leave no whole GPU for a job
    let go earlier (found in the mixed batch). So can an admin's or a user's release of a job the
    pool cannot place. Pure when `fits` is; none without it."""
    if fits is None or not let_go:
        return []

    def requests(jobs: list[tuple[Any, RequestRecord]]) -> list[LeaseRequest]:
        return [r for _, record in jobs for r in lease_requests(record)]

    def without(job: Any) -> list[tuple[Any, RequestRecord]]:
        return [(j, r) for j, r in kept if j is not job]

    kept = list(let_go)
    held: list[int] = []
    while not fits(requests(kept)):
        pending = [j for j, _ in reversed(kept) if j.state == "PENDING"]   # one in PrologSlurmctld cannot be held
        if not pending:
            break
        # The youngest whose hold alone makes room, else the youngest, and look again.
        one = next((j for j in pending if fits(requests(without(j)))), pending[0])
        kept = without(one)
        held.append(one.job_id)
    return held


# GPUs as (server address, UUID): the room kept for the job at the head of the queue
# (remoting/pool/backfill.py), which reservations made after it must leave alone.
Avoid = frozenset[tuple[str, str]]
# fits(requests, first): whether the pool can place `requests` in every order after `first`
# ((request, GPUs it may not use), placed one after the other): PoolCore.fits_in_every_order.
Fits = Callable[..., bool]
# room(head requests, first): the GPUs the head will get once the oldest leases end: PoolCore.room_for_head.
Room = Callable[[list[LeaseRequest], list[tuple[LeaseRequest, Avoid]]], Avoid]


@dataclass(frozen=True)
class AdmissionPlan:
    steps: list[tuple[int, tuple[str, ...]]]     # (job id, steps), in the order to run them
    avoid: dict[int, Avoid]                      # per job reserved after the head: the head's GPUs
    head: int | None = None                      # the oldest waiting job that does not fit yet


def jobs_to_start(jobs: Iterable[Any], gpu_statuses: Iterable[Any], leases: Iterable[Any] = (),
                  fits: Fits | None = None, room: Room | None = None) -> list[tuple[int, tuple[str, ...]]]:
    """(id, steps) of `plan_admission`."""
    return plan_admission(jobs, gpu_statuses, leases, fits, room).steps


def plan_admission(jobs: Iterable[Any], gpu_statuses: Iterable[Any], leases: Iterable[Any] = (),
                   fits: Fits | None = None, room: Room | None = None) -> AdmissionPlan:
    """The marked pending jobs the pool can place now, oldest first, each counted with the jobs
    already let go but not yet leased and with those this pass reserves before it. Steps: RESERVE
    then RELEASE for a job held for admission (or by Slurm after repeated requeues), RESERVE then
    START for a requeued one, HOLD (listed first) for a job let go without a reservation that Slurm
    has not started and that no longer fits (`_held_back`). A held job no GPU could ever serve is
    released too (no reservation): its PrologSlurmctld then cancels it with the reason.

    Backfill that does not delay the head: the oldest waiting job that does not fit (the head)
    gets the GPUs `room` says it will get once the oldest leases end, and every younger job is
    placed, and reserved, off those GPUs (`avoid`), so small jobs never keep a whole-GPU job
    waiting by taking each GPU as it frees.

    `fits(requests, first)`: the pool's own check (PoolCore.fits_in_every_order): the requests of
    jobs let go without a reservation in every order their prologs may ask in, after this pass's
    reservations `first` placed one after the other. Without it, each job is placed in turn on
    `gpu_statuses` with `take` (and no room is kept). `jobs`: SlurmJob records (squeue.py), every
    live one; `leases`: the pool's (job_key). Pure when `fits` and `room` are."""
    jobs = sorted(jobs, key=lambda j: j.job_id)
    gpu_statuses = list(gpu_statuses)
    leased = {(p.job_id, p.restart_count) for p in (parse_job_key(le.job_key) for le in leases) if p is not None}
    free = rooms(gpu_statuses)
    let_go: list[tuple[Any, RequestRecord]] = []
    for job in jobs:
        if is_record(job.admin_comment) and _admitted_unleased(job, leased):
            try:
                record = parse_record(job.admin_comment)
            except RgpuError:
                continue
            if never_fits(record, gpu_statuses):
                continue            # its PrologSlurmctld cancels it: it takes no room, and is not held again
            take(record, free)
            let_go.append((job, record))
    held_back = _held_back(let_go, fits)
    admitted = [r for job, record in let_go if job.job_id not in held_back for r in lease_requests(record)]
    first: list[tuple[LeaseRequest, Avoid]] = []
    kept: Avoid = frozenset()

    def placeable(record: RequestRecord) -> bool:
        nonlocal first
        if fits is None:
            return take(record, free)
        trial = first + [(r, kept) for r in lease_requests(record)]
        if not fits(admitted, trial):
            return False
        first = trial
        return True

    steps: list[tuple[int, tuple[str, ...]]] = [(job_id, (HOLD,)) for job_id in held_back]
    avoid: dict[int, Avoid] = {}
    head = None
    for job in jobs:
        if job.state != "PENDING" or getattr(job, "dependency", "") or job.job_id in held_back:
            continue
        waiting = waiting_record(job.admin_comment)
        if waiting is None:
            continue
        record = waiting
        if job.reason == ADMISSION_HOLD:
            todo: tuple[str, ...] = (RESERVE, RELEASE)
        elif job.reason == MAX_REQUEUE_HOLD:
            todo = (RESERVE, RELEASE, START)
        elif job.reason not in STARTABLE_REASONS and job.reason != ADMIN_HOLD:
            todo = (RESERVE, START)
        else:
            continue
        if placeable(record):
            steps.append((job.job_id, todo))
            if kept:
                avoid[job.job_id] = kept
        elif job.reason == ADMISSION_HOLD and never_fits(record, gpu_statuses):
            steps.append((job.job_id, (RELEASE,)))      # for its PrologSlurmctld to cancel: no room to hold
        elif head is None and room is not None:
            head = job.job_id
            kept = room(lease_requests(record), first)
    return AdmissionPlan(steps, avoid, head)


def reservation_upkeep(jobs: Iterable[Any], leases: Iterable[Any]) -> tuple[list[Any], list[tuple[int, int]]]:
    """For the pool's reservations of Slurm jobs (keys `slurm:<cluster>:<job>:<restart>:+r<n>`,
    PoolCore.reserve): the jobs whose reservations to keep (renew: the job is let go, pending or in
    its PrologSlurmctld), and the (job id, restart count) of those to give back (the job is held
    again, waits on a dependency, was requeued since, is past its prologs, or ended: cancelled
    while pending). Reservations of jobs gone from Slurm's
    list are left to the reconciler (`decide`) and to their expiry. Pure."""
    by_id = {j.job_id: j for j in jobs}
    keep: list[Any] = []
    drop: list[tuple[int, int]] = []
    for attempt in sorted({(p.job_id, p.restart_count) for p in (parse_job_key(le.job_key) for le in leases)
                           if p is not None and p.node.startswith(RESERVATION_NODE)}):
        job = by_id.get(attempt[0])
        if job is None:
            continue
        if job.live and job.restart_count == attempt[1] and _admitted_unleased(job, set()):
            keep.append(job)
        else:
            drop.append(attempt)
    return keep, drop


RESERVATION_NODE = "+"     # reservation keys end in `+r<n>` where lease keys end in a node name


def hold_again(job_id: int, record_text: str, run: Callable[[list[str]], Any],
               log: logging.Logger | logging.LoggerAdapter[Any]) -> bool:
    """Mark, then hold (a user hold, which rgpu releases: the job waits as it was submitted; marked
    first, so a held job always carries the mark). False when Slurm started the job meanwhile: the
    mark is taken off again."""
    try:
        run(mark_command(job_id, waiting_comment(record_text, HELD_AGAIN)))
    except RgpuError as exc:
        log.warning("rgpu: slurm: could not mark released job %s to hold it again: %s", job_id, exc)
        return False
    try:
        run(user_hold_command(job_id))
        return True
    except RgpuError as exc:
        log.info("rgpu: slurm: could not hold released job %s again (started meanwhile?): %s", job_id, exc)
    try:
        run(mark_command(job_id, record_text))
    except RgpuError as exc:        # its PrologSlurmctld removes a mark it finds
        log.warning("rgpu: slurm: could not unmark job %s: %s", job_id, exc)
    return False


HELD_AGAIN = "held again until the pool can place its slices (released, then its room went; rgpu-poold releases it once it fits)"


def user_hold_command(job_id: int) -> list[str]:
    return ["scontrol", "uhold", str(int(job_id))]


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
                       *, leases: Iterable[Any] = (), fits: Fits | None = None, room: Room | None = None,
                       env: Mapping[str, str] | None = None, timeout: float = 4.0,
                       scontrol: Callable[[list[str]], Any] | None = None,
                       reserve: Callable[[Any, RequestRecord, Avoid], Any] | None = None,
                       released: Callable[[], Any] | None = None) -> list[int]:
    """Release (or StartTime=now) every waiting job the pool can place now; returns their ids.
    Read `leases` before `gpu_statuses`: a lease made between the two reads is then counted twice
    (a job waits one more pass), never not at all (a job started into room that is gone).
    `scontrol(argv)` runs each command (default: run_command with `env` and `timeout`).
    `reserve(job, record, avoid)` holds the job's placement in the pool, off the GPUs in `avoid`,
    before it is let go (PoolCore.reserve); a job whose reservation fails (RgpuError) is not let go
    this pass. `room`: see plan_admission. `released()` is called once every job is let go, before
    the marks come off (admission_clock.py: a node Epilog waits for that)."""
    run = scontrol or (lambda argv: run_command(argv, env=env, timeout=timeout))
    by_id = {j.job_id: j for j in jobs}
    started = []
    # The record alone, once released (PrologSlurmctld also removes a mark it finds).
    marked = {j.job_id: j.admin_comment.partition(RECORD_SEPARATOR)[0] for j in jobs if j.reason == ADMISSION_HOLD}
    records = {j.job_id: j.admin_comment.partition(RECORD_SEPARATOR)[0] for j in jobs}
    held = []
    plan = plan_admission(jobs, gpu_statuses, leases, fits, room)
    for job_id, steps in plan.steps:
        if steps == (HOLD,):
            if hold_again(job_id, records[job_id], run, log):
                held.append(job_id)
            continue
        try:
            for step in steps:
                if step == RESERVE:
                    if reserve is not None:
                        reserve(by_id[job_id], parse_record(records[job_id]), plan.avoid.get(job_id, frozenset()))
                else:
                    run(release_command(job_id) if step == RELEASE else start_command(job_id))
            started.append(job_id)
        except RgpuError as exc:
            log.warning("rgpu: slurm: could not start waiting job %s: %s", job_id, exc)
    if held:
        log.info("rgpu: slurm: the pool can no longer place released job(s) %s (their room went): held again "
                 "until it can", ", ".join(map(str, held)))
    if released is not None:
        released()
    for job_id in started:          # after every release, which is what the jobs wait for
        if job_id in marked:
            try:
                run(mark_command(job_id, marked[job_id]))
            except RgpuError as exc:   # PrologSlurmctld removes a mark it finds
                log.warning("rgpu: slurm: could not unmark released job %s: %s", job_id, exc)
    if started:
        log.info("rgpu: slurm: the pool can place waiting job(s) %s now: released", ", ".join(map(str, started)))
    return started
