"""The real rgpu-poold process: durability across kill -9, auth, TLS, health."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rgpu.errors import AuthError, Unavailable
from rgpu.remoting.pool.client import PoolClient
from tests.daemons import RgpuCluster, register_servers, wait_for

pytestmark = pytest.mark.integration
GiB = 2**30


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = RgpuCluster(tmp_path)
    c.write_config(down_after_seconds=30.0, heartbeat_interval_seconds=5.0, reclaim_interval_seconds=0.5)
    yield c
    c.stop_all()


register = register_servers


def test_kill_9_loses_no_lease_quota_or_server(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    with cluster.client() as client:
        register(client)
        client.set_quota("user", "alice", 300)
        before = client.allocate("slurm-1-0", "alice", 2, percent=50)
    cluster.pool.kill()  # SIGKILL: no chance to flush anything
    cluster.start_pool()
    with cluster.client() as client:
        after = client.get_lease("slurm-1-0")
        assert after == before  # same slices, same tokens
        assert [(q.name, q.used_units, q.limit_units) for q in client.list_quotas()] == [("alice", 100, 300)]
        assert sorted(s.address for s in client.list_servers().servers) == ["127.0.0.1:56000", "127.0.0.1:56001"]
        assert client.allocate("slurm-1-0", "alice", 2, percent=50) == before  # a retried prolog
        assert client.release("slurm-1-0") is True


def test_kill_9_during_a_burst_keeps_every_acknowledged_lease(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    with cluster.client() as client:
        register(client, servers=4, gpus=8)
    acknowledged: list[str] = []
    stop = threading.Event()

    def worker(n: int) -> None:
        with PoolClient(cluster.pool_address, cluster.secret, timeout=2.0) as client:
            i = 0
            while not stop.is_set():
                key = f"burst-{n}-{i}"
                try:
                    client.allocate(key, "bob", 1, percent=10)
                except Unavailable:
                    return
                except Exception:
                    return
                acknowledged.append(key)
                i += 1

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acknowledged) >= 40, what="40 allocations")
    cluster.pool.kill()
    stop.set()
    for t in threads:
        t.join(timeout=10)
    cluster.start_pool()
    with cluster.client() as client:
        held = {lease.job_key for lease in client.list_leases()}
        assert set(acknowledged) <= held, f"lost {len(set(acknowledged) - held)} acknowledged lease(s)"
        for g in client.list_gpus():
            assert g.allocated_percent <= 100
        assert sum(g.allocated_percent for g in client.list_gpus()) == 10 * len(held)


def test_calls_without_the_secret_are_refused_but_health_is_open(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    with PoolClient(cluster.pool_address, b"wrong-secret-wrong-secret") as client:
        with pytest.raises(AuthError, match="wrong cluster secret"):
            client.list_gpus()
    channel = grpc.insecure_channel(cluster.pool_address)
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/rgpu.v1.Pool/ListGpus")(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no credential" in err.value.details()
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="rgpu.v1.Pool"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    wait_for(lambda: "refused /rgpu.v1.Pool/ListGpus: wrong cluster secret" in cluster.pool.log(),
             what="the refusal in the pool's log")


def test_missing_secret_and_busy_port_are_one_line_errors(cluster: RgpuCluster, tmp_path: Path) -> None:
    env = cluster.env(RGPU_SECRET_FILE=str(tmp_path / "nope"))
    run = subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", "127.0.0.1:0",
                          "--state", str(tmp_path / "x.db")], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith("rgpu: secret: secret file")
    cluster.start_pool()
    run = subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", cluster.pool_address,
                          "--state", str(tmp_path / "y.db")], env=cluster.env(), capture_output=True, text=True,
                         timeout=30)
    assert run.returncode != 0 and "rgpu: poold: cannot listen on" in run.stderr


def test_tls(cluster: RgpuCluster, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=rgpu-pool", "-addext", "subjectAltName=DNS:rgpu-pool"],
                   check=True, capture_output=True)
    cluster.write_config(tls_cert_file=str(cert), tls_key_file=str(key))
    cluster.start_pool()
    with PoolClient(cluster.pool_address, cluster.secret, tls_ca_file=str(cert),
                    tls_server_name="rgpu-pool") as client:
        register(client, servers=1, gpus=1)
        assert client.capacity().total_units == 100
    with PoolClient(cluster.pool_address, cluster.secret, timeout=2) as plain:  # plaintext to a TLS port
        with pytest.raises(Unavailable):
            plain.capacity()


def test_allocate_carries_a_whole_percent_and_still_reads_an_older_clients_fraction(cluster: RgpuCluster) -> None:
    """AllocateRequest's size is a oneof: `percent` (this client), `memory_bytes`, or the `fraction`
    double clients before the percent field send, read as Slurm reads a fraction: 0.5 is 50%, and
    0.001 is refused as below the smallest slice (it once leased 1%)."""
    from rgpu.errors import InvalidRequest
    from rgpu.proto import rgpu_pb2 as pb

    cluster.start_pool()
    with cluster.client() as client:
        register(client, servers=1, gpus=4)
        assert [s.compute_percent for s in client.allocate("new", "alice", 1, percent=25).slices] == [25]
        old = client._call("Allocate", pb.AllocateRequest(job_key="old", user="alice", count=1, fraction=0.5))
        assert [(s.compute_percent, s.memory_limit_bytes) for s in old.slices] == [(50, 40 * GiB)]
        assert pb.AllocateRequest.FromString(pb.AllocateRequest(fraction=0.5).SerializeToString()).WhichOneof(
            "size") == "fraction"
        for request, message in (
                (pb.AllocateRequest(job_key="tiny", user="alice", count=1, fraction=0.001),
                 "invalid fraction 0.001 (the smallest slice is 0.01 of a GPU"),
                (pb.AllocateRequest(job_key="zero", user="alice", count=1, percent=0), "invalid percent 0"),
                (pb.AllocateRequest(job_key="none", user="alice", count=1),
                 "neither a fraction nor a memory size was given")):
            with pytest.raises(InvalidRequest) as info:
                client._call("Allocate", request)
            assert message in str(info.value)
        assert sorted(lease.job_key for lease in client.list_leases()) == ["new", "old"]
