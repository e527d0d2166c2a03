"""Leases that end: flexrun -n's lease has a TTL renewed while the application runs, and a
kill -9'd flexrun's lease is reclaimed within one TTL; Renew never creates a lease; a NaN TTL is
INVALID_ARGUMENT. Real rgpu-poold and rgpu-dispatcher on loopback."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rgpu.errors import InvalidRequest, NotFound
from rgpu.remoting.native import build
from tests.daemons import EXAMPLES, RgpuCluster, wait_for
from tests.dispatcher_helpers import wait_state

TTL = 3.0
pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "cluster")
    c.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.25,
                   flexrun_lease_ttl_seconds=TTL)
    try:
        yield c
    finally:
        c.stop_all()


def _leases(cluster: RgpuCluster) -> list[str]:
    with cluster.client() as client:
        return [lease.job_key for lease in client.list_leases()]


def _expiry(cluster: RgpuCluster, job_key: str) -> float:
    """The lease's expires_unix, 0.0 once it is gone."""
    with cluster.client() as client:
        try:
            return client.get_lease(job_key).expires_unix
        except NotFound:
            return 0.0


def test_a_killed_flexruns_lease_is_reclaimed_within_one_ttl(cluster: RgpuCluster,
                                                             native_libs: build.Libraries) -> None:
    cluster.start_pool()
    _d, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
    wait_state(cluster, f"127.0.0.1:{port}", "up")
    env = cluster.env(RGPU_NATIVE_DIR=str(native_libs.folder))
    proc = subprocess.Popen([sys.executable, "-m", "rgpu.remoting.client.flexrun", "-n", "1", "-p", "0.5", "--",
                             "sleep", "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        wait_for(lambda: any(k.startswith("flexrun-") for k in _leases(cluster)), timeout=30,
                 what=f"flexrun's lease ({proc.poll()})")
        with cluster.client() as client:
            first = [lease for lease in client.list_leases() if lease.job_key.startswith("flexrun-")][0]
        assert 0 < first.expires_unix - first.created_unix <= TTL + 0.5
        # Renewed while the application runs, past the first expiry (a lease not renewed is gone).
        wait_for(lambda: _expiry(cluster, first.job_key) > first.expires_unix + TTL, timeout=30,
                 what="flexrun to renew its lease past its first expiry")
        os.kill(proc.pid, signal.SIGKILL)                  # flexrun only: its application lives on
        killed = time.monotonic()
        proc.wait()
        at_death = _expiry(cluster, first.job_key)

        def reclaimed() -> bool:
            expiry = _expiry(cluster, first.job_key)
            # Nothing renews it once flexrun is dead, so it goes at most one TTL after its last renewal.
            assert expiry in (0.0, at_death), f"the lease was renewed after flexrun died ({at_death} -> {expiry})"
            return expiry == 0.0
        wait_for(reclaimed, timeout=TTL + 10, what="the lease to be reclaimed")
        print(f"\nkill -9 of flexrun: its lease (TTL {TTL:g} s) reclaimed after {time.monotonic() - killed:.2f} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_a_finished_flexrun_releases_its_lease(cluster: RgpuCluster, native_libs: build.Libraries) -> None:
    cluster.start_pool()
    _d, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
    wait_state(cluster, f"127.0.0.1:{port}", "up")
    env = cluster.env(RGPU_NATIVE_DIR=str(native_libs.folder))
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.client.flexrun", "-n", "1", "-p", "0.5", "--",
                           "sleep", str(TTL)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert _leases(cluster) == []
    assert "renewing" not in done.stderr


def test_renew_extends_and_never_creates(cluster: RgpuCluster) -> None:
    from tests.daemons import register_servers
    cluster.start_pool()
    with cluster.client() as client:
        register_servers(client, servers=1, gpus=2)
        lease = client.allocate("job-ttl", "alice", 1, percent=50, ttl_seconds=TTL)
        renewed = client.renew("job-ttl", 100)
        assert renewed.expires_unix > lease.expires_unix + 90
        assert renewed.slices[0].token == lease.slices[0].token   # the running application's token stays good
        assert client.release("job-ttl")
        with pytest.raises(NotFound, match="no lease 'job-ttl' to renew"):
            client.renew("job-ttl", 100)
        assert client.list_leases() == []
        client.allocate("job-forever", "alice", 1, percent=50)
        with pytest.raises(InvalidRequest, match="has no TTL to renew"):
            client.renew("job-forever", 100)


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), -1.0])
def test_a_bad_ttl_is_invalid_argument(cluster: RgpuCluster, ttl: float) -> None:
    from rgpu.proto import rgpu_pb2 as pb
    from rgpu.proto import rgpu_pb2_grpc as pb_grpc
    from rgpu.remoting.pool.auth import AUTH_HEADER, request_credential
    from tests.daemons import register_servers
    cluster.start_pool()
    with cluster.client() as client:
        register_servers(client, servers=1, gpus=1)
        with pytest.raises(InvalidRequest, match="invalid TTL") as info:
            client.allocate("job-nan", "alice", 1, percent=50, ttl_seconds=ttl)
        assert "\n" not in str(info.value)
    method = "/rgpu.v1.Pool/Allocate"
    with grpc.insecure_channel(cluster.pool_address) as channel:
        with pytest.raises(grpc.RpcError) as raw:
            pb_grpc.PoolStub(channel).Allocate(
                pb.AllocateRequest(job_key="job-nan", user="alice", count=1, percent=50, ttl_seconds=ttl),
                metadata=[(AUTH_HEADER, request_credential(cluster.secret, method))], timeout=5)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_flexrun_isolation_strict_goes_only_on_isolated_gpus(cluster: RgpuCluster,
                                                             native_libs: build.Libraries) -> None:
    cluster.start_pool()
    _d, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")      # every GPU shared by MPS
    wait_state(cluster, f"127.0.0.1:{port}", "up")
    env = cluster.env(RGPU_NATIVE_DIR=str(native_libs.folder))
    strict = [sys.executable, "-m", "rgpu.remoting.client.flexrun", "-n", "1", "-p", "0.5", "--isolation", "strict",
              "--", sys.executable, "-c", "import os; print('SLICES', os.environ['RGPU_SLICES'].split(',')[0])"]
    refused = subprocess.run(strict, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2, refused.stderr         # no GPU could ever take it: a usage error, not a wait
    assert "isolation=strict" in refused.stderr and "this pool has none" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    _d2, port2 = cluster.start_dispatcher(EXAMPLES / "inventory-b.toml", env=cluster.env(RGPU_GPU_SHARING="isolated"))
    wait_state(cluster, f"127.0.0.1:{port2}", "up")
    done = subprocess.run(strict, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert f"SLICES 127.0.0.1:{port2}" in done.stdout
    assert _leases(cluster) == []


def test_flexrun_same_node_puts_every_slice_on_one_gpu_server_or_says_why_not(cluster: RgpuCluster,
                                                                              native_libs: build.Libraries) -> None:
    """`flexrun -n N --same-node` (issue 27: NCCL between a job's slices stays on one node's NVLink or PCIe).
    Two GPU servers of two GPUs each: two slices land on one server; three are refused (no capacity, one
    line) though they would spread over both without --same-node."""
    cluster.start_pool()
    ports = []
    for inventory in ("inventory-a.toml", "inventory-b.toml"):
        _d, port = cluster.start_dispatcher(EXAMPLES / inventory)
        wait_state(cluster, f"127.0.0.1:{port}", "up")
        ports.append(port)
    env = cluster.env(RGPU_NATIVE_DIR=str(native_libs.folder))
    show = [sys.executable, "-c", "import os; print(sorted({s.split(',')[0] for s in os.environ['RGPU_SLICES'].split(';')}))"]

    def flexrun(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rgpu.remoting.client.flexrun", *args, "--", *show], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
    two = flexrun("-n", "2", "-p", "0.5", "--same-node")
    assert two.returncode == 0, two.stderr
    assert len(ast.literal_eval(two.stdout)) == 1, two.stdout
    three = flexrun("-n", "3", "-p", "0.5", "--same-node")
    assert three.returncode == 3, three.stderr
    assert three.stderr.splitlines() == [
        "rgpu: pool: cannot place 3 slice(s) of fraction 0.5 (same node) on one GPU server (4 GPU(s) can take one now, "
        "at most 2 of them on one server; wait for capacity, ask for fewer or smaller slices, or ask without "
        "--same-node so the slices may spread over several GPU servers)"], three.stderr
    spread = flexrun("-n", "3", "-p", "0.5")
    assert spread.returncode == 0 and len(ast.literal_eval(spread.stdout)) == 2, spread.stdout + spread.stderr
    assert _leases(cluster) == []
