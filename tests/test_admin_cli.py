"""rgpu-admin against a real rgpu-poold: tables, --json, adaptor.conf, one-line errors, exit codes.

The CLI runs in-process (click's CliRunner): the pool daemon is the process boundary under test."""

from __future__ import annotations

import contextlib
import json
import time
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.adaptor import read_adaptor_conf
from rgpu.remoting.pool.client import PoolClient
from tests.daemons import EXAMPLES, RgpuCluster, register_servers as register, wait_for
from tests.dispatcher_helpers import wait_state
from tests.admin_helpers import admin, run_admin


@pytest.fixture
def cluster(tmp_path: Path):  # type: ignore[no-untyped-def]
    c = RgpuCluster(tmp_path)
    c.write_config(down_after_seconds=2.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.2)
    c.start_pool()
    yield c
    c.stop_all()


def test_request_list_release(cluster: RgpuCluster, tmp_path: Path) -> None:
    with cluster.client() as client:
        register(client, servers=2, gpus=2)
    conf_path = tmp_path / "out" / "adaptor.conf"
    out = admin(cluster, "request-gpus", "-n", "2", "-p", "0.5", "-o", str(conf_path), "--user", "alice").stdout
    assert "leased 2 slice(s)" in out
    conf = read_adaptor_conf(conf_path)
    assert len(conf.slices) == 2 and len({s.gpu_uuid for s in conf.slices}) == 2
    assert all(s.compute_percent == 50 and s.memory_limit_bytes == 40 * 2**30 for s in conf.slices)
    assert oct(conf_path.stat().st_mode & 0o777) == "0o600"

    gpus = json.loads(admin(cluster, "--json", "list-gpus").stdout)
    assert sum(g["allocated_percent"] for g in gpus) == 100 and {g["state"] for g in gpus} == {"up"}
    assert json.loads(admin(cluster, "list-gpus", "--json").stdout) == gpus
    table = admin(cluster, "list-gpus").stdout
    assert "ALLOC %" in table and "NVIDIA H100" in table
    leases = json.loads(admin(cluster, "leases", "--json").stdout)
    assert [(lease["job_key"], lease["user"], lease["units"]) for lease in leases] == [(conf.job_id, "alice", 100)]

    assert "released" in admin(cluster, "release-gpus", "-f", str(conf_path)).stdout
    assert "already released" in admin(cluster, "release-gpus", "-f", str(conf_path)).stdout
    assert json.loads(admin(cluster, "leases", "--json").stdout) == []


def test_ttl_and_memory_requests(cluster: RgpuCluster, tmp_path: Path) -> None:
    with cluster.client() as client:
        register(client, servers=1, gpus=1)
    admin(cluster, "request-gpus", "-n", "1", "-m", "20G", "--ttl", "1s", "-o", str(tmp_path / "a.conf"))
    assert read_adaptor_conf(tmp_path / "a.conf").slices[0].compute_percent == 25
    with cluster.client() as client:
        wait_for(lambda: client.list_leases() == [], timeout=10, what="the TTL lease to be reclaimed")


def test_a_ttl_lease_is_kept_by_renewing_it(cluster: RgpuCluster, tmp_path: Path) -> None:
    with cluster.client() as client:
        register(client, servers=1, gpus=1)
    conf = tmp_path / "a.conf"
    out = admin(cluster, "request-gpus", "-n", "1", "-p", "0.5", "--ttl", "2s", "-o", str(conf)).stdout
    assert f"rgpu-admin renew-gpus -f {conf} --ttl 2s" in out
    for _ in range(4):                                   # 4 s: twice its TTL, kept by renewing
        time.sleep(1)
        assert "renewed" in admin(cluster, "renew-gpus", "-f", str(conf), "--ttl", "2s").stdout
    with cluster.client() as client:
        assert len(client.list_leases()) == 1
        wait_for(lambda: client.list_leases() == [], timeout=10, what="the lease, no longer renewed, to be reclaimed")
    done = admin(cluster, "renew-gpus", "-f", str(conf), "--ttl", "2s", ok=False)
    assert done.returncode != 0 and done.stderr.strip().startswith("rgpu: pool: no lease") and \
        len(done.stderr.strip().splitlines()) == 1


def test_request_gpus_same_node_puts_every_slice_on_one_gpu_server_or_says_why_not(cluster: RgpuCluster,
                                                                                      tmp_path: Path) -> None:
    """`rgpu-admin request-gpus --same-node` (issue 27), as `flexrun -n N --same-node`: two real
    dispatchers of two GPUs each; two slices land on one server, three are refused with the pool's
    one line (exit 3, no file, no lease), and without --same-node the three spread over both."""
    for inventory in ("inventory-a.toml", "inventory-b.toml"):
        _daemon, port = cluster.start_dispatcher(EXAMPLES / inventory)
        wait_state(cluster, f"127.0.0.1:{port}", "up")
    two = tmp_path / "two.conf"
    admin(cluster, "request-gpus", "-n", "2", "-p", "0.5", "--same-node", "-o", str(two))
    assert len({s.server for s in read_adaptor_conf(two).slices}) == 1
    admin(cluster, "release-gpus", "-f", str(two))
    three = admin(cluster, "request-gpus", "-n", "3", "-p", "0.5", "--same-node", "-o", str(tmp_path / "x"), ok=False)
    assert three.returncode == 3, three.stderr
    assert three.stderr.splitlines() == [
        "rgpu: pool: cannot place 3 slice(s) of fraction 0.5 (same node) on one GPU server (4 GPU(s) can take one now, "
        "at most 2 of them on one server; wait for capacity, ask for fewer or smaller slices, or ask without "
        "--same-node so the slices may spread over several GPU servers)"], three.stderr
    assert not (tmp_path / "x").exists() and json.loads(admin(cluster, "leases", "--json").stdout) == []
    spread = tmp_path / "spread.conf"
    admin(cluster, "request-gpus", "-n", "3", "-p", "0.5", "-o", str(spread))
    assert len({s.server for s in read_adaptor_conf(spread).slices}) == 2


@pytest.mark.parametrize("args, code, message", [
    (["request-gpus", "-n", "1", "-p", "1.5", "-o", "x"], 2, "rgpu: admin: invalid fraction '1.5' (it must be more than 0 and at most 1"),
    (["request-gpus", "-n", "1", "-p", "0.5", "-m", "1G", "-o", "x"], 2, "rgpu: admin: -p and -m cannot be used together"),
    (["request-gpus", "-n", "9", "-p", "0.5", "-o", "x"], 3, "rgpu: pool: cannot place 9 slice(s)"),
    (["request-gpus", "-n", "1", "-m", "lots", "-o", "x"], 2, "rgpu: admin: invalid memory 'lots'"),
    (["drain", "nosuch"], 5, "rgpu: pool: no server 'nosuch'"),
    (["quota", "set", "user", "bad name", "5"], 2, "invalid user"),
    (["release-gpus", "-f", "/nonexistent"], 2, "rgpu: adaptor.conf: cannot read /nonexistent"),
    (["request-gpus", "-n", "1", "-p", "abc", "-o", "x"], 2,
     "rgpu: admin: invalid fraction 'abc' (not a number; write e.g. -p 0.5)"),
    (["request-gpus", "-n", "1", "-p", "0.001", "-o", "x"], 2,
     "rgpu: admin: invalid fraction '0.001' (the smallest slice is 0.01 of a GPU; ask for -p 0.01 or more)"),
    (["request-gpus", "-n", "0", "-p", "0.5", "-o", "x"], 2,
     "rgpu: pool: invalid count 0 (a job asks for at least 1 slice; ask for 1 or more slices"),
    (["drain"], 2, "rgpu: admin: invalid command line (Missing argument 'SERVER'; see `rgpu-admin drain --help`)"),
    (["no-such-command"], 2, "rgpu: admin: invalid command line (No such command 'no-such-command'"),
    (["--json", "secret", "create", "x"], 2, "rgpu: admin: `secret create` has no JSON output"),
])
def test_errors_are_one_line(cluster: RgpuCluster, tmp_path: Path, args: list[str], code: int, message: str) -> None:
    with cluster.client() as client:
        register(client, servers=1, gpus=2)
    run = admin(cluster, *args, ok=False)
    assert run.returncode == code, run.stderr
    assert run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
    assert not (tmp_path / "x").exists()


@contextlib.contextmanager
def heartbeating(client: PoolClient, address: str, every: float = 0.2) -> Iterator[None]:
    """Keep one dispatcher alive from a thread, as its Registrar would, however slow the steps between are."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            client.heartbeat(address)
            stop.wait(every)

    thread = threading.Thread(target=beat, name=f"heartbeat {address}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def test_health_drain_and_quota(cluster: RgpuCluster, tmp_path: Path) -> None:
    run = admin(cluster, "health", ok=False)
    assert run.returncode == 7 and "no dispatcher has registered" in run.stderr
    with cluster.client() as client:
        register(client, servers=2, gpus=1)
        # Server 0 stays alive for the whole test (each rgpu-admin start can take longer than the 2 s
        # down-after on a loaded 2-core machine); server 1 goes down after 2 s without heartbeats.
        with heartbeating(client, "127.0.0.1:56000"):
            wait_for(lambda: any(s.state == "down" for s in client.list_servers().servers),
                     timeout=10, what="server 1 down")
            run = admin(cluster, "health", ok=False)
            assert run.returncode == 7 and "1 server(s) down: 127.0.0.1:56001" in run.stderr
            rows = {r["server"]: r for r in json.loads(admin(cluster, "health", "--json", ok=False).stdout)}
            assert rows["127.0.0.1:56001"]["state"] == "down" and rows["127.0.0.1:56000"]["healthy"]
            assert "drained" in admin(cluster, "drain", "gpu0").stdout
            assert "up" in admin(cluster, "resume", "127.0.0.1:56000").stdout
    admin(cluster, "quota", "set", "user", "alice", "150")
    assert json.loads(admin(cluster, "quota", "show", "--json").stdout) == [
        {"kind": "user", "name": "alice", "limit_units": 150, "used_units": 0}]
    assert "removed" in admin(cluster, "quota", "remove", "user", "alice").stdout


def test_unreachable_pool(cluster: RgpuCluster) -> None:
    run = admin(cluster, "--pool", "127.0.0.1:1", "health", ok=False)
    assert run.returncode == 6 and run.stderr.startswith("rgpu: health: pool daemon at 127.0.0.1:1 is not serving")


def test_health_help_documents_its_exit_codes_and_json() -> None:
    text = " ".join(run_admin(["health", "--help"]).stdout.split())
    assert "6 the pool does not answer" in text and "7 the pool answers, but a dispatcher is down" in text
    assert 'with --deep one object, {"servers": [...], "checks": [...]}' in text


def test_commands_that_change_things_print_json(cluster: RgpuCluster, tmp_path: Path) -> None:
    with cluster.client() as client:
        register(client, servers=1, gpus=2)
    conf = tmp_path / "a.conf"
    made = json.loads(admin(cluster, "--json", "request-gpus", "-n", "2", "-p", "0.5", "--ttl", "1h", "--user", "alice",
                            "--job-key", "k1", "-o", str(conf)).stdout)
    assert made["job_key"] == "k1" and made["adaptor_conf"] == str(conf) and made["user"] == "alice"
    assert [(s["compute_percent"], s["memory_limit_bytes"]) for s in made["slices"]] == [(50, 40 * 2**30)] * 2
    assert made["expires_unix"] > time.time()
    renewed = json.loads(admin(cluster, "renew-gpus", "--job-key", "k1", "--ttl", "2h", "--json").stdout)
    assert renewed["job_key"] == "k1" and renewed["expires_unix"] > made["expires_unix"]
    assert json.loads(admin(cluster, "drain", "gpu0", "--json").stdout)["state"] == "drained"
    assert json.loads(admin(cluster, "--json", "resume", "gpu0").stdout)["state"] == "up"
    assert json.loads(admin(cluster, "quota", "set", "user", "alice", "150", "--json").stdout) == {
        "kind": "user", "name": "alice", "limit_units": 150, "used_units": 100}
    assert json.loads(admin(cluster, "quota", "remove", "user", "alice", "--json").stdout) == {
        "kind": "user", "name": "alice", "removed": True}
    assert json.loads(admin(cluster, "release-gpus", "-f", str(conf), "--json").stdout) == [
        {"job_key": "k1", "released": True}]
    assert json.loads(admin(cluster, "--json", "release-gpus", "--job-key", "k1").stdout) == [
        {"job_key": "k1", "released": False}]


def test_a_missing_secret_file_is_named_when_munge_fails_too(cluster: RgpuCluster, tmp_path: Path) -> None:
    run = run_admin(["--secret-file", str(tmp_path / "no-secret"), "drain", "gpu0"],
                    {"RGPU_POOL": cluster.pool_address, "RGPU_CONFIG": str(cluster.root / "rgpu.toml"),
                     "RGPU_MUNGE_SOCKET": str(tmp_path / "no-munged.socket")})
    assert run.returncode == 4, run.stderr
    assert run.stderr.startswith(f"rgpu: pool: no credential for this call (secret file {tmp_path / 'no-secret'} "
                                 "does not exist, and MUNGE failed: cannot get a MUNGE credential"), run.stderr
    assert "give a readable secret file" in run.stderr and run.stderr.count("\n") == 1


def test_secret_create(tmp_path: Path) -> None:
    run = run_admin(["secret", "create", str(tmp_path / "s")])
    assert run.returncode == 0 and oct((tmp_path / "s").stat().st_mode & 0o777) == "0o600"


def test_health_flags_dispatchers_whose_workers_launch_in_python(cluster: RgpuCluster) -> None:
    from rgpu.model import GpuInfo, ServerInfo
    from rgpu.remoting.pool.convert import server_to_pb

    with cluster.client() as client:
        for port, path in ((56010, "native"), (56011, "python (no C compiler found)")):
            gpu = GpuInfo(f"GPU-{port}", 0, "NVIDIA H100", 80 * 2**30, 80 * 2**30, "9.0")
            client.register_server(server_to_pb(ServerInfo(
                address=f"127.0.0.1:{port}", hostname="gpu", driver_version="580", cuda_version="13.0",
                gpus=(gpu,), compute_enforcement="mps", launch_path=path)))
    rows = {r["server"]: r for r in json.loads(admin(cluster, "health", "--json").stdout)}
    assert rows["127.0.0.1:56010"]["launch_path"] == "native" and rows["127.0.0.1:56010"]["notes"] == ""
    assert rows["127.0.0.1:56011"]["launch_path"] == "python (no C compiler found)"
    assert "kernel launches run in Python" in rows["127.0.0.1:56011"]["notes"]
    assert "kernel launches run in Python" in admin(cluster, "health").stdout
