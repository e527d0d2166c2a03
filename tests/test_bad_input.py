"""Every bad input is one clear line, against real daemons on loopback: damaged and zero-length
state files, a full disk under Allocate (a small tmpfs; needs root to mount), long inputs echoed
only in part, registrations that claim too much or carry control characters, and a client that
tries to set the address worker logs show."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rgpu.errors import InvalidRequest, NotFound, RgpuError
from rgpu.model import GpuInfo, ServerInfo
from rgpu.remoting.datapath import protocol
from rgpu.remoting.pool.convert import server_to_pb
from tests.daemons import EXAMPLES, RgpuCluster, register_servers, wait_for
from tests.dispatcher_helpers import wait_state

pytestmark = pytest.mark.integration
GiB = 2**30


def _pool_once(cluster: RgpuCluster, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", "127.0.0.1:0",
                           "--state", str(state)], env=cluster.env(), capture_output=True, text=True, timeout=30,
                          check=False)


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_a_zero_length_state_file_is_refused(cluster: RgpuCluster, tmp_path: Path) -> None:
    state = tmp_path / "pool.db"
    state.touch()
    done = _pool_once(cluster, state)
    assert done.returncode != 0
    assert _one_line(done.stderr).startswith(f"rgpu: store: state database {state} is empty (0 bytes)")


@pytest.mark.parametrize("blocked", ["a file where its folder goes", "a folder where the file goes"])
def test_a_state_path_that_cannot_be_made_is_one_line(cluster: RgpuCluster, tmp_path: Path, blocked: str) -> None:
    # (A read-only mount fails the same calls; root ignores permission bits, so a file stands in.)
    if blocked == "a file where its folder goes":
        (tmp_path / "afile").write_text("")
        state = tmp_path / "afile" / "pool.db"
    else:
        state = tmp_path / "adir"
        state.mkdir()
    done = _pool_once(cluster, state)
    assert done.returncode != 0
    assert _one_line(done.stderr).startswith(f"rgpu: store: cannot open state database {state}")


@pytest.mark.parametrize("damage", ["garbage", "row"])
def test_a_damaged_state_file_is_one_line(cluster: RgpuCluster, tmp_path: Path, damage: str) -> None:
    state = tmp_path / "pool.db"
    if damage == "garbage":
        state.write_bytes(os.urandom(8192))
    else:
        cluster.state = state
        cluster.start_pool()
        with cluster.client() as client:
            register_servers(client, servers=1, gpus=1)
        assert cluster.pool is not None
        cluster.pool.kill()
        with sqlite3.connect(state) as db:
            db.execute("INSERT INTO leases VALUES ('job-x', 'alice', '', 0, 0, '{not json')")
    done = _pool_once(cluster, state)
    assert done.returncode != 0
    assert _one_line(done.stderr).startswith("rgpu: store: ")


def test_long_input_is_echoed_only_in_part(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    big = "A" * (1 << 20)
    with cluster.client() as client:
        register_servers(client, servers=1, gpus=1)
        for call in (lambda: client.get_lease(big), lambda: client.set_server_state(big, True),
                     lambda: client.set_quota(big, "x", 5),
                     lambda: client.allocate("k", "alice", 1, percent=50, gpu_model=big)):
            with pytest.raises(RgpuError) as info:
                call()
            text = str(info.value)
            assert len(text) < 400 and "\n" not in text and "[1048" in text, text[:500]


def _server(address: str, gpus: int = 1, name: str = "NVIDIA H100", memory: int = 80 * GiB,
            uuid_prefix: str = "GPU-r") -> ServerInfo:
    return ServerInfo(address=address, hostname="gpu9", driver_version="580", cuda_version="13.0",
                      gpus=tuple(GpuInfo(f"{uuid_prefix}-{i}", i, name, memory, memory, "9.0") for i in range(gpus)))


@pytest.mark.parametrize("info, message", [
    (_server("127.0.0.1:56100", name="H100\n127.0.0.1:1 forged row"), "invalid GPU name"),
    (_server("127.0.0.1:56100", name="H100\x1b[2J"), "invalid GPU name"),
    (_server("127.0.0.1:56100", gpus=1000), "registers 1000 GPUs"),
    (_server("127.0.0.1:56100", memory=2**62), "invalid GPU memory"),
])
def test_registrations_that_claim_too_much_are_refused(cluster: RgpuCluster, info: ServerInfo, message: str) -> None:
    cluster.start_pool()
    with cluster.client() as client:
        with pytest.raises(InvalidRequest, match=message) as raised:
            client.register_server(server_to_pb(info))
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 400
        assert client.list_servers().servers == []


def test_a_reregistration_dropping_leased_gpus_is_refused(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    with cluster.client() as client:
        client.register_server(server_to_pb(_server("127.0.0.1:56100", gpus=2)))
        lease = client.allocate("job-held", "alice", 2, percent=50)
        with pytest.raises(InvalidRequest, match="re-registers without GPU.* that live leases hold"):
            client.register_server(server_to_pb(_server("127.0.0.1:56100", gpus=0)))
        assert len(client.get_lease("job-held").slices) == len(lease.slices) == 2
        assert {g.gpu.uuid for g in client.list_gpus()} == {"GPU-r-0", "GPU-r-1"}
        assert client.release("job-held")
        client.register_server(server_to_pb(_server("127.0.0.1:56100", gpus=0)))   # nothing held: fine


def test_the_client_cannot_set_the_address_worker_logs_show(cluster: RgpuCluster) -> None:
    import socket
    cluster.start_pool()
    daemon, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
    address = f"127.0.0.1:{port}"
    wait_state(cluster, address, "up")
    with cluster.client() as client:
        token = client.allocate("job-addr", "alice", 1, percent=50).slices[0].token
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(protocol.encode_hello(token, info={"address": "6.6.6.6:66", "host": "evil\nforged line", "pid": 1}))
    (_, op, _, _, _, _), _payload = protocol.recv_frame(s, 1 << 20)
    assert op == protocol.OP_WELCOME
    wait_for(lambda: "session open: job job-addr" in daemon.log(), what="the worker's first line")
    s.close()
    line = next(x for x in daemon.log().splitlines() if "session open: job job-addr" in x)
    assert "6.6.6.6" not in daemon.log() and "'address': '127.0.0.1:" in line and "evil?forged line" in line


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, check=False).returncode == 0


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_a_clear_error_and_the_pool_restarts(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("needs root to mount a small tmpfs as the full disk")
    cluster = RgpuCluster(tmp_path / "cluster")
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5)
    cluster.state = disk / "pool.db"
    try:
        cluster.start_pool()
        with cluster.client() as client:
            register_servers(client, servers=1, gpus=4)
            client.allocate("job-before", "alice", 1, percent=25)
        filler = _fill(disk)
        refused = None
        with cluster.client() as client:
            for n in range(200):
                try:
                    client.allocate(f"job-{n}", "alice", 1, percent=1)
                except RgpuError as exc:
                    refused = str(exc)
                    break
        assert refused is not None, "the disk never filled"
        assert _one_line(refused).startswith(f"rgpu: store: cannot save the pool's state in {cluster.state} "
                                             "(database or disk is full"), refused
        assert "a bug" not in refused
        assert cluster.pool is not None and cluster.pool.alive
        cluster.pool.kill()
        cluster.start_pool()                                    # on the full disk: it starts, and reads
        with cluster.client() as client:
            assert "job-before" in [lease.job_key for lease in client.list_leases()]
        filler.unlink()
        with cluster.client() as client:
            client.allocate("job-after", "alice", 1, percent=25)
    finally:
        cluster.stop_all()
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("processes", ["1", "2"])
def test_release_on_a_full_disk_is_one_line_naming_the_state_file_and_its_disk(tmp_path: Path, processes: str) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "4m"):
        pytest.skip("needs root to mount a small tmpfs as the full disk")
    cluster = RgpuCluster(tmp_path / "cluster")
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5)
    cluster.state = disk / "pool.db"
    try:
        cluster.start_pool("--processes", processes)
        with cluster.client() as client:
            register_servers(client, servers=1, gpus=4)
            for n in range(20):
                client.allocate(f"job-{n}", "alice", 1, percent=1)
        filler = _fill(disk)
        refused = []
        with cluster.client() as client:
            for n in range(20):
                try:
                    client.release(f"job-{n}")
                except RgpuError as exc:
                    refused.append(str(exc))
        assert refused, "every release found room on the full disk"
        for message in refused:
            line = _one_line(message)
            assert "a bug" not in line and "internal error" not in line, line
            # With several processes the shared call guards beside the state file may be the first
            # write to fail: "cannot check the call's credential now (.../pool.db.calls: ... full)".
            assert line.startswith((f"rgpu: store: cannot save the pool's state in {cluster.state}",
                                    "rgpu: pool: cannot check the call's credential now")), line
            assert str(disk) in line and "full" in line, line
        assert cluster.pool is not None and cluster.pool.alive
        filler.unlink()
        with cluster.client() as client:
            for n in range(20):
                client.release(f"job-{n}")
            assert client.list_leases() == []
    finally:
        cluster.stop_all()
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_fresh_state_path_on_a_read_only_mount_is_one_line(cluster: RgpuCluster, tmp_path: Path) -> None:
    disk = tmp_path / "ro"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)
        done = _pool_once(cluster, disk / "pool.db")
        assert done.returncode != 0
        line = _one_line(done.stderr)
        assert line.startswith(f"rgpu: store: cannot open state database {disk / 'pool.db'}"), line
        assert "read-only" in line, line
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_not_found_messages_name_the_key_briefly(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    with cluster.client() as client:
        with pytest.raises(NotFound):
            client.renew("job-none", 10)


def test_a_live_dispatchers_address_cannot_be_taken_from_another_host(cluster: RgpuCluster) -> None:
    """Every daemon holds the secret: a registration or heartbeat for a live server's address from
    another IP is refused. Loopback gives two IPs: 127.0.0.1 and ::1 (the pool listens on both)."""
    from rgpu.remoting.pool.client import PoolClient
    from rgpu.errors import PermissionDenied
    cluster.start_pool("--listen", "[::]:0")
    mine = _server("127.0.0.1:56100", gpus=2)
    with cluster.client() as owner, PoolClient(f"[::1]:{cluster.pool_port}", cluster.secret, timeout=5) as other:
        owner.register_server(server_to_pb(mine))
        assert owner.heartbeat("127.0.0.1:56100").known
        with pytest.raises(PermissionDenied, match="registered from 127.0.0.1 and is not down") as info:
            other.register_server(server_to_pb(_server("127.0.0.1:56100", gpus=0)))
        assert "from ::1 refused" in str(info.value) and "\n" not in str(info.value)
        with pytest.raises(PermissionDenied, match="heartbeat for server 127.0.0.1:56100 from ::1 refused"):
            other.heartbeat("127.0.0.1:56100")
        assert {g.gpu.uuid for g in owner.list_gpus()} == {"GPU-r-0", "GPU-r-1"}
        # Down (no heartbeats for down_after_seconds): the address may move to a new host.
        wait_for(lambda: [s.state for s in owner.list_servers().servers] == ["down"], timeout=10,
                 what="the server to be down")
        other.register_server(server_to_pb(_server("127.0.0.1:56100", gpus=1)))
        assert other.heartbeat("127.0.0.1:56100").known


def test_registrations_whose_clients_gave_up_bind_nothing(tmp_path: Path) -> None:
    """Issue 26 (LOW): a registration answered after its client gave up must not bind the address
    to an empty peer (which would refuse the real dispatcher while the server is live). Two ways to
    give up while the pool holds the call (the shared call guards' lock, held here): a deadline, and
    a client process killed. Neither call is served; the dispatcher's own registration then is, and
    binds the address to its host."""
    import fcntl
    import textwrap
    cluster = RgpuCluster(tmp_path / "cluster")
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=30.0, reclaim_interval_seconds=0.5)
    info = ServerInfo(address="127.0.0.1:56000", hostname="gpu0", driver_version="580", cuda_version="13.0",
                      gpus=(GpuInfo("GPU-0-0", 0, "NVIDIA H100", 80 * GiB, 80 * GiB, "9.0"),))
    program = textwrap.dedent(f"""
        from rgpu.model import GpuInfo, ServerInfo
        from rgpu.remoting.pool.client import PoolClient
        from rgpu.remoting.pool.convert import server_to_pb
        from rgpu.secret import load_secret
        info = ServerInfo(address="127.0.0.1:56000", hostname="gpu0", driver_version="580", cuda_version="13.0",
                          gpus=(GpuInfo("GPU-0-0", 0, "NVIDIA H100", {80 * GiB}, {80 * GiB}, "9.0"),))
        with PoolClient("{{address}}", load_secret("{cluster.secret_file}"), timeout=60) as client:
            client.register_server(server_to_pb(info))
    """)
    try:
        cluster.start_pool("--processes", "2", "--listen", "[::]:0")   # 127.0.0.1 and ::1: two hosts
        with cluster.client() as client:
            client.capacity()
        lock = os.open(f"{cluster.state}.calls.lock", os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            from rgpu.remoting.pool.client import PoolClient
            with PoolClient(cluster.pool_address, cluster.secret, timeout=0.5) as impatient:
                with pytest.raises(RgpuError, match="did not answer"):
                    impatient.register_server(server_to_pb(info))
            killed = subprocess.Popen([sys.executable, "-c", program.replace("{address}", cluster.pool_address)],
                                      env=cluster.env())
            wait_for(lambda: len(os.listdir(f"/proc/{killed.pid}/task")) > 2, what="the client to call")
            killed.kill()
            killed.wait()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)
        with cluster.client() as client:
            client.register_server(server_to_pb(info))       # the dispatcher's own: served
            assert [s.address for s in client.list_servers().servers] == ["127.0.0.1:56000"]
        from rgpu.remoting.pool.client import PoolClient
        with PoolClient(f"[::1]:{cluster.pool_port}", cluster.secret, timeout=5) as other:
            with pytest.raises(RgpuError, match="registered from 127.0.0.1"):   # bound to its host, not ""
                other.register_server(server_to_pb(info))
    finally:
        cluster.stop_all()


def test_a_peer_that_is_no_ip_binds_nothing() -> None:
    from rgpu.remoting.pool.servicer import _is_ip
    assert _is_ip("10.0.0.7") and _is_ip("::1")
    assert not _is_ip("") and not _is_ip("unix:/run/x") and not _is_ip("unknown")


def test_peer_ip_reads_grpc_peer_strings() -> None:
    from rgpu.remoting.pool.servicer import peer_ip
    assert peer_ip("ipv4:10.0.0.7:5555") == "10.0.0.7"
    assert peer_ip("ipv6:%5B::1%5D:5555") == "::1"
    assert peer_ip("ipv6:[::ffff:10.0.0.7]:5555") == "10.0.0.7"
    assert peer_ip("unix:/run/x") == "unix:/run/x"
