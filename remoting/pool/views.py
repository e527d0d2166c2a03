"""One consistent read of the pool's state for observers (the metrics endpoint, the dashboard):
servers with their health, GPUs with what is allocated on them, leases with their state, quotas
with their use. Taken under the core's lock; everything in it is an immutable copy."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from rgpu.model import GpuInfo, LeaseRecord, QuotaRecord
from rgpu.remoting.pool.accounting import SliceUsageRecord
from rgpu.remoting.pool.rules import PoolCore
from rgpu.remoting.pool.telemetry import TelemetryBoard

SERVER_STATES = ("up", "down", "drained")
LEASE_STATES = ("active", "on_down_server", "expired")


@dataclass(frozen=True)
class ServerView:
    address: str
    hostname: str
    state: str                     # up | down | drained
    heartbeat_age_seconds: float
    version: str
    driver_version: str
    compute_enforcement: str       # mps | time-slicing | "" (an older dispatcher)
    launch_path: str
    static_inventory: bool
    gpus: int


@dataclass(frozen=True)
class GpuView:
    server: str
    server_state: str
    gpu: GpuInfo
    allocated_percent: int
    allocated_memory_bytes: int
    slices: int
    telemetry: Any = None          # pb.GpuTelemetry of its dispatcher's last heartbeat; None: none yet
    faults: tuple[Any, ...] = ()   # pb.GpuFault: its recent GPU faults


@dataclass(frozen=True)
class LeaseView:
    lease: LeaseRecord
    state: str                     # active | on_down_server | expired (not reclaimed yet)
    idle: bool = False             # no call for idle_after_seconds (PoolCore.lease_idle)
    idle_since_unix: float = 0.0   # its last activity (or its start), by the pool's clock
    usage: tuple[SliceUsageRecord | None, ...] = ()   # per slice, as its dispatcher last reported it
    compute_used: tuple[float, ...] = ()              # per slice: % of wall time busy; < 0: not reported


@dataclass(frozen=True)
class PoolView:
    now: float
    servers: tuple[ServerView, ...]
    gpus: tuple[GpuView, ...]
    leases: tuple[LeaseView, ...]
    quotas: tuple[tuple[QuotaRecord, int], ...]   # (quota, GPU-percent in use)
    total_units: int                               # 100 per GPU of the servers that are up
    allocated_units: int


def pool_view(core: PoolCore, board: TelemetryBoard | None = None) -> PoolView:
    faults, readings, compute = board.snapshot() if board is not None else ({}, {}, {})
    with core.lock:   # one consistent read: the views below take the same (reentrant) lock
        now = core.clock()
        servers = []
        for address in sorted(core.servers):
            entry = core.servers[address]
            info = entry.info
            servers.append(ServerView(
                address=address, hostname=info.hostname, state=core.state_of(entry, now),
                heartbeat_age_seconds=max(0.0, now - entry.last_heartbeat), version=info.version,
                driver_version=info.driver_version, compute_enforcement=info.compute_enforcement,
                launch_path=info.launch_path, static_inventory=info.static_inventory, gpus=len(info.gpus)))
        state = {s.address: s.state for s in servers}
        leases = []
        for lease in core.list_leases():
            if lease.expired(now):
                lease_state = "expired"
            elif any(state.get(s.server) == "down" for s in lease.slices):
                lease_state = "on_down_server"
            else:
                lease_state = "active"
            since, idle = core.lease_idle(lease)
            leases.append(LeaseView(lease, lease_state, idle, since, tuple(core.slice_usage(lease)),
                                    tuple(compute.get((s.server, lease.job_key, n), -1.0)
                                          for n, s in enumerate(lease.slices))))
        gpus = tuple(GpuView(g.server, g.server_state, g.gpu, g.allocated_percent,  # type: ignore[arg-type]
                             g.allocated_memory_bytes, g.slices, readings.get((g.server, g.gpu.uuid)),  # type: ignore[attr-defined]
                             tuple(f for f in faults.get(g.server, ()) if f.gpu_uuid == g.gpu.uuid))  # type: ignore[attr-defined]
                     for g in core.gpu_statuses())
        capacity = core.capacity()
        return PoolView(now=now, servers=tuple(servers), gpus=gpus, leases=tuple(leases),
                        quotas=tuple(core.quota_usage()), total_units=capacity.total_units,
                        allocated_units=capacity.allocated_units)
