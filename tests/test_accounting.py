"""The pool's accounting, pure: idle leases, dispatcher times on the pool's clock, GPU-percent-hours
per user and account in a window; and how rgpu-admin shows them."""

from __future__ import annotations

import pytest

from rgpu.model import LeaseRecord, SliceRecord
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.admin.usage_view import duration, lease_usage, usage_rows
from rgpu.remoting.pool.accounting import (Interval, SliceUsageRecord, idle_seconds, idle_since, is_idle,
                                           to_pool_clock, totals)

LEASE = LeaseRecord(job_key="j", user="alice", account="physics", created_unix=1000.0, expires_unix=0.0,
                    slices=(SliceRecord("h:1", "GPU-a", 0, "H100", 1 << 30, 50),
                            SliceRecord("h:1", "GPU-b", 1, "H100", 1 << 30, 50)))


def test_idle_counts_from_creation_then_from_the_last_call() -> None:
    assert idle_since(LEASE, [None, None]) == 1000.0 and idle_seconds(LEASE, [None, None], 1600.0) == 600.0
    used = SliceUsageRecord(last_active_unix=1500.0)
    assert idle_seconds(LEASE, [None, used], 1600.0) == 100.0
    # An open session that makes no calls is idle from its last call on.
    quiet = SliceUsageRecord(sessions=1, last_active_unix=1100.0)
    assert idle_since(LEASE, [quiet, used]) == 1500.0 and idle_seconds(LEASE, [quiet, used], 1400.0) == 0.0
    assert is_idle(600.0, 600.0) and not is_idle(599.0, 600.0) and not is_idle(10**9, 0.0)


def test_dispatcher_times_move_to_the_pool_clock() -> None:
    # The dispatcher's clock is 100 s ahead: its "last active 5 s before sending" stays 5 s old.
    assert to_pool_clock(1195.0, 1200.0, 1100.0) == 1095.0
    assert to_pool_clock(0.0, 1200.0, 1100.0) == 0.0
    assert to_pool_clock(1195.0, 0.0, 1100.0) == 1195.0


def test_gpu_percent_hours_are_clipped_to_the_window() -> None:
    rows = totals([Interval("alice", "physics", 50, 0, 7200, busy_seconds=30),
                   Interval("alice", "physics", 100, 3600, 10800),
                   Interval("bob", "chem", 200, -3600, 1800),
                   Interval("carol", "", 100, 9000, 9999)], since=0, until=7200)
    assert [(r.user, r.gpu_percent_hours, r.leases) for r in rows] == [("alice", 200.0, 2), ("bob", 100.0, 1)]
    assert rows[0].busy_gpu_seconds == 30


def test_usage_rows_group_by_user_account_or_both() -> None:
    reply = pb.UsageReply(rows=[pb.UsageRow(user="alice", account="physics", gpu_percent_hours=150, leases=2),
                                pb.UsageRow(user="alice", account="chem", gpu_percent_hours=50, leases=1),
                                pb.UsageRow(user="bob", account="chem", gpu_percent_hours=300, leases=1)])
    assert [(r["user"], r["gpu_percent_hours"]) for r in usage_rows(reply, "user")] == [("bob", 300), ("alice", 200)]
    assert [(r["account"], r["gpu_hours"]) for r in usage_rows(reply, "account")] == [("chem", 3.5), ("physics", 1.5)]
    assert len(usage_rows(reply, "both")) == 3


def test_lease_usage_for_the_leases_table() -> None:
    lease = pb.Lease(job_key="j", idle_since_unix=1000.0, idle=True, slices=[
        pb.Slice(usage=pb.SliceUsage(busy_seconds=3700, memory_high_water_bytes=3 << 30)),
        pb.Slice(usage=pb.SliceUsage(busy_seconds=20, memory_high_water_bytes=1 << 30))])
    row = lease_usage(lease, now=1000.0 + 7500)
    assert (row["busy"], row["memory_high_water"], row["idle_for"], row["idle"]) == ("1h02m", "3.0 GiB", "2h05m", True)
    assert lease_usage(pb.Lease(job_key="k"), now=5.0)["idle_for"] == "-"     # an older pool says nothing
    assert [duration(s) for s in (5, 61, 3 * 86400 + 7200)] == ["5s", "1m", "3d02h"]


def test_the_store_keeps_ended_leases(tmp_path: pytest.TempPathFactory) -> None:
    from rgpu.remoting.pool.store import Store
    store = Store(tmp_path / "pool.db")   # type: ignore[operator]
    store.insert_lease(LEASE)
    store.end_lease(LEASE, 4600.0, busy_seconds=12.5, how="released")
    assert store.load_leases() == []
    assert store.load_history(0, 10**10) == [("alice", "physics", 100, 1000.0, 4600.0, 12.5)]
    assert store.load_history(5000, 10**10) == []
    store.close()


def test_a_running_call_is_busy_and_active_now(tmp_path: pytest.TempPathFactory) -> None:
    import time
    from pathlib import Path

    from rgpu.remoting.datapath.usage import SessionStats, read_slice_stats

    folder = Path(str(tmp_path))
    stats = SessionStats(folder / "1.stats", publish_every_s=3600)
    assert read_slice_stats(folder).last_active_unix == 0.0          # no call yet
    stats.call_started_ns = time.perf_counter_ns() - 2_000_000_000   # a synchronise running for 2 s
    stats.publish()
    running = read_slice_stats(folder)
    assert running.busy_seconds >= 2.0 and running.last_active_unix >= time.time() - 1 and running.calls == 0
    stats.account(stats.call_started_ns, high_water=5 << 20)
    stats.close(high_water=3 << 20)
    (folder / "2.stats").write_bytes((folder / "1.stats").read_bytes())   # a second, ended session
    (folder / "2.used").write_bytes(bytes(8))
    total = read_slice_stats(folder)
    assert (total.sessions_seen, total.calls, total.memory_high_water_bytes) == (2, 2, 5 << 20)
    assert total.busy_seconds >= 4.0
