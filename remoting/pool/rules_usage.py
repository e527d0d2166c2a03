"""PoolCore's part for what leases use: use per slice reported by the dispatchers, idle leases,
GPU-percent-hours per user and account, and the slices' tokens (rules_types.py says how PoolCore
is put together)."""

from __future__ import annotations

from rgpu import tokens
from rgpu.model import LeaseRecord
from rgpu.remoting.pool.accounting import (Interval, SliceUsageRecord, UsageTotal, idle_seconds, idle_since, is_idle,
                                           to_pool_clock, totals)
from rgpu.remoting.pool.reservations import reservation_prefix
from rgpu.remoting.pool.rules_types import CoreParts, log


class UsageRules(CoreParts):
    """Use, idleness, accounting and tokens (mixed into PoolCore)."""

    # -- usage per slice, idle leases, accounting ------------------------------------------------
    def record_usage(self, address: str, reports: list[tuple[str, int, SliceUsageRecord]], sent_unix: float) -> None:
        """Take a dispatcher's usage report (heartbeat) for the slices it holds; others are ignored."""
        taken: list[tuple[str, int, SliceUsageRecord]] = []
        with self._lock:
            now = self.clock()
            for job_key, number, usage in reports:
                lease = self.leases.get(job_key)
                if lease is None or not 0 <= number < len(lease.slices) or lease.slices[number].server != address:
                    continue
                record = SliceUsageRecord(
                    sessions=usage.sessions, busy_seconds=usage.busy_seconds,
                    memory_high_water_bytes=usage.memory_high_water_bytes, memory_used_bytes=usage.memory_used_bytes,
                    last_active_unix=to_pool_clock(usage.last_active_unix, sent_unix, now), calls=usage.calls)
                self._slice_usage[(job_key, number)] = record
                taken.append((job_key, number, record))
        if self._shared:   # the daemon that decides idle_release may be another one
            self.store.save_slice_usage(taken)

    def load_shared_usage(self) -> None:
        """With a shared store: take the usage reports every daemon received (no-op with SQLite)."""
        if self._shared:
            usage = self.store.load_slice_usage()
            with self._lock:
                self._slice_usage = usage

    def _usages(self, lease: LeaseRecord) -> list[SliceUsageRecord | None]:
        return [self._slice_usage.get((lease.job_key, n)) for n in range(len(lease.slices))]

    def slice_usage(self, lease: LeaseRecord) -> list[SliceUsageRecord | None]:
        with self._lock:
            return self._usages(lease)

    def lease_idle(self, lease: LeaseRecord) -> tuple[float, bool]:
        """(idle since, by the pool's clock; whether idle by idle_after_seconds)."""
        with self._lock:
            usages = self._usages(lease)
            return idle_since(lease, usages), is_idle(idle_seconds(lease, usages, self.clock()), self.idle_after_seconds)

    def release_idle(self) -> list[str]:
        """Release every idle lease (idle_release: Bitfusion's auto_release)."""
        if self.idle_after_seconds <= 0:
            return []
        with self._change():
            if self._shared:   # reports other daemons received count (read under the change's lock)
                self._slice_usage = self.store.load_slice_usage()
            now = self.clock()
            idle = [lease for lease in self.leases.values() if reservation_prefix(lease.job_key) is None
                    and is_idle(idle_seconds(lease, self._usages(lease), now), self.idle_after_seconds)]
            for lease in idle:
                self._drop(lease, "idle")
        for lease in idle:
            log.info("rgpu-poold: lease %s of %s was idle for %g s and was released", lease.job_key, lease.user,
                     self.idle_after_seconds)
        return [lease.job_key for lease in idle]

    def usage_totals(self, since: float, until: float) -> list[UsageTotal]:
        """GPU-percent-hours per user and account: ended leases from the store, live ones up to now."""
        with self._lock:
            now = self.clock()
            live = [Interval(lease.user, lease.account, lease.units, lease.created_unix,
                             min(now, lease.expires_unix) if lease.expires_unix else now,
                             sum(u.busy_seconds for u in self._usages(lease) if u is not None))
                    for lease in self.leases.values()]
        ended = [Interval(user, account, units, created, ended_at, busy)
                 for user, account, units, created, ended_at, busy in self.store.load_history(since, until)]
        return totals(ended + live, since, until)

    def token_for(self, lease: LeaseRecord, number: int) -> str:
        cached = self._tokens.get((lease.job_key, number))
        if cached is not None and self.leases.get(lease.job_key) is lease:
            return cached
        s = lease.slices[number]
        # Deterministic: the same lease always yields the same token, so nothing secret is stored.
        token = tokens.sign(self.secret, tokens.SliceClaims(
            job_key=lease.job_key, slice_number=number, server=s.server, gpu_uuid=s.gpu_uuid,
            gpu_index=s.gpu_index, memory_limit_bytes=s.memory_limit_bytes, compute_percent=s.compute_percent,
            # No expiry of its own: a TTL lease may be renewed while its application (holding this
            # token) runs; when it ends the pool reclaims it and dispatchers drop its token at their
            # next heartbeat (live-lease list; a dispatcher with no list takes no tokens).
            expires_unix=0.0, issued_unix=lease.created_unix))
        if self.leases.get(lease.job_key) is lease:
            self._tokens[(lease.job_key, number)] = token
        return token
