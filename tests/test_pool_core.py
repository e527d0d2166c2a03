"""PoolCore against a real SQLite file: idempotency, quotas, TTLs, server states, durability."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rgpu import tokens
from rgpu.errors import CapacityError, InvalidRequest, NotFound, PermissionDenied
from rgpu.model import ServerInfo
from rgpu.remoting.pool.rules import AllocationRequest, PoolCore
from rgpu.remoting.pool.store import Store
from tests.poolcore_helpers import SECRET, Clock, GiB, make_core, req, server

def test_same_key_same_lease_and_release_is_idempotent(tmp_path: Path) -> None:
    core = make_core(tmp_path / "p.db")
    a = core.allocate(req("job-1", 2))
    assert core.allocate(req("job-1", 2)) == a
    assert core.capacity().allocated_units == 100
    assert core.release("job-1") is True
    assert core.release("job-1") is False
    assert core.release("never-existed") is False
    assert core.capacity().allocated_units == 0


def test_same_key_with_a_different_shape_is_refused(tmp_path: Path) -> None:
    core = make_core(tmp_path / "p.db")
    core.allocate(req("job-1", 2))
    with pytest.raises(InvalidRequest, match="already holds a different lease"):
        core.allocate(req("job-1", 3))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d", "e"]), st.booleans(), st.integers(1, 3)),
                max_size=30))
def test_random_allocate_release_keeps_accounting_exact(tmp_path: Path, ops) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / f"p{abs(hash(tuple(ops)))}.db"
    core = make_core(db)
    held: dict[str, object] = {}
    for key, allocate, count in ops:
        if allocate:
            try:
                lease = core.allocate(req(key, count, 50))
            except (CapacityError, InvalidRequest):
                continue
            if key in held:
                assert lease == held[key]
            held[key] = lease
        else:
            core.release(key)
            held.pop(key, None)
        for g in core.gpu_statuses():
            assert g.allocated_percent <= 100 and g.allocated_memory_bytes <= g.gpu.usable_memory_bytes
    # What a restart sees equals what the live pool saw.
    again = PoolCore(store=Store(db), secret=SECRET, clock=core.clock)
    assert {k: v for k, v in again.leases.items()} == {k: v for k, v in core.leases.items()}
    assert [(g.allocated_percent, g.slices) for g in again.gpu_statuses()] == \
           [(g.allocated_percent, g.slices) for g in core.gpu_statuses()]


def test_quota_refusal_says_used_and_limit(tmp_path: Path) -> None:
    core = make_core(tmp_path / "p.db")
    core.set_quota("user", "alice", 150)
    core.allocate(req("j1", 2, 50))
    with pytest.raises(CapacityError, match=r"used 100 / limit 150 GPU-percent, asked 100"):
        core.allocate(req("j2", 2, 50))
    core.allocate(req("j3", 1, 50))
    core.set_quota("account", "physics", 0)
    with pytest.raises(PermissionDenied):
        core.allocate(req("j4", 1, 10, user="bob", account="physics"))
    core.set_quota("account", "physics", -1)
    core.allocate(req("j4", 1, 10, user="bob", account="physics"))
    assert dict(((q.kind, q.name), u) for q, u in core.quota_usage()) == {("user", "alice"): 150}


def test_ttl_leases_are_reclaimed(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "p.db", clock)
    lease = core.allocate(req("tmp", 1, 100, ttl_seconds=60))
    assert lease.expires_unix == clock.now + 60
    clock.now += 61
    with pytest.raises(NotFound):
        core.get_lease("tmp")
    assert core.reclaim_expired() == ["tmp"]
    assert core.capacity().allocated_units == 0


def test_down_and_drained_servers_get_no_placements(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "p.db", clock)
    held = core.allocate(req("held", 1, 100))
    core.set_drained("gpu0", True)
    assert all(s.server == "127.0.0.1:55002" for s in core.allocate(req("x", 2, 50)).slices)
    clock.now += 11  # no heartbeats: server 1 goes down; server 0 is drained, which an admin chose
    assert core.check_down_servers() == ["127.0.0.1:55002"]
    assert core.check_down_servers() == []  # reported once
    states = {g.server: g.server_state for g in core.gpu_statuses()}
    assert states == {"127.0.0.1:55001": "drained", "127.0.0.1:55002": "down"}
    with pytest.raises(CapacityError):
        core.allocate(req("y", 1, 10))
    core.set_drained("127.0.0.1:55001", False)
    assert core.lease_on_down_server(held)  # resumed, but it missed heartbeats too
    assert core.capacity().total_units == 0
    core.heartbeat("127.0.0.1:55001")
    core.heartbeat("127.0.0.1:55002")
    assert core.capacity().total_units == 400 and not core.lease_on_down_server(held)
    assert core.heartbeat("127.0.0.1:9") is False  # unknown: the dispatcher must re-register


def test_tokens_bind_job_gpu_and_server(tmp_path: Path) -> None:
    core = make_core(tmp_path / "p.db")
    lease = core.allocate(req("job-7", 2))
    token = core.token_for(lease, 0)
    claims = tokens.verify(SECRET, token, server=lease.slices[0].server, gpu_uuids={lease.slices[0].gpu_uuid})
    assert (claims.job_key, claims.memory_limit_bytes, claims.compute_percent) == ("job-7", 40 * GiB, 50)
    assert core.token_for(lease, 0) == token  # deterministic: nothing secret needs storing


def test_hostile_request_fields_are_refused(tmp_path: Path) -> None:
    core = make_core(tmp_path / "p.db")
    for bad in [req("x\n[[slice]]"), req("ok", user="a'; rm -rf /"), req("ok", 0), req("ok", 10**9),
                req("ok", 1, 0), req("ok", 1, -100), req("ok", 1, 0.5), req("ok", 1, 150),
                AllocationRequest(job_key="ok", user="alice", count=1, percent=50, memory_bytes=GiB),
                AllocationRequest(job_key="ok", user="alice", count=1)]:
        with pytest.raises(InvalidRequest):
            core.allocate(bad)
    assert core.leases == {}


def test_a_gpu_served_by_two_live_dispatchers_is_refused(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "p.db", clock, servers=1)
    twin = ServerInfo(address="127.0.0.1:60000", hostname="gpu0", driver_version="580", cuda_version="13.0",
                      gpus=server(0).gpus)
    with pytest.raises(InvalidRequest, match="127.0.0.1:55001 already serves it"):
        core.register(twin)
    clock.now += 11  # the first dispatcher is down: its GPUs may move
    core.register(twin)


def test_lease_listeners_hear_each_lease_start_and_end_and_the_core_checks_every_order(tmp_path: Path) -> None:
    """What rgpu-poold's Slurm admission hangs on (slurm_plugin/poolhooks.py): a pass at once when
    a lease starts or ends, and the pool's own placement asked for a set of leases in any order."""
    core = make_core(tmp_path / "pool.db")           # 2 servers x 2 GPUs
    heard: list[bool] = []
    core.add_lease_listener(heard.append)
    core.add_lease_listener(lambda ended: 1 / 0)      # a broken listener breaks nothing
    core.allocate(req("a", count=1, percent=50))
    core.allocate(req("a", count=1, percent=50))    # the same lease again: nothing started
    assert core.release("a") and not core.release("a")
    assert heard == [False, True]
    half, whole = (1, 50, 0, "", False), (1, 100, 0, "", False)
    assert core.fits_in_every_order([half] * 8) and not core.fits_in_every_order([half] * 9)
    core.allocate(req("b", count=1, percent=60))
    assert core.fits_in_every_order([whole] * 3) and not core.fits_in_every_order([whole] * 4)
    assert not core.fits_in_every_order([(1, 0, 100 * GiB, "", False)])            # more memory than a GPU has
    assert not core.fits_in_every_order([(1, 50, 0, "strict", False)])             # no isolated GPU here
