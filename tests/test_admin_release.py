"""`rgpu-admin release-gpus` by adaptor.conf, by lease key and by Slurm job id, against a real
rgpu-poold (issue 10: an admin can release a lease after the node Epilog deleted adaptor.conf)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rgpu.remoting.admin.cli import slurm_job_keys
from tests.daemons import RgpuCluster, register_servers, wait_for


pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = RgpuCluster(tmp_path)
    c.start_pool()
    with c.client() as client:
        register_servers(client, servers=2, gpus=2)
    yield c
    c.stop_all()


def admin(cluster: RgpuCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "release-gpus", *args], env=cluster.env(),
                          capture_output=True, text=True, timeout=60)


def keys(cluster: RgpuCluster) -> set[str]:
    with cluster.client() as client:
        return {lease.job_key for lease in client.list_leases()}


def test_slurm_job_keys_match_whole_fields_only() -> None:
    all_keys = ["slurm:a:12:0:c1", "slurm:a:12:1:c2", "slurm:a:123:0:c1", "slurm:b:12:0:c1", "manual-12", "slurm:a:12"]
    assert slurm_job_keys(all_keys, "12", "a") == ["slurm:a:12:0:c1", "slurm:a:12:1:c2"]
    assert slurm_job_keys(all_keys, "12", "") == ["slurm:a:12:0:c1", "slurm:a:12:1:c2", "slurm:b:12:0:c1"]


def test_release_by_key_and_by_slurm_job(cluster: RgpuCluster) -> None:
    with cluster.client() as client:
        for key in ("slurm:hpc:7:0:c1", "slurm:hpc:7:1:c2", "slurm:hpc:77:0:c1", "slurm:other:7:0:c1", "manual-x"):
            client.allocate(key, "alice", 1, percent=10)
    out = admin(cluster, "--job-key", "manual-x")
    assert out.returncode == 0 and out.stdout == "released manual-x\n", out
    assert admin(cluster, "--job-key", "manual-x").stdout == "manual-x was already released\n"
    ambiguous = admin(cluster, "--slurm-job", "7")
    assert ambiguous.returncode != 0 and "clusters hpc, other" in ambiguous.stderr and "--cluster" in ambiguous.stderr
    assert len(ambiguous.stderr.strip().splitlines()) == 1
    out = admin(cluster, "--slurm-job", "7", "--cluster", "hpc")
    assert out.returncode == 0 and out.stdout.splitlines() == ["released slurm:hpc:7:0:c1", "released slurm:hpc:7:1:c2"]
    assert keys(cluster) == {"slurm:hpc:77:0:c1", "slurm:other:7:0:c1"}
    assert "holds no lease in cluster hpc" in admin(cluster, "--slurm-job", "7", "--cluster", "hpc").stdout


@pytest.mark.parametrize("args, message", [
    ((), "give one of -f FILE, --job-key KEY or --slurm-job ID"),
    (("--job-key", "a", "--slurm-job", "1"), "give one of"),
    (("--slurm-job", "1;2"), "is not a job id"),
    (("--job-key", "a", "--cluster", "hpc"), "--cluster goes with --slurm-job"),
])
def test_bad_arguments_are_one_line(cluster: RgpuCluster, args: tuple[str, ...], message: str) -> None:
    out = admin(cluster, *args)
    assert out.returncode != 0 and message in out.stderr and out.stderr.startswith("rgpu: admin: "), out


def test_remove_server_gone_for_good(tmp_path: Path) -> None:
    c = RgpuCluster(tmp_path)
    c.write_config(down_after_seconds=1.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5)
    c.start_pool()
    try:
        with c.client() as client:
            register_servers(client, servers=2, gpus=1)     # they never heartbeat: down after 1 s
            client.allocate("job-on-gpu0", "alice", 1, percent=50, server="127.0.0.1:56000")
            up = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "remove-server", "gpu1"],
                                env=c.env(), capture_output=True, text=True, timeout=60)
            assert up.returncode != 0 and "is not down" in up.stderr, up
            wait_for(lambda: {s.state for s in client.list_servers().servers} == {"down"}, timeout=10, what="servers down")

            def remove(name: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "remove-server", name],
                                      env=c.env(), capture_output=True, text=True, timeout=60)

            held = remove("127.0.0.1:56000")
            assert held.returncode != 0 and "still holds slices of 1 lease(s): job-on-gpu0" in held.stderr, held
            assert len(held.stderr.strip().splitlines()) == 1
            gone = remove("gpu1")
            assert gone.returncode == 0 and gone.stdout == "127.0.0.1:56001: removed\n", gone
            assert [s.address for s in client.list_servers().servers] == ["127.0.0.1:56000"]
            assert "no server 'gpu1'" in remove("gpu1").stderr
        # Forgotten for good: not back after a restart (SQLite state).
        assert c.pool is not None
        c.pool.stop()
        c.start_pool()
        with c.client() as client:
            assert [s.address for s in client.list_servers().servers] == ["127.0.0.1:56000"]
    finally:
        c.stop_all()
