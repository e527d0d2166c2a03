"""rgpu-admin net-perf: lease a tiny slice on each dispatcher (its token opens the data path),
measure round trip and bandwidth to its session port, release the slice.

The measurement is rgpu.remoting.datapath.perf; this module picks the dispatchers, holds the
leases for as short as it can, and turns results and failures into rows.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

from rgpu.errors import RgpuError
from rgpu.remoting.datapath.perf import PerfResult, measure
from rgpu.remoting.pool.client import PoolClient
from rgpu.units import format_bytes

PROBE_MEMORY_BYTES = 1 << 20   # the smallest slice worth asking for: 1 MiB, 1% compute
PROBE_TTL_SECONDS = 300.0      # reclaimed by the pool even if net-perf is killed mid-way
PROBE_ACCOUNT = "net-perf"     # so `rgpu-admin usage` tells probes from work

Measure = Callable[..., PerfResult]


def perf_row(server: str, result: PerfResult | None, error: str = "") -> dict[str, Any]:
    if result is None:
        return {"server": server, "ok": False, "error": error}
    row: dict[str, Any] = {"ok": True, "error": "", **asdict(result)}
    row["server"] = server
    return row


def table_cells(row: dict[str, Any]) -> list[str]:
    if not row["ok"]:
        return [row["server"], "-", "-", "-", "-", "-", row["error"]]
    return [row["server"], f"{row['connect_ms']:.1f}", f"{row['rtt_min_us']:.0f}", f"{row['rtt_p50_us']:.0f}",
            f"{format_bytes(int(row['upload_bytes_per_s']))}/s", f"{format_bytes(int(row['download_bytes_per_s']))}/s",
            ""]


TABLE_HEADERS = ["SERVER", "CONNECT ms", "RTT MIN us", "RTT P50 us", "UPLOAD", "DOWNLOAD", "ERROR"]


def probe_server(client: PoolClient, server: str, *, user: str, pings: int, bulk_bytes: int,
                 measure_fn: Measure = measure) -> dict[str, Any]:
    job_key = f"net-perf-{user}-{secrets.token_hex(4)}"
    try:
        lease = client.allocate(job_key, user, 1, memory_bytes=PROBE_MEMORY_BYTES, server=server,
                                ttl_seconds=PROBE_TTL_SECONDS, account=PROBE_ACCOUNT)
    except RgpuError as exc:
        return perf_row(server, None, f"cannot lease a probe slice: {exc}")
    try:
        return perf_row(server, measure_fn(lease.slices[0].server, lease.slices[0].token, pings=pings,
                                           bulk_bytes=bulk_bytes))
    except RgpuError as exc:
        return perf_row(server, None, str(exc))
    finally:
        client.release(job_key)


def up_servers(client: PoolClient, only: Iterable[str] = ()) -> list[str]:
    wanted = set(only)
    return [s.address for s in client.list_servers().servers
            if s.state == "up" and (not wanted or s.address in wanted or s.hostname in wanted)]
