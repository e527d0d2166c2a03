"""The pool's own accounting, pure: per-slice usage as dispatchers report it, idle leases, and
GPU-percent-hours per user and account over a time window."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rgpu.model import LeaseRecord


@dataclass(frozen=True)
class SliceUsageRecord:
    """One slice's usage, as its dispatcher last reported it; times by the pool's clock."""

    sessions: int = 0
    busy_seconds: float = 0.0
    memory_high_water_bytes: int = 0
    memory_used_bytes: int = 0
    last_active_unix: float = 0.0     # 0: no call yet
    calls: int = 0


def to_pool_clock(reported_unix: float, sent_unix: float, received_unix: float) -> float:
    """A dispatcher's timestamp on the pool's clock: the same age before the report arrived (the
    dispatchers' clocks may be off; the time between them is not)."""
    if reported_unix <= 0:
        return 0.0
    if sent_unix <= 0:
        return reported_unix
    return received_unix - max(0.0, sent_unix - reported_unix)


def idle_since(lease: LeaseRecord, usages: Sequence[SliceUsageRecord | None]) -> float:
    """Since when no slice of the lease has run a call (its creation if never used). An open
    session that makes no calls is idle too; a call still running counts as activity now (the
    worker publishes it as such), so a long synchronise is never idle."""
    return max([lease.created_unix] + [u.last_active_unix for u in usages if u is not None])


def idle_seconds(lease: LeaseRecord, usages: Sequence[SliceUsageRecord | None], now: float) -> float:
    """How long the lease has run no call."""
    return max(0.0, now - idle_since(lease, usages))


def is_idle(idle_for: float, idle_after_seconds: float) -> bool:
    return idle_after_seconds > 0 and idle_for >= idle_after_seconds


@dataclass(frozen=True)
class Interval:
    user: str
    account: str
    units: int                 # GPU percent held
    start: float
    end: float
    busy_seconds: float = 0.0


@dataclass(frozen=True)
class UsageTotal:
    user: str
    account: str
    gpu_percent_hours: float
    leases: int
    busy_gpu_seconds: float


def totals(intervals: Iterable[Interval], since: float, until: float) -> list[UsageTotal]:
    """GPU-percent-hours per (user, account) of the intervals' parts inside [since, until);
    sorted by usage, largest first. Busy time counts whole for any lease that overlaps."""
    sums: dict[tuple[str, str], list[float]] = {}
    for i in intervals:
        overlap = min(i.end, until) - max(i.start, since)
        if overlap <= 0:
            continue
        entry = sums.setdefault((i.user, i.account), [0.0, 0, 0.0])
        entry[0] += i.units * overlap / 3600.0
        entry[1] += 1
        entry[2] += i.busy_seconds
    rows = [UsageTotal(user, account, hours, int(n), busy) for (user, account), (hours, n, busy) in sums.items()]
    return sorted(rows, key=lambda r: (-r.gpu_percent_hours, r.user, r.account))
