"""rgpu-admin net-perf against a real pool and a real dispatcher (emulated backend) on loopback:
a probe slice is leased, its token opens a perf session on the data port, and it is released."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rgpu.errors import AuthError
from rgpu.remoting.datapath import perf
from tests.daemons import EXAMPLES, RgpuCluster, wait_for
from tests.admin_helpers import admin


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = RgpuCluster(tmp_path)
    c.write_config(down_after_seconds=5.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5)
    c.start_pool()
    c.start_dispatcher(EXAMPLES / "inventory-a.toml")
    with c.client() as client:
        wait_for(lambda: any(s.state == "up" for s in client.list_servers().servers), what="dispatcher up")
    yield c
    c.stop_all()


def test_net_perf_measures_each_dispatcher_and_releases_its_probe(cluster: RgpuCluster) -> None:
    run = admin(cluster, "net-perf", "--pings", "20", "--size", "4M", "--json")
    rows = json.loads(run.stdout)
    assert len(rows) == 1 and rows[0]["ok"], rows
    assert run.stderr == ""        # no progress bar where stderr is not a terminal
    row = rows[0]
    assert row["server"].startswith("127.0.0.1:")
    assert 0 < row["rtt_min_us"] <= row["rtt_p50_us"] <= row["rtt_p99_us"]
    assert row["upload_bytes_per_s"] > 0 and row["download_bytes_per_s"] > 0
    with cluster.client() as client:
        assert client.list_leases() == []        # the probe slice was released
        assert [r.account for r in client.usage().rows] == ["net-perf"]
    table = admin(cluster, "net-perf", "--pings", "5", "--size", "1M").stdout
    assert "RTT P50 us" in table and "/s" in table and "ERROR" in table
    assert "perf session from" in cluster.daemons[-1].log()


def test_perf_session_needs_a_valid_token(cluster: RgpuCluster) -> None:
    with cluster.client() as client:
        server = client.list_servers().servers[0].address
    with pytest.raises(AuthError, match="token"):
        perf.measure(server, "not-a-token", pings=1, bulk_bytes=1)


def test_net_perf_of_an_unknown_server_fails_with_a_fix(cluster: RgpuCluster) -> None:
    run = admin(cluster, "net-perf", "--server", "nosuchhost", ok=False)
    assert run.returncode != 0 and "no dispatcher to measure" in run.stderr and "rgpu-admin health" in run.stderr


def test_summarise_and_percentile() -> None:
    r = perf.summarise("h:1", 0.002, [3e-6, 1e-6, 2e-6], (10 << 20, 0.5), (0, 0.0))
    assert (r.rtt_min_us, r.rtt_p50_us, r.connect_ms) == (pytest.approx(1), pytest.approx(2), pytest.approx(2))
    assert r.upload_bytes_per_s == pytest.approx(20 << 20) and r.download_bytes_per_s == 0
    assert perf.percentile([5.0, 1.0, 9.0, 3.0], 100) == 9.0
