"""The pool's value types, and PoolCore's state as its parts see it.

PoolCore (rules.py) is one object with one lock; its methods live in four modules along the seams
the class already had: rules.py (state, the store, listeners, the admission's checks),
rules_servers.py (dispatchers, their GPUs and the views of them), rules_leases.py (leases,
reservations, quotas) and rules_usage.py (use per slice, idle leases, accounting, tokens). Each part
is a mixin of PoolCore over CoreParts, which declares the state they share.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from rgpu.errors import InvalidRequest, PermissionDenied
from rgpu.model import LeaseRecord, ServerInfo, SliceRecord
from rgpu.remoting.pool.accounting import SliceUsageRecord
from rgpu.remoting.pool.placement import GpuSlot, PlacedSlice, SliceRequest
from rgpu.remoting.pool.placement_index import PlacementIndex
from rgpu.remoting.pool.store import PoolStore

# One lease's request as the Slurm admission passes it: (count, percent of a GPU per slice or 0,
# memory_bytes per slice or 0, isolation, same_node: every slice on one GPU server, pack=node).
LeaseRequest = tuple[int, int, int, str, bool]
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
    same_node: bool = False        # every slice on one GPU server, else CapacityError


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


class CoreParts:
    """PoolCore's state (its dataclass fields, rules.py) and the methods one part calls on another."""

    store: PoolStore
    secret: bytes
    placement: str
    down_after_seconds: float
    max_slices_per_job: int
    idle_after_seconds: float
    clock: Callable[[], float]
    servers: dict[str, ServerEntry]
    leases: dict[str, LeaseRecord]
    quotas: dict[tuple[str, str], int]
    _usage: dict[tuple[str, str], GpuUsage]
    # Placement's view of each server's GPUs, kept current by _index_lease and register, so an
    # allocation does not rebuild 8 x N slot objects.
    _slot_cache: dict[str, list[GpuSlot]]
    # The servers placement may use (all but drained ones), grouped by shape, so an allocation
    # looks at each distinct shape once rather than at every GPU (placement_index.py).
    _index: PlacementIndex
    _versions: dict[str, int]
    # Job keys holding slices per server: a heartbeat (every server, every few seconds) looks at
    # its own server's leases only.
    _leases_on: dict[str, set[str]]
    # Reservation keys per prefix (reservations.py): an Allocate looks up its own prefixes only.
    _reserved: dict[str, set[str]]
    _used_units: dict[tuple[str, str], int]
    _tokens: dict[tuple[str, int], str]
    _listeners: list[Callable[[], None]]
    _lease_listeners: list[Callable[[bool], None]]
    _slice_usage: dict[tuple[str, int], SliceUsageRecord]
    _lock: threading.RLock
    # The shared store's version this daemon's memory reflects (PostgreSQL, several daemons);
    # None with SQLite, where this daemon is the only writer.
    _seen_version: int | None

    _shared: bool
    full_reloads: int

    if TYPE_CHECKING:     # defined by PoolCore (rules.py) and its parts; declared for the others
        def _change(self) -> contextlib.AbstractContextManager[None]: ...
        def catch_up(self) -> None: ...
        def _lease_changed(self, ended: bool) -> None: ...
        def _capacity_changed(self) -> None: ...
        def state_of(self, entry: ServerEntry, now: float | None = None) -> str: ...
        def _refresh(self, address: str, gpus: set[str] | None = None) -> None: ...
        def _slots(self, now: float) -> list[GpuSlot]: ...
        def _index_lease(self, lease: LeaseRecord, sign: int) -> None: ...
        def _drop(self, lease: LeaseRecord, how: str) -> None: ...
        def lease_on_down_server(self, lease: LeaseRecord) -> bool: ...
        def _usages(self, lease: LeaseRecord) -> list[SliceUsageRecord | None]: ...


def _slice_request(request: LeaseRequest) -> SliceRequest:
    """(count, percent or 0, memory_bytes or 0, isolation, same_node): one lease's request as the
    Slurm admission passes it."""
    count, percent, memory, isolation, same_node = request
    return SliceRequest(count=count, percent=percent if not memory else None, memory_bytes=memory or None,
                        isolation=isolation, same_node=same_node)


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
