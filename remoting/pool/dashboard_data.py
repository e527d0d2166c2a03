"""What the dashboard shows, as the JSON document its page polls (/api/state). Pure."""

from __future__ import annotations

from typing import Any

from rgpu.model import mostly_unused
from rgpu.remoting.pool.events import Event
from rgpu.remoting.pool.views import PoolView

STATE_VERSION = 1


def telemetry_row(reading: Any) -> dict[str, Any] | None:
    """A GPU's last readings for the page; None where its dispatcher sent none (an older one)."""
    if reading is None:
        return None
    return {"source": reading.source, "utilization_percent": reading.utilization_percent,
            "memory_used_bytes": reading.memory_used_bytes, "temperature_celsius": reading.temperature_celsius,
            "power_watts": reading.power_watts, "power_limit_watts": reading.power_limit_watts,
            "ecc_corrected": reading.ecc_corrected, "ecc_uncorrected": reading.ecc_uncorrected,
            "xid_errors": reading.xid_errors, "last_xid": reading.last_xid, "read_unix": reading.read_unix}


def fault_rows(faults: Any) -> list[dict[str, Any]]:
    return [{"unix": f.unix, "error": f.error, "cross_tenant": f.cross_tenant, "sessions_ended": f.sessions_ended,
             "faulting": f.faulting} for f in faults]


def dashboard_state(view: PoolView, events: list[Event]) -> dict[str, Any]:
    held: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for lv in view.leases:
        lease = lv.lease
        for number, s in enumerate(lease.slices):
            usage = lv.usage[number] if number < len(lv.usage) else None
            used = usage.memory_used_bytes if usage is not None else 0
            held.setdefault((s.server, s.gpu_uuid), []).append({
                "job_key": lease.job_key, "user": lease.user, "account": lease.account, "slice": number,
                "memory_bytes": s.memory_limit_bytes, "compute_percent": s.compute_percent,
                "lease_state": lv.state, "memory_used_bytes": used,
                "compute_used_percent": lv.compute_used[number] if number < len(lv.compute_used) else -1.0,
                "sessions": usage.sessions if usage is not None else 0,
                "mostly_unused": mostly_unused(s.memory_limit_bytes, used)})
    return {
        "version": STATE_VERSION,
        "now_unix": view.now,
        # total/allocated_units: the GPUs of servers that are up (placement's view); all/held_units:
        # every registered GPU, down ones included, so the page's "% allocated" keeps one base.
        "capacity": {"total_units": view.total_units, "allocated_units": view.allocated_units,
                     "all_units": 100 * len(view.gpus), "held_units": sum(g.allocated_percent for g in view.gpus),
                     "gpus": len(view.gpus), "leases": len(view.leases),
                     "servers_down": sum(s.state == "down" for s in view.servers),
                     "gpus_faulted": sum(bool(g.faults) for g in view.gpus),
                     "gpus_ecc_uncorrected": sum(bool(g.telemetry is not None and g.telemetry.ecc_uncorrected)
                                                 for g in view.gpus)},
        "gpus": [{
            "server": g.server, "server_state": g.server_state, "uuid": g.gpu.uuid, "index": g.gpu.index,
            "name": g.gpu.name, "sharing": g.gpu.sharing, "memory_bytes": g.gpu.usable_memory_bytes,
            "allocated_memory_bytes": g.allocated_memory_bytes, "allocated_percent": g.allocated_percent,
            "slices": held.get((g.server, g.gpu.uuid), []),
            "memory_used_bytes": sum(s["memory_used_bytes"] for s in held.get((g.server, g.gpu.uuid), [])),
            "telemetry": telemetry_row(g.telemetry), "faults": fault_rows(g.faults),
        } for g in view.gpus],
        "leases": [{
            "job_key": lv.lease.job_key, "user": lv.lease.user, "account": lv.lease.account,
            "state": lv.state, "idle": lv.idle, "idle_since_unix": lv.idle_since_unix,
            "created_unix": lv.lease.created_unix,
            "age_seconds": max(0.0, view.now - lv.lease.created_unix), "expires_unix": lv.lease.expires_unix,
            "units": lv.lease.units,
            "slices": [{"server": s.server, "gpu_index": s.gpu_index, "gpu_name": s.gpu_name,
                        "memory_bytes": s.memory_limit_bytes, "compute_percent": s.compute_percent,
                        "memory_used_bytes": u.memory_used_bytes if u is not None else 0}
                       for s, u in zip(lv.lease.slices, lv.usage or [None] * len(lv.lease.slices))],
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
