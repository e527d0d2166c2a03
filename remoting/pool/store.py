"""Durable pool state in SQLite (WAL): servers, leases and quotas.

Every mutation is one transaction committed before the pool answers, so `kill -9` at any moment
loses nothing that a caller was told had happened. WAL with synchronous=NORMAL survives a process
crash (what `kill -9` is); set synchronous=FULL through `durability="full"` to survive power loss
too, at the cost of an fsync per change. Tokens are not stored: they are re-signed on demand, so
the database holds no secret.

One file serves one pool: either one process (the default), or the processes of one
`rgpu-poold --processes N` on one host (`shared=True`), which work as several daemons on one
PostgreSQL do (store_pg.py): every change takes the file's write lock (BEGIN IMMEDIATE), reads the
state's version, and logs which leases, servers and quotas it touched under the next version, so
each process catches up by reading those rows only; heartbeats and usage reports are stored so
every process sees the ones another received.
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
from rgpu.filelock import held
from rgpu.model import GpuInfo, LeaseRecord, QuotaRecord, ServerInfo, SliceRecord
from rgpu.remoting.pool import disk_note
from rgpu.remoting.pool.accounting import SliceUsageRecord

# 1: servers, leases, history, quotas. 2: the change log, heartbeats and usage reports of shared
# mode (tables added in place; a file of layout 1 keeps its leases). 3: web_spent (dashboard
# credentials spent or logged out).
SCHEMA_VERSION = 3
# Versions of the change log kept (shared mode); a process further behind reloads everything.
CHANGE_LOG_KEEP = 20_000
USAGE_COLUMNS = "sessions, busy_seconds, memory_high_water_bytes, memory_used_bytes, last_active_unix, calls"


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
CREATE TABLE IF NOT EXISTS pool_meta (
    one     INTEGER PRIMARY KEY CHECK (one = 1),
    version INTEGER NOT NULL,
    pruned  INTEGER NOT NULL DEFAULT 0
);
INSERT OR IGNORE INTO pool_meta(one, version, pruned) VALUES (1, 0, 0);
CREATE TABLE IF NOT EXISTS pool_changes (
    version INTEGER NOT NULL,
    kind    TEXT NOT NULL,
    key     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS pool_changes_version ON pool_changes(version);
CREATE TABLE IF NOT EXISTS heartbeats (
    address TEXT PRIMARY KEY,
    unix    REAL NOT NULL
);
-- Dashboard credentials used up, until they expire: login links exchanged and sessions logged out
-- (kept here, not in memory, so a pool restart does not make them good again).
CREATE TABLE IF NOT EXISTS web_spent (
    nonce   TEXT PRIMARY KEY,
    expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS slice_usage (
    job_key          TEXT NOT NULL,
    slice            INTEGER NOT NULL,
    sessions         INTEGER NOT NULL,
    busy_seconds     REAL NOT NULL,
    memory_high_water_bytes INTEGER NOT NULL,
    memory_used_bytes INTEGER NOT NULL,
    last_active_unix REAL NOT NULL,
    calls            INTEGER NOT NULL,
    PRIMARY KEY (job_key, slice)
);
-- Each dispatcher's last report of its GPUs (readings, faults, slices' compute use: a serialized
-- pb.HeartbeatRequest), shared by the processes of one rgpu-poold (telemetry.py).
CREATE TABLE IF NOT EXISTS server_reports (
    address  TEXT PRIMARY KEY,
    report   BLOB NOT NULL,
    received REAL NOT NULL
);
"""


@dataclass
class StateVersion:
    """The shared state's version when a change began (None: this store has one daemon, never
    reload) and after it (set when the change commits)."""

    before: int | None
    after: int | None = None


class Store:
    def __init__(self, path: str | os.PathLike[str], durability: str = "normal", shared: bool = False) -> None:
        self.path = Path(path)
        self.shared = shared
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
            if shared:   # another process's commit empties this connection's page cache: re-read from memory
                self._db.execute("PRAGMA mmap_size=268435456")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError("store", f"{self.path} has schema version {version}",
                                  f"this rgpu-poold understands up to {SCHEMA_VERSION}",
                                  "upgrade rgpu-poold, or point --state at another file")
            if version < SCHEMA_VERSION or fresh:   # no write when up to date: a full disk still starts
                self._db.executescript(_SCHEMA)
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.DatabaseError as exc:
            if disk_note.read_only(self.path):
                raise ConfigError("store", f"cannot open state database {self.path}",
                                  f"{exc}: {disk_note.describe(self.path)}",
                                  "point --state at a file on a writable file system of the pool host") from None
            raise ConfigError("store", f"cannot open state database {self.path}", str(exc),
                              "check the path and permissions, or move a damaged file aside") from None
        except OSError as exc:   # its folder cannot be made or read (a file in the way, a read-only mount)
            raise ConfigError("store", f"cannot open state database {self.path}", exc.strerror or str(exc),
                              "point --state at a file in a writable folder of the pool host") from None
        self._lock = threading.RLock()
        self._lock_fd: int | None = None
        self._admission_fd: int | None = None
        self._admission_lock = threading.Lock()
        if shared:
            self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._admission_fd = os.open(f"{self.path}.admission.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._in_transaction = False
        self._wrote = False                           # in the open transaction: something changed
        self._touched: set[tuple[str, str]] = set()   # in the open transaction: (kind, key) changed
        self.change_log_keep, self.prune_every = CHANGE_LOG_KEEP, 1000

    def close(self) -> None:
        self._db.close()
        for name in ("_lock_fd", "_admission_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Held for one admission pass (the Slurm reconciler's release of held jobs): by one thread,
        and with shared=True by one process of the pool at a time (a lock file beside the state,
        apart from the writer lock, so allocations go on meanwhile)."""
        with self._admission_lock:
            if self._admission_fd is None:
                yield
                return
            with held(self._admission_fd):
                yield

    def _rows(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        with self._lock:   # never in the middle of another thread's transaction on this connection
            return self._db.execute(sql, params).fetchall()

    def _failed(self, exc: sqlite3.Error) -> StoreError:
        # A full disk, a read-only or vanished file, a lock held too long: the change is not made.
        disk = disk_note.describe(self.path)
        return StoreError("store", f"cannot save the pool's state in {self.path}",
                          f"{exc}: {disk}" if disk else str(exc),
                          "free space on that disk or fix the file's permissions; nothing was changed")

    def _abort(self, exc: BaseException) -> None:
        """After a transaction failed: roll back what is left of it (a failed COMMIT on a full disk
        may have rolled back already); a database error is raised as the store's one-line error."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise self._failed(exc) from None

    # -- shared by the processes of one daemon (shared=True), or one process's alone ---------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[StateVersion]:
        """One change: with shared=True, under the file's write lock, with the version seen before
        and after (PoolCore catches up when another process changed the state in between)."""
        if not self.shared:
            yield StateVersion(None)
            return
        with self._lock:
            if self._in_transaction:   # nested: part of the open one
                yield StateVersion(None)
                return
            self._in_transaction, self._wrote, self._touched = True, False, set()
            try:
                with self._writer():
                    yield from self._change()
            finally:
                self._in_transaction = False

    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        """The processes' writer lock: a lock file taken before SQLite's own write lock, because a
        process that finds SQLite's lock held sleeps in steps of milliseconds, while one waiting
        on the file lock wakes as soon as it is free."""
        if self._lock_fd is None:
            yield
            return
        with held(self._lock_fd):
            yield

    def _change(self) -> Iterator[StateVersion]:
        """The body of one shared transaction (under the writer lock)."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
            state = StateVersion(self._db.execute("SELECT version FROM pool_meta").fetchone()[0])
        except sqlite3.Error as exc:
            raise self._failed(exc) from None
        try:
            yield state
            if self._wrote:
                state.after = self._log_change(state.before or 0)
            self._db.execute("COMMIT")
        except BaseException as exc:
            self._abort(exc)
            raise
        if state.after is not None and state.after % self.prune_every == 0:
            self._prune(state.after)

    def _log_change(self, before: int) -> int:
        """Bump the version and log what the open transaction touched under it."""
        after = before + 1
        touched = sorted(self._touched) or [("all", "")]   # a write that named nothing: catch up fully
        self._db.execute("UPDATE pool_meta SET version = ?", (after,))
        self._db.executemany("INSERT INTO pool_changes(version, kind, key) VALUES (?, ?, ?)",
                             [(after, kind, key) for kind, key in touched])
        return after

    def _prune(self, version: int) -> None:
        if version <= self.change_log_keep:
            return
        with self._lock, contextlib.suppress(sqlite3.Error):   # a later prune catches up
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM pool_changes WHERE version <= ?", (version - self.change_log_keep,))
            self._db.execute("UPDATE pool_meta SET pruned = max(pruned, ?)", (version - self.change_log_keep,))
            self._db.execute("COMMIT")

    def version(self) -> int | None:
        if not self.shared:
            return None
        return int(self._rows("SELECT version FROM pool_meta")[0][0])  # type: ignore[call-overload]

    def heartbeat(self, address: str, now: float) -> None:
        """Shared: stored (not a change others reload for). Alone: the daemon's memory has it."""
        if self.shared:
            with self._lock, self._writer():
                self._db.execute("INSERT INTO heartbeats(address, unix) VALUES (?, ?) ON CONFLICT(address) "
                                 "DO UPDATE SET unix = max(unix, excluded.unix)", (address, now))

    def load_heartbeats(self) -> dict[str, float]:
        if not self.shared:
            return {}
        return {str(a): float(u) for a, u in self._rows("SELECT address, unix FROM heartbeats")}  # type: ignore[arg-type]

    def changes_since(self, version: int) -> list[tuple[str, str]] | None:
        """(kind, key) of every change after `version`, or None when the log no longer reaches back."""
        rows = self._rows("SELECT 'pruned', '' FROM pool_meta WHERE pruned > ? UNION ALL "
                          "SELECT DISTINCT kind, key FROM pool_changes WHERE version > ?", (version, version))
        return None if any(kind == "pruned" for kind, _ in rows) else [(str(k), str(v)) for k, v in rows]

    def load_leases_named(self, job_keys: list[str]) -> list[LeaseRecord]:
        wanted = set(job_keys)
        if not self.shared or len(wanted) > 500:
            return [lease for lease in self.load_leases() if lease.job_key in wanted]
        marks = ",".join("?" * len(wanted))
        return _leases(self._rows("SELECT job_key, user, account, created, expires, slices_json FROM leases "
                                  f"WHERE job_key IN ({marks})", tuple(wanted)))

    def load_servers_named(self, addresses: list[str]) -> list[tuple[ServerInfo, bool]]:
        wanted = set(addresses)
        if not self.shared or len(wanted) > 500:
            return [(info, drained) for info, drained in self.load_servers() if info.address in wanted]
        marks = ",".join("?" * len(wanted))
        return [(server_from_json(str(info)), bool(drained)) for info, drained in
                self._rows(f"SELECT info_json, drained FROM servers WHERE address IN ({marks})", tuple(wanted))]

    def save_slice_usage(self, rows: list[tuple[str, int, SliceUsageRecord]]) -> None:
        """Shared: stored for the other processes. Alone: the daemon's memory has them."""
        if not self.shared or not rows:
            return
        with self._lock, self._writer():
            self._db.executemany(usage_upsert("?"), usage_rows(rows))

    def load_slice_usage(self) -> dict[tuple[str, int], SliceUsageRecord]:
        if not self.shared:
            return {}
        return {(str(key), int(number)): SliceUsageRecord(*values)  # type: ignore[arg-type,call-overload]
                for key, number, *values in self._rows(f"SELECT job_key, slice, {USAGE_COLUMNS} FROM slice_usage")}

    def save_server_report(self, address: str, report: bytes, received: float) -> None:
        """Shared: stored for the other processes. Alone: the daemon's memory has it."""
        if not self.shared:
            return
        with self._lock, self._writer():
            self._db.execute(REPORT_UPSERT.replace("%s", "?"), (address, report, received))

    def load_server_reports(self) -> dict[str, bytes]:
        if not self.shared:
            return {}
        return {str(a): bytes(r) for a, r in self._rows("SELECT address, report FROM server_reports")}  # type: ignore[call-overload]

    # -- loading ---------------------------------------------------------------------------
    def load_servers(self) -> list[tuple[ServerInfo, bool]]:
        rows = self._rows("SELECT info_json, drained FROM servers")
        return [(server_from_json(str(info)), bool(drained)) for info, drained in rows]

    def load_leases(self) -> list[LeaseRecord]:
        return _leases(self._rows("SELECT job_key, user, account, created, expires, slices_json FROM leases"))

    def load_quotas(self) -> list[QuotaRecord]:
        rows = self._rows("SELECT kind, name, limit_units FROM quotas")
        return [QuotaRecord(str(kind), str(name), int(limit)) for kind, name, limit in rows]  # type: ignore[call-overload]

    # -- changes (each one committed before it returns) -------------------------------------
    def _write(self, sql: str, params: tuple[object, ...], touched: tuple[str, str] | None = None) -> None:
        if self.shared and not self._in_transaction:
            with self.transaction():   # a change on its own: versioned like any other
                self._write(sql, params, touched)
            return
        with self._lock:
            try:
                self._db.execute(sql, params)
            except sqlite3.Error as exc:
                raise self._failed(exc) from None
            self._wrote = True
            if touched is not None:
                self._touched.add(touched)

    def upsert_server(self, server: ServerInfo, registered: float) -> None:
        self._write(
            "INSERT INTO servers(address, info_json, drained, registered) VALUES (?, ?, 0, ?) "
            "ON CONFLICT(address) DO UPDATE SET info_json=excluded.info_json, registered=excluded.registered",
            (server.address, json.dumps(asdict(server)), registered), ("server", server.address))

    def set_drained(self, address: str, drained: bool) -> None:
        self._write("UPDATE servers SET drained=? WHERE address=?", (int(drained), address), ("server", address))

    def delete_server(self, address: str) -> None:
        self._write("DELETE FROM servers WHERE address=?", (address,), ("server", address))

    def insert_lease(self, lease: LeaseRecord) -> None:
        self._write(
            "INSERT INTO leases(job_key, user, account, created, expires, slices_json) VALUES (?, ?, ?, ?, ?, ?)",
            (lease.job_key, lease.user, lease.account, lease.created_unix, lease.expires_unix,
             json.dumps([vars(s) for s in lease.slices])), ("lease", lease.job_key))

    def set_lease_expiry(self, job_key: str, expires: float) -> None:
        self._write("UPDATE leases SET expires=? WHERE job_key=?", (expires, job_key), ("lease", job_key))

    def delete_lease(self, job_key: str) -> None:
        self._write("DELETE FROM leases WHERE job_key=?", (job_key,), ("lease", job_key))

    def end_lease(self, lease: LeaseRecord, ended: float, busy_seconds: float = 0.0, how: str = "") -> None:
        """Delete a lease (and its usage reports) and record it in lease_history, in one transaction."""
        if self.shared:
            with self.transaction():
                self._write("DELETE FROM leases WHERE job_key=?", (lease.job_key,), ("lease", lease.job_key))
                self._write("DELETE FROM slice_usage WHERE job_key=?", (lease.job_key,))
                self._write("INSERT INTO lease_history(job_key, user, account, units, created, ended, busy_seconds, "
                            "how) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (lease.job_key, lease.user, lease.account,
                                                                     lease.units, lease.created_unix, ended,
                                                                     busy_seconds, how))
            return
        with self._lock:
            try:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM leases WHERE job_key=?", (lease.job_key,))
                self._db.execute(
                    "INSERT INTO lease_history(job_key, user, account, units, created, ended, busy_seconds, how) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (lease.job_key, lease.user, lease.account, lease.units, lease.created_unix, ended,
                     busy_seconds, how))
                self._db.execute("COMMIT")
            except BaseException as exc:
                self._abort(exc)
                raise

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

    def prune_history(self, ended_before: float | None, max_rows: int, limit: int) -> int:
        """Delete at most `limit` of the oldest ended leases: those ended before `ended_before`
        (None: none by age), then the oldest beyond `max_rows` (0: no cap). Returns how many."""
        try:
            with self._lock, self._writer():
                gone = 0
                if ended_before is not None:
                    gone = self._db.execute("DELETE FROM lease_history WHERE rowid IN (SELECT rowid FROM lease_history "
                                            "WHERE ended < ? ORDER BY ended LIMIT ?)", (ended_before, limit)).rowcount
                if max_rows and gone < limit:
                    excess = self._db.execute("SELECT count(*) FROM lease_history").fetchone()[0] - max_rows
                    if excess > 0:
                        gone += self._db.execute("DELETE FROM lease_history WHERE rowid IN (SELECT rowid FROM "
                                                 "lease_history ORDER BY ended LIMIT ?)",
                                                 (min(excess, limit - gone),)).rowcount
                return gone
        except sqlite3.Error as exc:
            raise self._failed(exc) from None

    # -- dashboard credentials spent (login links) or revoked (logged-out sessions) ------------
    def spend_web_nonce(self, nonce: str, expires: float, now: float) -> bool:
        """Record `nonce` as used up until `expires`; False when it was already."""
        try:
            with self._lock, self._writer():
                self._db.execute("DELETE FROM web_spent WHERE expires <= ?", (now,))
                return self._db.execute("INSERT INTO web_spent(nonce, expires) VALUES (?, ?) "
                                        "ON CONFLICT(nonce) DO NOTHING", (nonce, expires)).rowcount == 1
        except sqlite3.Error as exc:
            raise self._failed(exc) from None

    def web_nonce_spent(self, nonce: str) -> bool:
        try:
            return bool(self._rows("SELECT 1 FROM web_spent WHERE nonce = ?", (nonce,)))
        except sqlite3.Error as exc:
            raise self._failed(exc) from None

    def set_quota(self, quota: QuotaRecord) -> None:
        self._write("INSERT INTO quotas(kind, name, limit_units) VALUES (?, ?, ?) "
                    "ON CONFLICT(kind, name) DO UPDATE SET limit_units=excluded.limit_units",
                    (quota.kind, quota.name, quota.limit_units), ("quota", ""))

    def delete_quota(self, kind: str, name: str) -> None:
        self._write("DELETE FROM quotas WHERE kind=? AND name=?", (kind, name), ("quota", ""))


REPORT_UPSERT = ("INSERT INTO server_reports(address, report, received) VALUES (%s, %s, %s) "
                 "ON CONFLICT (address) DO UPDATE SET report=excluded.report, received=excluded.received")


def usage_upsert(mark: str) -> str:
    """The statement that stores one slice's usage report (`mark`: the driver's placeholder)."""
    return (f"INSERT INTO slice_usage(job_key, slice, {USAGE_COLUMNS}) VALUES ({', '.join([mark] * 8)}) "
            "ON CONFLICT (job_key, slice) DO UPDATE SET sessions=excluded.sessions, "
            "busy_seconds=excluded.busy_seconds, memory_high_water_bytes=excluded.memory_high_water_bytes, "
            "memory_used_bytes=excluded.memory_used_bytes, last_active_unix=excluded.last_active_unix, "
            "calls=excluded.calls")


def usage_rows(rows: list[tuple[str, int, SliceUsageRecord]]) -> list[tuple[object, ...]]:
    return [(key, number, u.sessions, u.busy_seconds, u.memory_high_water_bytes, u.memory_used_bytes,
             u.last_active_unix, u.calls) for key, number, u in rows]


def _leases(rows: list[tuple[object, ...]]) -> list[LeaseRecord]:
    return [LeaseRecord(job_key=str(k), user=str(u), account=str(a), created_unix=float(c),  # type: ignore[arg-type]
                        expires_unix=float(e), slices=tuple(SliceRecord(**s) for s in json.loads(str(sj))))  # type: ignore[arg-type]
            for k, u, a, c, e, sj in rows]


def server_from_json(text: str) -> ServerInfo:
    data = json.loads(text)
    data["gpus"] = tuple(GpuInfo(**g) for g in data["gpus"])
    return ServerInfo(**data)


class PoolStore(Protocol):
    """What PoolCore needs of a store: SQLite (Store, one daemon) or PostgreSQL (store_pg, several)."""

    def close(self) -> None: ...
    def transaction(self) -> contextlib.AbstractContextManager[StateVersion]: ...
    def admitting(self) -> contextlib.AbstractContextManager[None]: ...
    def version(self) -> int | None: ...
    def heartbeat(self, address: str, now: float) -> None: ...
    def load_heartbeats(self) -> dict[str, float]: ...
    def changes_since(self, version: int) -> list[tuple[str, str]] | None: ...
    def load_leases_named(self, job_keys: list[str]) -> list[LeaseRecord]: ...
    def load_servers_named(self, addresses: list[str]) -> list[tuple[ServerInfo, bool]]: ...
    def save_slice_usage(self, rows: list[tuple[str, int, SliceUsageRecord]]) -> None: ...
    def load_slice_usage(self) -> dict[tuple[str, int], SliceUsageRecord]: ...
    def save_server_report(self, address: str, report: bytes, received: float) -> None: ...
    def load_server_reports(self) -> dict[str, bytes]: ...
    def load_servers(self) -> list[tuple[ServerInfo, bool]]: ...
    def load_leases(self) -> list[LeaseRecord]: ...
    def load_quotas(self) -> list[QuotaRecord]: ...
    def upsert_server(self, server: ServerInfo, registered: float) -> None: ...
    def set_drained(self, address: str, drained: bool) -> None: ...
    def delete_server(self, address: str) -> None: ...
    def insert_lease(self, lease: LeaseRecord) -> None: ...
    def set_lease_expiry(self, job_key: str, expires: float) -> None: ...
    def delete_lease(self, job_key: str) -> None: ...
    def end_lease(self, lease: LeaseRecord, ended: float, busy_seconds: float = 0.0, how: str = "") -> None: ...
    def load_history(self, since: float, until: float) -> list[tuple[str, str, int, float, float, float]]: ...
    def set_quota(self, quota: QuotaRecord) -> None: ...
    def delete_quota(self, kind: str, name: str) -> None: ...
    def spend_web_nonce(self, nonce: str, expires: float, now: float) -> bool: ...
    def prune_history(self, ended_before: float | None, max_rows: int, limit: int) -> int: ...
    def web_nonce_spent(self, nonce: str) -> bool: ...
