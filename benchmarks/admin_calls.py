"""Admin-call latency against a real pool, shared by the flood benchmarks (munge_flood, http_flood)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from tests.daemons import RgpuCluster


def admin_latencies(cluster: RgpuCluster, seconds: float, between: Callable[[int], None] | None = None) -> list[float]:
    """ListServers (the cluster secret) back to back for `seconds`; `between(n)` runs after the n-th."""
    out: list[float] = []
    deadline = time.monotonic() + seconds
    with cluster.client() as admin:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            admin.list_servers()
            out.append(time.perf_counter() - started)
            if between is not None:
                between(len(out))
    return out


def percentiles(name: str, samples: list[float]) -> str:
    if not samples:
        return f"{name}: none"
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (f"{name}: {len(ordered)}, p50 {statistics.median(ordered) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
            f"max {ordered[-1] * 1e3:.2f} ms")


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
