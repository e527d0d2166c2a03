"""What the two epilogs do: EpilogSlurmctld releases the ended job's leases, the node Epilog
removes the job's files on its node.

Slurm keeps an ended job's license (so every job waiting for those units waits too) until
EpilogSlurmctld exits, and rgpu-poold lets the next held job start the moment a lease ends: the
release is what the next job waits on. So the epilogs live apart from logic.py, whose imports
serve the prologs (the node Prolog's adaptor.conf rendering, the Slurm queries), and import only
job.py, jobkey.py and paths, beside the pool client they are handed; and EpilogSlurmctld releases
the leases it can name before it lists the others.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rgpu.prolog.job import JobContext, ended_mark, job_dir
from rgpu.slurm_plugin.jobkey import job_prefix, parse_job_key

from rgpu.paths import run_dir


# How often a node Epilog of an rgpu job asks whether the pool's admission caught up with the job's
# end (how long it waits at most: slurm_epilog_admission_wait_seconds).
ADMISSION_ASK_EVERY_SECONDS = 0.05     # each ask is a call the pool serves beside the releases


class AdmissionPool(Protocol):
    def admission_pending(self, job_key_prefix: str, timeout: float | None = None) -> bool: ...


class ReleasingPool(Protocol):
    def release(self, job_key: str) -> bool: ...
    def list_leases(self) -> list[Any]: ...


def keys_to_release(leases: list[Any], cluster: str, job_id: int, restart_count: int) -> list[str]:
    """This job's leases up to this restart: never a later attempt's (an epilog may run late). Pure."""
    keys = []
    for lease in leases:
        parsed = parse_job_key(lease.job_key)
        if (parsed and parsed.cluster == cluster and parsed.job_id == job_id
                and parsed.restart_count <= restart_count):
            keys.append(lease.job_key)
    return sorted(keys)


def epilog_slurmctld(env: Mapping[str, str], pool_factory: Callable[[], ReleasingPool]) -> list[str]:
    """Release the job's leases; idempotent (nothing to release is a success). The pool's
    reconciler, woken by the release, then lets the jobs waiting for that room start.

    First the lease of each of this attempt's nodes, named from the environment (one call each,
    and the first already frees the room); then, from the pool's list, what else the job holds:
    an earlier attempt's lease an epilog could not release, a reservation its prolog never took.
    """
    job = JobContext.from_env(env, "epilog-slurmctld")
    pool = pool_factory()
    own = sorted({job.key_for(n) for n in job.nodes})
    released = [key for key in own if pool.release(key)]
    rest = [key for key in keys_to_release(pool.list_leases(), job.cluster, job.job_id, job.restart_count)
            if key not in own]
    return sorted(released + [key for key in rest if pool.release(key)])


def node_epilog(env: Mapping[str, str]) -> bool:
    """Remove the job's files on this node, leaving its ended mark (a later attempt of the job that
    starts here without its Prolog is refused by the TaskProlog); True when there was something to
    remove."""
    job = JobContext.from_env(env, "epilog")
    directory = job_dir(run_dir(env), job.job_id)
    if directory.is_symlink():
        directory.unlink()
    elif directory.exists():
        shutil.rmtree(directory)   # does not follow symlinks the job may have left inside
    else:
        return False
    mark = ended_mark(directory.parent, job.job_id)
    if mark.is_symlink():
        mark.unlink()
    mark.touch(mode=0o644)
    return True


def await_admission(env: Mapping[str, str], pool_factory: Callable[[], AdmissionPool], *,
                    budget: float, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], Any] = time.sleep) -> bool:
    """Wait until the pool holds none of the job's leases and its admission has run after the last
    lease end (AdmissionPending false), at most `budget` seconds; True when it has caught up.

    Why: the completion of a node Epilog is what makes Slurm run its scheduler at once (a release
    from hold only queues a pass for slurmctld's next whole second, at most once per
    batch_sched_delay), and the ended job's license comes back once EpilogSlurmctld and the node
    Epilogs are done. Ending after the pool let the next job go lets that job start at once
    (slurm_plugin/admission_clock.py). A pool that does not answer (or an old one, which lacks the
    call) ends the wait: RgpuError goes up."""
    job = JobContext.from_env(env, "epilog")
    prefix = job_prefix(job.cluster, job.job_id)
    deadline = clock() + budget
    pool = pool_factory()
    while True:
        left = deadline - clock()
        if left <= 0:
            return False
        if not pool.admission_pending(prefix, timeout=max(0.05, left)):
            return True
        sleep(min(ADMISSION_ASK_EVERY_SECONDS, max(0.0, deadline - clock())))
