"""`rgpu-admin release-gpus` by adaptor.conf, by lease key and by Slurm job id, against a real
rgpu-poold (issue 10: an admin can release a lease after the node Epilog deleted adaptor.conf)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rgpu.remoting.admin.cli import slurm_job_keys
from tests.daemons import RgpuCluster
from tests.test_pool_daemon import register

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = RgpuCluster(tmp_path)
    c.start_pool()
    with c.client() as client:
        register(client, servers=2, gpus=2)
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
            client.allocate(key, "alice", 1, fraction=0.1)
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
