"""rgpu-poold --processes N: several pool processes on one port and one SQLite file (shared mode
of store.py, group.py), with real SQLite files and real daemons on loopback."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rgpu.config import load_settings
from rgpu.errors import CapacityError
from rgpu.remoting.pool.client import connect
from rgpu.remoting.pool.rules import PoolCore
from rgpu.remoting.pool.store import SCHEMA_VERSION, Store
from tests.daemons import AllocationBurst, RgpuCluster, register_servers, wait_for
from tests.poolcore_helpers import SECRET, Clock, pool_state, req, server, two_cores


def _core(db: Path, clock: Clock) -> PoolCore:
    return PoolCore(store=Store(db, shared=True), secret=SECRET, down_after_seconds=1e6, clock=clock,
                    idle_after_seconds=600.0)


@pytest.fixture
def two_processes(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two pool cores on one SQLite file, each on its own connection, as two processes hold them."""
    with two_cores(lambda: Store(tmp_path / "pool.db", shared=True)) as cores:
        yield cores


def test_each_process_sees_what_the_other_changed_from_the_change_log(two_processes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b, clock = two_processes
    for n in range(2):
        a.register(server(n))
    a.allocate(req("job-1", count=2))
    b.allocate(req("job-2", ttl_seconds=60.0))
    a.release("job-1")
    b.set_drained("gpu1", True)
    a.set_quota("user", "alice", 900)
    b.renew("job-2", 600.0)
    clock.now += 120
    assert a.reclaim_expired() == []                    # renewed through b: a must not reclaim it
    assert pool_state(a) == pool_state(b)
    fresh = _core(tmp_path / "pool.db", clock)
    try:
        assert pool_state(fresh) == pool_state(a)
        assert a.token_for(a.get_lease("job-2"), 0) == fresh.token_for(fresh.get_lease("job-2"), 0)
    finally:
        fresh.store.close()
    assert a.full_reloads == b.full_reloads == 0


def test_a_process_behind_the_pruned_change_log_reloads(two_processes) -> None:  # type: ignore[no-untyped-def]
    a, b, _clock = two_processes
    a.store.change_log_keep, a.store.prune_every = 2, 1
    a.register(server(0, gpus=4))
    for n in range(5):
        a.allocate(req(f"job-{n}", percent=25))
    assert pool_state(b) == pool_state(a) and b.full_reloads == 1


def test_heartbeats_and_usage_reports_reach_every_process(two_processes) -> None:  # type: ignore[no-untyped-def]
    from rgpu.remoting.pool.accounting import SliceUsageRecord
    a, b, clock = two_processes
    a.register(server(0))
    b.down_after_seconds = 30.0
    clock.now += 20
    a.heartbeat(server(0).address)                       # the dispatcher's heartbeat went to a
    clock.now += 20
    assert b.check_down_servers() == []                  # b sees it: 20 s ago, not 40
    a.allocate(req("busy"))
    a.allocate(req("idle"))
    clock.now += 1000
    report = SliceUsageRecord(sessions=1, busy_seconds=900.0, last_active_unix=clock.now - 5, calls=10)
    a.record_usage(server(0).address, [("busy", 0, report)], sent_unix=clock.now)
    assert b.release_idle() == ["idle"]


def test_concurrent_allocations_through_both_never_over_commit(two_processes) -> None:  # type: ignore[no-untyped-def]
    a, b, _clock = two_processes
    a.register(server(0, gpus=4))                        # room for 8 half-GPU slices
    placed: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()

    def burst(core: PoolCore, name: str) -> None:
        for i in range(10):
            try:
                core.allocate(req(f"{name}-{i}", percent=50))
            except CapacityError:
                with lock:
                    refused.append(name)
                continue
            with lock:
                placed.append(name)

    threads = [threading.Thread(target=burst, args=(core, f"{n}")) for n, core in enumerate((a, b, a, b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(placed) == 8 and len(refused) == 32
    for core in (a, b):
        assert all(gpu.allocated_percent <= 100 for gpu in core.gpu_statuses())


def test_a_state_file_of_the_first_layout_opens_with_its_leases(tmp_path: Path) -> None:
    db = tmp_path / "pool.db"
    core = PoolCore(store=Store(db), secret=SECRET, clock=Clock())
    core.register(server(0))
    core.allocate(req("kept"))
    core.store.close()
    with sqlite3.connect(db) as old:                     # back to layout 1: no shared-mode tables
        for table in ("pool_meta", "pool_changes", "heartbeats", "slice_usage"):
            old.execute(f"DROP TABLE {table}")
        old.execute("PRAGMA user_version=1")
    for shared in (False, True):
        again = PoolCore(store=Store(db, shared=shared), secret=SECRET, clock=Clock())
        assert [lease.job_key for lease in again.list_leases()] == ["kept"]
        again.store.close()
    with sqlite3.connect(db) as upgraded:
        assert upgraded.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


# ------------------------------------------------------------------ the daemon

def _children(pid: int) -> list[int]:
    return [int(c) for task in os.listdir(f"/proc/{pid}/task")
            for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]


def _state(pid: int) -> str | None:
    """A process's state letter ("Z": a zombie), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return None


def _pool_children(pid: int) -> list[int]:
    """The pool processes (not multiprocessing's resource tracker)."""
    return [c for c in _children(pid) if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]


@pytest.mark.integration
def test_a_burst_through_two_processes_and_kill_9_of_one(tmp_path: Path) -> None:
    cluster = RgpuCluster(tmp_path)
    cluster.write_config(down_after_seconds=30.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5)
    cluster.start_pool("--processes", "2")
    try:
        assert cluster.pool is not None and cluster.pool.proc is not None
        parent = cluster.pool.proc.pid
        wait_for(lambda: len(_pool_children(parent)) == 2, what="two pool processes")
        with cluster.client() as admin:
            register_servers(admin, servers=4, gpus=4)        # 16 GPUs: room for 32 half-GPU slices
        # The address twice: a call whose connection died with its process is tried again on a
        # new connection (the client's failover), which reaches a live process.
        settings = load_settings(env=cluster.env(RGPU_POOL=f"{cluster.pool_address},{cluster.pool_address}"))
        burst = AllocationBurst()
        # Workers 0-2 ask twice, then wait for the kill: at most 3*8 + 3*2 = 30 asks come before
        # it, so the pool's room (32) is filled by asks after it, however loaded the host is.
        held_back, killed = threading.Semaphore(0), threading.Event()

        def worker(n: int) -> None:
            for i in range(8):                                 # a new channel per call
                if n < 3 and i == 2:
                    held_back.release()
                    killed.wait(timeout=60)
                with connect(settings, timeout=10.0) as client:
                    burst.ask(client, f"job-{n}-{i}", f"user{n}")
                time.sleep(0.05)                               # a burst long enough to kill into

        threads = burst.start(6, worker)
        for _ in range(3):
            assert held_back.acquire(timeout=60), "the held-back workers never reached the kill"
        # kill -9 mid-burst of the process serving it (this test's channels share one connection)
        serving = [line for line in cluster.pool.log().splitlines() if "rgpu-poold: lease job-" in line][-1]
        victim = int(serving.split(" pid ", 1)[1].split("]", 1)[0])
        assert victim in _pool_children(parent)
        os.kill(victim, signal.SIGKILL)
        at_kill = len(burst.acknowledged)
        killed.set()
        for thread in threads:
            thread.join(timeout=60)
        assert not burst.failures, burst.failures
        assert len(burst.acknowledged) == 32 and len(burst.refused) == 16   # exactly the pool's room, never more
        assert at_kill <= 30                                    # so some were placed after the kill
        with connect(settings, timeout=10.0) as admin:
            held = {lease.job_key for lease in admin.list_leases()}
            assert set(burst.acknowledged) <= held             # nothing acknowledged was lost
            for gpu in admin.list_gpus():
                assert gpu.allocated_percent <= 100
        wait_for(lambda: len(_pool_children(parent)) == 2 and victim not in _pool_children(parent),
                 what="the parent to start the killed process again")
        assert "exited with status -9; starting it again" in cluster.pool.log()
    finally:
        cluster.stop_all()


@pytest.mark.integration
def test_the_processes_end_with_a_parent_killed_with_kill_9(tmp_path: Path) -> None:
    # Left serving, they would answer beside a new pool started on their port's neighbour, with
    # nothing to restart them (issue 26, LOW).
    cluster = RgpuCluster(tmp_path)
    cluster.start_pool("--processes", "2")
    try:
        assert cluster.pool is not None and cluster.pool.proc is not None
        parent = cluster.pool.proc.pid
        wait_for(lambda: len(_pool_children(parent)) == 2, what="two pool processes")
        children = _pool_children(parent)
        os.kill(parent, signal.SIGKILL)

        wait_for(lambda: all(_state(pid) in (None, "Z") for pid in children),
                 what="the pool processes to end with their parent", timeout=20)
    finally:
        cluster.stop_all()


def _zombies(pid: int) -> list[int]:
    return [child for child in _children(pid) if _state(child) == "Z"]


@pytest.mark.integration
def test_a_restarted_process_leaves_no_zombie(tmp_path: Path) -> None:
    cluster = RgpuCluster(tmp_path)
    cluster.start_pool("--processes", "2")
    try:
        assert cluster.pool is not None and cluster.pool.proc is not None
        parent = cluster.pool.proc.pid
        wait_for(lambda: len(_pool_children(parent)) == 2, what="two pool processes")
        for round_ in range(2):
            victim = _pool_children(parent)[0]
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: victim not in _children(parent) and len(_pool_children(parent)) == 2
                     and not _zombies(parent), what=f"a restart without a zombie (round {round_}): "
                     f"zombies {_zombies(parent)}", timeout=20)
        with cluster.client() as client:
            assert client.capacity().total_units == 0
    finally:
        cluster.stop_all()


@pytest.mark.integration
def test_another_pool_daemon_cannot_take_the_groups_port(tmp_path: Path) -> None:
    cluster = RgpuCluster(tmp_path / "a")
    cluster.start_pool("--processes", "2")
    try:
        other = subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", cluster.pool_address,
                                "--state", str(tmp_path / "other.db")], env=cluster.env(), capture_output=True,
                               text=True, timeout=60, check=False)
        assert other.returncode != 0
        assert f"cannot listen on {cluster.pool_address}" in other.stderr, other.stderr
    finally:
        cluster.stop_all()


@pytest.mark.integration
@pytest.mark.parametrize("value", ["0", "-3", "65", "100000000000000000000"])
def test_a_process_count_out_of_range_is_one_line(tmp_path: Path, value: str) -> None:
    cluster = RgpuCluster(tmp_path)
    cluster.write_config()
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", "127.0.0.1:0",
                           "--state", str(tmp_path / "pool.db"), "--processes", value], env=cluster.env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pool_processes" in lines[0] and "1 to 64" in lines[0], done.stderr


def _call_on_a_new_connection(address: str, method: str, request: object, credential: str) -> object:
    """One call on a connection of its own (no subchannel shared with other channels), so the kernel
    may hand it to any of the group's processes."""
    import grpc

    from rgpu.proto import rgpu_pb2_grpc as pb_grpc
    from rgpu.remoting.pool.auth import AUTH_HEADER
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        return getattr(pb_grpc.PoolStub(channel), method)(request, metadata=((AUTH_HEADER, credential),), timeout=10)


@pytest.mark.integration
def test_a_credential_is_good_for_one_call_in_whichever_process(tmp_path: Path) -> None:
    """The processes share the nonces they saw: a replay on another connection (another process,
    as the kernel spreads connections) is refused like a replay to a single-process pool."""
    import grpc

    from rgpu.proto import rgpu_pb2 as pb
    from rgpu.remoting.pool.auth import request_credential
    cluster = RgpuCluster(tmp_path)
    cluster.start_pool("--processes", "2")
    try:
        credential = request_credential(cluster.secret, "/rgpu.v1.Pool/Capacity")
        answered, refused = 0, []
        for _ in range(16):   # all 16 on one process of two: odds of 1 in 32,768
            try:
                _call_on_a_new_connection(cluster.pool_address, "Capacity", pb.CapacityRequest(), credential)
                answered += 1
            except grpc.RpcError as exc:
                refused.append((exc.code(), exc.details()))   # type: ignore[attr-defined]
        assert answered == 1
        assert all(code == grpc.StatusCode.UNAUTHENTICATED and "replayed credential" in details
                   for code, details in refused), refused
        # Each new credential still works, in either process.
        for _ in range(4):
            _call_on_a_new_connection(cluster.pool_address, "Capacity", pb.CapacityRequest(),
                                      request_credential(cluster.secret, "/rgpu.v1.Pool/Capacity"))
    finally:
        cluster.stop_all()


@pytest.mark.integration
def test_a_live_servers_address_stays_with_its_host_in_every_process(tmp_path: Path) -> None:
    """Registration binds a dispatcher's address to its IP for all the group's processes: another
    host (::1 here, the owner being 127.0.0.1) is refused on every connection."""
    import grpc

    from rgpu.model import GpuInfo, ServerInfo
    from rgpu.proto import rgpu_pb2 as pb
    from rgpu.remoting.pool.auth import request_credential
    from rgpu.remoting.pool.convert import server_to_pb
    cluster = RgpuCluster(tmp_path)
    cluster.start_pool("--processes", "2", "--listen", "[::]:0")
    try:
        mine = ServerInfo(address="127.0.0.1:56100", hostname="gpu-r", driver_version="580", cuda_version="13.0",
                          gpus=(GpuInfo("GPU-r-0", 0, "NVIDIA H100", 80 << 30, 80 << 30, "9.0"),))
        with cluster.client() as owner:
            owner.register_server(server_to_pb(mine))
        other = f"[::1]:{cluster.pool_port}"
        for _ in range(8):
            for method, request in (("Heartbeat", pb.HeartbeatRequest(address=mine.address)),
                                    ("RegisterServer", pb.RegisterServerRequest(server=server_to_pb(mine)))):
                with pytest.raises(grpc.RpcError) as info:
                    _call_on_a_new_connection(other, method, request,
                                              request_credential(cluster.secret, f"/rgpu.v1.Pool/{method}"))
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED   # type: ignore[attr-defined]
                assert "registered from 127.0.0.1 and is not down" in info.value.details()   # type: ignore[attr-defined]
        with cluster.client() as owner:
            assert owner.heartbeat(mine.address).known
    finally:
        cluster.stop_all()


def test_ownership_is_decided_after_catching_up_with_the_other_process(two_processes) -> None:  # type: ignore[no-untyped-def]
    """Issue 26, HIGH 1: a lease made a moment ago through one process was nobody's in the other's
    memory, so another user's Release or Renew there passed the check and then acted. The core
    decides ownership inside the change, after catching up."""
    from rgpu.errors import PermissionDenied

    a, b, clock = two_processes
    a.register(server(0))
    lease = a.allocate(req("job-alice", ttl_seconds=60.0))
    assert "job-alice" not in b.leases                  # b has not caught up yet
    with pytest.raises(PermissionDenied, match="cannot release lease job-alice"):
        b.release("job-alice", owner="mallory")
    with pytest.raises(PermissionDenied, match="cannot renew lease job-alice"):
        b.renew("job-alice", 365 * 24 * 3600.0, owner="mallory")
    assert a.get_lease("job-alice").expires_unix == lease.expires_unix    # neither released nor renewed
    assert b.renew("job-alice", 120.0, owner=lease.user).expires_unix == clock.now + 120.0
    assert b.release("job-alice", owner=lease.user) and "job-alice" not in b.leases


def test_two_processes_admitting_from_one_look_never_release_more_than_the_pool_holds(two_processes) -> None:  # type: ignore[no-untyped-def]
    """As two daemons on PostgreSQL (test_pool_postgres.py): an admission pass holds the state
    file's admission lock, so two processes never release held jobs into the same room."""
    from tests.admission_race import admit_from_one_look, released_fit

    a, b, _clock = two_processes
    released, core = admit_from_one_look(a, b)
    assert released and released_fit(released, core), f"jobs {released} released into room for fewer"
