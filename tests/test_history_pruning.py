"""Ended-lease history is pruned (issue 26, LOW: 183 B per allocate/release pair were kept for
ever): rows older than history_keep_days, and the oldest beyond history_max_rows, go in the pool's
maintenance passes, a bounded batch a pass. Real rgpu-poold; the rows read from its SQLite file."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.model import LeaseRecord, SliceRecord
from rgpu.remoting.pool.store import Store
from tests.daemons import RgpuCluster, register_servers, wait_for


def history(state: Path) -> list[str]:
    with sqlite3.connect(state) as db:
        return [key for (key,) in db.execute("SELECT job_key FROM lease_history ORDER BY ended")]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop_all()


def churn(cluster: RgpuCluster, count: int) -> None:
    with cluster.client() as client:
        register_servers(client, servers=1, gpus=1)
        for n in range(count):
            client.allocate(f"job-{n:02d}", "alice", 1, percent=50)
            client.release(f"job-{n:02d}")


@pytest.mark.integration
def test_the_oldest_rows_beyond_history_max_rows_are_pruned(cluster: RgpuCluster) -> None:
    cluster.write_config(heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.2, history_max_rows=5)
    cluster.start_pool()
    churn(cluster, 12)
    wait_for(lambda: len(history(cluster.state)) == 5, what="the history cut to 5 rows")
    assert history(cluster.state) == [f"job-{n:02d}" for n in range(7, 12)]     # the newest stay
    assert cluster.pool is not None and "Traceback" not in cluster.pool.log()


@pytest.mark.integration
def test_rows_older_than_history_keep_days_are_pruned(cluster: RgpuCluster) -> None:
    cluster.write_config(heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.2,
                         history_keep_days=1 / 86400)   # one second
    cluster.start_pool()
    churn(cluster, 4)
    wait_for(lambda: history(cluster.state) == [], what="every row older than a second gone")


def test_one_pass_deletes_at_most_its_limit(tmp_path: Path) -> None:
    store = Store(tmp_path / "pool.db")
    try:
        for n in range(10):
            lease = LeaseRecord(f"job-{n}", "alice", "", float(n), 0.0, (SliceRecord("127.0.0.1:1", "GPU-0", 0, "H100", 1 << 30, 50),))
            store.insert_lease(lease)
            store.end_lease(lease, ended=100.0 + n)
        assert store.prune_history(ended_before=200.0, max_rows=0, limit=3) == 3        # by age, bounded
        assert store.prune_history(ended_before=None, max_rows=2, limit=3) == 3         # by count, bounded
        assert store.prune_history(ended_before=None, max_rows=2, limit=3) == 2
        assert store.prune_history(ended_before=None, max_rows=2, limit=3) == 0
        assert [row[0] for row in store.dump_history()] == ["job-8", "job-9"]
    finally:
        store.close()
