"""Durable pool state in PostgreSQL (psycopg 3), for several rgpu-poold on one database.

The same interface as the SQLite Store (store.py), plus what several daemons need:
- `transaction()`: every change of the pool's state runs in one transaction that first takes one
  advisory lock, so allocations through different daemons are serialised and never over-commit;
  it yields the state's version (a counter every change bumps), and a daemon that sees another
  version than its own reloads the state before deciding (rules.py);
- `version()`: the version, read without the lock, so reads catch up with other daemons' changes;
- heartbeats are stored per server, so a daemon sees dispatchers that heartbeat to another.

A change is committed before the daemon answers: `kill -9` of a daemon loses nothing it
acknowledged. PostgreSQL itself is made highly available with the site's usual tools.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import asdict
from typing import Any, Iterator

from rgpu.errors import ConfigError, Unavailable
from rgpu.model import LeaseRecord, QuotaRecord, ServerInfo, SliceRecord
from rgpu.remoting.pool.store import StateVersion, server_from_json

LOCK_KEY = 0x72677075   # "rgpu": the advisory lock every change takes

_SCHEMA = """
CREATE TABLE IF NOT EXISTS servers (
    address    TEXT PRIMARY KEY,
    info_json  TEXT NOT NULL,
    drained    BOOLEAN NOT NULL DEFAULT FALSE,
    registered DOUBLE PRECISION NOT NULL,
    heartbeat  DOUBLE PRECISION NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS leases (
    job_key     TEXT PRIMARY KEY,
    "user"      TEXT NOT NULL,
    account     TEXT NOT NULL,
    created     DOUBLE PRECISION NOT NULL,
    expires     DOUBLE PRECISION NOT NULL,
    slices_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS lease_history (
    job_key      TEXT NOT NULL,
    "user"       TEXT NOT NULL,
    account      TEXT NOT NULL,
    units        INTEGER NOT NULL,
    created      DOUBLE PRECISION NOT NULL,
    ended        DOUBLE PRECISION NOT NULL,
    busy_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
    how          TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS lease_history_ended ON lease_history(ended);
CREATE TABLE IF NOT EXISTS quotas (
    kind        TEXT NOT NULL,
    name        TEXT NOT NULL,
    limit_units INTEGER NOT NULL,
    PRIMARY KEY (kind, name)
);
CREATE TABLE IF NOT EXISTS pool_meta (
    one     INTEGER PRIMARY KEY CHECK (one = 1),
    version BIGINT NOT NULL
);
INSERT INTO pool_meta(one, version) VALUES (1, 0) ON CONFLICT DO NOTHING;
"""


class PostgresStore:
    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError:
            raise ConfigError("store", "store_url names PostgreSQL but psycopg is not installed", "",
                              "pip install 'psycopg[binary]' (or the distribution's python3-psycopg)") from None
        self.url = url
        self._psycopg = psycopg
        try:
            self._db = self._connect()
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))  # one schema creator at a time
                self._db.execute(_SCHEMA)
        except psycopg.Error as exc:
            raise ConfigError("store", "cannot open the PostgreSQL state database", _first_line(exc),
                              "check store_url (host, port, database, user, password) and that PostgreSQL runs") from None
        self._lock = threading.RLock()
        self._in_transaction = False
        self._wrote = False   # in the open transaction: a change that others must reload for

    def _connect(self) -> Any:
        return self._psycopg.connect(self.url, autocommit=True, connect_timeout=5)

    @contextlib.contextmanager
    def _session(self) -> Iterator[Any]:
        """The connection, opened again when it broke (PostgreSQL restarted or failed over); a
        failure on the way is UNAVAILABLE, so clients retry or go to another pool daemon."""
        with self._lock:
            try:
                if self._db.closed or self._db.broken:
                    self._db = self._connect()
                yield self._db
            except self._psycopg.OperationalError as exc:
                raise Unavailable("store", "PostgreSQL is unreachable", _first_line(exc),
                                  "check that PostgreSQL runs and store_url; the pool reconnects by itself") from None

    def close(self) -> None:
        self._db.close()

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._session() as db:
            return db.execute(sql, params).fetchall()

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        with self._session() as db:
            db.execute(sql, params)
            self._wrote = True

    # -- several daemons ---------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[StateVersion]:
        """One change: hold the pool-wide lock; the version seen before and after."""
        with self._lock:
            if self._in_transaction:   # nested: part of the open one
                yield StateVersion(None)
                return
            self._in_transaction, self._wrote = True, False
            try:
                with self._session() as db, db.transaction():
                    db.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                    state = StateVersion(db.execute("SELECT version FROM pool_meta").fetchone()[0])
                    yield state
                    # Only a change that wrote makes the other daemons reload.
                    state.after = db.execute(
                        "UPDATE pool_meta SET version = version + 1 RETURNING version").fetchone()[0] \
                        if self._wrote else state.before
            finally:
                self._in_transaction = False

    def version(self) -> int | None:
        return self._rows("SELECT version FROM pool_meta")[0][0]

    def heartbeat(self, address: str, now: float) -> None:
        with self._session() as db:   # not a change others must reload for: no version bump
            db.execute("UPDATE servers SET heartbeat = GREATEST(heartbeat, %s) WHERE address = %s",
                             (now, address))

    def load_heartbeats(self) -> dict[str, float]:
        return dict(self._rows("SELECT address, heartbeat FROM servers"))

    # -- loading ---------------------------------------------------------------------------
    def load_servers(self) -> list[tuple[ServerInfo, bool]]:
        return [(server_from_json(info), bool(drained))
                for info, drained in self._rows("SELECT info_json, drained FROM servers")]

    def load_leases(self) -> list[LeaseRecord]:
        rows = self._rows('SELECT job_key, "user", account, created, expires, slices_json FROM leases')
        return [LeaseRecord(job_key=k, user=u, account=a, created_unix=c, expires_unix=e,
                            slices=tuple(SliceRecord(**s) for s in json.loads(sj)))
                for k, u, a, c, e, sj in rows]

    def load_quotas(self) -> list[QuotaRecord]:
        return [QuotaRecord(kind, name, limit)
                for kind, name, limit in self._rows("SELECT kind, name, limit_units FROM quotas")]

    # -- changes -----------------------------------------------------------------------------
    def upsert_server(self, server: ServerInfo, registered: float) -> None:
        self._write(
            "INSERT INTO servers(address, info_json, drained, registered, heartbeat) VALUES (%s, %s, FALSE, %s, %s) "
            "ON CONFLICT(address) DO UPDATE SET info_json=excluded.info_json, registered=excluded.registered, "
            "heartbeat=GREATEST(servers.heartbeat, excluded.heartbeat)",
            (server.address, json.dumps(asdict(server)), registered, registered))

    def set_drained(self, address: str, drained: bool) -> None:
        self._write("UPDATE servers SET drained=%s WHERE address=%s", (drained, address))

    def delete_server(self, address: str) -> None:
        self._write("DELETE FROM servers WHERE address=%s", (address,))

    def insert_lease(self, lease: LeaseRecord) -> None:
        self._write(
            'INSERT INTO leases(job_key, "user", account, created, expires, slices_json) VALUES (%s, %s, %s, %s, %s, %s)',
            (lease.job_key, lease.user, lease.account, lease.created_unix, lease.expires_unix,
             json.dumps([vars(s) for s in lease.slices])))

    def delete_lease(self, job_key: str) -> None:
        self._write("DELETE FROM leases WHERE job_key=%s", (job_key,))

    def end_lease(self, lease: LeaseRecord, ended: float, busy_seconds: float = 0.0, how: str = "") -> None:
        with self._session() as db, db.transaction():
            self._wrote = True
            db.execute("DELETE FROM leases WHERE job_key=%s", (lease.job_key,))
            db.execute(
                'INSERT INTO lease_history(job_key, "user", account, units, created, ended, busy_seconds, how) '
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (lease.job_key, lease.user, lease.account, lease.units, lease.created_unix, ended, busy_seconds, how))

    def load_history(self, since: float, until: float) -> list[tuple[str, str, int, float, float, float]]:
        return [tuple(row) for row in self._rows(  # type: ignore[misc]
            'SELECT "user", account, units, created, ended, busy_seconds FROM lease_history '
            "WHERE ended > %s AND created < %s", (since, until))]

    def insert_history(self, rows: list[tuple[str, str, str, int, float, float, float, str]]) -> None:
        with self._session() as db, db.cursor() as cursor:
            self._wrote = True
            cursor.executemany(
                'INSERT INTO lease_history(job_key, "user", account, units, created, ended, busy_seconds, how) '
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", rows)

    def set_quota(self, quota: QuotaRecord) -> None:
        self._write("INSERT INTO quotas(kind, name, limit_units) VALUES (%s, %s, %s) "
                    "ON CONFLICT(kind, name) DO UPDATE SET limit_units=excluded.limit_units",
                    (quota.kind, quota.name, quota.limit_units))

    def delete_quota(self, kind: str, name: str) -> None:
        self._write("DELETE FROM quotas WHERE kind=%s AND name=%s", (kind, name))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
