"""PoolCore's per-server indexes (placement groups, leases per server) stay equal to what a full
scan of its leases says, through random allocations, releases, drains and restarts."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rgpu.errors import CapacityError
from rgpu.live_leases import LiveLeases
from rgpu.remoting.pool.rules import PoolCore
from rgpu.remoting.pool.store import Store
from tests.poolcore_helpers import SECRET, Clock, make_core, req

ops = st.lists(st.tuples(st.sampled_from(["allocate", "release", "drain", "resume"]), st.integers(0, 7),
                         st.integers(1, 3), st.sampled_from([25, 50, 100])), min_size=1, max_size=30)


def scanned_live(core: PoolCore, address: str) -> LiveLeases:
    now = core.clock()
    return LiveLeases.of(now, ((lease.job_key, n, lease.created_unix) for lease in core.leases.values()
                               if not lease.expired(now) for n, s in enumerate(lease.slices) if s.server == address))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_indexes_match_a_full_scan(tmp_path: Path, steps) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "p.db"
    db.unlink(missing_ok=True)
    clock = Clock()
    core = make_core(db, clock, servers=3)
    for op, n, count, percent in steps:
        key = f"job-{n}"
        if op == "allocate":
            try:
                core.allocate(req(key, count=count, percent=percent))
            except (CapacityError, Exception) as exc:  # same key, other shape: refused
                assert "capacity" in type(exc).__name__.lower() or "different lease" in str(exc)
        elif op == "release":
            core.release(key)
        else:
            core.set_drained(f"gpu{n % 3}", op == "drain")
        for address in core.servers:
            assert core.live_slices(address) == scanned_live(core, address)
    restarted = PoolCore(store=Store(db), secret=SECRET, down_after_seconds=10, clock=clock)
    for address in core.servers:
        assert restarted.live_slices(address) == scanned_live(core, address)
    assert [g.allocated_percent for g in restarted.gpu_statuses()] == [g.allocated_percent for g in core.gpu_statuses()]
