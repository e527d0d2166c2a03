"""The pool's state and rules: servers, leases, quotas. No gRPC here; every change is written
through to the Store before it is visible, so a crash never loses an acknowledged change.

All methods are thread-safe (one lock: allocation decisions must see a consistent view).
PoolCore's methods are in four modules (rules_types.py says which holds what); this one holds its
state, its sync with the store, its listeners and the admission's checks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from rgpu.errors import CapacityError
from rgpu.model import LeaseRecord
from rgpu.remoting.pool.accounting import SliceUsageRecord
from rgpu.remoting.pool.placement import GpuSlot, fits_in_every_order
from rgpu.remoting.pool.backfill import Avoid, head_room, place_in_turn, place_one
from rgpu.remoting.pool.placement_index import PlacementIndex
from rgpu.remoting.pool.store import PoolStore
from rgpu.remoting.pool.rules_leases import LeaseRules
from rgpu.remoting.pool.rules_servers import ServerRules
from rgpu.remoting.pool.rules_types import (GpuUsage, LeaseRequest, ServerEntry, _slice_records, _slice_request,
                                            log)
# The value types callers import from here (the daemon, the Slurm hooks, tests).
from rgpu.remoting.pool.rules_types import (MAX_SERVERS, QUOTA_KINDS, AllocationRequest, Capacity,  # noqa: F401
                                            GpuStatusRecord, check_owner)
from rgpu.remoting.pool.rules_usage import UsageRules


@dataclass
class PoolCore(ServerRules, LeaseRules, UsageRules):
    store: PoolStore
    secret: bytes
    placement: str = "binpack"
    down_after_seconds: float = 15.0
    max_slices_per_job: int = 16
    idle_after_seconds: float = 0.0     # 0: leases are never idle
    clock: Callable[[], float] = time.time
    servers: dict[str, ServerEntry] = field(default_factory=dict)
    leases: dict[str, LeaseRecord] = field(default_factory=dict)
    quotas: dict[tuple[str, str], int] = field(default_factory=dict)
    _usage: dict[tuple[str, str], GpuUsage] = field(default_factory=dict)
    # Placement's view of each server's GPUs, kept current by _index_lease and register, so an
    # allocation does not rebuild 8 x N slot objects.
    _slot_cache: dict[str, list[GpuSlot]] = field(default_factory=dict)
    # The servers placement may use (all but drained ones), grouped by shape, so an allocation
    # looks at each distinct shape once rather than at every GPU (placement_index.py).
    _index: PlacementIndex = field(default_factory=PlacementIndex)
    _versions: dict[str, int] = field(default_factory=dict)   # per server, bumped on every change of its GPUs
    # Job keys holding slices per server: a heartbeat (every server, every few seconds) looks at
    # its own server's leases only.
    _leases_on: dict[str, set[str]] = field(default_factory=dict)
    # Reservation keys per prefix (reservations.py): an Allocate looks up its own prefixes only.
    _reserved: dict[str, set[str]] = field(default_factory=dict)
    _used_units: dict[tuple[str, str], int] = field(default_factory=dict)
    _tokens: dict[tuple[str, int], str] = field(default_factory=dict)  # signed once per slice
    _listeners: list[Callable[[], None]] = field(default_factory=list)
    _lease_listeners: list[Callable[[bool], None]] = field(default_factory=list)
    _slice_usage: dict[tuple[str, int], SliceUsageRecord] = field(default_factory=dict)   # in memory only
    _lock: threading.RLock = field(default_factory=threading.RLock)
    # The shared store's version this daemon's memory reflects (PostgreSQL, several daemons);
    # None with SQLite, where this daemon is the only writer.
    _seen_version: int | None = None

    def __post_init__(self) -> None:
        self._seen_version = self.store.version()
        self._shared = self._seen_version is not None   # several daemons on one store (PostgreSQL)
        self.full_reloads = 0   # catch-ups that had to reload everything (the change log did not reach back)
        self._reload()
        if self._shared:
            self._slice_usage = self.store.load_slice_usage()

    def _reload(self) -> None:
        """(Re)build the memory from the store. Servers new to this daemon get a fresh grace
        period: they are down only if they miss heartbeats from now on, not because the pool
        itself was away; heartbeats other daemons stored count too."""
        now = self.clock()
        old = self.servers
        stored = self.store.load_heartbeats()
        self.servers, self.leases, self.quotas = {}, {}, {}
        self._usage, self._used_units, self._tokens, self._leases_on, self._reserved = {}, {}, {}, {}, {}
        self._slot_cache, self._index = {}, PlacementIndex()
        for info, drained in self.store.load_servers():
            before = old.get(info.address)
            self.servers[info.address] = ServerEntry(
                info, drained, max(before.last_heartbeat if before else now, stored.get(info.address, 0.0)),
                before.reported_down if before else False)
        for lease in self.store.load_leases():
            self._index_lease(lease, +1)
        for address in self.servers:
            self._refresh(address)
        for quota in self.store.load_quotas():
            self.quotas[(quota.kind, quota.name)] = quota.limit_units

    def _catch_up(self) -> None:
        """Bring the memory up to the shared store's present state, under the lock: apply only the
        leases, servers and quotas that other daemons changed since the version this daemon saw
        (the store's change log), or reload everything when the log does not reach back that far."""
        changes = None
        if self._seen_version is not None and self._seen_version >= 0:
            changes = self.store.changes_since(self._seen_version)
        if changes is None or any(kind == "all" for kind, _ in changes):
            self.full_reloads += 1
            self._reload()
            return
        addresses = sorted({key for kind, key in changes if kind == "server"})
        job_keys = sorted({key for kind, key in changes if kind == "lease"})
        if addresses:
            now = self.clock()
            stored = {info.address: (info, drained) for info, drained in self.store.load_servers_named(addresses)}
            for address in addresses:
                before = self.servers.get(address)
                if address not in stored:
                    self.servers.pop(address, None)
                    for gpu_key in [k for k in self._usage if k[0] == address]:
                        del self._usage[gpu_key]
                else:
                    info, drained = stored[address]
                    self.servers[address] = ServerEntry(info, drained, before.last_heartbeat if before else now,
                                                        before.reported_down if before else False)
                self._refresh(address)
        if job_keys:
            ended: dict[str, LeaseRecord] = {}
            for key in job_keys:
                old = self.leases.get(key)
                if old is not None:
                    self._index_lease(old, -1)
                    ended[key] = old
            for lease in self.store.load_leases_named(job_keys):
                self._index_lease(lease, +1)
                ended.pop(lease.job_key, None)
            for key, old in ended.items():   # ended through another daemon: its usage goes too
                for number in range(len(old.slices)):
                    self._slice_usage.pop((key, number), None)
        if any(kind == "quota" for kind, _ in changes):
            self.quotas = {(q.kind, q.name): q.limit_units for q in self.store.load_quotas()}

    @contextlib.contextmanager
    def _change(self) -> Iterator[None]:
        """One change of the pool's state, under the lock; with a shared store, in one store
        transaction that first brings this daemon up to the other daemons' changes."""
        with self._lock:
            try:
                with self.store.transaction() as state:
                    if state.before is not None and state.before != self._seen_version:
                        self._catch_up()
                    self._seen_version = state.before
                    yield
            except BaseException:
                if self._seen_version is not None:
                    self._seen_version = -1   # memory may be ahead of a rolled-back store: reload next time
                raise
            if state.after is not None:
                self._seen_version = state.after

    def catch_up(self) -> None:
        """Before a read: reload when another daemon changed the shared state (no-op with SQLite)."""
        version = self.store.version()
        if version is not None and version != self._seen_version:
            with self._lock:
                if version != self._seen_version:   # another reader may have caught up meanwhile
                    self._catch_up()
                    self._seen_version = version

    def admitting(self) -> contextlib.AbstractContextManager[None]:
        """Held for one admission pass (slurm_plugin/waiting.py: releasing the Slurm jobs held until
        the pool can place them) by one daemon or process of the pool at a time: two that each
        found room for a different held job could release both into one GPU's remaining room."""
        return self.store.admitting()

    @property
    def lock(self) -> threading.RLock:
        """Held by readers that need several views at one instant (remoting/pool/views.py)."""
        return self._lock

    # -- listeners: told when healthy capacity may have changed (servers up/down/drained) -----
    def add_capacity_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def fits_in_every_order(self, requests: list[LeaseRequest],
                            first: list[tuple[LeaseRequest, Avoid]] | None = None) -> bool:
        """Whether the pool could place all these requests now, whatever order they come in
        (placement.fits_in_every_order on the GPUs of up servers). Each is (count, percent or
        0, memory_bytes or 0, isolation); one per lease, so a two-node job is two requests.
        `first`: (request, GPUs it may not use) placed before those, one after the other in this
        order, as `reserve` places them."""
        self.catch_up()
        with self._lock:
            slots = self._slots(self.clock())
        try:
            slots = place_in_turn(slots, [(_slice_request(r), avoid) for r, avoid in first or []], self.placement)
        except CapacityError:
            return False
        return fits_in_every_order(slots, [_slice_request(r) for r in requests], self.placement)

    def room_for_head(self, head: list[LeaseRequest],
                      first: list[tuple[LeaseRequest, Avoid]] | None = None) -> Avoid:
        """The GPUs, as (server address, UUID), that a job waiting at the head of the queue (its
        requests, one per lease) will get once the oldest leases end (backfill.head_room), after
        `first` (as for fits_in_every_order: reservations about to be made, which end last)."""
        self.catch_up()
        with self._lock:
            slots = self._slots(self.clock())
            leases = sorted(self.leases.values(), key=lambda lease: lease.created_unix)
        for request, avoid in first or []:     # about to be reserved: the youngest, so they end last
            try:
                slots, placed = place_one(slots, _slice_request(request), avoid, self.placement)
            except CapacityError:
                return frozenset()
            leases.append(LeaseRecord(job_key="", user="", account="", created_unix=0.0, expires_unix=0.0,
                                      slices=_slice_records(placed)))
        return head_room(slots, leases, [_slice_request(r) for r in head], self.placement)

    # -- lease listeners: told when a lease started (False) or ended (True: released, expired, idle)
    def add_lease_listener(self, callback: Callable[[bool], None]) -> None:
        """`callback(ended)` must be quick and must not call back into the pool (it runs under its lock)."""
        self._lease_listeners.append(callback)

    def _lease_changed(self, ended: bool) -> None:
        for callback in self._lease_listeners:
            try:
                callback(ended)
            except Exception:  # a listener's failure must never break the pool
                log.exception("rgpu-poold: lease listener failed")

    def _capacity_changed(self) -> None:
        for callback in self._listeners:
            try:
                callback()
            except Exception:  # a listener's failure must never break the pool
                log.exception("rgpu-poold: capacity listener failed")

