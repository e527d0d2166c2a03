"""How rgpu-admin shows usage: per lease and slice (leases, stats) and per user or account
(usage). Pure: pb messages in, rows out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rgpu.model import mostly_unused
from rgpu.proto import rgpu_pb2 as pb
from rgpu.units import format_bytes


def duration(seconds: float) -> str:
    """'45s', '12m', '3h05m', '2d04h'."""
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def lease_usage(lease: pb.Lease, now: float | None = None) -> dict[str, Any]:
    """A lease's usage summed over its slices, for `rgpu-admin leases`."""
    now = time.time() if now is None else now
    busy = sum(s.usage.busy_seconds for s in lease.slices)
    peak = max((s.usage.memory_high_water_bytes for s in lease.slices), default=0)
    idle_for = max(0.0, now - lease.idle_since_unix) if lease.idle_since_unix else 0.0
    return {"busy_seconds": busy, "busy": duration(busy) if busy else "-",
            "memory_high_water_bytes": peak, "memory_high_water": format_bytes(peak) if peak else "-",
            "sessions": sum(s.usage.sessions for s in lease.slices),
            "idle_seconds": idle_for, "idle_for": duration(idle_for) if lease.idle_since_unix else "-",
            "idle": lease.idle}


def slice_rows(leases: Sequence[pb.Lease], now: float | None = None) -> list[dict[str, Any]]:
    """One row per slice, for `rgpu-admin stats`."""
    now = time.time() if now is None else now
    rows = []
    for lease in leases:
        idle_for = max(0.0, now - lease.idle_since_unix) if lease.idle_since_unix else 0.0
        for number, s in enumerate(lease.slices):
            u = s.usage
            rows.append({
                "job_key": lease.job_key, "user": lease.user, "slice": number, "server": s.server,
                "gpu_index": s.gpu_index, "compute_percent": s.compute_percent,
                "memory_limit_bytes": s.memory_limit_bytes, "sessions": u.sessions,
                "busy_seconds": u.busy_seconds, "calls": u.calls,
                "memory_high_water_bytes": u.memory_high_water_bytes, "memory_used_bytes": u.memory_used_bytes,
                "last_active_unix": u.last_active_unix, "lease_idle_seconds": idle_for, "lease_idle": lease.idle,
                # -1: not reported (no session yet, or an older pool or dispatcher)
                "compute_used_percent": round(u.compute_used_percent, 1) if u.compute_used_percent >= 0 else -1,
                "mostly_unused": mostly_unused(s.memory_limit_bytes, u.memory_used_bytes),
                "where": f"{s.server}/{s.gpu_index}",
                "memory": f"{format_bytes(u.memory_used_bytes)} now, {format_bytes(u.memory_high_water_bytes)} peak "
                          f"of {format_bytes(s.memory_limit_bytes)}",
                "busy": duration(u.busy_seconds) if u.busy_seconds else "-",
                "compute": (f"{u.compute_used_percent:.0f}% of {s.compute_percent}%" if u.compute_used_percent >= 0
                            else f"- of {s.compute_percent}%"),
                "last_active": f"{duration(now - u.last_active_unix)} ago" if u.last_active_unix else "never",
                "flag": " ".join(f for f in ("IDLE" if lease.idle else "",
                                             "UNUSED" if mostly_unused(s.memory_limit_bytes, u.memory_used_bytes)
                                             else "") if f),
            })
    return rows


def usage_rows(reply: pb.UsageReply, by: str) -> list[dict[str, Any]]:
    """GPU-percent-hours per user, per account, or per (user, account)."""
    sums: dict[tuple[str, ...], list[float]] = {}
    for r in reply.rows:
        key: tuple[str, ...] = (r.user,) if by == "user" else (r.account,) if by == "account" else (r.user, r.account)
        entry = sums.setdefault(key, [0.0, 0, 0.0])
        entry[0] += r.gpu_percent_hours
        entry[1] += r.leases
        entry[2] += r.busy_gpu_seconds
    rows = []
    for key, (hours, leases, busy) in sorted(sums.items(), key=lambda kv: (-kv[1][0], kv[0])):
        row: dict[str, Any] = {"user": key[0]} if by == "user" else {"account": key[0]} if by == "account" else \
            {"user": key[0], "account": key[1]}
        row.update({"gpu_percent_hours": round(hours, 4), "gpu_hours": round(hours / 100, 4), "leases": int(leases),
                    "busy_gpu_seconds": round(busy, 3)})
        rows.append(row)
    return rows
