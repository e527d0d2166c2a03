"""Lease keys of Slurm jobs. Pure: no I/O.

One lease per node of a job: `slurm:<cluster>:<job id>:<restart count>:<node>`, e.g.
`slurm:hpc:4242:0:c17`.

- per node, so each node's slices are on distinct GPUs but two nodes may share a GPU (a job of
  -N 3 --gres=rgpu:2 fits on 4 GPUs), and the node Prolog finds its own lease by name;
- with the restart count, so a retried PrologSlurmctld gets the same lease back (the pool's
  Allocate is idempotent per key) and a requeued job never holds two;
- with the cluster name, so Slurm clusters sharing one pool never release each other's leases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rgpu import validate
from rgpu.errors import InvalidRequest

PREFIX = "slurm"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True, order=True)
class JobKey:
    cluster: str
    job_id: int
    restart_count: int
    node: str

    def __str__(self) -> str:
        return f"{PREFIX}:{self.cluster}:{self.job_id}:{self.restart_count}:{self.node}"

    def validated(self) -> JobKey:
        for what, value in (("cluster name", self.cluster), ("node name", self.node)):
            if not _NAME_RE.match(value):
                raise InvalidRequest("slurm", f"cannot make a lease key from {what} {value!r}",
                                     "letters, digits, . _ - only", "rename it, or report this to rgpu")
        validate.job_key(str(self))
        return self


def job_key(cluster: str, job_id: int, restart_count: int, node: str) -> str:
    return str(JobKey(cluster, job_id, restart_count, node).validated())


def job_prefix(cluster: str, job_id: int | None = None) -> str:
    """Prefix shared by the keys of one cluster (or of one job of it)."""
    return f"{PREFIX}:{cluster}:" if job_id is None else f"{PREFIX}:{cluster}:{job_id}:"


def attempt_prefix(cluster: str, job_id: int, restart_count: int) -> str:
    """Prefix of the keys of one attempt (restart count) of one job: its leases and the pool's
    reservations for them (`slurm:<cluster>:<job id>:<restart>:+r<n>`, remoting/pool/reservations.py)."""
    return f"{job_prefix(cluster, int(job_id))}{int(restart_count)}:"


def parse_job_key(key: str) -> JobKey | None:
    """The parts of a Slurm lease key; None for keys rgpu's Slurm integration did not make."""
    parts = key.split(":")
    if len(parts) != 5 or parts[0] != PREFIX or not parts[2].isdigit() or not parts[3].isdigit():
        return None
    return JobKey(parts[1], int(parts[2]), int(parts[3]), parts[4])
