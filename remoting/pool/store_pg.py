"""Durable pool state in PostgreSQL (psycopg 3), for several rgpu-poold on one database.

The same interface as the SQLite Store (store.py), plus what several daemons need:
- `transaction()`: every change of the pool's state runs in one transaction that first takes one
  advisory lock, so allocations through different daemons are serialised and never over-commit;
  it yields the state's version (a counter every change bumps), and a daemon that sees another
  version than its own catches up before deciding (rules.py);
- a change log (`pool_changes`: version, kind, key): each change records which leases, servers
  and quotas it touched, so a daemon catches up by reading those rows only (`changes_since`,
  `load_leases_named`, `load_servers_named`); the log keeps the last CHANGE_LOG_KEEP versions,
  and a daemon further behind than that reloads everything;
- `version()`: the version, read without the lock, so reads catch up with other daemons' changes;
- `admitting()`: held by one daemon at a time for one admission pass (a session advisory lock on a
  connection of its own), so two daemons never release held jobs into the same room;
- heartbeats are stored per server, so a daemon sees dispatchers that heartbeat to another;
- usage reports (busy time, last activity per slice) are stored per slice, so the daemon that
  decides `idle_release` sees reports that dispatchers sent to another (`load_slice_usage`).

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
from rgpu.remoting.pool.accounting import SliceUsageRecord
from rgpu.remoting.pool.store import (REPORT_UPSERT, USAGE_COLUMNS, StateVersion, server_from_json, usage_rows,
                                      usage_upsert)

LOCK_KEY = 0x72677075   # "rgpu": the advisory lock every change takes
# "rgpa": the advisory lock one admission pass holds (the Slurm reconciler's release of held jobs),
# apart from LOCK_KEY so allocations go on meanwhile.
ADMISSION_LOCK_KEY = 0x72677061
ADMISSION_WAIT_SECONDS = 60

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
-- Versions up to `pruned` have no rows left in pool_changes: a daemon that saw less reloads all.
ALTER TABLE pool_meta ADD COLUMN IF NOT EXISTS pruned BIGINT NOT NULL DEFAULT 0;
-- The layout's version (STORE_SCHEMA): a daemon never works on a layout newer than its own.
ALTER TABLE pool_meta ADD COLUMN IF NOT EXISTS schema INTEGER NOT NULL DEFAULT 1;
CREATE TABLE IF NOT EXISTS pool_changes (
    version BIGINT NOT NULL,
    kind    TEXT NOT NULL,
    key     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS pool_changes_version ON pool_changes(version);
-- Dashboard credentials used up (login links exchanged, sessions logged out), until they expire.
-- Added in place: daemons of layout 2 do not read it.
CREATE TABLE IF NOT EXISTS web_spent (
    nonce   TEXT PRIMARY KEY,
    expires DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS slice_usage (
    job_key          TEXT NOT NULL,
    slice            INTEGER NOT NULL,
    sessions         INTEGER NOT NULL,
    busy_seconds     DOUBLE PRECISION NOT NULL,
    memory_high_water_bytes BIGINT NOT NULL,
    memory_used_bytes BIGINT NOT NULL,
    last_active_unix DOUBLE PRECISION NOT NULL,
    calls            BIGINT NOT NULL,
    PRIMARY KEY (job_key, slice)
);
-- Each dispatcher's last report of its GPUs (telemetry.py). Added in place: older daemons do not read it.
CREATE TABLE IF NOT EXISTS server_reports (
    address  TEXT PRIMARY KEY,
    report   BYTEA NOT NULL,
    received DOUBLE PRECISION NOT NULL
);
"""

# The layout this code reads and writes. 1: before the change log (session 1); 2: the change log
# and shared usage reports, which every daemon on the database must write. Raise it with any change
# other daemons could not follow; older daemons of layout 2 or later refuse a newer database.
STORE_SCHEMA = 2

# Versions of the change log kept; a daemon more changes behind than this reloads everything.
CHANGE_LOG_KEEP = 20_000


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
                found = self._db.execute("SELECT schema FROM pool_meta").fetchone()[0]
                if found > STORE_SCHEMA:
                    raise ConfigError("store", f"the PostgreSQL state database has layout {found}, newer than this "
                                      f"rgpu-poold's {STORE_SCHEMA}",
                                      "a newer rgpu wrote it; an older daemon would miss what newer ones record",
                                      "upgrade this pool daemon to the version the others run")
                if found < STORE_SCHEMA:
                    self._db.execute("UPDATE pool_meta SET schema = %s", (STORE_SCHEMA,))
        except psycopg.Error as exc:
            raise ConfigError("store", "cannot open the PostgreSQL state database", _first_line(exc),
                              "check store_url (host, port, database, user, password) and that PostgreSQL runs") from None
        self._lock = threading.RLock()
        self._admission_lock = threading.Lock()
        self._admission_db: Any = None       # its own connection: the pass may take seconds
        self._in_transaction = False
        self._wrote = False   # in the open transaction: a change that others must catch up with
        self._touched: set[tuple[str, str]] = set()   # in the open transaction: (kind, key) changed
        self._queued: list[tuple[str, tuple[Any, ...]]] = []   # in the open transaction: writes to send
        self.change_log_keep, self.prune_every = CHANGE_LOG_KEEP, 1000

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
                raise _unreachable(exc) from None

    def close(self) -> None:
        self._db.close()
        if self._admission_db is not None:
            self._admission_db.close()

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Held for one admission pass, by one daemon (and one thread) at a time. Should the
        connection break meanwhile, PostgreSQL lets the lock go with it."""
        with self._admission_lock:
            db = self._admission_session()
            try:
                db.execute(f"SET lock_timeout = '{ADMISSION_WAIT_SECONDS}s'")
                db.execute("SELECT pg_advisory_lock(%s)", (ADMISSION_LOCK_KEY,))
            except self._psycopg.errors.LockNotAvailable:
                raise Unavailable("store", f"another pool daemon has held the admission lock for over "
                                  f"{ADMISSION_WAIT_SECONDS} s", "its admission pass is stuck (Slurm commands hanging?)",
                                  "check the other rgpu-poold's log; this daemon tries again at its next pass") from None
            except self._psycopg.OperationalError as exc:
                raise _unreachable(exc) from None
            try:
                yield
            finally:
                try:
                    db.execute("SELECT pg_advisory_unlock(%s)", (ADMISSION_LOCK_KEY,))
                except self._psycopg.Error:
                    db.close()           # closing the session lets the lock go

    def _admission_session(self) -> Any:
        if self._admission_db is None or self._admission_db.closed or self._admission_db.broken:
            try:
                self._admission_db = self._connect()
            except self._psycopg.OperationalError as exc:
                raise _unreachable(exc) from None
        return self._admission_db

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._session() as db:
            return db.execute(sql, params).fetchall()

    def _write(self, sql: str, params: tuple[Any, ...], touched: tuple[str, str] | None = None) -> None:
        with self._session() as db:
            if self._in_transaction:   # sent with the commit, in one round trip (transaction())
                self._queued.append((sql, params))
            else:
                db.execute(sql, params)
            self._wrote = True
            if touched is not None:
                self._touched.add(touched)

    # -- several daemons ---------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[StateVersion]:
        """One change: hold the pool-wide lock; the version seen before and after."""
        with self._lock:
            if self._in_transaction:   # nested: part of the open one
                yield StateVersion(None)
                return
            self._in_transaction, self._wrote, self._touched, self._queued = True, False, set(), []
            try:
                with self._session() as db:
                    # Two round trips. One: BEGIN, the lock, the version; each statement of a
                    # simple query takes its own snapshot (READ COMMITTED), so the version's shows
                    # every change committed before the lock was ours. Two: the writes, the change
                    # log and COMMIT in one pipeline.
                    begun = db.execute(f"BEGIN; SELECT pg_advisory_xact_lock({LOCK_KEY}); SELECT version FROM pool_meta")
                    try:
                        while begun.nextset():   # the last statement's result
                            pass
                        state = StateVersion(begun.fetchone()[0])
                        yield state
                        if self._wrote:   # only a change that wrote makes the other daemons catch up
                            state.after = self._commit_change(db)
                        else:
                            db.execute("COMMIT")
                    except BaseException:
                        if not db.broken and not db.closed:
                            with contextlib.suppress(self._psycopg.Error):
                                db.execute("ROLLBACK")
                        raise
            finally:
                self._in_transaction, self._queued = False, []

    def _commit_change(self, db: Any) -> int:
        """Send the change's writes, bump the version and log what the change touched under it, and
        commit: one round trip (a pipeline). Returns the new version."""
        touched = sorted(self._touched) or [("all", "")]   # a write that named nothing: catch up fully
        with db.pipeline():
            for sql, params in self._queued:
                db.execute(sql, params)
            logged = db.execute(
                "WITH bumped AS (UPDATE pool_meta SET version = version + 1 RETURNING version) "
                "INSERT INTO pool_changes(version, kind, key) SELECT bumped.version, t.kind, t.key "
                "FROM bumped, unnest(%s::text[], %s::text[]) AS t(kind, key) RETURNING version",
                ([kind for kind, _ in touched], [key for _, key in touched]))
            db.execute("COMMIT")
        version: int = logged.fetchone()[0]
        if version % self.prune_every == 0 and version > self.change_log_keep:   # now and then, forget old ones
            with db.transaction():   # deletion and mark together: a catch-up sees both or neither
                db.execute("DELETE FROM pool_changes WHERE version <= %s", (version - self.change_log_keep,))
                db.execute("UPDATE pool_meta SET pruned = GREATEST(pruned, %s)", (version - self.change_log_keep,))
        return version

    def changes_since(self, version: int) -> list[tuple[str, str]] | None:
        """(kind, key) of every change after `version` ("lease"/job key, "server"/address,
        "quota"/"", "all"/""), or None when the log no longer reaches back that far."""
        rows = self._rows("SELECT 'pruned', '' FROM pool_meta WHERE pruned > %s UNION ALL "
                          "SELECT DISTINCT kind, key FROM pool_changes WHERE version > %s", (version, version))
        return None if any(kind == "pruned" for kind, _ in rows) else rows

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

    def load_leases_named(self, job_keys: list[str]) -> list[LeaseRecord]:
        rows = self._rows('SELECT job_key, "user", account, created, expires, slices_json FROM leases '
                          "WHERE job_key = ANY(%s)", (job_keys,))
        return [LeaseRecord(job_key=k, user=u, account=a, created_unix=c, expires_unix=e,
                            slices=tuple(SliceRecord(**s) for s in json.loads(sj)))
                for k, u, a, c, e, sj in rows]

    def load_servers_named(self, addresses: list[str]) -> list[tuple[ServerInfo, bool]]:
        return [(server_from_json(info), bool(drained))
                for info, drained in self._rows("SELECT info_json, drained FROM servers WHERE address = ANY(%s)",
                                                (addresses,))]

    # -- usage reports, shared (not versioned: like heartbeats, they change all the time) --------
    def save_slice_usage(self, rows: list[tuple[str, int, SliceUsageRecord]]) -> None:
        if not rows:
            return
        with self._session() as db, db.cursor() as cursor:
            cursor.executemany(usage_upsert("%s"), usage_rows(rows))

    def load_slice_usage(self) -> dict[tuple[str, int], SliceUsageRecord]:
        return {(key, number): SliceUsageRecord(sessions, busy, high, used, active, calls)
                for key, number, sessions, busy, high, used, active, calls in self._rows(
                    f"SELECT job_key, slice, {USAGE_COLUMNS} FROM slice_usage")}

    def save_server_report(self, address: str, report: bytes, received: float) -> None:
        with self._session() as db, db.cursor() as cursor:
            cursor.execute(REPORT_UPSERT, (address, report, received))

    def load_server_reports(self) -> dict[str, bytes]:
        return {address: bytes(report) for address, report in self._rows("SELECT address, report FROM server_reports")}

    def load_quotas(self) -> list[QuotaRecord]:
        return [QuotaRecord(kind, name, limit)
                for kind, name, limit in self._rows("SELECT kind, name, limit_units FROM quotas")]

    # -- changes -----------------------------------------------------------------------------
    def upsert_server(self, server: ServerInfo, registered: float) -> None:
        self._write(
            "INSERT INTO servers(address, info_json, drained, registered, heartbeat) VALUES (%s, %s, FALSE, %s, %s) "
            "ON CONFLICT(address) DO UPDATE SET info_json=excluded.info_json, registered=excluded.registered, "
            "heartbeat=GREATEST(servers.heartbeat, excluded.heartbeat)",
            (server.address, json.dumps(asdict(server)), registered, registered), ("server", server.address))

    def set_drained(self, address: str, drained: bool) -> None:
        self._write("UPDATE servers SET drained=%s WHERE address=%s", (drained, address), ("server", address))

    def delete_server(self, address: str) -> None:
        self._write("DELETE FROM servers WHERE address=%s", (address,), ("server", address))

    def insert_lease(self, lease: LeaseRecord) -> None:
        self._write(
            'INSERT INTO leases(job_key, "user", account, created, expires, slices_json) VALUES (%s, %s, %s, %s, %s, %s)',
            (lease.job_key, lease.user, lease.account, lease.created_unix, lease.expires_unix,
             json.dumps([vars(s) for s in lease.slices])), ("lease", lease.job_key))

    def set_lease_expiry(self, job_key: str, expires: float) -> None:
        self._write("UPDATE leases SET expires=%s WHERE job_key=%s", (expires, job_key), ("lease", job_key))

    def delete_lease(self, job_key: str) -> None:
        self._write("DELETE FROM leases WHERE job_key=%s", (job_key,), ("lease", job_key))

    def end_lease(self, lease: LeaseRecord, ended: float, busy_seconds: float = 0.0, how: str = "") -> None:
        # One statement (atomic by itself, and one round trip): the lease, its usage, its history row.
        self._write(
            "WITH gone AS (DELETE FROM leases WHERE job_key=%s), used AS (DELETE FROM slice_usage WHERE job_key=%s) "
            'INSERT INTO lease_history(job_key, "user", account, units, created, ended, busy_seconds, how) '
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (lease.job_key, lease.job_key, lease.job_key, lease.user, lease.account, lease.units, lease.created_unix,
             ended, busy_seconds, how), ("lease", lease.job_key))

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

    def prune_history(self, ended_before: float | None, max_rows: int, limit: int) -> int:
        """As Store.prune_history: at most `limit` of the oldest ended leases, by age, then by count."""
        with self._session() as db:
            gone = 0
            if ended_before is not None:
                gone = db.execute("DELETE FROM lease_history WHERE ctid IN (SELECT ctid FROM lease_history "
                                  "WHERE ended < %s ORDER BY ended LIMIT %s)", (ended_before, limit)).rowcount
            if max_rows and gone < limit:
                excess = db.execute("SELECT count(*) FROM lease_history").fetchone()[0] - max_rows
                if excess > 0:
                    gone += db.execute("DELETE FROM lease_history WHERE ctid IN (SELECT ctid FROM lease_history "
                                       "ORDER BY ended LIMIT %s)", (min(excess, limit - gone),)).rowcount
            return gone

    def spend_web_nonce(self, nonce: str, expires: float, now: float) -> bool:
        """Record `nonce` as used up until `expires`; False when it was already (any daemon)."""
        with self._session() as db:
            db.execute("DELETE FROM web_spent WHERE expires <= %s", (now,))
            return db.execute("INSERT INTO web_spent(nonce, expires) VALUES (%s, %s) ON CONFLICT (nonce) DO NOTHING",
                              (nonce, expires)).rowcount == 1

    def web_nonce_spent(self, nonce: str) -> bool:
        return bool(self._rows("SELECT 1 FROM web_spent WHERE nonce = %s", (nonce,)))

    def set_quota(self, quota: QuotaRecord) -> None:
        self._write("INSERT INTO quotas(kind, name, limit_units) VALUES (%s, %s, %s) "
                    "ON CONFLICT(kind, name) DO UPDATE SET limit_units=excluded.limit_units",
                    (quota.kind, quota.name, quota.limit_units), ("quota", ""))

    def delete_quota(self, kind: str, name: str) -> None:
        self._write("DELETE FROM quotas WHERE kind=%s AND name=%s", (kind, name), ("quota", ""))


def _unreachable(exc: BaseException) -> Unavailable:
    return Unavailable("store", "PostgreSQL is unreachable", _first_line(exc),
                       "check that PostgreSQL runs and store_url; the pool reconnects by itself")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
