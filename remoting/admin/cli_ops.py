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
