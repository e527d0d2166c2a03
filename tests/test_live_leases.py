"""Which lease tokens a dispatcher honours (rgpu/live_leases.py), and the pool's list behind it
(PoolCore.live_slices, against a real SQLite file)."""

from __future__ import annotations

from pathlib import Path

from rgpu import tokens
from rgpu.live_leases import LiveLeases
from tests.poolcore_helpers import SECRET, Clock, make_core, req, server

SNAPSHOT = LiveLeases.of(1000.0, [("job-1", 0, 900.0), ("job-1", 1, 900.0)])


def test_a_listed_slice_is_live() -> None:
    assert not SNAPSHOT.revoked("job-1", 1, 900.0)


def test_a_slice_missing_from_the_list_was_released() -> None:
    assert SNAPSHOT.revoked("job-2", 0, 950.0)
    assert SNAPSHOT.revoked("job-1", 2, 900.0)


def test_a_reused_job_key_does_not_revive_the_earlier_leases_tokens() -> None:
    later = LiveLeases.of(2000.0, [("job-1", 0, 1500.0)])
    assert later.revoked("job-1", 0, 900.0) and not later.revoked("job-1", 0, 1500.0)


def test_a_token_newer_than_the_list_waits_for_the_next_heartbeat() -> None:
    assert not SNAPSHOT.revoked("job-3", 0, 1000.0)   # issued at the very moment the list was taken
    assert not SNAPSHOT.revoked("job-3", 0, 1000.5)


def test_pool_lists_live_unexpired_slices_per_server(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "p.db", clock)
    mine, other = server(0).address, server(1).address
    spread = core.allocate(req("job-spread", 2, percent=100))
    clock.now += 1
    short = core.allocate(req("job-ttl", 1, percent=50, ttl_seconds=10))
    clock.now += 1
    gone = core.allocate(req("job-gone", 1, percent=25))
    core.release("job-gone")
    clock.now += 1

    live = core.live_slices(mine)
    assert live.pool_unix == clock.now
    expected = {(lease.job_key, n, lease.created_unix)
                for lease in (spread, short) for n, s in enumerate(lease.slices) if s.server == mine}
    assert live.slices == expected and expected
    assert live.revoked("job-gone", 0, gone.created_unix)
    on_other = core.live_slices(other)
    assert on_other.slices.isdisjoint(live.slices)
    assert live.slices | on_other.slices == {(lease.job_key, n, lease.created_unix)
                                             for lease in (spread, short) for n in range(len(lease.slices))}

    clock.now += 60                                                 # the TTL lease has expired
    assert all(key != "job-ttl" for key, _, _ in core.live_slices(mine).slices)
    assert all(key != "job-ttl" for key, _, _ in core.live_slices(other).slices)


def test_a_token_and_the_pools_list_agree_on_the_lease(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "p.db", clock)
    lease = core.allocate(req("job-1", 1))
    slice0 = lease.slices[0]
    claims = tokens.verify(SECRET, core.token_for(lease, 0), server=slice0.server, gpu_uuids={slice0.gpu_uuid})
    clock.now += 1
    assert not core.live_slices(slice0.server).revoked(claims.job_key, claims.slice_number, claims.issued_unix)
    core.release("job-1")
    assert core.live_slices(slice0.server).revoked(claims.job_key, claims.slice_number, claims.issued_unix)
