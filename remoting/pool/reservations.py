"""Reservations: room the pool holds for leases that are about to be asked for. Pure: no I/O.

When rgpu-poold lets a Slurm job start (slurm_plugin/waiting.py, the admission), the job's
PrologSlurmctld asks for its leases up to a few seconds later. Meanwhile another lease may end or
start and binpack then places the job's slices elsewhere, or nowhere (the job is requeued). So
the admission reserves the job's placement: one reservation per lease the job will ask for, each
a lease of its own under the key `<prefix>+r<n>` (the prefix is the job's: `slurm:<cluster>:<job
id>:<restart count>:`), with a short expiry. Its slices count as allocated, so no other request
can take them; the first Allocate of a key that starts with the prefix, for the same user and the
same slices, takes one over (the lease gets the reservation's slices, and the reservation goes).
A job that never starts gives its room back when the reservation expires (or when the admission
finds the job held again, or the reconciler finds it gone).

Reservations are leases so that every daemon of a pool sees them (the store and its change log)
and every listing shows them; they leave no history (they were never used) and are never released
as idle, so Allocate refuses keys of their form: only PoolCore.reserve makes them.
"""

from __future__ import annotations

from rgpu.model import LeaseRecord, isolation_allows

MARK = "+r"        # no Slurm node name starts with "+" (slurm_plugin/jobkey.py), so no lease key does either


def reservation_key(prefix: str, number: int) -> str:
    return f"{prefix}{MARK}{int(number)}"


def reservation_prefix(job_key: str) -> str | None:
    """The prefix a reservation key holds room for; None for any other key."""
    head, sep, number = job_key.rpartition(MARK)
    if not sep or not head.endswith(":") or not number.isdigit():
        return None
    return head


def claim_prefixes(job_key: str) -> list[str]:
    """The prefixes whose reservations an Allocate of `job_key` may take: each of its leading parts
    that ends with ':' (none for a reservation key itself)."""
    if reservation_prefix(job_key) is not None:
        return []
    return [job_key[:i + 1] for i, c in enumerate(job_key) if c == ":"]


def fits_request(reservation: LeaseRecord, user: str, count: int, percent: int | None, memory_bytes: int | None,
                 sharing_of: dict[str, str], isolation: str, same_node: bool = False) -> bool:
    """Whether `reservation`'s slices are what this request would get: the same user and count,
    each slice of `percent` compute (a fraction) or of `memory_bytes` memory, each on a GPU whose
    sharing mode (`sharing_of`, by GPU UUID; missing: the GPU is gone) the request's isolation
    allows, all on one GPU server when `same_node`."""
    if reservation.user != user or len(reservation.slices) != count:
        return False
    if same_node and len({s.server for s in reservation.slices}) > 1:
        return False
    for s in reservation.slices:
        if percent is not None and s.compute_percent != percent:
            return False
        if memory_bytes is not None and s.memory_limit_bytes != memory_bytes:
            return False
        if s.gpu_uuid not in sharing_of or not isolation_allows(isolation, sharing_of[s.gpu_uuid]):
            return False
    return True
