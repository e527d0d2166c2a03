"""What rgpu's Slurm prologs and epilogs do. Entry points (main.py) only map errors to
exit codes; the contracts are written down in prolog/README.md.

The pool is passed in (anything with PoolClient's allocate / release / get_lease / list_leases),
and the one Slurm query is a function argument, so each step runs against real daemons in the
tests without patching.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rgpu.prolog.job import JobContext, ended_mark, env_value, job_dir
from rgpu.remoting.pool.convert import lease_to_adaptor
from rgpu.slurm_plugin.hostlist import expand_hostlist
from rgpu.slurm_plugin.jobenv import license_units
from rgpu.slurm_plugin.request import (
    RECORD_SEPARATOR,
    RequestRecord,
    RgpuRequest,
    is_record,
    parse_record,
    parse_tres_per_node,
)
from rgpu.slurm_plugin.scontrol import JobInfo
from rgpu.slurm_plugin.waiting import never_fits, refused_comment, waiting_comment

from rgpu import validate
from rgpu.adaptor import write_adaptor_conf, write_private_file
from rgpu.errors import (
    CapacityError,
    InvalidRequest,
    NotFound,
    RgpuError,
    Unavailable,
)
from rgpu.paths import (
    ADAPTOR_CONF_NAME,
    ENDED_KEEP_SECONDS,
    ENDED_SUFFIX,
    ERROR_NAME,
    LEASE_GONE_KEEP_SECONDS,
    LEASE_GONE_NAME,
)
from rgpu.paths import run_dir as run_dir_from_env


class Pool(Protocol):
    def allocate(self, job_key: str, user: str, count: int, *, percent: int = 0, memory_bytes: int = 0,
                 account: str = "", ttl_seconds: float = 0.0, gpu_model: str = "", server: str = "",
                 min_memory_bytes: int = 0, isolation: str = "", same_node: bool = False) -> Any: ...
    def release(self, job_key: str) -> bool: ...
    def get_lease(self, job_key: str) -> Any: ...
    def list_leases(self) -> list[Any]: ...
    def list_gpus(self) -> list[Any]: ...


# ---------------------------------------------------------------- PrologSlurmctld

@dataclass(frozen=True)
class AllocationPlan:
    keys: tuple[str, ...]       # one per node
    request: RgpuRequest
    record: RequestRecord | None = None


def plan_allocation(job: JobContext, info: JobInfo, gres_name: str = "rgpu",
                    license_name: str = "rgpu") -> AllocationPlan | None:
    """Which leases the job needs (None: it asked for no rgpu). Pure.

    The request is the record job_submit.lua wrote in the admin comment, which only Slurm and
    admins write; the GRES count, node count and license (all set or checked by job_submit.lua)
    must agree with it, so the pool leases exactly what the license charged.
    """
    count = parse_tres_per_node(info.tres_per_node, gres_name)
    recorded = is_record(info.admin_comment)
    if count is None and not recorded:
        return None
    if count is None:
        raise InvalidRequest("prolog-slurmctld", f"job {job.job_id} carries an rgpu record but no --gres={gres_name}",
                             "its GRES was changed after submission", "scancel the job and submit it again")
    record = parse_record(info.admin_comment)
    nodes = job.nodes or tuple(expand_hostlist(info.node_names))
    if not nodes:
        raise InvalidRequest("prolog-slurmctld", f"job {job.job_id} has no nodes", "Slurm gave no node list",
                             "this is unexpected; see the slurmctld log")
    units = license_units(info.licenses, license_name)
    disagree = [f"{what} {have} (recorded {want})" for what, have, want in (
        ("--gres count", count, record.request.count), ("node count", len(nodes), record.nodes),
        (f"license {license_name}", units, record.units)) if have != want]
    if disagree:
        raise InvalidRequest("prolog-slurmctld", f"job {job.job_id} does not match its rgpu record: {'; '.join(disagree)}",
                             "the job was changed after job_submit.lua recorded its request",
                             "scancel the job and submit it again")
    validate.name("user", job.user or info.user)
    return AllocationPlan(keys=tuple(job.key_for(n) for n in nodes), request=record.request, record=record)


def allocate_job(job: JobContext, plan: AllocationPlan, pool: Pool) -> list[str]:
    """Allocate every node's lease; on any failure release what this call got, then raise."""
    got: list[str] = []
    req = plan.request
    try:
        for key in plan.keys:
            pool.allocate(key, job.user, req.count, percent=req.size.percent,
                          memory_bytes=req.size.memory_bytes, account=job.account, isolation=req.isolation,
                          same_node=req.pack == "node")
            got.append(key)
    except RgpuError:
        for key in got:
            try:
                pool.release(key)
            except RgpuError:
                pass  # the reconciler releases it once the job is gone
        raise
    return got


class NeverServable(InvalidRequest):
    """No GPU of the pool could hold the request even if all were free: waiting would never end."""


def prolog_slurmctld(env: Mapping[str, str], pool_factory: Callable[[], Pool],
                     query_job: Callable[[int], JobInfo], gres_name: str = "rgpu",
                     set_admin_comment: Callable[[int, str], None] | None = None,
                     notify: Callable[[int, str], None] | None = None,
                     cancel: Callable[[int], None] | None = None) -> list[str]:
    """Allocate the job's leases; returns their keys ([] for a job without rgpu).

    When the pool cannot place the job now, the job is marked as waiting for the pool (its admin
    comment, via `set_admin_comment`) before the CapacityError goes up; the mark is removed once
    the job got its slices. See slurm_plugin/waiting.py. When no GPU of the pool could ever place
    it (job_submit.lua's view of the pool was stale), the admin comment says why and the job is
    cancelled (`cancel`) rather than requeued for ever. An interactive job (srun, salloc) is not
    requeued but ended by Slurm: `notify` tells its user why, in one line, on the terminal.
    """
    job = JobContext.from_env(env, "prolog-slurmctld")
    info = query_job(job.job_id)                     # the one Slurm query for this job
    try:
        return _allocate_for(job, info, pool_factory, gres_name, set_admin_comment)
    except RgpuError as exc:
        if notify is not None and not info.batch:
            notify(job.job_id, interactive_message(exc))
        if isinstance(exc, NeverServable) and cancel is not None:
            cancel(job.job_id)
        raise


def interactive_message(exc: RgpuError) -> str:
    """One line for the srun/salloc user whose job rgpu could not prepare."""
    text = " ".join(str(exc).split())
    if isinstance(exc, CapacityError):
        return (f"{text} -- srun cannot wait for the pool: try again later, or submit with sbatch "
                "(a batch job waits and starts as soon as the pool can place it)")
    return text


def _allocate_for(job: JobContext, info: JobInfo, pool_factory: Callable[[], Pool], gres_name: str,
                  set_admin_comment: Callable[[int, str], None] | None) -> list[str]:
    plan = plan_allocation(job, info, gres_name)
    if plan is None:
        return []
    pool = pool_factory()
    record_text, marked, _ = info.admin_comment.strip().partition(RECORD_SEPARATOR)
    try:
        keys = allocate_job(job, plan, pool)
    except CapacityError as exc:
        if plan.record is not None and never_fits(plan.record, pool.list_gpus()):
            why = str(exc).removeprefix("rgpu: ")
            never = NeverServable("prolog-slurmctld", f"no GPU of the pool can ever hold job {job.job_id}'s slices",
                                  why, "submit it again with a request the pool's GPUs can serve "
                                       "(rgpu-admin list-gpus shows them)")
            if set_admin_comment is not None:
                set_admin_comment(job.job_id, refused_comment(record_text, str(never)))
            raise never from exc
        if set_admin_comment is not None:
            why = str(exc).removeprefix("rgpu: ")
            set_admin_comment(job.job_id, waiting_comment(record_text, f"{why} -- it starts when the pool can place it"))
        raise
    except Unavailable as exc:
        # Marked like a job the pool cannot place, so the reconciler in rgpu-poold starts it as
        # soon as the pool answers again, not after Slurm's requeue delay.
        if set_admin_comment is not None:
            why = str(exc).removeprefix("rgpu: ")
            set_admin_comment(job.job_id, waiting_comment(record_text, f"{why} -- it starts when the pool answers "
                                                                       "and can place it"))
        raise
    if marked and set_admin_comment is not None:
        set_admin_comment(job.job_id, record_text)
    return keys


# ---------------------------------------------------------------- node Prolog

def _make_job_dir(path: Path, job_id: int, uid: int, gid: int) -> None:
    """The job's folder, owned by its user, without the job's ended mark or an earlier attempt's
    lease-gone note (that attempt's lease ended; this one's has not)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o755)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if path.is_symlink() or not path.is_dir():
            raise
    if uid >= 0:
        os.chown(path, uid, gid if gid >= 0 else -1, follow_symlinks=False)
    path.chmod(0o700)
    ended_mark(path.parent, job_id).unlink(missing_ok=True)
    (path / LEASE_GONE_NAME).unlink(missing_ok=True)


def charged_for_rgpu(info: JobInfo, license_name: str = "rgpu") -> bool:
    """Whether Slurm charged the job for rgpu slices (its rgpu license, or job_submit.lua's
    record). Pure."""
    return bool(license_units(info.licenses, license_name)) or is_record(info.admin_comment)


def _not_charged(query_job: Callable[[int], JobInfo], job_id: int) -> bool:
    """True only when Slurm answers that the job holds no rgpu license and no rgpu record; a
    failed query is not an answer."""
    try:
        return not charged_for_rgpu(query_job(job_id))
    except RgpuError:
        return False


def node_prolog(env: Mapping[str, str], pool_factory: Callable[[], Pool],
                query_job: Callable[[int], JobInfo] | None = None) -> Path | None:
    """Write this node's adaptor.conf; None when the job asked for no rgpu. Raises on failure,
    also when the pool has no lease for a job charged for rgpu (asked with `query_job`, only
    then): a lease lost after PrologSlurmctld must not let the job run without its slices."""
    job = JobContext.from_env(env, "prolog")
    node = job.node or env_value(env, "SLURMD_NODENAME", "prolog")
    key = job.key_for(node)
    pool = pool_factory()
    try:
        lease = pool.get_lease(key)
    except NotFound:
        if query_job is not None and charged_for_rgpu(query_job(job.job_id)):
            raise NotFound("prolog", f"the pool has no lease {key} for job {job.job_id}, which holds the rgpu license",
                           "the lease was released or lost after PrologSlurmctld leased it",
                           "nothing to do: the job is requeued and leases new slices; if it repeats, "
                           "see rgpu-admin leases and the pool's log") from None
        return None                                   # a job without rgpu (a size word in a plain comment)
    except Unavailable:
        # A plain job whose comment happens to name a size owes the pool nothing: Slurm, not the
        # pool, says whether the job was charged for rgpu; only a charged one is requeued.
        if query_job is not None and _not_charged(query_job, job.job_id):
            return None
        raise
    if job.user and lease.user != job.user:
        raise InvalidRequest("prolog", f"lease {key} belongs to {lease.user!r}, not to {job.user!r}",
                             "the pool's state does not match this job", "release it with rgpu-admin and requeue the job")
    directory = job_dir(run_dir_from_env(env), job.job_id)
    _make_job_dir(directory, job.job_id, job.uid, job.gid)
    conf = lease_to_adaptor(lease)       # lease.user is the job's user (checked above)
    path = write_adaptor_conf(directory / ADAPTOR_CONF_NAME, conf, uid=job.uid if job.uid >= 0 else None,
                              gid=job.gid if job.gid >= 0 else None)
    (directory / ERROR_NAME).unlink(missing_ok=True)
    sweep_stale_job_dirs(directory.parent, job.job_id, pool)
    return path


def sweep_stale_job_dirs(run_dir: Path, current_job_id: int, pool: Pool) -> list[Path]:
    """Remove the job folders a node Epilog never got to remove (slurmd crashed, node rebooted
    without a tmpfs /run): those whose adaptor.conf names a lease the pool no longer has, since a
    sweep noted it LEASE_GONE_KEEP_SECONDS ago (_lease_gone_long_ago). Folders without
    adaptor.conf (a failed prolog's `error`, which flexrun reports) are kept. Never raises."""
    from rgpu.adaptor import read_adaptor_conf

    removed: list[Path] = []
    try:
        entries = sorted(run_dir.iterdir())
    except OSError:
        return removed
    now = time.time()
    old_marks = now - ENDED_KEEP_SECONDS
    for entry in entries:
        if entry.name.endswith(ENDED_SUFFIX) and entry.name[:-len(ENDED_SUFFIX)].isdigit():
            try:
                if entry.lstat().st_mtime < old_marks:
                    entry.unlink()
                    removed.append(entry)
            except OSError:
                pass
            continue
        if not entry.name.isdigit() or int(entry.name) == current_job_id or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            key = read_adaptor_conf(entry / ADAPTOR_CONF_NAME).job_id
            pool.get_lease(key)
        except NotFound:
            if _lease_gone_long_ago(entry, now):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
        except (RgpuError, OSError, ValueError):
            continue        # unreadable, or the pool did not answer: leave it for the next Prolog
    return removed


def _lease_gone_long_ago(job_folder: Path, now: float) -> bool:
    """Whether a sweep noted the folder's lease gone LEASE_GONE_KEEP_SECONDS ago or more; the
    first sweep to find it gone notes it now. A lease gone is not enough: EpilogSlurmctld ends it
    while (or before) the job's node Epilog runs, and that Epilog, which removes the folder and
    leaves the job's ended mark, starts only once the job's Prolog and tasks are done (KillWait).
    The note is never followed where it is a link (the folder is the job's user's). Never raises."""
    note = job_folder / LEASE_GONE_NAME
    try:
        noted = note.lstat().st_mtime
    except FileNotFoundError:
        try:
            os.close(os.open(note, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except OSError:
            pass            # the folder went (its Epilog ran), or a note came: the next sweep sees
        return False
    except OSError:
        return False
    return now - noted >= LEASE_GONE_KEEP_SECONDS


def record_node_error(env: Mapping[str, str], message: str) -> Path | None:
    """Leave the reason where flexrun reports it: <run dir>/<job id>/error. Never raises."""
    try:
        job_id = int(env.get("SLURM_JOB_ID", ""))
        uid = int(env.get("SLURM_JOB_UID", "-1") or -1)
        gid = int(env.get("SLURM_JOB_GID", "-1") or -1)
        directory = job_dir(run_dir_from_env(env), job_id)
        _make_job_dir(directory, job_id, uid, gid)
        (directory / ADAPTOR_CONF_NAME).unlink(missing_ok=True)
        return write_private_file(directory / ERROR_NAME, message.rstrip("\n") + "\n",
                                  uid if uid >= 0 else None, gid if gid >= 0 else None)
    except (ValueError, OSError):
        return None


# ---------------------------------------------------------------- epilogs
