"""What the pool remembers about its callers between calls, to refuse two kinds of abuse:

- a replayed credential: each credential's nonce is good for one call (auth.py);
- a dispatcher address taken over by another host: an address is bound to the IP that registered
  it while that server is not down (daemon.py).

One rgpu-poold process keeps both in memory (`MemoryCallGuards`). The processes of one
`rgpu-poold --processes N` share them through a small SQLite file beside the state file
(`SharedCallGuards`): the kernel hands each new connection to any of the processes, so a nonce or
a binding one process saw must hold in all of them. Several daemons on one PostgreSQL share them
in two tables there (`PostgresCallGuards`), for the same reason: a client fails over to any of
them. None needs to survive a crash: credentials made before a pool process started are refused
anyway, and bindings are made again by the next registration, as after a restart.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

from rgpu.errors import ConfigError
from rgpu.filelock import held

T = TypeVar("T")

# Registrar bindings kept for addresses the pool does not know (refused registrations).
MAX_UNKNOWN_BINDINGS = 8192
# Nonces are pruned once per this many calls (those older than the credential window).
PRUNE_EVERY = 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nonces (
    nonce TEXT PRIMARY KEY,
    unix  REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS nonces_unix ON nonces(unix);
CREATE TABLE IF NOT EXISTS registrars (
    address TEXT PRIMARY KEY,
    ip      TEXT NOT NULL
);
"""


class GuardError(Exception):
    """The shared guards could not be read or written (a full disk, PostgreSQL away): callers fail
    closed, since an unrecorded nonce could be replayed."""


class CallGuards(Protocol):
    def first_use(self, nonce: str, now: float, window: float) -> bool:
        """Record `nonce`; False when it was seen within `window` seconds (a replay)."""

    def claim(self, address: str, peer: str, live: bool, registering: bool, known: set[str]) -> str | None:
        """Bind `address` to `peer` (on registration, or when unbound); returns the IP that holds it
        when another host does and its server is `live` (the call is then refused, nothing bound).
        `known`: the addresses the pool has, for pruning bindings of refused registrations."""

    def close(self) -> None: ...


def _decide(bound: str | None, peer: str, live: bool, registering: bool) -> tuple[str | None, bool]:
    """(conflicting IP or None, whether to bind) for a registrar check."""
    if bound is not None and bound != peer and live:
        return bound, False
    return None, registering or bound is None


class MemoryCallGuards:
    """One process's guards, in memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nonces: OrderedDict[str, float] = OrderedDict()
        self._registrars: dict[str, str] = {}

    def first_use(self, nonce: str, now: float, window: float) -> bool:
        with self._lock:
            while self._nonces and next(iter(self._nonces.values())) < now - window:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                return False
            self._nonces[nonce] = now
            return True

    def claim(self, address: str, peer: str, live: bool, registering: bool, known: set[str]) -> str | None:
        with self._lock:
            conflict, bind = _decide(self._registrars.get(address), peer, live, registering)
            if bind:
                if len(self._registrars) > MAX_UNKNOWN_BINDINGS:
                    self._registrars = {a: ip for a, ip in self._registrars.items() if a in known}
                self._registrars[address[:300]] = peer
            return conflict

    def close(self) -> None:
        pass


class SharedCallGuards:
    """The guards of the processes of one rgpu-poold, in `path` (SQLite, WAL, no fsync: see the
    module's text for why losing it in a crash is safe). Each check is one short write under a
    lock file (taken before SQLite's own lock, whose waiters sleep in millisecond steps)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError("poold", f"cannot open {self.path}.lock", exc.strerror or str(exc),
                              "check the state directory's permissions") from None
        try:
            with held(self._lock_fd):
                fresh = not self.path.exists()
                self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
                if fresh:
                    os.chmod(self.path, 0o600)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=OFF")
                self._db.execute("PRAGMA busy_timeout=5000")
                self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            os.close(self._lock_fd)
            raise ConfigError("poold", f"cannot open {self.path}", str(exc),
                              "move the damaged file aside (it holds nothing the pool needs after a restart)") from None
        self._lock = threading.Lock()
        self._calls = 0

    def close(self) -> None:
        self._db.close()
        os.close(self._lock_fd)

    def first_use(self, nonce: str, now: float, window: float) -> bool:
        try:
            return self._first_use(nonce, now, window)
        except sqlite3.Error as exc:
            raise GuardError(f"{self.path}: {exc}") from None

    def _first_use(self, nonce: str, now: float, window: float) -> bool:
        with self._lock, held(self._lock_fd):
            self._calls += 1
            if self._calls % PRUNE_EVERY == 0:
                self._db.execute("DELETE FROM nonces WHERE unix < ?", (now - window,))
            try:
                self._db.execute("INSERT INTO nonces(nonce, unix) VALUES (?, ?)", (nonce, now))
            except sqlite3.IntegrityError:
                old = self._db.execute("SELECT unix FROM nonces WHERE nonce = ?", (nonce,)).fetchone()
                if old is not None and old[0] >= now - window:
                    return False
                self._db.execute("UPDATE nonces SET unix = ? WHERE nonce = ?", (now, nonce))
            return True

    def claim(self, address: str, peer: str, live: bool, registering: bool, known: set[str]) -> str | None:
        try:
            return self._claim(address, peer, live, registering, known)
        except sqlite3.Error as exc:
            raise GuardError(f"{self.path}: {exc}") from None

    def _claim(self, address: str, peer: str, live: bool, registering: bool, known: set[str]) -> str | None:
        with self._lock, held(self._lock_fd):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT ip FROM registrars WHERE address = ?", (address,)).fetchone()
                conflict, bind = _decide(row[0] if row else None, peer, live, registering)
                if bind:
                    count = self._db.execute("SELECT count(*) FROM registrars").fetchone()[0]
                    if count > MAX_UNKNOWN_BINDINGS:
                        stale = [(a,) for (a,) in self._db.execute("SELECT address FROM registrars") if a not in known]
                        self._db.executemany("DELETE FROM registrars WHERE address = ?", stale)
                    self._db.execute("INSERT INTO registrars(address, ip) VALUES (?, ?) "
                                     "ON CONFLICT(address) DO UPDATE SET ip = excluded.ip", (address[:300], peer))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return conflict


_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS pool_nonces (
    nonce TEXT PRIMARY KEY,
    unix  DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS pool_nonces_unix ON pool_nonces(unix);
CREATE TABLE IF NOT EXISTS pool_registrars (
    address TEXT PRIMARY KEY,
    ip      TEXT NOT NULL
);
"""
_PG_REGISTRARS_LOCK = 0x72677076   # one registrar check at a time across daemons ("rgpv")


class PostgresCallGuards:
    """The guards of several rgpu-poold on one PostgreSQL, on a connection of their own (a nonce
    check must not wait behind a change of the pool's state). One round trip per call; commits do
    not wait for the WAL flush (synchronous_commit off: see the module's text)."""

    def __init__(self, url: str) -> None:
        import psycopg   # present: the store opened the same URL first
        self._psycopg, self._url = psycopg, url
        self._lock = threading.Lock()
        self._calls = 0
        try:
            self._db = self._connect()
            self._db.execute(_PG_SCHEMA)
        except psycopg.Error as exc:
            raise ConfigError("poold", "cannot set up the call guards' tables in PostgreSQL", _first_line(exc),
                              "check store_url and that its user may create tables") from None

    def _connect(self) -> Any:
        db = self._psycopg.connect(self._url, autocommit=True, connect_timeout=5)
        db.execute("SET synchronous_commit = off")
        return db

    def _session(self) -> Any:
        if self._db.closed or self._db.broken:   # PostgreSQL restarted or failed over
            self._db = self._connect()
        return self._db

    def close(self) -> None:
        self._db.close()

    def _retried(self, work: Callable[[Any], T]) -> T:
        """work(connection), once more on a new connection when the first try finds the old one
        broken (PostgreSQL restarted or failed over since the last call)."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    return work(self._session())
                except self._psycopg.OperationalError as exc:
                    if attempt == 2 or not self._db.broken:
                        raise GuardError(f"PostgreSQL: {_first_line(exc)}") from None
                except self._psycopg.Error as exc:
                    raise GuardError(f"PostgreSQL: {_first_line(exc)}") from None
            raise AssertionError("unreachable")

    def first_use(self, nonce: str, now: float, window: float) -> bool:
        def record(db: Any) -> bool:
            self._calls += 1
            if self._calls % PRUNE_EVERY == 0:
                db.execute("DELETE FROM pool_nonces WHERE unix < %s", (now - window,))
            # A row comes back when the nonce is new, or was last seen before the window.
            return db.execute(
                "INSERT INTO pool_nonces(nonce, unix) VALUES (%s, %s) ON CONFLICT (nonce) DO UPDATE "
                "SET unix = EXCLUDED.unix WHERE pool_nonces.unix < %s RETURNING 1",
                (nonce, now, now - window)).fetchone() is not None
        return self._retried(record)

    def claim(self, address: str, peer: str, live: bool, registering: bool, known: set[str]) -> str | None:
        def decide(db: Any) -> str | None:
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_REGISTRARS_LOCK,))
                row = db.execute("SELECT ip FROM pool_registrars WHERE address = %s", (address,)).fetchone()
                conflict, bind = _decide(row[0] if row else None, peer, live, registering)
                if bind:
                    count = db.execute("SELECT count(*) FROM pool_registrars").fetchone()[0]
                    if count > MAX_UNKNOWN_BINDINGS:
                        db.execute("DELETE FROM pool_registrars WHERE NOT (address = ANY(%s))", (sorted(known),))
                    db.execute("INSERT INTO pool_registrars(address, ip) VALUES (%s, %s) ON CONFLICT (address) "
                               "DO UPDATE SET ip = EXCLUDED.ip", (address[:300], peer))
            return conflict
        return self._retried(decide)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
