"""Replay and registrar guards (remoting/pool/call_guards.py): one process's, in memory; those the
processes of one `rgpu-poold --processes N` share through a real SQLite file (two instances on one
file stand for two processes); those several daemons share in a real PostgreSQL."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.errors import ConfigError
from rgpu.remoting.pool import call_guards
from rgpu.remoting.pool.call_guards import CallGuards, MemoryCallGuards, PostgresCallGuards, SharedCallGuards
from tests.postgres import Postgres, server_bin

WINDOW = 300.0


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    if server_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    pytest.importorskip("psycopg")
    server = Postgres().start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "shared", pytest.param("postgres", marks=pytest.mark.integration)])
def two_views(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[CallGuards, CallGuards]]:
    """Two views of one pool's guards: the same object (one process), two processes' instances on
    one file, or two daemons' on one PostgreSQL (a real one on loopback, emptied for each test)."""
    if request.param == "memory":
        one = MemoryCallGuards()
        yield one, one
        return
    if request.param == "postgres":
        url = request.getfixturevalue("postgres").url
        a, b = PostgresCallGuards(url), PostgresCallGuards(url)
        a._db.execute("TRUNCATE pool_nonces, pool_registrars")   # type: ignore[attr-defined]
    else:
        a, b = SharedCallGuards(tmp_path / "pool.db.calls"), SharedCallGuards(tmp_path / "pool.db.calls")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_nonce_is_good_for_one_call_in_any_process(two_views: tuple[CallGuards, CallGuards]) -> None:
    a, b = two_views
    assert a.first_use("n1", 1000.0, WINDOW)
    assert not b.first_use("n1", 1001.0, WINDOW)
    assert not a.first_use("n1", 1002.0, WINDOW)
    assert b.first_use("n2", 1002.0, WINDOW)
    # Past the window the credential's own time check refuses it; the nonce is forgotten.
    assert a.first_use("n1", 1000.0 + WINDOW + 1, WINDOW)


def test_old_nonces_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_guards, "PRUNE_EVERY", 10)
    guards = SharedCallGuards(tmp_path / "pool.db.calls")
    try:
        for n in range(25):
            assert guards.first_use(f"n{n}", 1000.0 + n * 100, WINDOW)
        with sqlite3.connect(tmp_path / "pool.db.calls") as db:
            oldest = db.execute("SELECT min(unix) FROM nonces").fetchone()[0]
        assert oldest == 1000.0 + 19 * 100 - WINDOW   # pruned at the 20th call (n=19)
    finally:
        guards.close()


def test_a_live_servers_address_stays_with_the_host_that_registered_it(
        two_views: tuple[CallGuards, CallGuards]) -> None:
    a, b = two_views
    known = {"10.0.0.5:7100"}
    assert a.claim("10.0.0.5:7100", "10.0.0.5", live=False, registering=True, known=known) is None
    # Another host, through either process: refused while the server is live, nothing rebound.
    assert b.claim("10.0.0.5:7100", "10.9.9.9", live=True, registering=True, known=known) == "10.0.0.5"
    assert a.claim("10.0.0.5:7100", "10.9.9.9", live=True, registering=False, known=known) == "10.0.0.5"
    assert b.claim("10.0.0.5:7100", "10.0.0.5", live=True, registering=False, known=known) is None
    # Down: a new host may take the address, and then holds it.
    assert b.claim("10.0.0.5:7100", "10.9.9.9", live=False, registering=True, known=known) is None
    assert a.claim("10.0.0.5:7100", "10.0.0.5", live=True, registering=False, known=known) == "10.9.9.9"


def test_bindings_of_unknown_addresses_are_bounded(two_views: tuple[CallGuards, CallGuards],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_guards, "MAX_UNKNOWN_BINDINGS", 3)
    a, b = two_views
    known = {"kept:1"}
    a.claim("kept:1", "10.0.0.1", live=False, registering=True, known=known)
    for n in range(20):   # registrations the pool refused leave bindings of addresses it does not know
        (a if n % 2 else b).claim(f"junk:{n}", "10.6.6.6", live=False, registering=True, known=known)
    assert b.claim("kept:1", "10.6.6.6", live=True, registering=True, known=known) == "10.0.0.1"
    if isinstance(a, SharedCallGuards):
        with sqlite3.connect(a.path) as db:
            assert db.execute("SELECT count(*) FROM registrars").fetchone()[0] <= 5
    elif isinstance(a, PostgresCallGuards):
        assert a._db.execute("SELECT count(*) FROM pool_registrars").fetchone()[0] <= 5   # type: ignore[attr-defined]
    else:
        assert len(a._registrars) <= 5   # type: ignore[attr-defined]


def test_a_damaged_guard_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "pool.db.calls"
    path.write_bytes(b"not a database, " * 100)
    with pytest.raises(ConfigError) as info:
        SharedCallGuards(path)
    assert "cannot open" in str(info.value) and "\n" not in str(info.value)
