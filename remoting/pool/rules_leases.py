"""PoolCore's part for leases: allocate (checks, quotas, placement), reservations for Slurm jobs,
renew, release, reclaim, and the quotas themselves (rules_types.py says how PoolCore is put
together)."""

from __future__ import annotations

import logging
from dataclasses import replace

from rgpu import validate
from rgpu.errors import InvalidRequest, NotFound, PermissionDenied, QuotaExceeded
from rgpu.model import LeaseRecord, QuotaRecord
from rgpu.remoting.pool.placement import SliceRequest, place
from rgpu.remoting.pool.backfill import Avoid, place_one
from rgpu.remoting.pool.reservations import claim_prefixes, fits_request, reservation_key, reservation_prefix
from rgpu.remoting.pool.rules_types import (QUOTA_KINDS, AllocationRequest, CoreParts, LeaseRequest, _check_ttl,
                                            _slice_records, check_owner, log)


class LeaseRules(CoreParts):
    """Leases, reservations and quotas (mixed into PoolCore)."""

    def _validate(self, req: AllocationRequest) -> None:
        validate.job_key(req.job_key)
        validate.name("user", req.user)
        if req.account:
            validate.name("account", req.account)
        if not isinstance(req.count, int) or req.count < 1:
            raise InvalidRequest("pool", f"invalid count {req.count}", "a job asks for at least 1 slice",
                                 "ask for 1 or more slices (e.g. -n 1)")
        if req.count > self.max_slices_per_job:
            raise InvalidRequest("pool", f"invalid count {req.count}",
                                 f"a job may hold 1 to {self.max_slices_per_job} slices",
                                 "ask for fewer slices (max_slices_per_job in rgpu.toml sets the limit)")
        if req.percent is not None and req.memory_bytes is not None:
            raise InvalidRequest("pool", "both a fraction and a memory size were given", "they are exclusive",
                                 "give one of them")
        if req.percent is None and req.memory_bytes is None:
            raise InvalidRequest("pool", "neither a fraction nor a memory size was given", "",
                                 "give a fraction in (0, 1] or a memory size per slice")
        if req.percent is not None:
            validate.percent(req.percent)
        if req.memory_bytes is not None and not 0 < req.memory_bytes <= 2**60:
            raise InvalidRequest("pool", f"invalid memory size {req.memory_bytes}", "", "give a size above 0")
        _check_ttl(req.ttl_seconds, allow_zero=True)
        validate.isolation(req.isolation)

    def _check_quotas(self, req: AllocationRequest, units: int, instead_of: LeaseRecord | None = None) -> None:
        """`instead_of`: a lease (a reservation) this one replaces: its units are not counted."""
        for kind, name in (("user", req.user), ("account", req.account)):
            limit = self.quotas.get((kind, name))
            if not name or limit is None:
                continue
            used = self._used_units.get((kind, name), 0)
            if instead_of is not None and name == (instead_of.user if kind == "user" else instead_of.account):
                used -= instead_of.units
            if limit == 0:
                raise PermissionDenied("pool", f"{kind} {name} may not use rgpu GPUs", "its quota is 0",
                                       f"ask an admin to raise it (rgpu-admin quota set {kind} {name} UNITS)")
            if used + units > limit:
                raise QuotaExceeded("pool", f"quota of {kind} {name} exceeded",
                                    f"used {used} / limit {limit} GPU-percent, asked {units}",
                                    "release other leases or ask an admin to raise the quota")

    def allocate(self, req: AllocationRequest) -> LeaseRecord:
        self._validate(req)
        if reservation_prefix(req.job_key) is not None:
            # Such a lease would be taken for a reservation: no history, never idle, claimable.
            raise InvalidRequest("pool", f"job key {req.job_key[:80]!r} has the form of a reservation",
                                 "keys ending in ':+r<number>' are the pool's reservations for Slurm jobs",
                                 "pick another key")
        with self._change():
            now = self.clock()
            existing = self.leases.get(req.job_key)
            if existing is not None and existing.expired(now):
                self._drop(existing, "expired")
                existing = None
            if existing is not None:
                if len(existing.slices) != req.count or existing.user != req.user:
                    raise InvalidRequest(
                        "pool", f"job key {req.job_key} already holds a different lease",
                        f"{len(existing.slices)} slice(s) for {existing.user}",
                        "release it first, or use another job key")
                return existing  # a retried prolog gets the same lease, never a second one
            expires = now + req.ttl_seconds if req.ttl_seconds else 0.0
            reserved = self._reservation_for(req, now)
            if reserved is not None:    # the admission held these slices for this job: they are its own
                lease = LeaseRecord(job_key=req.job_key, user=req.user, account=req.account, created_unix=now,
                                    expires_unix=expires, slices=reserved.slices)
                self._check_quotas(req, lease.units, instead_of=reserved)
                self.store.delete_lease(reserved.job_key)
                self.store.insert_lease(lease)
                self._index_lease(reserved, -1)
            else:
                request = SliceRequest(count=req.count, percent=req.percent, memory_bytes=req.memory_bytes,
                                       gpu_model=req.gpu_model, server=req.server,
                                       min_memory_bytes=req.min_memory_bytes, isolation=req.isolation,
                                       same_node=req.same_node)
                placed = self._index.place(request, self.placement,
                                           lambda address: self.state_of(self.servers[address], now) == "up")
                if placed is None:  # no room: the reference over every GPU says what is free
                    placed = place(self._slots(now), request, self.placement)
                lease = LeaseRecord(job_key=req.job_key, user=req.user, account=req.account, created_unix=now,
                                    expires_unix=expires, slices=_slice_records(placed))
                self._check_quotas(req, lease.units)
                self.store.insert_lease(lease)
            self._index_lease(lease, +1)
            self._lease_changed(False)
        if log.isEnabledFor(logging.INFO):   # the slice list is built only when logged
            log.info("rgpu-poold: lease %s for %s: %s", lease.job_key, lease.user,
                     ", ".join(f"{s.server}/{s.gpu_index}@{s.compute_percent}%" for s in lease.slices))
        return lease

    def _reservation_for(self, req: AllocationRequest, now: float) -> LeaseRecord | None:
        """A live reservation this request takes over (reservations.py): under one of its key's
        prefixes, for its user, with the slices it would get, on GPUs of up servers. Requests with
        filters (model, server, memory) place as usual."""
        if not self._reserved or req.gpu_model or req.server or req.min_memory_bytes:
            return None
        for prefix in claim_prefixes(req.job_key):
            for key in sorted(self._reserved.get(prefix, ())):
                reservation = self.leases[key]
                servers = [self.servers.get(s.server) for s in reservation.slices]
                if reservation.expired(now) or any(e is None or self.state_of(e, now) != "up" for e in servers):
                    continue
                sharing = {g.uuid: g.sharing for e in servers if e is not None for g in e.info.gpus}
                if fits_request(reservation, req.user, req.count, req.percent, req.memory_bytes, sharing, req.isolation,
                                req.same_node):
                    return reservation
        return None

    def reserve(self, prefix: str, user: str, requests: list[LeaseRequest],
                ttl_seconds: float, avoid: Avoid = frozenset()) -> list[LeaseRecord]:
        """Hold room for the leases about to be asked for under keys that start with `prefix` (one
        ending in ':'; reservations.py): one reservation per request (count, percent or 0,
        memory_bytes or 0, isolation, same_node), placed as Allocates would place them now one after the
        other, all or none (CapacityError), each expiring `ttl_seconds` from now, on none of the
        GPUs in `avoid` ((server address, UUID): kept for a job that waits). A prefix that holds
        reservations already gets their expiry moved to now + ttl_seconds instead (once less than
        half of ttl_seconds is left of it)."""
        if not prefix.endswith(":") or reservation_prefix(reservation_key(prefix, 0)) != prefix:
            raise InvalidRequest("pool", f"cannot reserve under {prefix[:80]!r}", "a reservation prefix ends with ':'",
                                 "this is a bug in the caller")
        _check_ttl(ttl_seconds, allow_zero=False)
        wanted = [AllocationRequest(job_key=reservation_key(prefix, n), user=user, count=count,
                                    percent=percent if not memory else None, memory_bytes=memory or None,
                                    ttl_seconds=ttl_seconds, isolation=isolation, same_node=same_node)
                  for n, (count, percent, memory, isolation, same_node) in enumerate(requests)]
        for one in wanted:
            self._validate(one)
        with self._change():
            now = self.clock()
            held = [self.leases[key] for key in sorted(self._reserved.get(prefix, ()))]
            if held and all(r.expires_unix - now > ttl_seconds / 2 for r in held):
                return held             # renewed lately: no write on every admission pass
            if held:
                renewed = [replace(r, expires_unix=now + ttl_seconds) for r in held]
                for r in renewed:
                    self.store.set_lease_expiry(r.job_key, r.expires_unix)
                    self.leases[r.job_key] = r
                return renewed
            slots, planned = self._slots(now), []
            for one in wanted:      # CapacityError here leaves everything as it was
                slots, placed = place_one(slots, SliceRequest(count=one.count, percent=one.percent,
                                                              memory_bytes=one.memory_bytes, isolation=one.isolation,
                                                              same_node=one.same_node),
                                          avoid, self.placement)
                planned.append(LeaseRecord(job_key=one.job_key, user=user, account="", created_unix=now,
                                           expires_unix=now + ttl_seconds, slices=_slice_records(placed)))
            for reservation in planned:
                self.store.insert_lease(reservation)
                self._index_lease(reservation, +1)
            if planned:
                self._lease_changed(False)
        log.info("rgpu-poold: reserved %s for %s: %s", prefix, user, "; ".join(
            ", ".join(f"{s.server}/{s.gpu_index}@{s.compute_percent}%" for s in r.slices) for r in planned))
        return planned

    def drop_reservations(self, prefix: str) -> int:
        """Give back the room held under `prefix` (its job will not start now); how many went."""
        with self._change():
            held = [self.leases[key] for key in sorted(self._reserved.get(prefix, ()))]
            for reservation in held:
                self._drop(reservation, "unclaimed")
        if held:
            log.info("rgpu-poold: dropped %d reservation(s) of %s", len(held), prefix)
        return len(held)

    def reservations(self) -> dict[str, list[LeaseRecord]]:
        """The live reservations, by prefix."""
        self.catch_up()
        with self._lock:
            return {prefix: [self.leases[k] for k in sorted(keys)] for prefix, keys in self._reserved.items()}

    def renew(self, job_key: str, ttl_seconds: float, owner: str | None = None) -> LeaseRecord:
        """Extend a TTL lease to now + ttl_seconds. Never creates one: a lease that expired (and so
        may already be reclaimed, its GPU share given to another job) stays gone. `owner`: the user
        who asks (None: a daemon), checked inside the change, after catching up with the others."""
        _check_ttl(ttl_seconds, allow_zero=False)
        with self._change():   # a change others must see: a renewed lease is not theirs to reclaim
            now = self.clock()
            lease = self.leases.get(job_key)
            check_owner(lease, owner, "renew", job_key)
            if lease is not None and lease.expired(now):
                self._drop(lease, "expired")
                lease = None
            if lease is None:
                raise NotFound("pool", f"no lease {job_key[:80]!r} to renew",
                               "it was released, or reclaimed because it was not renewed within its TTL",
                               "request new slices")
            if not lease.expires_unix:
                raise InvalidRequest("pool", f"lease {job_key[:80]} has no TTL to renew", "it never expires",
                                     "only leases made with a TTL are renewed")
            renewed = replace(lease, expires_unix=now + ttl_seconds)
            self.store.set_lease_expiry(job_key, renewed.expires_unix)
            self.leases[job_key] = renewed
            for number in range(len(lease.slices)):
                self._tokens.pop((job_key, number), None)
        return renewed

    def _drop(self, lease: LeaseRecord, how: str) -> None:
        if reservation_prefix(lease.job_key) is not None:
            self.store.delete_lease(lease.job_key)      # never used: no history, no usage
        else:
            busy = sum(u.busy_seconds for u in self._usages(lease) if u is not None)
            self.store.end_lease(lease, self.clock(), busy, how)
        self._index_lease(lease, -1)
        for number in range(len(lease.slices)):
            self._slice_usage.pop((lease.job_key, number), None)
        self._lease_changed(True)

    def release(self, job_key: str, owner: str | None = None) -> bool:
        """Idempotent: releasing an unknown or already released key succeeds (returns False).
        `owner` as for renew: decided inside the change, after catching up with other processes or
        daemons of the pool (before, a lease made a moment ago elsewhere was nobody's here)."""
        with self._change():
            lease = self.leases.get(job_key)
            check_owner(lease, owner, "release", job_key)
            if lease is None:
                return False
            self._drop(lease, "released")
        log.info("rgpu-poold: released lease %s", job_key)
        return True

    def get_lease(self, job_key: str) -> LeaseRecord:
        self.catch_up()
        with self._lock:
            lease = self.leases.get(job_key)
            if lease is None or lease.expired(self.clock()):
                raise NotFound("pool", f"no lease for job key {job_key!r}", "it was never allocated, or was released",
                               "see `rgpu-admin leases`")
            return lease

    def list_leases(self) -> list[LeaseRecord]:
        self.catch_up()
        with self._lock:
            return sorted(self.leases.values(), key=lambda lease: lease.created_unix)

    def lease_on_down_server(self, lease: LeaseRecord) -> bool:
        now = self.clock()
        with self._lock:
            return any(s.server in self.servers and self.state_of(self.servers[s.server], now) == "down"
                       for s in lease.slices)

    def reclaim_expired(self) -> list[str]:
        with self._change():
            now = self.clock()
            expired = [lease for lease in self.leases.values() if lease.expired(now)]
            for lease in expired:
                self._drop(lease, "expired")
        for lease in expired:
            log.info("rgpu-poold: lease %s expired and was reclaimed", lease.job_key)
        return [lease.job_key for lease in expired]

    # -- quotas -------------------------------------------------------------------------------
    def set_quota(self, kind: str, name: str, limit_units: int) -> QuotaRecord | None:
        if kind not in QUOTA_KINDS:
            raise InvalidRequest("pool", f"unknown quota kind {kind!r}", "", "use user or account")
        validate.name(kind, name)
        if limit_units > 100 * 100_000:
            raise InvalidRequest("pool", f"quota {limit_units} is too large", "at most 10,000,000 GPU-percent", "")
        with self._change():
            if limit_units < 0:
                self.store.delete_quota(kind, name)
                self.quotas.pop((kind, name), None)
                return None
            quota = QuotaRecord(kind, name, limit_units)
            self.store.set_quota(quota)
            self.quotas[(kind, name)] = limit_units
            return quota

    def quota_usage(self) -> list[tuple[QuotaRecord, int]]:
        self.catch_up()
        with self._lock:
            return [(QuotaRecord(kind, name, limit), self._used_units.get((kind, name), 0))
                    for (kind, name), limit in sorted(self.quotas.items())]
