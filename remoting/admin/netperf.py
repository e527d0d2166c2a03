"""rgpu-admin net-perf: lease a tiny slice on each dispatcher (its token opens the data path),
measure round trip and bandwidth to its session port (over TCP, and over UCX where both ends
take it), release the slice.

The measurement is rgpu.remoting.datapath.perf; this module picks the dispatchers, holds the
leases for as short as it can, opens this end's UCX, and turns results and failures into rows.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

from rgpu.errors import ConfigError, RgpuError
from rgpu.remoting.datapath.perf import PerfResult, measure
from rgpu.remoting.datapath.worker.ucx import UcxLink, UcxUnavailable
from rgpu.remoting.pool.client import PoolClient
from rgpu.units import format_bytes

PROBE_MEMORY_BYTES = 1 << 20   # the smallest slice worth asking for: 1 MiB, 1% compute
PROBE_TTL_SECONDS = 300.0      # reclaimed by the pool even if net-perf is killed mid-way
PROBE_ACCOUNT = "net-perf"     # so `rgpu-admin usage` tells probes from work

Measure = Callable[..., PerfResult]


def perf_row(server: str, result: PerfResult | None, error: str = "", *, ucx_required: bool = False) -> dict[str, Any]:
    """One dispatcher's JSON row. ok is False when it could not be measured, or when UCX was
    asked for (--transport ucx) and not measured."""
    if result is None:
        return {"server": server, "ok": False, "error": error}
    row: dict[str, Any] = {"ok": True, "error": "", **asdict(result)}
    row["server"] = server
    if ucx_required and result.ucx is None:
        row["ok"], row["error"] = False, f"not measured over UCX: {result.ucx_why_not}"
    return row


def _rate(bytes_per_s: float) -> str:
    return f"{format_bytes(int(bytes_per_s))}/s"


def table_rows(row: dict[str, Any]) -> list[list[str]]:
    """The table's rows of one dispatcher: TCP's, then UCX's where it was offered."""
    if "connect_ms" not in row:
        return [[row["server"], "-", "-", "-", "-", "-", "-", row["error"]]]
    rows = [[row["server"], "tcp", f"{row['connect_ms']:.1f}", f"{row['rtt_min_us']:.0f}", f"{row['rtt_p50_us']:.0f}",
             _rate(row["upload_bytes_per_s"]), _rate(row["download_bytes_per_s"]), ""]]
    ucx = row.get("ucx")
    if ucx:
        note = f"note: its sessions keep TCP ({ucx['sessions_keep_tcp']})" if ucx["sessions_keep_tcp"] else ""
        rows.append([row["server"], f"ucx ({ucx['transports']})", f"{ucx['connect_ms']:.1f}", "", "",
                     _rate(ucx["upload_bytes_per_s"]), _rate(ucx["download_bytes_per_s"]), note])
    elif row["ucx_why_not"]:
        rows.append([row["server"], "ucx", "", "", "", "-", "-", row["error"] or f"not measured: {row['ucx_why_not']}"])
    return rows


TABLE_HEADERS = ["SERVER", "TRANSPORT", "CONNECT ms", "RTT MIN us", "RTT P50 us", "UPLOAD", "DOWNLOAD", "ERROR / NOTE"]
NET_PERF_TRANSPORTS = ("auto", "tcp", "ucx")


def open_ucx(transport: str) -> tuple[UcxLink | None, str]:
    """This end's UCX for `--transport` (auto, tcp, ucx), built with the client libraries (cached):
    the link, or None and why not ("" for tcp: nothing to say)."""
    if transport == "tcp":
        return None, ""
    from rgpu.remoting.native.build import ensure_built
    try:
        return UcxLink(str(ensure_built().libworker)), ""
    except (ConfigError, OSError) as exc:
        return None, f"this node has no librgpu-worker.so to drive UCX with ({exc})"
    except UcxUnavailable as exc:
        return None, f"this node cannot use UCX: {exc}"


def probe_server(client: PoolClient, server: str, *, user: str, pings: int, bulk_bytes: int, transport: str = "tcp",
                 measure_fn: Measure = measure) -> dict[str, Any]:
    """Lease, measure, release. With transport auto or ucx the bulk runs over UCX too, with a UCX
    link of its own (a UCX endpoint serves one peer)."""
    ucx, why_not = open_ucx(transport)
    if ucx is None and why_not and transport == "ucx":
        return perf_row(server, None, f"not measured over UCX: {why_not}")
    try:
        row = _probe(client, server, user=user, pings=pings, bulk_bytes=bulk_bytes, ucx=ucx, measure_fn=measure_fn,
                     ucx_required=transport == "ucx")
    finally:
        if ucx is not None:
            ucx.close()
    if why_not and row.get("ok"):
        row["ucx_why_not"] = why_not
    return row


def _probe(client: PoolClient, server: str, *, user: str, pings: int, bulk_bytes: int, ucx: UcxLink | None,
           measure_fn: Measure, ucx_required: bool) -> dict[str, Any]:
    job_key = f"net-perf-{user}-{secrets.token_hex(4)}"
    try:
        lease = client.allocate(job_key, user, 1, memory_bytes=PROBE_MEMORY_BYTES, server=server,
                                ttl_seconds=PROBE_TTL_SECONDS, account=PROBE_ACCOUNT)
    except RgpuError as exc:
        return perf_row(server, None, f"cannot lease a probe slice: {exc}")
    try:
        return perf_row(server, measure_fn(lease.slices[0].server, lease.slices[0].token, pings=pings,
                                           bulk_bytes=bulk_bytes, ucx=ucx), ucx_required=ucx_required)
    except RgpuError as exc:
        return perf_row(server, None, str(exc))
    finally:
        client.release(job_key)


def up_servers(client: PoolClient, only: Iterable[str] = ()) -> list[str]:
    wanted = set(only)
    return [s.address for s in client.list_servers().servers
            if s.state == "up" and (not wanted or s.address in wanted or s.hostname in wanted)]
