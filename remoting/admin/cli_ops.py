"""rgpu-admin's operations commands: net-perf, health --deep, usage, stats."""

from __future__ import annotations

import getpass
import json
from typing import Any

import click
from tabulate import tabulate

from rgpu import __version__
from rgpu.config import Settings
from rgpu.proto import rgpu_pb2 as pb
from rgpu.errors import DispatcherUnavailable, InvalidRequest, RgpuError
from rgpu.remoting.admin import netperf
from rgpu.remoting.admin.progress import progress
from rgpu.remoting.datapath.perf import MAX_SOURCE_BYTES
from rgpu.units import format_bytes, parse_size


def _json_wanted(ctx: Any, local: bool) -> bool:
    return bool(local or getattr(ctx, "json_output", False))


@click.command("net-perf")
@click.option("--server", "servers", multiple=True, help="Only this dispatcher (address or hostname; repeat).")
@click.option("--pings", type=click.IntRange(1, 100000), default=50, show_default=True, help="Round trips to time.")
@click.option("--size", default="64M", show_default=True, help="Bytes to send and to receive per dispatcher.")
@click.option("--transport", type=click.Choice(netperf.NET_PERF_TRANSPORTS), default="auto", show_default=True,
              help="Bulk over the session's TCP stream, and over UCX: where both ends can (auto), or "
                   "required (ucx: a dispatcher not measured over UCX is an error); tcp: TCP only.")
@click.option("--json", "json_local", is_flag=True, help="Print a JSON array of objects.")
@click.pass_obj
def net_perf(ctx: Any, servers: tuple[str, ...], pings: int, size: str, transport: str, json_local: bool) -> None:
    """Round trip and bandwidth from this node to each dispatcher's data port, through a real
    (token-checked) session: a 1 MiB slice is leased for the probe and released after. Bulk goes
    over TCP, and over UCX where both ends take it; the UCX row names UCX's transports (shared
    memory, tcp/DEVICE, rc_mlx5/mlx5_0:1 for InfiniBand)."""
    bulk = parse_size(size, "size")
    if bulk > MAX_SOURCE_BYTES:
        raise InvalidRequest("net-perf", f"--size {size} is more than a perf session moves each way",
                             f"at most {format_bytes(MAX_SOURCE_BYTES)}", "give --size 1G or less")
    with ctx.client() as client:
        targets = netperf.up_servers(client, servers)
        if not targets:
            raise DispatcherUnavailable("net-perf", "no dispatcher to measure", "no server is up" + (
                f" among {', '.join(servers)}" if servers else ""), "see `rgpu-admin health`")
        rows = [netperf.probe_server(client, server, user=getpass.getuser(), pings=pings, bulk_bytes=bulk,
                                     transport=transport)
                for server in progress(targets, "net-perf", describe=str)]
    if _json_wanted(ctx, json_local):
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(tabulate([cells for r in rows for cells in netperf.table_rows(r)], headers=netperf.TABLE_HEADERS))
    failed = [r["server"] for r in rows if not r["ok"]]
    if failed:
        raise DispatcherUnavailable("net-perf", f"{len(failed)} dispatcher(s) could not be measured: {', '.join(failed)}",
                          "see the ERROR column", "check those dispatchers with `rgpu-admin health`")


def deep_checks(settings: Settings, reply: pb.ListServersReply, rows: list[dict[str, Any]], hosts: tuple[str, ...], *,
                json_output: bool) -> list[str]:
    """Run `health --deep` over SSH and print its findings (after the server table, or as one JSON
    object with the server rows); returns 'host: check' of each failure."""
    from rgpu.remoting.admin import deep_health
    from rgpu.remoting.admin.hosts import parse_node_list, slurm_nodes

    clients = parse_node_list(settings.health_client_nodes) if settings.health_client_nodes else slurm_nodes()
    jobs = deep_health.plan_hosts(settings, list(reply.servers), clients, hosts)
    findings = deep_health.run_checks(
        jobs, pool_version=__version__,
        each=lambda done: progress(done, "health", length=len(jobs),
                                   describe=lambda future: future.result().host if future.done() else ""))
    if json_output:
        click.echo(json.dumps({"servers": rows, "checks": [f.row() for f in findings]}, indent=2))
    else:
        if rows:
            click.echo("")
        click.echo(tabulate([[f.host, f.check, f.status.upper(), f.detail, f.fix] for f in findings],
                            headers=["HOST", "CHECK", "STATUS", "DETAIL", "FIX"], maxcolwidths=[None, None, None, 60, 50]))
    return [f"{f.host}: {f.check}" for f in findings if f.status == "fail"]


@click.command()
@click.option("--idle", "idle_only", is_flag=True, help="Only slices of idle leases.")
@click.option("--json", "json_local", is_flag=True, help="Print a JSON array of objects.")
@click.pass_obj
def stats(ctx: Any, idle_only: bool, json_local: bool) -> None:
    """Usage of every slice as its dispatcher reports it: open sessions, busy time, compute used
    (busy share of the last heartbeat interval) against the share held, memory in use and peak
    against the limit, last activity; idle leases flagged IDLE (idle_after_seconds), slices that
    use under a quarter of 4 GiB or more flagged UNUSED."""
    from rgpu.remoting.admin.usage_view import slice_rows

    with ctx.client() as client:
        rows = slice_rows([lease for lease in client.list_leases() if lease.idle or not idle_only])
    if _json_wanted(ctx, json_local):
        click.echo(json.dumps(rows, indent=2))
    elif not rows:
        click.echo("no idle leases" if idle_only else "no leases")
    else:
        click.echo(tabulate([[r["job_key"], r["user"], r["slice"], r["where"], r["sessions"], r["busy"], r["compute"],
                              r["memory"], r["last_active"], r["flag"]] for r in rows],
                            headers=["JOB KEY", "USER", "SLICE", "GPU", "SESSIONS", "BUSY", "COMPUTE USED/HELD", "MEMORY",
                                     "LAST ACTIVE", "FLAG"]))


def _when(text: str | None, what: str) -> float:
    """Unix time from '2026-11-01', '2026-11-01T12:00', a duration ago ('7d', '12h'), or nothing (0)."""
    import datetime

    from rgpu.errors import InvalidRequest
    from rgpu.units import parse_duration

    if not text:
        return 0.0
    try:
        parsed = datetime.datetime.fromisoformat(text)
    except ValueError:
        try:
            import time
            return time.time() - parse_duration(text, what)
        except RgpuError:
            raise InvalidRequest("usage", f"--{what} {text!r} is neither a date nor a duration", "",
                                 "give e.g. 2026-11-01, 2026-11-01T12:00 or 7d") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return parsed.timestamp()


@click.command()
@click.option("--by", type=click.Choice(["user", "account", "both"]), default="user", show_default=True,
              help="Group by user, by account, or by both.")
@click.option("--since", help="From this UTC date/time (2026-11-01, 2026-11-01T12:00) or this long ago (30d).")
@click.option("--until", help="Up to this UTC date/time or this long ago (default: now).")
@click.option("--json", "json_local", is_flag=True, help="Print a JSON array of objects.")
@click.pass_obj
def usage(ctx: Any, by: str, since: str | None, until: str | None, json_local: bool) -> None:
    """GPU-percent-hours per user or account from the pool's own records (100 GPU-percent for an
    hour = one GPU-hour): ended leases and live ones up to now."""
    from rgpu.remoting.admin.usage_view import usage_rows

    with ctx.client() as client:
        reply = client.usage(_when(since, "since"), _when(until, "until"))
    rows = usage_rows(reply, by)
    if _json_wanted(ctx, json_local):
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no usage in that window")
        return
    keys = {"user": ["user"], "account": ["account"], "both": ["user", "account"]}[by]
    click.echo(tabulate([[r[k] for k in keys] + [f"{r['gpu_percent_hours']:.2f}", f"{r['gpu_hours']:.2f}", r["leases"],
                          f"{r['busy_gpu_seconds'] / 3600:.2f}"] for r in rows],
                        headers=[k.upper() for k in keys] + ["GPU-%-HOURS", "GPU-HOURS", "LEASES", "BUSY HOURS"]))
