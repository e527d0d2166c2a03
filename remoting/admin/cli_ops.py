"""rgpu-admin's operations commands: net-perf, health --deep, usage, stats."""

from __future__ import annotations

import getpass
import json
from typing import Any

import click
from tabulate import tabulate

from rgpu.errors import Unavailable
from rgpu.remoting.admin import netperf
from rgpu.remoting.admin.progress import progress
from rgpu.units import parse_size


def _json_wanted(ctx: Any, local: bool) -> bool:
    return bool(local or getattr(ctx, "json_output", False))


@click.command("net-perf")
@click.option("--server", "servers", multiple=True, help="Only this dispatcher (address or hostname; repeat).")
@click.option("--pings", type=click.IntRange(1, 100000), default=50, show_default=True, help="Round trips to time.")
@click.option("--size", default="64M", show_default=True, help="Bytes to send and to receive per dispatcher.")
@click.option("--json", "json_local", is_flag=True, help="Print a JSON array of objects.")
@click.pass_obj
def net_perf(ctx: Any, servers: tuple[str, ...], pings: int, size: str, json_local: bool) -> None:
    """Round trip and bandwidth from this node to each dispatcher's data port, through a real
    (token-checked) session: a 1 MiB slice is leased for the probe and released after."""
    bulk = parse_size(size, "size")
    with ctx.client() as client:
        targets = netperf.up_servers(client, servers)
        if not targets:
            raise Unavailable("net-perf", "no dispatcher to measure", "no server is up" + (
                f" among {', '.join(servers)}" if servers else ""), "see `rgpu-admin health`")
        rows = [netperf.probe_server(client, server, user=getpass.getuser(), pings=pings, bulk_bytes=bulk)
                for server in progress(targets, "net-perf", describe=str)]
    if _json_wanted(ctx, json_local):
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(tabulate([netperf.table_cells(r) for r in rows], headers=netperf.TABLE_HEADERS))
    failed = [r["server"] for r in rows if not r["ok"]]
    if failed:
        raise Unavailable("net-perf", f"{len(failed)} dispatcher(s) could not be measured: {', '.join(failed)}",
                          "see the ERROR column", "check those dispatchers with `rgpu-admin health`")


def deep_checks(settings: Any, reply: Any, rows: list[dict[str, Any]], hosts: tuple[str, ...], *,
                json_output: bool) -> list[str]:
    """Run `health --deep` over SSH and print its findings (after the server table, or as one JSON
    object with the server rows); returns 'host: check' of each failure."""
    from rgpu.remoting.admin import deep_health
    from rgpu.remoting.admin.hosts import parse_node_list, slurm_nodes

    clients = parse_node_list(settings.health_client_nodes) if settings.health_client_nodes else slurm_nodes()
    jobs = deep_health.plan_hosts(settings, list(reply.servers), clients, hosts)
    pool_version = next((s.version for s in reply.servers if s.version), "")
    findings = deep_health.run_checks(
        jobs, pool_version=pool_version,
        each=lambda items: progress(items, "health", describe=lambda job: job.plan.host))
    if json_output:
        click.echo(json.dumps({"servers": rows, "checks": [f.row() for f in findings]}, indent=2))
    else:
        if rows:
            click.echo("")
        click.echo(tabulate([[f.host, f.check, f.status.upper(), f.detail, f.fix] for f in findings],
                            headers=["HOST", "CHECK", "STATUS", "DETAIL", "FIX"], maxcolwidths=[None, None, None, 60, 50]))
    return [f"{f.host}: {f.check}" for f in findings if f.status == "fail"]
