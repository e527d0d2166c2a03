"""What rgpu-poold runs for Slurm: the reconciler and the license sync, as background threads.

The pool daemon finds `start_from_settings` through the `rgpu.pool_plugins` entry point and
calls it after its gRPC server started, and `.stop()` on shutdown. `core` is the pool's PoolCore (or anything with list_leases() ->
records with job_key and created_unix, release(job_key) -> bool, capacity() -> .total_units and
add_capacity_listener(callback)). Slurm is reached with the Slurm client commands of the pool's
host (squeue, scontrol; $SLURM_CONF or /etc/slurm/slurm.conf; munge).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rgpu.slurm_plugin.admission_clock import AdmissionClock, admission_pending
from rgpu.slurm_plugin.heldwatch import HeldJobWatch, squeue_runner
from rgpu.slurm_plugin.licenses import LicenseSync, SlurmLicenses
from rgpu.slurm_plugin.reconcile import Reconciler
from rgpu.slurm_plugin.squeue import JobSource, backend_for


@dataclass
class SlurmIntegration:
    reconciler: Reconciler | None
    license_sync: LicenseSync | None
    held_watch: HeldJobWatch | None = None
    core: Any = None
    clock: AdmissionClock | None = None     # set where this daemon admits jobs

    def admission_pending(self, job_key_prefix: str) -> bool:
        """The pool's AdmissionPending call (admission_clock.py): False where this daemon admits no jobs."""
        if self.clock is None or self.core is None:
            return False
        return admission_pending(self.clock, self.core.list_leases, job_key_prefix)

    def stop(self) -> None:
        for part in (self.held_watch, self.reconciler, self.license_sync):
            if part is not None:
                part.stop()


def start_slurm_integration(core: Any, *, interval_seconds: float, grace_seconds: float, cluster: str = "",
                            backend: str = "auto", license_sync: bool = False,
                            admission_poll_seconds: float = 0.0, log: logging.Logger | None = None,
                            env: Mapping[str, str] | None = None, keep_room_for_head: bool = False) -> SlurmIntegration:
    """interval_seconds <= 0 starts nothing (a pool with no Slurm cluster beside it)."""
    log = log or logging.getLogger("rgpu-poold")
    if interval_seconds <= 0:
        return SlurmIntegration(None, None)
    reconciler, admission = admitting_reconciler(core, backend_for(backend, env=env), interval_seconds, grace_seconds,
                                                 log, cluster=cluster or None,
                                                 cluster_lookup=None if cluster else _cluster_lookup(env), env=env)
    admission.keep_room_for_head = keep_room_for_head
    clock = wake_on_lease_changes(core, reconciler, admission)
    reconciler.start()
    # New held jobs wake the reconciler at once, not at its next pass (heldwatch.py).
    watch = None
    if admission_poll_seconds > 0:
        watch = HeldJobWatch(reconciler.wake, admission_poll_seconds, squeue_runner(env), log).start()
    sync = None
    if license_sync:
        sync = LicenseSync(core, SlurmLicenses(env=env), log).start(interval_seconds)
        core.add_capacity_listener(sync.trigger)   # servers down/drained/back: sync at once
    log.info("rgpu-poold: Slurm reconciler every %g s (grace %g s)%s%s", interval_seconds, grace_seconds,
             f", new held jobs looked for every {admission_poll_seconds:g} s" if watch else "",
             ", license sync on" if sync else "")
    return SlurmIntegration(reconciler, sync, watch, core=core, clock=clock)


def wake_on_lease_changes(core: Any, reconciler: Reconciler, admission: Admission) -> AdmissionClock:
    """Wake the reconciler when a lease changes, and keep the clock that says when its admission
    has caught up with the last lease end (AdmissionPending, admission_clock.py)."""
    clock = AdmissionClock()
    reconciler.pass_started = clock.pass_started
    reconciler.pass_done = clock.pass_done
    admission.released = clock.pass_done
    if hasattr(core, "add_lease_listener"):
        # This thread is the one place of this daemon that admits jobs, and its passes hold the
        # pool's admission lock, so two admissions never share out the same room. A lease that
        # ended frees room; one that started settles where a released job's slices went: either
        # may let a held job start, so a pass runs at once.
        def lease_changed(ended: bool) -> None:
            if ended:
                clock.lease_ended()        # before the wake: the pass it makes starts after this
            if ended or admission.jobs_held:
                reconciler.wake()

        core.add_lease_listener(lease_changed)
    return clock


def admitting_reconciler(core: Any, backend: JobSource, interval_seconds: float, grace_seconds: float,
                         log: logging.Logger, *, cluster: str | None = None, cluster_lookup: Any = None,
                         env: Mapping[str, str] | None = None,
                         scontrol: Callable[[list[str]], Any] | None = None) -> tuple[Reconciler, Admission]:
    """The reconciler whose passes end with the admission, each pass under the pool's admission
    lock (`core.admitting()`: one daemon or process at a time, from reading the jobs to the last
    release). Not started. `scontrol(argv)` runs the admission's Slurm commands."""
    admission = Admission(core, log, env, scontrol, reservation_seconds=reservation_seconds(interval_seconds))
    reconciler = Reconciler(core, backend, interval_seconds, grace_seconds, log, cluster=cluster,
                            cluster_lookup=cluster_lookup, after_pass=admission.run,
                            exclusive=getattr(core, "admitting", None))
    admission.cluster = reconciler._cluster
    return reconciler, admission


def reservation_seconds(interval_seconds: float) -> float:
    """How long the pool holds a released job's room for its PrologSlurmctld: every pass renews it
    while the job is let go (pending or in its PrologSlurmctld), so this only bounds how long a
    job that never starts (its pool daemon gone with it) keeps room: three passes, at least 30 s."""
    return max(30.0, 3 * interval_seconds)


@dataclass
class Admission:
    """After each reconciler pass: let the held jobs the pool can place start (waiting.py)."""

    core: Any
    log: logging.Logger
    env: Mapping[str, str] | None
    scontrol: Callable[[list[str]], Any] | None = None    # None: run_command (proc.py)
    jobs_held: bool = False        # some were still held after the last pass
    cluster: Callable[[], str] | None = None              # the reconciler's (reservation keys)
    reservation_seconds: float = 30.0
    # Backfill that never delays the oldest waiting job (waiting.plan_admission's `room`): off by
    # default, as it costs throughput when jobs run alike (the mixed batch: docs/benchmarks.md).
    keep_room_for_head: bool = False
    released: Callable[[], Any] | None = None     # every job this pass lets go is let go (admission_clock.py)

    def run(self, jobs: list[Any]) -> None:
        from rgpu.slurm_plugin.waiting import start_waiting_jobs

        reserve = self._reserve if self.cluster is not None and hasattr(self.core, "reserve") else None
        if reserve is not None:
            self._upkeep(jobs)
        pending = [j for j in jobs if j.state == "PENDING" and j.admin_comment]
        if pending:
            leases = self.core.list_leases()          # before the GPUs: see start_waiting_jobs
            started = start_waiting_jobs(jobs, self.core.gpu_statuses(), self.log, leases=leases, env=self.env,
                                         fits=getattr(self.core, "fits_in_every_order", None), scontrol=self.scontrol,
                                         reserve=reserve,
                                         room=getattr(self.core, "room_for_head", None)
                                         if reserve and self.keep_room_for_head else None,
                                         released=self.released)
            self.jobs_held = len(started) < len(pending)
        else:
            self.jobs_held = False

    def _prefix(self, job_id: int, restart_count: int) -> str:
        from rgpu.slurm_plugin.jobkey import attempt_prefix

        assert self.cluster is not None
        return attempt_prefix(self.cluster(), job_id, restart_count)

    def _reserve(self, job: Any, record: Any, avoid: frozenset[tuple[str, str]] = frozenset()) -> None:
        """Hold the job's placement in the pool (off the GPUs in `avoid`) until its
        PrologSlurmctld claims it (PoolCore.reserve)."""
        from rgpu.slurm_plugin.waiting import lease_requests

        self.core.reserve(self._prefix(job.job_id, job.restart_count), job.user, lease_requests(record),
                          self.reservation_seconds, avoid)

    def _upkeep(self, jobs: list[Any]) -> None:
        """Renew the reservations of jobs still let go; give back those of jobs that are not."""
        from rgpu.errors import RgpuError
        from rgpu.slurm_plugin.request import is_record, parse_record
        from rgpu.slurm_plugin.waiting import reservation_upkeep

        keep, drop = reservation_upkeep(jobs, self.core.list_leases())
        for job in keep:
            try:
                if is_record(job.admin_comment):
                    self._reserve(job, parse_record(job.admin_comment))
            except RgpuError as exc:
                self.log.warning("rgpu: slurm: could not renew the reservation of job %s: %s", job.job_id, exc)
        for job_id, restart_count in drop:
            try:
                self.core.drop_reservations(self._prefix(job_id, restart_count))
            except RgpuError as exc:
                self.log.warning("rgpu: slurm: could not give back the reservation of job %s: %s", job_id, exc)


def slurm_configured(env: Mapping[str, str] | None = None) -> str | None:
    """Why this host has no Slurm integration to run (None: it has one): the Slurm client
    commands and a slurm.conf ($SLURM_CONF, /etc/slurm/slurm.conf) must be there."""
    import os
    import shutil
    from pathlib import Path

    env = os.environ if env is None else env
    if shutil.which("scontrol", path=env.get("PATH")) is None or shutil.which("squeue", path=env.get("PATH")) is None:
        return "the Slurm client commands (scontrol, squeue) are not installed here"
    conf = env.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    if not Path(conf).is_file():
        return f"there is no Slurm configuration at {conf} (set $SLURM_CONF)"
    return None


def start_from_settings(core: Any, settings: Any, log: logging.Logger) -> SlurmIntegration:
    """The `rgpu.pool_plugins` entry point: the integration as the pool's settings configure it.

    On by default wherever Slurm is configured on the pool's host; off with
    slurm_reconcile_interval_seconds = 0 (license sync alone: slurm_license_sync = false).
    """
    if settings.slurm_reconcile_interval_seconds > 0:
        why_not = slurm_configured()
        if why_not:
            log.info("rgpu-poold: Slurm integration off: %s", why_not)
            return SlurmIntegration(None, None)
    return start_slurm_integration(core, interval_seconds=settings.slurm_reconcile_interval_seconds,
                                   grace_seconds=settings.slurm_reconcile_grace_seconds,
                                   cluster=settings.slurm_cluster, backend=settings.slurm_backend,
                                   license_sync=settings.slurm_license_sync,
                                   admission_poll_seconds=settings.slurm_admission_poll_seconds, log=log,
                                   keep_room_for_head=settings.slurm_keep_room_for_head)


def _cluster_lookup(env: Mapping[str, str] | None) -> Any:
    from rgpu.slurm_plugin.scontrol import cluster_name

    return lambda: cluster_name(env)
