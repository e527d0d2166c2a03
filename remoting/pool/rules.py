"""The pool's state and rules: servers, leases, quotas. No gRPC here; every change is written
through to the Store before it is visible, so a crash never loses an acknowledged change.

All methods are thread-safe (one lock: allocation decisions must see a consistent view).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from rgpu import tokens, validate
from rgpu.errors import CapacityError, InvalidRequest, NotFound, PermissionDenied, QuotaExceeded
from rgpu.live_leases import LiveLeases
from rgpu.model import GpuInfo, LeaseRecord, QuotaRecord, ServerInfo, SliceRecord
from rgpu.remoting.pool.accounting import (Interval, SliceUsageRecord, UsageTotal, idle_seconds, idle_since, is_idle,
                                           to_pool_clock, totals)
from rgpu.remoting.pool.placement import (GpuSlot, PlacedSlice, SliceRequest, fits_in_every_order, place)
from rgpu.remoting.pool.backfill import Avoid, head_room, place_in_turn, place_one
from rgpu.remoting.pool.placement_index import PlacementIndex
from rgpu.remoting.pool.reservations import claim_prefixes, fits_request, reservation_key, reservation_prefix
from rgpu.remoting.pool.store import PoolStore

# One lease's request as the Slurm admission passes it: (count, percent of a GPU per slice or 0,
# memory_bytes per slice or 0, isolation).
LeaseRequest = tuple[int, int, int, str]
MAX_SERVERS = 4096   # dispatchers one pool keeps; bounds what registrations can make it store

log = logging.getLogger("rgpu-poold")

QUOTA_KINDS = ("user", "account")


@dataclass
class ServerEntry:
    info: ServerInfo
    drained: bool
    last_heartbeat: float
    reported_down: bool = False   # so "went down" is logged once, not on every check


@dataclass
class GpuUsage:
    percent: int = 0
    memory_bytes: int = 0
    slices: int = 0


@dataclass(frozen=True)
class AllocationRequest:
    job_key: str
    user: str
    count: int
    percent: int | None = None          # of one GPU per slice (1-100); exactly one of percent / memory_bytes
    memory_bytes: int | None = None
    account: str = ""
    ttl_seconds: float = 0.0
    gpu_model: str = ""
    server: str = ""
    min_memory_bytes: int = 0
    isolation: str = ""            # "strict": only GPUs shared "isolated" or "exclusive"


@dataclass(frozen=True)
class GpuStatusRecord:
    server: str
    server_state: str
    gpu: object  # GpuInfo
    allocated_percent: int
    allocated_memory_bytes: int
    slices: int


@dataclass(frozen=True)
class Capacity:
    total_units: int
    allocated_units: int
    gpus: int

    @property
    def free_units(self) -> int:
        return max(0, self.total_units - self.allocated_units)


@dataclass
class PoolCore:
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

    # -- servers ------------------------------------------------------------------------------
    def state_of(self, entry: ServerEntry, now: float | None = None) -> str:
        if entry.drained:
            return "drained"
        if (self.clock() if now is None else now) - entry.last_heartbeat > self.down_after_seconds:
            return "down"
        return "up"

    def register(self, info: ServerInfo) -> None:
        validate.server_info(info)
        if len({g.uuid for g in info.gpus}) != len(info.gpus):
            raise InvalidRequest("pool", f"server {info.address} reports a GPU UUID twice", "",
                                 "check the dispatcher's inventory")
        with self._change():
            now = self.clock()
            uuids = {g.uuid for g in info.gpus}
            for other in self.servers.values():
                clash = uuids & {g.uuid for g in other.info.gpus}
                if other.info.address != info.address and clash and self.state_of(other, now) != "down":
                    raise InvalidRequest(
                        "pool", f"server {info.address} reports GPU {sorted(clash)[0]}",
                        f"{other.info.address} already serves it",
                        "give the dispatchers disjoint GPU sets (RGPU_VISIBLE_DEVICES)")
            previous = self.servers.get(info.address)
            if previous is None and len(self.servers) >= MAX_SERVERS:
                raise InvalidRequest("pool", f"cannot register server {info.address}",
                                     f"the pool already has {MAX_SERVERS} servers",
                                     "remove gone ones with `rgpu-admin remove-server`")
            held = {s.gpu_uuid for key in self._leases_on.get(info.address, ()) for s in self.leases[key].slices
                    if s.server == info.address}
            missing = held - {g.uuid for g in info.gpus}
            if missing:
                # A registration must not take back GPU shares that leases hold (their jobs run there).
                raise InvalidRequest("pool", f"server {info.address} re-registers without GPU(s) "
                                     f"{', '.join(sorted(missing)[:4])} that live leases hold",
                                     "dropping them would strand those jobs",
                                     "release those leases first (rgpu-admin leases), then restart the dispatcher")
            was_up = previous is not None and self.state_of(previous, now) == "up"
            self.store.upsert_server(info, now)
            drained = previous.drained if previous else False
            self.servers[info.address] = ServerEntry(info, drained, now)
            self._refresh(info.address)
        log.info("rgpu-poold: server %s registered with %d GPU(s)%s", info.address, len(info.gpus),
                 " (static inventory)" if info.static_inventory else "")
        if not was_up:
            self._capacity_changed()

    def heartbeat(self, address: str) -> bool:
        if address not in self.servers:
            self.catch_up()   # registered through another daemon
        with self._lock:
            entry = self.servers.get(address)
            if entry is None:
                return False
            now = self.clock()
            came_back = self.state_of(entry, now) == "down"
            entry.last_heartbeat = now
        self.store.heartbeat(address, now)
        if came_back:
            log.info("rgpu-poold: server %s is back", address)
            self._capacity_changed()
        return True

    def live_slices(self, address: str) -> LiveLeases:
        """The live (unreleased, unexpired) leases' slices on one server, as of now by the pool's
        clock: the dispatcher honours no other token issued before now (rgpu/live_leases.py)."""
        self.catch_up()
        with self._lock:
            now = self.clock()
            leases = [self.leases[key] for key in self._leases_on.get(address, ())]
            return LiveLeases.of(now, ((lease.job_key, number, lease.created_unix)
                                       for lease in leases if not lease.expired(now)
                                       for number, s in enumerate(lease.slices) if s.server == address))

    def find_server(self, name: str) -> ServerEntry:
        with self._lock:
            if name in self.servers:
                return self.servers[name]
            matches = [e for e in self.servers.values() if e.info.hostname == name]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound("pool", f"no server {name!r}", "", "see `rgpu-admin health` for the servers")
        raise InvalidRequest("pool", f"{name!r} names {len(matches)} servers", "several dispatchers on that host",
                             "give the address host:port")

    def set_drained(self, name: str, drained: bool) -> ServerEntry:
        with self._change():
            entry = self.find_server(name)
            self.store.set_drained(entry.info.address, drained)
            entry.drained = drained
            self._refresh(entry.info.address)
        log.info("rgpu-poold: server %s %s", entry.info.address, "drained" if drained else "resumed")
        self._capacity_changed()
        return entry

    def remove_server(self, name: str) -> str:
        """Forget a server that is gone for good: it must be down and hold no lease. Returns its address."""
        with self._change():
            entry = self.find_server(name)
            address = entry.info.address
            if self.state_of(entry) != "down":
                raise InvalidRequest("pool", f"server {address} is not down", "it still sends heartbeats",
                                     "stop its rgpu-dispatcher first (or drain it to keep it out of placement)")
            holders = sorted(lease.job_key for lease in self.leases.values()
                             if any(s.server == address for s in lease.slices))
            if holders:
                shown = ", ".join(holders[:5]) + (f" and {len(holders) - 5} more" if len(holders) > 5 else "")
                raise InvalidRequest("pool", f"server {address} still holds slices of {len(holders)} lease(s): {shown}",
                                     "their jobs may still be running",
                                     "release them first (rgpu-admin release-gpus --job-key KEY)")
            self.store.delete_server(address)
            del self.servers[address]
            for key in [k for k in self._usage if k[0] == address]:
                del self._usage[key]
            self._refresh(address)
        log.info("rgpu-poold: server %s removed", address)
        self._capacity_changed()
        return address

    def check_down_servers(self) -> list[str]:
        """Log servers that went down since the last check; return their addresses."""
        now = self.clock()
        went_down = []
        stored = self.store.load_heartbeats()   # heartbeats other daemons took (shared store)
        with self._lock:
            for address, beat in stored.items():
                if address in self.servers:
                    self.servers[address].last_heartbeat = max(self.servers[address].last_heartbeat, beat)
            for entry in self.servers.values():
                down = self.state_of(entry, now) == "down"
                if down and not entry.reported_down:
                    went_down.append(entry.info.address)
                entry.reported_down = down
        for address in went_down:
            log.warning("rgpu-poold: server %s missed heartbeats for %.0f s: marked down",
                        address, self.down_after_seconds)
        if went_down:
            self._capacity_changed()
        return went_down

    # -- leases -------------------------------------------------------------------------------
    def _index_lease(self, lease: LeaseRecord, sign: int) -> None:
        for s in lease.slices:
            usage = self._usage.setdefault((s.server, s.gpu_uuid), GpuUsage())
            usage.percent += sign * s.compute_percent
            usage.memory_bytes += sign * s.memory_limit_bytes
            usage.slices += sign
        for kind, name in (("user", lease.user), ("account", lease.account)):
            if name:
                self._used_units[(kind, name)] = self._used_units.get((kind, name), 0) + sign * lease.units
        for server in {s.server for s in lease.slices}:
            self._refresh(server, {s.gpu_uuid for s in lease.slices if s.server == server})
            holders = self._leases_on.setdefault(server, set())
            if sign > 0:
                holders.add(lease.job_key)
            else:
                holders.discard(lease.job_key)
                if not holders:
                    del self._leases_on[server]
        prefix = reservation_prefix(lease.job_key)
        if prefix is not None:
            keys = self._reserved.setdefault(prefix, set())
            (keys.add if sign > 0 else keys.discard)(lease.job_key)
            if not keys:
                del self._reserved[prefix]
        if sign > 0:
            self.leases[lease.job_key] = lease
        else:
            self.leases.pop(lease.job_key, None)
            for number in range(len(lease.slices)):
                self._tokens.pop((lease.job_key, number), None)

    def _refresh(self, address: str, gpus: set[str] | None = None) -> None:
        """After a server's GPUs, usage or drained state changed: rebuild its slots and index entry
        (given `gpus`, UUIDs whose usage alone changed: only their slots)."""
        cached = self._slot_cache.pop(address, None)
        if gpus is not None and cached is not None:
            self._slot_cache[address] = [self._slot(address, slot.hostname, slot) if slot.uuid in gpus else slot
                                         for slot in cached]
        self._versions[address] = self._versions.get(address, 0) + 1
        entry = self.servers.get(address)
        self._index.set_server(address, None if entry is None or entry.drained else self._server_slots(address))

    def _server_slots(self, address: str) -> list[GpuSlot]:
        slots = self._slot_cache.get(address)
        if slots is None:
            entry = self.servers[address]
            slots = [self._slot(address, entry.info.hostname, gpu) for gpu in entry.info.gpus]
            self._slot_cache[address] = slots
        return slots

    def _slot(self, address: str, hostname: str, gpu: GpuInfo | GpuSlot) -> GpuSlot:
        usage = self._usage.get((address, gpu.uuid)) or GpuUsage()
        return GpuSlot(server=address, hostname=hostname, uuid=gpu.uuid, index=gpu.index, name=gpu.name,
                       usable_memory_bytes=gpu.usable_memory_bytes, allocated_percent=usage.percent,
                       allocated_memory_bytes=usage.memory_bytes, sharing=gpu.sharing)

    def _slots(self, now: float) -> list[GpuSlot]:
        """Placement candidates: the GPUs of servers that are up (drained and down ones excluded)."""
        slots: list[GpuSlot] = []
        for address, entry in self.servers.items():
            if self.state_of(entry, now) == "up":
                slots.extend(self._server_slots(address))
        return slots

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
                                       min_memory_bytes=req.min_memory_bytes, isolation=req.isolation)
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
                if fits_request(reservation, req.user, req.count, req.percent, req.memory_bytes, sharing, req.isolation):
                    return reservation
        return None

    def reserve(self, prefix: str, user: str, requests: list[LeaseRequest],
                ttl_seconds: float, avoid: Avoid = frozenset()) -> list[LeaseRecord]:
        """Hold room for the leases about to be asked for under keys that start with `prefix` (one
        ending in ':'; reservations.py): one reservation per request (count, percent or 0,
        memory_bytes or 0, isolation), placed as Allocates would place them now one after the
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
                                    ttl_seconds=ttl_seconds, isolation=isolation)
                  for n, (count, percent, memory, isolation) in enumerate(requests)]
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
                                                              memory_bytes=one.memory_bytes, isolation=one.isolation),
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

    # -- views --------------------------------------------------------------------------------
    def gpu_statuses(self) -> list[GpuStatusRecord]:
        now = self.clock()
        self.catch_up()
        with self._lock:
            out = []
            for address in sorted(self.servers):
                entry = self.servers[address]
                state = self.state_of(entry, now)
                for gpu in sorted(entry.info.gpus, key=lambda g: g.index):
                    usage = self._usage.get((address, gpu.uuid), GpuUsage())
                    out.append(GpuStatusRecord(address, state, gpu, usage.percent, usage.memory_bytes, usage.slices))
            return out

    def gpu_statuses_changed(self, known: dict[str, tuple[str, int]]
                             ) -> list[tuple[str, tuple[str, int], list[GpuStatusRecord] | None]]:
        """Per server (sorted): its (state, version) and its GPUs' statuses, or None where `known`
        already holds that (state, version), so a large listing rebuilds only what changed."""
        now = self.clock()
        out: list[tuple[str, tuple[str, int], list[GpuStatusRecord] | None]] = []
        self.catch_up()
        with self._lock:
            for address in sorted(self.servers):
                entry = self.servers[address]
                key = (self.state_of(entry, now), self._versions.get(address, 0))
                if known.get(address) == key:
                    out.append((address, key, None))
                    continue
                records = []
                for gpu in sorted(entry.info.gpus, key=lambda g: g.index):
                    usage = self._usage.get((address, gpu.uuid), GpuUsage())
                    records.append(GpuStatusRecord(address, key[0], gpu, usage.percent, usage.memory_bytes,
                                                   usage.slices))
                out.append((address, key, records))
        return out

    def capacity(self) -> Capacity:
        now = self.clock()
        self.catch_up()
        with self._lock:
            up_gpus = [(entry.info.address, g.uuid) for entry in self.servers.values()
                       if self.state_of(entry, now) == "up" for g in entry.info.gpus]
            allocated = sum(self._usage.get(key, GpuUsage()).percent for key in up_gpus)
            return Capacity(total_units=100 * len(up_gpus), allocated_units=allocated, gpus=len(up_gpus))

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


def _slice_request(request: LeaseRequest) -> SliceRequest:
    """(count, percent or 0, memory_bytes or 0, isolation): one lease's request as the Slurm
    admission passes it."""
    count, percent, memory, isolation = request
    return SliceRequest(count=count, percent=percent if not memory else None, memory_bytes=memory or None,
                        isolation=isolation)


def _slice_records(placed: list[PlacedSlice]) -> tuple[SliceRecord, ...]:
    return tuple(SliceRecord(server=p.gpu.server, gpu_uuid=p.gpu.uuid, gpu_index=p.gpu.index, gpu_name=p.gpu.name,
                             memory_limit_bytes=p.memory_limit_bytes, compute_percent=p.compute_percent)
                 for p in placed)


def check_owner(lease: LeaseRecord | None, owner: str | None, what: str, job_key: str) -> None:
    """A user (owner not None) may only act on leases of their own; a lease that does not exist is
    left to the call."""
    if owner is not None and lease is not None and lease.user != owner:
        raise PermissionDenied("pool", f"cannot {what} lease {job_key[:80]}", f"it belongs to {lease.user}, "
                               f"you are {owner}", "act on your own leases (rgpu-admin leases lists them)")


def _check_ttl(ttl_seconds: float, *, allow_zero: bool) -> None:
    """A TTL in seconds: finite (NaN compares false with everything, so it is named here), above
    0 (or 0 for none where allowed), at most a year."""
    if not (ttl_seconds == ttl_seconds and (0 if allow_zero else 1e-3) <= ttl_seconds <= 366 * 86400):
        raise InvalidRequest("pool", f"invalid TTL {str(ttl_seconds)[:20]}",
                             ("0 (none) or " if allow_zero else "") + "a number of seconds up to a year",
                             "give a TTL such as 300 (seconds)")
