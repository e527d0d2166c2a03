"""`rgpu-admin migrate-state`: copy a pool's SQLite state into PostgreSQL, once, when a site moves
from one pool host to several pool daemons on PostgreSQL (docs/admin-guide.md, "One host or several").

Stop rgpu-poold first (the SQLite file must not change during the copy). Servers (with their
drained flag), live leases, quotas and the lease history are copied in one PostgreSQL
transaction; a target that already holds servers or leases is refused, so nothing is merged or
copied twice. The command joins rgpu-admin through the `rgpu.admin_commands` entry point.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import click

from rgpu.config import load_settings
from rgpu.errors import ConfigError, RgpuError
from rgpu.remoting.pool.store import Store
from rgpu.remoting.pool.store_pg import PostgresStore


def migrate_state(sqlite_path: str | Path, store_url: str) -> dict[str, int]:
    """Copy everything from the SQLite file into the empty PostgreSQL store; counts per kind."""
    path = Path(sqlite_path)
    if not path.is_file():
        raise ConfigError("migrate-state", f"no SQLite state at {path}", "the file does not exist",
                          "give --from the pool's state file (the `state` setting)")
    source = Store(path)
    target = PostgresStore(store_url)
    try:
        servers, leases, quotas = source.load_servers(), source.load_leases(), source.load_quotas()
        history = source.dump_history()
        with target.transaction():
            if target.load_servers() or target.load_leases():
                raise ConfigError("migrate-state", "the PostgreSQL store already holds servers or leases",
                                  "migrating twice would merge two pools' states",
                                  "point --to at an empty database")
            now = time.time()
            for info, drained in servers:
                target.upsert_server(info, now)
                if drained:
                    target.set_drained(info.address, True)
            for lease in leases:
                target.insert_lease(lease)
            for quota in quotas:
                target.set_quota(quota)
            target.insert_history(history)
    except sqlite3.DatabaseError as exc:
        raise ConfigError("migrate-state", f"cannot read {path}", str(exc), "check the file") from None
    finally:
        source.close()
        target.close()
    return {"servers": len(servers), "leases": len(leases), "quotas": len(quotas), "history": len(history)}


@click.command("migrate-state")
@click.option("--from", "source", metavar="PATH", help="SQLite state file (default: the `state` setting).")
@click.option("--to", "target", metavar="URL", help="postgresql://... (default: the `store_url` setting).")
@click.pass_context
def migrate_state_command(ctx: click.Context, source: str | None, target: str | None) -> None:
    """Copy the pool's SQLite state into an empty PostgreSQL store (stop rgpu-poold first)."""
    try:
        settings = getattr(ctx.obj, "settings", None) or load_settings()
        url = target or settings.store_url
        if not url:
            raise ConfigError("migrate-state", "no PostgreSQL store given", "store_url is empty",
                              "pass --to postgresql://USER@HOST:PORT/DB or set store_url")
        counts = migrate_state(source or settings.state, url)
        click.echo("copied " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
                   + "; set store_url on every pool host and start rgpu-poold there")
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        ctx.exit(exc.exit_code)
