"""What the dashboard shows, as the JSON document its page polls (/api/state). Pure."""

from __future__ import annotations

from typing import Any

from rgpu.remoting.pool.events import Event
from rgpu.remoting.pool.views import PoolView

STATE_VERSION = 1


def dashboard_state(view: PoolView, events: list[Event]) -> dict[str, Any]:
    held: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for lv in view.leases:
        lease = lv.lease
        for number, s in enumerate(lease.slices):
            held.setdefault((s.server, s.gpu_uuid), []).append({
                "job_key": lease.job_key, "user": lease.user, "account": lease.account, "slice": number,
                "memory_bytes": s.memory_limit_bytes, "compute_percent": s.compute_percent,
                "lease_state": lv.state})
    return {
        "version": STATE_VERSION,
        "now_unix": view.now,
        # total/allocated_units: the GPUs of servers that are up (placement's view); all/held_units:
        # every registered GPU, down ones included, so the page's "% allocated" keeps one base.
        "capacity": {"total_units": view.total_units, "allocated_units": view.allocated_units,
                     "all_units": 100 * len(view.gpus), "held_units": sum(g.allocated_percent for g in view.gpus),
                     "gpus": len(view.gpus), "leases": len(view.leases)},
        "gpus": [{
            "server": g.server, "server_state": g.server_state, "uuid": g.gpu.uuid, "index": g.gpu.index,
            "name": g.gpu.name, "sharing": g.gpu.sharing, "memory_bytes": g.gpu.usable_memory_bytes,
            "allocated_memory_bytes": g.allocated_memory_bytes, "allocated_percent": g.allocated_percent,
            "slices": held.get((g.server, g.gpu.uuid), []),
        } for g in view.gpus],
        "leases": [{
            "job_key": lv.lease.job_key, "user": lv.lease.user, "account": lv.lease.account,
            "state": lv.state, "idle": lv.idle, "idle_since_unix": lv.idle_since_unix,
            "created_unix": lv.lease.created_unix,
            "age_seconds": max(0.0, view.now - lv.lease.created_unix), "expires_unix": lv.lease.expires_unix,
            "units": lv.lease.units,
            "slices": [{"server": s.server, "gpu_index": s.gpu_index, "gpu_name": s.gpu_name,
                        "memory_bytes": s.memory_limit_bytes, "compute_percent": s.compute_percent}
                       for s in lv.lease.slices],
        } for lv in view.leases],
        "servers": [{
            "address": s.address, "hostname": s.hostname, "state": s.state,
            "heartbeat_age_seconds": s.heartbeat_age_seconds, "version": s.version,
            "driver_version": s.driver_version, "compute_enforcement": s.compute_enforcement,
            "launch_path": s.launch_path, "static_inventory": s.static_inventory, "gpus": s.gpus,
        } for s in view.servers],
        "quotas": [{"kind": q.kind, "name": q.name, "limit_units": q.limit_units, "used_units": used}
                   for q, used in view.quotas],
        "events": [{"unix": e.unix, "level": e.level, "message": e.message} for e in events],
    }
