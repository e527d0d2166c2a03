"""Which lease tokens a dispatcher still honours: the pool's list of live slices (pure logic).

Dispatchers verify lease tokens offline (HMAC, server, GPU, expiry), so a token would otherwise
stay good after its lease was released or reclaimed, and a job that kept it could use a GPU share
the pool has since given to someone else. Each heartbeat reply therefore lists the live slices on
that dispatcher as of the pool's clock. A token issued before that moment whose slice is not
listed belongs to a lease that is gone. A token issued after it may belong to a lease the list
could not yet show; it is accepted and judged by the next heartbeat.

Both times come from the pool's clock (a token's issued_unix is its lease's creation time), so
clock skew between pool and dispatcher plays no part.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LiveLeases:
    pool_unix: float                              # when the pool took the list, by its clock
    slices: frozenset[tuple[str, int, float]]     # (job key, slice number, lease issued_unix)

    @classmethod
    def of(cls, pool_unix: float, slices: Iterable[tuple[str, int, float]]) -> LiveLeases:
        return cls(pool_unix, frozenset(slices))

    def revoked(self, job_key: str, slice_number: int, issued_unix: float) -> bool:
        """True when the token's lease was released or reclaimed before this list was taken.

        issued_unix is part of the key: a job key reused by a later lease does not revive the
        tokens of the earlier one."""
        return issued_unix < self.pool_unix and (job_key, slice_number, issued_unix) not in self.slices
