"""Two pool daemons (or two processes of one) admitting held Slurm jobs at the same moment: the
scenario the PostgreSQL and the SQLite --processes tests both run.

Slurm's queue is a stand-in here (what `squeue --json` shows and `scontrol release` changes, in the
shape waiting.py reads): real Slurm is tested in tests/slurm; what this checks is the pool's side,
two admission passes that decide from the same look at the queue.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from rgpu.remoting.pool.rules import PoolCore
from rgpu.slurm_plugin.poolhooks import admitting_reconciler
from rgpu.slurm_plugin.request import parse_record
from rgpu.slurm_plugin.squeue import SlurmJob
from rgpu.slurm_plugin.waiting import lease_requests
from tests.poolcore_helpers import req, server

WAIT_SECONDS = 2.0
TWO_GPUS = "rgpu:v1 nodes=1 count=2 percent=100 units=200"
ONE_GPU = "rgpu:v1 nodes=1 count=1 percent=100 units=100"


def held_job(job_id: int, record: str) -> SlurmJob:
    """A job as job_submit.lua submits it with hold_until_placed: held, marked."""
    return SlurmJob(job_id=job_id, state="PENDING", flags=(), restart_count=0, user="alice", cluster="c", nodes="",
                    tres_per_node="gres:rgpu:1", comment="", reason="JobHeldUser",
                    admin_comment=record + " | rgpu: waiting: held until the pool can place its slices")


class SlurmQueue:
    """The jobs slurmctld holds; `scontrol` takes the argv the admission runs (release, unmark)."""

    def __init__(self, jobs: list[SlurmJob], on_release: object = None) -> None:
        self._jobs = {job.job_id: job for job in jobs}
        self._lock = threading.Lock()
        self.released: list[int] = []
        self.on_release = on_release

    def live_jobs(self) -> list[SlurmJob]:
        with self._lock:
            return list(self._jobs.values())

    def scontrol(self, argv: list[str]) -> None:
        with self._lock:
            if argv[1] == "release":
                job_id = int(argv[2])
                if self._jobs[job_id].reason == "JobHeldUser":
                    self._jobs[job_id] = replace(self._jobs[job_id], reason="Priority")
                    self.released.append(job_id)
            else:                                     # update jobid=N admincomment=RECORD
                job_id = int(argv[2].split("=", 1)[1])
                self._jobs[job_id] = replace(self._jobs[job_id], admin_comment=argv[3].split("=", 1)[1])
        if argv[1] == "release" and callable(self.on_release):
            self.on_release()


class LateLook:
    """The queue as one daemon's pass reads it, pausing after the read until `resume` (or
    WAIT_SECONDS): the other daemon's pass runs in between, if the pool lets it."""

    def __init__(self, queue: SlurmQueue, read: threading.Event, resume: threading.Event) -> None:
        self.queue, self.read, self.resume = queue, read, resume

    def live_jobs(self) -> list[SlurmJob]:
        jobs = self.queue.live_jobs()
        self.read.set()
        self.resume.wait(WAIT_SECONDS)
        return jobs


def admit_from_one_look(a: PoolCore, b: PoolCore) -> tuple[list[int], PoolCore]:
    """Two GPUs, one held by a running job; job 10 waits for two GPUs, job 11 for one. Daemon b
    reads the queue; daemon a admits job 11 into the free GPU, and the running job ends; then b
    goes on from its look, which still shows job 11 held. Returns the jobs released."""
    a.register(server(0, gpus=2))
    a.allocate(req("running", count=1, percent=100))
    b_read, room_freed = threading.Event(), threading.Event()

    def first_release_frees_the_running_jobs_gpu() -> None:
        if not room_freed.is_set():
            a.release("running")
            room_freed.set()

    queue = SlurmQueue([held_job(10, TWO_GPUS), held_job(11, ONE_GPU)], first_release_frees_the_running_jobs_gpu)
    log = logging.getLogger("test.admission")
    passes = [admitting_reconciler(core, source, 1.0, 10.0, log, cluster="c", scontrol=queue.scontrol)[0]
              for core, source in ((b, LateLook(queue, b_read, room_freed)), (a, queue))]
    threads = [threading.Thread(target=p.run_once) for p in passes]
    threads[0].start()
    assert b_read.wait(10), "daemon b never read the queue"
    threads[1].start()
    for t in threads:
        t.join(30)
    return queue.released, a


def released_fit(released: list[int], core: PoolCore) -> bool:
    """Whether the pool can hold every released job's slices together (none leased yet)."""
    records = {10: TWO_GPUS, 11: ONE_GPU}
    return core.fits_in_every_order([r for job in released for r in lease_requests(parse_record(records[job]))])
