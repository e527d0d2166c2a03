"""The reconciler: keeps the pool's leases in step with the jobs Slurm knows.

Every `interval_seconds` it reads the live jobs (squeue --json or pyslurm) and the pool's leases.
A Slurm lease (key `slurm:<cluster>:<job>:<restart>:<node>`, see jobkey.py) whose job is gone,
finished, or requeued since (a lower restart count) is released once it has been so for
`grace_seconds` in every look, and the lease is at least that old: this covers a lease allocated
just after the job list was read, and a job list that was briefly incomplete. Running rgpu jobs
that hold no lease are reported (once per job). Leases of other clusters and non-Slurm leases
(rgpu-admin request-gpus) are never touched. A failed look at Slurm or the pool releases nothing.

`decide()` is pure; `Reconciler` does the I/O and can run in a thread of the pool daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from rgpu.slurm_plugin.jobkey import parse_job_key
from rgpu.slurm_plugin.squeue import JobSource, SlurmJob

from rgpu.errors import RgpuError


class LeaseLike(Protocol):
    job_key: str
    created_unix: float


class PoolLike(Protocol):
    def list_leases(self) -> Sequence[Any]: ...
    def release(self, job_key: str) -> bool: ...


@dataclass(frozen=True)
class Decision:
    release: tuple[str, ...]                 # release these now
    absent_since: dict[str, float]           # leases without a live job, and since when (carry over)
    missing: tuple[int, ...]                 # running rgpu jobs of this cluster without any lease


def stale_reason(parsed_restart: int, job: SlurmJob | None) -> str | None:
    if job is None or not job.live:
        return "job gone" if job is None else f"job {job.state.lower()}"
    if parsed_restart < job.restart_count:
        return f"job requeued (restart {job.restart_count})"
    return None


def decide(jobs: Iterable[SlurmJob], leases: Iterable[LeaseLike], *, cluster: str, now: float,
           grace_seconds: float, absent_since: Mapping[str, float] | None = None,
           gres_name: str = "rgpu") -> Decision:
    by_id = {j.job_id: j for j in jobs if not j.cluster or j.cluster == cluster}
    previous = dict(absent_since or {})
    still_absent: dict[str, float] = {}
    release: list[str] = []
    held_jobs: set[tuple[int, int]] = set()
    for lease in leases:
        parsed = parse_job_key(lease.job_key)
        if parsed is None or parsed.cluster != cluster:
            continue
        job = by_id.get(parsed.job_id)
        if stale_reason(parsed.restart_count, job) is None:
            held_jobs.add((parsed.job_id, parsed.restart_count))
            continue
        since = previous.get(lease.job_key, now)
        if now - since >= grace_seconds and now - float(lease.created_unix) >= grace_seconds:
            release.append(lease.job_key)
        else:
            still_absent[lease.job_key] = since
    missing = sorted(j.job_id for j in by_id.values()
                     if j.running and j.rgpu_count(gres_name) and (j.job_id, j.restart_count) not in held_jobs)
    return Decision(release=tuple(sorted(release)), absent_since=still_absent, missing=tuple(missing))


@dataclass
class Reconciler:
    """Run by rgpu-poold: `Reconciler(pool, backend, interval, grace, log).start()`."""

    pool: PoolLike
    backend: JobSource
    interval_seconds: float
    grace_seconds: float
    log: logging.Logger | logging.LoggerAdapter[Any]
    cluster: str | None = None           # None: ask Slurm (`scontrol show config`) on first use
    clock: Callable[[], float] = time.time
    cluster_lookup: Callable[[], str] | None = None
    # Called with the live jobs after each pass (waiting.py: start jobs waiting for the pool).
    after_pass: Callable[[list[SlurmJob]], Any] | None = None
    # Held for the whole pass, from reading the jobs to the last release (PoolCore.admitting):
    # the pool's other daemons admit only before or after it, never from the same look.
    exclusive: Callable[[], AbstractContextManager[Any]] | None = None
    # Told when each pass starts and ends (admission_clock.py).
    pass_started: Callable[[], Any] | None = None
    pass_done: Callable[[], Any] | None = None
    _absent_since: dict[str, float] = field(default_factory=dict)
    _reported_missing: set[int] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _cluster(self) -> str:
        if self.cluster is None:
            if self.cluster_lookup is None:
                from rgpu.slurm_plugin.scontrol import cluster_name
                self.cluster = cluster_name()
            else:
                self.cluster = self.cluster_lookup()
        return self.cluster

    def run_once(self) -> Decision | None:
        """One look; None when Slurm or the pool could not be read (nothing is released then)."""
        if self.exclusive is None:
            return self._look()
        try:
            with self.exclusive():
                return self._look()
        except RgpuError as exc:       # the lock could not be taken (PostgreSQL away, another pass stuck)
            self.log.warning("rgpu reconciler: skipped a pass: %s", exc)
            return None

    def _look(self) -> Decision | None:
        try:
            cluster = self._cluster()
            jobs = self.backend.live_jobs()
            leases = list(self.pool.list_leases())
        except RgpuError as exc:
            self.log.warning("rgpu reconciler: skipped a pass: %s", exc)
            return None
        decision = decide(jobs, leases, cluster=cluster, now=self.clock(), grace_seconds=self.grace_seconds,
                          absent_since=self._absent_since)
        self._absent_since = dict(decision.absent_since)
        for key in decision.release:
            try:
                if self.pool.release(key):
                    self.log.info("rgpu reconciler: released %s (its Slurm job is gone)", key)
            except RgpuError as exc:
                self.log.warning("rgpu reconciler: could not release %s: %s", key, exc)
        for job_id in decision.missing:
            if job_id not in self._reported_missing:
                self.log.warning("rgpu reconciler: running job %s of cluster %s asked for rgpu but holds no lease "
                                 "(its prolog failed or the pool lost it; flexrun in it will fail)", job_id, cluster)
        self._reported_missing = set(decision.missing)
        if self.after_pass is not None:
            try:
                self.after_pass(list(jobs))
            except RgpuError as exc:
                self.log.warning("rgpu reconciler: %s", exc)
        return decision

    def wake(self) -> None:
        """Run the next pass now (cheap, never blocks: the pool core's lease listener). Wakes that come
        during a pass make one more pass, not one each."""
        self._wake.set()

    def run_forever(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            if self.pass_started is not None:   # after the clear: a wake from now on makes one more pass
                self.pass_started()
            try:
                self.run_once()
            except Exception:
                self.log.exception("rgpu reconciler: pass failed (will retry)")
            if self.pass_done is not None:
                self.pass_done()
            self._wake.wait(self.interval_seconds)

    def start(self) -> Reconciler:
        self._thread = threading.Thread(target=self.run_forever, name="rgpu-reconciler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
