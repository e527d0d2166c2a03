"""What the pool remembers about its callers between calls, to refuse two kinds of abuse:

- a replayed credential: each credential's nonce is good for one call (auth.py);
- a dispatcher address taken over by another host: an address is bound to the IP that registered
  it while that server is not down (daemon.py).

One rgpu-poold process keeps both in memory (`MemoryCallGuards`). The processes of one
`rgpu-poold --processes N` share them through a small SQLite file beside the state file
(`SharedCallGuards`): the kernel hands each new connection to any of the processes, so a nonce or
a binding one process saw must hold in all of them. Neither needs to survive a crash of the whole
group: credentials made before a pool process started are refused anyway, and bindings are made
again by the next registration, as after a restart of one process.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from rgpu.errors import ConfigError
from rgpu.filelock import held

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
        with self._lock, held(self._lock_fd):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT ip FROM registrars WHERE address = ?", (address,)).fetchone()
                conflict, bind = _decide(row[0] if row else None, peer, live, registering)
                if bind:
                    count = self._db.execute("SELECT count(*) FROM registrars").fetchone()[0]
                    if count > MAX_UNKNOWN_BINDINGS:
                        kept = [(a,) for a in known]
                        self._db.execute("CREATE TEMP TABLE IF NOT EXISTS known(address TEXT PRIMARY KEY)")
                        self._db.execute("DELETE FROM known")
                        self._db.executemany("INSERT OR IGNORE INTO known(address) VALUES (?)", kept)
                        self._db.execute("DELETE FROM registrars WHERE address NOT IN (SELECT address FROM known)")
                    self._db.execute("INSERT INTO registrars(address, ip) VALUES (?, ?) "
                                     "ON CONFLICT(address) DO UPDATE SET ip = excluded.ip", (address[:300], peer))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return conflict

