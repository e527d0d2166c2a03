"""Usage per slice, end to end: a program runs through rgpu's libcuda.so.1 against a real
dispatcher (emulated GPU); its worker counts busy time and the memory high-water mark, the
dispatcher reports them in heartbeats, and `rgpu-admin stats` / `leases` show them; idle leases
are flagged, and released with idle_release."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rgpu.remoting.native import build
from tests.daemons import EXAMPLES, RgpuCluster, wait_for
from tests.remoting.conftest import run_client
from tests.admin_helpers import admin

PROGRAM = """
import ctypes, sys
sys.path.insert(0, {tests!r})
import ctcuda
ctcuda.setup()
r1, a = ctcuda.alloc(64 << 20)
r2, b = ctcuda.alloc(32 << 20)
assert (r1, r2) == (0, 0), (r1, r2)
ctcuda.check("cuMemFree_v2", ctypes.c_uint64(b))
r3, c = ctcuda.alloc(16 << 20)
assert r3 == 0
ctcuda.mem_info()
print("done", flush=True)
"""


def start(tmp_path: Path, **config: object) -> tuple[RgpuCluster, str]:
    cluster = RgpuCluster(tmp_path / "rgpu")
    cluster.write_config(down_after_seconds=5.0, heartbeat_interval_seconds=0.3, reclaim_interval_seconds=0.3,
                         **config)
    cluster.start_pool()
    _, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
    address = f"127.0.0.1:{port}"
    with cluster.client() as client:
        wait_for(lambda: any(s.state == "up" for s in client.list_servers().servers), what="dispatcher up")
    return cluster, address


def slice_stats(cluster: RgpuCluster) -> list[dict]:
    return json.loads(admin(cluster, "stats", "--json").stdout)


@pytest.mark.integration
def test_busy_time_and_memory_peak_reach_rgpu_admin(native_libs: build.Libraries, tmp_path: Path) -> None:
    cluster, address = start(tmp_path, idle_after_seconds=2.0)
    try:
        with cluster.client() as client:
            lease = client.allocate("job-usage", "alice", 1, percent=25, account="physics")
        program = tmp_path / "prog.py"
        program.write_text(PROGRAM.format(tests=str(Path(__file__).parent)))
        run = run_client(native_libs, f"{address},{lease.slices[0].token}", [sys.executable, str(program)])
        assert run.returncode == 0 and "done" in run.stdout, run.stdout + run.stderr

        wait_for(lambda: slice_stats(cluster)[0]["calls"] > 0 and slice_stats(cluster)[0]["sessions"] == 0,
                 what="the session's usage in a heartbeat")
        row = slice_stats(cluster)[0]
        assert row["job_key"] == "job-usage" and row["slice"] == 0
        assert row["memory_high_water_bytes"] == 96 << 20          # 64 + 32 MiB held at once
        assert row["memory_used_bytes"] == 0                        # the session ended
        assert row["busy_seconds"] > 0 and row["last_active_unix"] > lease.created_unix - 5
        table = admin(cluster, "stats").stdout
        assert "96.0 MiB peak" in table or "96 MiB peak" in table, table

        # No session and no call for idle_after_seconds: flagged, not released (idle_release off).
        wait_for(lambda: json.loads(admin(cluster, "leases", "--json").stdout)[0]["idle"], what="the idle flag")
        leases = json.loads(admin(cluster, "leases", "--json").stdout)
        assert leases[0]["state"] == "IDLE" and leases[0]["busy_seconds"] > 0
        assert [r["job_key"] for r in json.loads(admin(cluster, "stats", "--idle", "--json").stdout)] == ["job-usage"]

        usage = json.loads(admin(cluster, "usage", "--by", "both", "--json").stdout)
        assert [(u["user"], u["account"], u["leases"]) for u in usage] == [("alice", "physics", 1)]
        assert usage[0]["gpu_percent_hours"] > 0 and usage[0]["busy_gpu_seconds"] > 0
    finally:
        cluster.stop_all()


@pytest.mark.integration
def test_idle_release_frees_an_unused_lease_and_accounts_for_it(tmp_path: Path) -> None:
    cluster, _ = start(tmp_path, idle_after_seconds=1.0, idle_release=True)
    try:
        with cluster.client() as client:
            client.allocate("job-idle", "bob", 1, percent=50, account="chem")
            wait_for(lambda: client.list_leases() == [], what="the idle lease's release")
        assert "was idle for 1 s and was released" in cluster.pool.log()
        usage = json.loads(admin(cluster, "usage", "--by", "account", "--json").stdout)
        assert [(u["account"], u["leases"]) for u in usage] == [("chem", 1)]
        assert 0 < usage[0]["gpu_percent_hours"] < 50 * 30 / 3600     # 50 % for well under half a minute
    finally:
        cluster.stop_all()
