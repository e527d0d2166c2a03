"""Durable pool state in SQLite (WAL): servers, leases and quotas.

Every mutation is one transaction committed before the pool answers, so `kill -9` at any moment
loses nothing that a caller was told had happened. WAL with synchronous=NORMAL survives a process
crash (what `kill -9` is); set synchronous=FULL through `durability="full"` to survive power loss
too, at the cost of an fsync per change. Tokens are not stored: they are re-signed on demand, so
the database holds no secret.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Protocol

from rgpu.errors import ConfigError, Unavailable
from rgpu.model import GpuInfo, LeaseRecord, QuotaRecord, ServerInfo, SliceRecord
from rgpu.remoting.pool.accounting import SliceUsageRecord

SCHEMA_VERSION = 1


class StoreError(Unavailable):
    """The state database refused a change (full disk, read-only file): retry later."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS servers (
    address     TEXT PRIMARY KEY,
    info_json   TEXT NOT NULL,
    drained     INTEGER NOT NULL DEFAULT 0,
    registered  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    job_key     TEXT PRIMARY KEY,
    user        TEXT NOT NULL,
    account     TEXT NOT NULL,
    created     REAL NOT NULL,
    expires     REAL NOT NULL,
    slices_json TEXT NOT NULL
);
-- Ended leases, for accounting (rgpu-admin usage). Added in place: older pools ignore it.
CREATE TABLE IF NOT EXISTS lease_history (
    job_key      TEXT NOT NULL,
    user         TEXT NOT NULL,
    account      TEXT NOT NULL,
    units        INTEGER NOT NULL,
    created      REAL NOT NULL,
    ended        REAL NOT NULL,
    busy_seconds REAL NOT NULL DEFAULT 0,
    how          TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS lease_history_ended ON lease_history(ended);
CREATE TABLE IF NOT EXISTS quotas (
    kind        TEXT NOT NULL,
    name        TEXT NOT NULL,
    limit_units INTEGER NOT NULL,
    PRIMARY KEY (kind, name)
);
"""


@dataclass
class StateVersion:
    """The shared state's version when a change began (None: this store has one daemon, never
    reload) and after it (set when the change commits)."""

    before: int | None
    after: int | None = None


class Store:
    def __init__(self, path: str | os.PathLike[str], durability: str = "normal") -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fresh = not self.path.exists()
            if not fresh and self.path.is_file() and self.path.stat().st_size == 0:
                # SQLite would take it as a new database: a truncated state file must not become
                # an empty pool that hands out GPU shares its leases still hold.
                raise ConfigError("store", f"state database {self.path} is empty (0 bytes)",
                                  "a truncated or damaged file, or one made by hand",
                                  "restore it from a backup, or remove it to start an empty pool")
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            if fresh:
                os.chmod(self.path, 0o600)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if durability == 'full' else 'NORMAL'}")
            self._db.execute("PRAGMA busy_timeout=5000")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError("store", f"{self.path} has schema version {version}",
                                  f"this rgpu-poold understands up to {SCHEMA_VERSION}",
                                  "upgrade rgpu-poold, or point --state at another file")
            if version < SCHEMA_VERSION or fresh:   # no write when up to date: a full disk still starts
                self._db.executescript(_SCHEMA)
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            raise ConfigError("store", f"cannot open state database {self.path}", str(exc),
                              "check the path and permissions, or move a damaged file aside") from None
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    # -- one daemon per file: nothing to share ------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[StateVersion]:
        yield StateVersion(None)

    def version(self) -> int | None:
        return None

    def heartbeat(self, address: str, now: float) -> None:
        """Heartbeats stay in the daemon's memory: it is the only one."""

    def load_heartbeats(self) -> dict[str, float]:
        return {}

    def changes_since(self, version: int) -> list[tuple[str, str]] | None:
        return None   # never asked: version() is None

    def load_leases_named(self, job_keys: list[str]) -> list[LeaseRecord]:
        return [lease for lease in self.load_leases() if lease.job_key in set(job_keys)]

    def load_servers_named(self, addresses: list[str]) -> list[tuple[ServerInfo, bool]]:
        return [(info, drained) for info, drained in self.load_servers() if info.address in set(addresses)]

    def save_slice_usage(self, rows: list[tuple[str, int, SliceUsageRecord]]) -> None:
        """Usage reports stay in the daemon's memory: it is the only one."""

    def load_slice_usage(self) -> dict[tuple[str, int], SliceUsageRecord]:
        return {}

    # -- loading ---------------------------------------------------------------------------
    def load_servers(self) -> list[tuple[ServerInfo, bool]]:
        rows = self._db.execute("SELECT info_json, drained FROM servers").fetchall()
        return [(server_from_json(info), bool(drained)) for info, drained in rows]

    def load_leases(self) -> list[LeaseRecord]:
        rows = self._db.execute(
            "SELECT job_key, user, account, created, expires, slices_json FROM leases").fetchall()
        return [LeaseRecord(job_key=k, user=u, account=a, created_unix=c, expires_unix=e,
                            slices=tuple(SliceRecord(**s) for s in json.loads(sj)))
                for k, u, a, c, e, sj in rows]

    def load_quotas(self) -> list[QuotaRecord]:
        rows = self._db.execute("SELECT kind, name, limit_units FROM quotas").fetchall()
        return [QuotaRecord(kind, name, limit) for kind, name, limit in rows]

    # -- changes (each one committed before it returns) -------------------------------------
    def _write(self, sql: str, params: tuple[object, ...]) -> None:
        with self._lock:
            try:
                self._db.execute(sql, params)
            except sqlite3.Error as exc:   # a full disk, a read-only or vanished file: the change is not made
                raise StoreError("store", f"cannot save the pool's state in {self.path}", str(exc),
                                 "free space on its disk or fix the file's permissions; nothing was changed") from None

    def upsert_server(self, server: ServerInfo, registered: float) -> None:
        self._write(
            "INSERT INTO servers(address, info_json, drained, registered) VALUES (?, ?, 0, ?) "
            "ON CONFLICT(address) DO UPDATE SET info_json=excluded.info_json, registered=excluded.registered",
            (server.address, json.dumps(asdict(server)), registered))

    def set_drained(self, address: str, drained: bool) -> None:
        self._write("UPDATE servers SET drained=? WHERE address=?", (int(drained), address))

    def delete_server(self, address: str) -> None:
        self._write("DELETE FROM servers WHERE address=?", (address,))

    def insert_lease(self, lease: LeaseRecord) -> None:
        self._write(
            "INSERT INTO leases(job_key, user, account, created, expires, slices_json) VALUES (?, ?, ?, ?, ?, ?)",
            (lease.job_key, lease.user, lease.account, lease.created_unix, lease.expires_unix,
             json.dumps([vars(s) for s in lease.slices])))

    def set_lease_expiry(self, job_key: str, expires: float) -> None:
        self._write("UPDATE leases SET expires=? WHERE job_key=?", (expires, job_key))

    def delete_lease(self, job_key: str) -> None:
        self._write("DELETE FROM leases WHERE job_key=?", (job_key,))

    def end_lease(self, lease: LeaseRecord, ended: float, busy_seconds: float = 0.0, how: str = "") -> None:
        """Delete a lease and record it in lease_history, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM leases WHERE job_key=?", (lease.job_key,))
                self._db.execute(
                    "INSERT INTO lease_history(job_key, user, account, units, created, ended, busy_seconds, how) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (lease.job_key, lease.user, lease.account, lease.units, lease.created_unix, ended,
                     busy_seconds, how))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def load_history(self, since: float, until: float) -> list[tuple[str, str, int, float, float, float]]:
        """(user, account, units, created, ended, busy_seconds) of ended leases overlapping [since, until)."""
        with self._lock:
            return self._db.execute(
                "SELECT user, account, units, created, ended, busy_seconds FROM lease_history "
                "WHERE ended > ? AND created < ?", (since, until)).fetchall()

    def dump_history(self) -> list[tuple[str, str, str, int, float, float, float, str]]:
        """Every ended lease, all columns (for migrate-state)."""
        with self._lock:
            return self._db.execute("SELECT job_key, user, account, units, created, ended, busy_seconds, how "
                                    "FROM lease_history").fetchall()

    def set_quota(self, quota: QuotaRecord) -> None:
        self._write("INSERT INTO quotas(kind, name, limit_units) VALUES (?, ?, ?) "
                    "ON CONFLICT(kind, name) DO UPDATE SET limit_units=excluded.limit_units",
                    (quota.kind, quota.name, quota.limit_units))

    def delete_quota(self, kind: str, name: str) -> None:
        self._write("DELETE FROM quotas WHERE kind=? AND name=?", (kind, name))


def server_from_json(text: str) -> ServerInfo:
    data = json.loads(text)
    data["gpus"] = tuple(GpuInfo(**g) for g in data["gpus"])
    return ServerInfo(**data)


class PoolStore(Protocol):
    """What PoolCore needs of a store: SQLite (Store, one daemon) or PostgreSQL (store_pg, several)."""

    def close(self) -> None: ...
    def transaction(self) -> contextlib.AbstractContextManager[StateVersion]: ...
    def version(self) -> int | None: ...
    def heartbeat(self, address: str, now: float) -> None: ...
    def load_heartbeats(self) -> dict[str, float]: ...
    def changes_since(self, version: int) -> list[tuple[str, str]] | None: ...
    def load_leases_named(self, job_keys: list[str]) -> list[LeaseRecord]: ...
    def load_servers_named(self, addresses: list[str]) -> list[tuple[ServerInfo, bool]]: ...
    def save_slice_usage(self, rows: list[tuple[str, int, SliceUsageRecord]]) -> None: ...
    def load_slice_usage(self) -> dict[tuple[str, int], SliceUsageRecord]: ...
    def load_servers(self) -> list[tuple[ServerInfo, bool]]: ...
    def load_leases(self) -> list[LeaseRecord]: ...
    def load_quotas(self) -> list[QuotaRecord]: ...
    def upsert_server(self, server: ServerInfo, registered: float) -> None: ...
    def set_drained(self, address: str, drained: bool) -> None: ...
    def delete_server(self, address: str) -> None: ...
    def insert_lease(self, lease: LeaseRecord) -> None: ...
    def set_lease_expiry(self, job_key: str, expires: float) -> None: ...
    def end_lease(self, lease: LeaseRecord, ended: float, busy_seconds: float = 0.0, how: str = "") -> None: ...
    def load_history(self, since: float, until: float) -> list[tuple[str, str, int, float, float, float]]: ...
    def set_quota(self, quota: QuotaRecord) -> None: ...
    def delete_quota(self, kind: str, name: str) -> None: ...


def open_store(state: str, store_url: str = "") -> PoolStore:
    """The store the settings name: PostgreSQL when store_url is set, else SQLite at `state`."""
    if store_url:
        if not store_url.startswith(("postgresql://", "postgres://")):
            raise ConfigError("store", f"store_url {store_url.split('@')[-1]!r} is not a PostgreSQL URL", "",
                              "use postgresql://USER@HOST:PORT/DATABASE, or leave it empty for SQLite")
        from rgpu.remoting.pool.store_pg import PostgresStore
        return PostgresStore(store_url)
    return Store(state)
