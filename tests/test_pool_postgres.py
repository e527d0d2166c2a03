"""Several pool daemons on one real PostgreSQL (Debian's package, on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rgpu.config import load_settings
from rgpu.errors import ConfigError, Unavailable
from rgpu.remoting.pool.client import connect
from rgpu.remoting.pool.rules import PoolCore
from rgpu.remoting.pool.store_pg import PostgresStore
from tests.daemons import AllocationBurst, RgpuCluster, register_servers, two_clusters, wait_for
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.pool.accounting import SliceUsageRecord
from tests.poolcore_helpers import SECRET, Clock, make_core, pool_state, req, server
from tests.poolcore_helpers import two_cores as cores_on_one_store
from tests.postgres import Postgres, server_bin

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(server_bin() is None, reason="PostgreSQL is not installed (apt-get install postgresql)")]
psycopg = pytest.importorskip("psycopg")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def postgres():  # type: ignore[no-untyped-def]
    server = Postgres().start()
    yield server
    server.stop()


@pytest.fixture
def two_pools(tmp_path: Path, postgres: Postgres):  # type: ignore[no-untyped-def]
    first, second = two_clusters(tmp_path)   # one cluster secret
    for cluster in (first, second):
        cluster.write_config(down_after_seconds=30.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5,
                             store_url=postgres.url)
        cluster.start_pool()
    yield first, second
    for cluster in (first, second):
        cluster.stop_all()


def test_both_pools_see_one_state(two_pools) -> None:  # type: ignore[no-untyped-def]
    first, second = two_pools
    with first.client() as a, second.client() as b:
        register_servers(a, servers=2, gpus=2)
        lease = a.allocate("job-1", "alice", 1, percent=50)
        again = b.allocate("job-1", "alice", 1, percent=50)     # the same job key on the other daemon
        assert again.slices[0].token == lease.slices[0].token
        assert b.get_lease("job-1").job_key == "job-1"
        assert len(b.list_gpus()) == 4
        assert b.release("job-1") and not a.release("job-1")
        assert a.list_leases() == []


def test_a_burst_through_both_never_over_commits_and_kill_9_loses_no_acknowledged_lease(two_pools) -> None:  # type: ignore[no-untyped-def]
    first, second = two_pools
    with first.client() as a:
        register_servers(a, servers=4, gpus=4)                    # 16 GPUs: room for 32 half-GPU slices
    settings_ab = load_settings(env=first.env(RGPU_POOL=f"{first.pool_address},{second.pool_address}"))
    settings_ba = load_settings(env=first.env(RGPU_POOL=f"{second.pool_address},{first.pool_address}"))
    burst = AllocationBurst()

    def worker(n: int) -> None:
        with connect(settings_ab if n % 2 else settings_ba, timeout=10.0) as client:
            for i in range(8):
                burst.ask(client, f"job-{n}-{i}", f"user{n}")

    threads = burst.start(6, worker)
    first.pool.kill()                                              # kill -9 mid-burst
    for thread in threads:
        thread.join(timeout=60)
    assert not burst.failures, burst.failures
    assert len(burst.acknowledged) + len(burst.refused) == 48
    assert len(burst.acknowledged) == 32 and len(burst.refused) == 16   # exactly the pool's room, never more
    with second.client() as b:
        held = {lease.job_key for lease in b.list_leases()}
        assert set(burst.acknowledged) <= held
        for gpu in b.list_gpus():
            assert gpu.allocated_percent <= 100 and gpu.allocated_memory_bytes <= gpu.gpu.usable_memory_bytes


def test_a_dispatcher_heartbeating_to_one_daemon_is_up_on_the_other(tmp_path: Path, postgres: Postgres) -> None:
    first, second = two_clusters(tmp_path)   # one cluster secret
    try:
        for cluster in (first, second):
            cluster.write_config(down_after_seconds=2.0, heartbeat_interval_seconds=0.3,
                                 reclaim_interval_seconds=0.3, store_url=postgres.url)
            cluster.start_pool()
        first.start_dispatcher(EXAMPLES / "inventory-a.toml")       # knows the first daemon only
        with second.client() as b:
            wait_for(lambda: [s.state for s in b.list_servers().servers] == ["up"], what="the server on the other daemon")
            time.sleep(3.0)                                         # longer than down_after_seconds
            assert [s.state for s in b.list_servers().servers] == ["up"]
            assert b.allocate("job-1", "alice", 1, percent=50).slices
    finally:
        for cluster in (first, second):
            cluster.stop_all()


def test_rgpu_admin_migrates_sqlite_state_into_postgresql(tmp_path: Path, postgres: Postgres) -> None:
    clock = Clock()
    db = tmp_path / "pool.db"
    before = make_core(db, clock, servers=2)
    lease = before.allocate(req("job-1", count=2, percent=50, account="physics"))
    before.allocate(req("job-2", percent=25))
    clock.now += 3600
    before.release("job-2")                                         # history
    before.set_drained("gpu1", True)
    before.set_quota("user", "alice", 500)
    before.store.close()

    def admin(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
        return subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "--config", str(tmp_path / "none.toml"),
                               "migrate-state", "--from", str(db), "--to", postgres.url],
                              capture_output=True, text=True, env=env, timeout=60)

    (tmp_path / "none.toml").write_text("")
    done = admin()
    assert done.returncode == 0, done.stderr
    assert "copied 2 servers, 1 leases, 1 quotas, 1 history" in done.stdout
    after = PoolCore(store=PostgresStore(postgres.url), secret=SECRET, down_after_seconds=10, clock=clock)
    try:
        assert after.get_lease("job-1") == lease
        assert after.token_for(after.get_lease("job-1"), 0) == before.token_for(lease, 0)
        assert after.servers["127.0.0.1:55002"].drained and not after.servers["127.0.0.1:55001"].drained
        assert after.quota_usage()[0][0].limit_units == 500
        totals = after.usage_totals(clock.now - 7200, clock.now)
        # the live lease (2 x 50% for an hour) and the ended one from the history (25% for an hour)
        assert {(t.account, t.gpu_percent_hours, t.leases) for t in totals} == {("physics", 100.0, 1), ("", 25.0, 1)}
    finally:
        after.store.close()
    again = admin()
    assert again.returncode == 2 and again.stderr.startswith("rgpu: migrate-state: the PostgreSQL store already holds")
    assert again.stderr.count("\n") == 1


def test_a_pool_daemon_reconnects_after_postgresql_restarts(two_pools, postgres: Postgres) -> None:  # type: ignore[no-untyped-def]
    first, _second = two_pools
    with first.client() as a:
        register_servers(a, servers=1, gpus=2)
        a.allocate("job-1", "alice", 1, percent=50)
        postgres.restart()
        errors: list[str] = []

        def allocated() -> bool:
            try:
                a.allocate("job-2", "alice", 1, percent=50)
                return True
            except Unavailable as exc:           # the call that meets the broken connection
                errors.append(str(exc))
                return False

        wait_for(allocated, what="an allocation after PostgreSQL restarted")
        assert all(e.startswith("rgpu: store: PostgreSQL is unreachable") or "unavailable" in e.lower()
                   for e in errors), errors
        assert {lease.job_key for lease in a.list_leases()} == {"job-1", "job-2"}


@pytest.fixture
def two_cores(postgres: Postgres):  # type: ignore[no-untyped-def]
    """Two pool cores (what two rgpu-poold hold in memory) on one PostgreSQL, one clock."""
    with cores_on_one_store(lambda: PostgresStore(postgres.url)) as cores:
        yield cores


def test_a_daemon_catches_up_with_what_another_changed_without_reloading(two_cores, postgres: Postgres) -> None:  # type: ignore[no-untyped-def]
    a, b, clock = two_cores
    for n in range(3):
        a.register(server(n))
    a.allocate(req("job-1", count=2))
    a.allocate(req("job-2", ttl_seconds=60.0))
    assert pool_state(b) == pool_state(a)                         # b caught up with registrations and leases
    b.allocate(req("job-3", percent=100))              # and decides on the state both hold
    a.release("job-1")
    a.set_drained("gpu1", True)
    a.set_quota("user", "alice", 900)
    a.renew("job-2", 600.0)                             # renewed through a: b must not reclaim it
    clock.now += 120
    assert b.reclaim_expired() == []
    b.register(server(3))
    assert pool_state(a) == pool_state(b)
    fresh = PoolCore(store=PostgresStore(postgres.url), secret=SECRET, down_after_seconds=1e6, clock=clock)
    try:
        assert pool_state(fresh) == pool_state(a)
        assert b.token_for(b.get_lease("job-2"), 0) == fresh.token_for(fresh.get_lease("job-2"), 0)
    finally:
        fresh.store.close()
    assert a.full_reloads == 0 and b.full_reloads == 0  # each caught up from the change log alone


def test_a_daemon_further_behind_than_the_change_log_reloads_everything(two_cores) -> None:  # type: ignore[no-untyped-def]
    a, b, _clock = two_cores
    a.store.change_log_keep, a.store.prune_every = 2, 1  # forget all but the last 2 changes
    a.register(server(0, gpus=4))
    for n in range(6):
        a.allocate(req(f"job-{n}", percent=25))
    a.release("job-0")
    assert pool_state(b) == pool_state(a)
    assert b.full_reloads == 1


def test_usage_reported_to_one_daemon_counts_for_idle_release_on_the_other(two_cores) -> None:  # type: ignore[no-untyped-def]
    a, b, clock = two_cores
    a.register(server(0))
    a.allocate(req("busy"))
    a.allocate(req("idle"))
    clock.now += 1000                                   # both older than idle_after_seconds (600)
    report = SliceUsageRecord(sessions=1, busy_seconds=900.0, last_active_unix=clock.now - 5, calls=10)
    a.record_usage(server(0).address, [("busy", 0, report)], sent_unix=clock.now)   # the dispatcher talks to a
    assert b.release_idle() == ["idle"]                 # b decides with a's report: busy is not idle
    assert [lease.job_key for lease in a.list_leases()] == ["busy"]
    b.load_shared_usage()                               # what GetLease and ListLeases show on b
    assert b.slice_usage(b.get_lease("busy"))[0] == report
    assert b.usage_totals(0, clock.now)[0].busy_gpu_seconds == pytest.approx(900.0)


def test_idle_release_on_one_daemon_sees_usage_reported_to_the_other(tmp_path: Path, postgres: Postgres) -> None:
    """Real daemons: the dispatcher (here its Heartbeat calls, made directly) reports to the first,
    which does not release idle leases; the second does, and must keep the busy lease."""
    first, second = two_clusters(tmp_path)   # one cluster secret
    try:
        for cluster, idle_release in ((first, False), (second, True)):
            cluster.write_config(down_after_seconds=60.0, heartbeat_interval_seconds=0.3, reclaim_interval_seconds=0.3,
                                 store_url=postgres.url, idle_after_seconds=2.0, idle_release=idle_release)
            cluster.start_pool()
        with first.client() as a, second.client() as b:
            register_servers(a, servers=1, gpus=2)
            address = a.list_servers().servers[0].address
            a.allocate("busy", "alice", 1, percent=50)
            a.allocate("idle", "alice", 1, percent=50)
            beats = 0

            def busy_report() -> None:
                nonlocal beats
                now = time.time()
                a.heartbeat(address, [pb.SliceUsage(job_key="busy", slice_number=0, sessions=1, busy_seconds=beats,
                                                    last_active_unix=now, calls=beats)], sent_unix=now)
                beats += 1

            def idle_released() -> bool:
                busy_report()
                return [lease.job_key for lease in b.list_leases()] == ["busy"]

            wait_for(idle_released, timeout=30, what="the second daemon to release the idle lease")
            reporting_until = time.monotonic() + 6.0      # three times idle_after_seconds
            while time.monotonic() < reporting_until:
                busy_report()
                time.sleep(0.3)
            assert [lease.job_key for lease in b.list_leases()] == ["busy"]
            assert b.get_lease("busy").slices[0].usage.calls > 0   # the second daemon shows the report too
    finally:
        for cluster in (first, second):
            cluster.stop_all()


def test_idle_release_is_accepted_with_a_shared_store(tmp_path: Path) -> None:
    config = tmp_path / "rgpu.toml"
    config.write_text('store_url = "postgresql://rgpu@db:5432/rgpu"\nidle_release = true\n')
    assert load_settings(config, env={}).idle_release


def test_a_daemon_refuses_a_database_written_by_a_newer_layout(postgres: Postgres) -> None:
    from rgpu.remoting.pool.store_pg import STORE_SCHEMA
    PostgresStore(postgres.url)                       # creates the layout, at this code's version
    with psycopg.connect(postgres.url, autocommit=True) as db:
        assert db.execute("SELECT schema FROM pool_meta").fetchone()[0] == STORE_SCHEMA
        db.execute("UPDATE pool_meta SET schema = %s", (STORE_SCHEMA + 1,))
    with pytest.raises(ConfigError, match=f"layout {STORE_SCHEMA + 1}, newer than this rgpu-poold's {STORE_SCHEMA}") as caught:
        PostgresStore(postgres.url)
    assert "\n" not in str(caught.value) and "upgrade this pool daemon" in str(caught.value)


def test_two_daemons_reconcilers_release_a_finished_jobs_lease_once(two_cores, postgres: Postgres) -> None:  # type: ignore[no-untyped-def]
    # Each rgpu-poold runs the Slurm reconciler; with a shared store both see the finished job.
    # The release is one change under the store's lock after catching up: exactly one of them
    # releases it, the other finds nothing left, and the history holds one end.
    import logging

    from rgpu.slurm_plugin.jobkey import job_key
    from rgpu.slurm_plugin.reconcile import Reconciler

    a, b, clock = two_cores
    a.register(server(0))
    key = job_key("c", 42, 0, "c1")
    a.allocate(req(key))

    class NoJobs:   # stands in for Slurm's job list (squeue): job 42 has finished
        def live_jobs(self) -> list:  # type: ignore[type-arg]
            return []

    released: list[bool] = []
    both_looked = threading.Barrier(2, timeout=20)   # both see the lease before either releases it

    class Counting:
        def __init__(self, core: PoolCore) -> None:
            self.core = core

        def list_leases(self):  # type: ignore[no-untyped-def]
            leases = self.core.list_leases()
            both_looked.wait()
            return leases

        def release(self, job_key: str) -> bool:
            done = self.core.release(job_key)
            released.append(done)
            return done

    reconcilers = [Reconciler(Counting(core), NoJobs(), interval_seconds=1.0, grace_seconds=0.0,
                              log=logging.getLogger("test.reconcile"), cluster="c", clock=lambda: clock.now + 60)
                   for core in (a, b)]
    threads = [threading.Thread(target=r.run_once) for r in reconcilers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(released) == [False, True], released
    assert a.list_leases() == [] and b.list_leases() == []
    with psycopg.connect(postgres.url, autocommit=True) as db:
        assert db.execute("SELECT count(*) FROM lease_history WHERE job_key = %s", (key,)).fetchone()[0] == 1


def test_a_credential_replayed_to_the_other_daemon_is_refused(two_pools) -> None:  # type: ignore[no-untyped-def]
    """The daemons share the nonces they saw (pool_nonces): a credential captured on its way to one
    daemon is good for no call on the other, as clients fail over to either."""
    import grpc

    from rgpu.proto import rgpu_pb2_grpc as pb_grpc
    from rgpu.remoting.pool.auth import AUTH_HEADER, request_credential
    first, second = two_pools
    credential = request_credential(first.secret, "/rgpu.v1.Pool/Capacity")

    def capacity(cluster: RgpuCluster) -> None:
        with grpc.insecure_channel(cluster.pool_address) as channel:
            pb_grpc.PoolStub(channel).Capacity(pb.CapacityRequest(), metadata=((AUTH_HEADER, credential),), timeout=10)

    capacity(first)
    with pytest.raises(grpc.RpcError) as info:
        capacity(second)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED   # type: ignore[attr-defined]
    assert "replayed credential" in info.value.details()   # type: ignore[attr-defined]


def test_two_daemons_decide_ownership_after_catching_up(two_cores) -> None:  # type: ignore[no-untyped-def]
    """Issue 26, HIGH 1, with two rgpu-poold on one PostgreSQL: another user's Release or Renew
    through the daemon that has not seen the lease yet is refused inside the change."""
    from rgpu.errors import PermissionDenied

    a, b, _clock = two_cores
    a.register(server(0))
    lease = a.allocate(req("job-alice", ttl_seconds=60.0))
    with pytest.raises(PermissionDenied, match="cannot release lease job-alice"):
        b.release("job-alice", owner="mallory")
    with pytest.raises(PermissionDenied, match="cannot renew lease job-alice"):
        b.renew("job-alice", 365 * 24 * 3600.0, owner="mallory")
    assert a.get_lease("job-alice").expires_unix == lease.expires_unix


def test_two_daemons_admitting_from_one_look_never_release_more_than_the_pool_holds(two_cores) -> None:  # type: ignore[no-untyped-def]
    """Each daemon's reconciler releases held Slurm jobs the pool can place; an admission pass holds
    the database's admission lock from reading the queue to its last release, so the second pass
    looks after the first one's release, and never releases a job into room already given out."""
    from tests.admission_race import admit_from_one_look, released_fit

    a, b, _clock = two_cores
    released, core = admit_from_one_look(a, b)
    assert released and released_fit(released, core), f"jobs {released} released into room for fewer"


def test_dashboard_credentials_spent_at_one_daemon_are_spent_at_the_other(postgres: Postgres) -> None:
    first, second = PostgresStore(postgres.url), PostgresStore(postgres.url)
    try:
        assert first.spend_web_nonce("link1:abc", expires=2000.0, now=1000.0)
        assert not second.spend_web_nonce("link1:abc", expires=2000.0, now=1000.0)   # used once, anywhere
        assert second.web_nonce_spent("link1:abc") and not second.web_nonce_spent("sess1:abc")
        assert second.spend_web_nonce("sess1:x", expires=3000.0, now=2500.0)          # the link's row expired
        assert not first.web_nonce_spent("link1:abc")
    finally:
        first.close()
        second.close()


def test_history_pruning_on_postgresql_is_bounded_per_pass(postgres: Postgres) -> None:
    store = PostgresStore(postgres.url)
    try:
        store.insert_history([(f"job-{n}", "alice", "", 50, float(n), 100.0 + n, 0.0, "released") for n in range(10)])
        assert store.prune_history(ended_before=105.0, max_rows=0, limit=3) == 3
        assert store.prune_history(ended_before=105.0, max_rows=0, limit=3) == 2
        assert store.prune_history(ended_before=None, max_rows=2, limit=10) == 3
        assert sorted(key for key, *_ in store._rows("SELECT job_key FROM lease_history")) == ["job-8", "job-9"]
    finally:
        store.close()


def test_gpu_readings_reported_to_one_daemon_show_on_the_other(postgres: Postgres) -> None:
    """Issue 29: a dispatcher heartbeats to one daemon; the other's metrics and page read its GPU
    readings, faults and slices' compute use from PostgreSQL."""
    from rgpu.proto import rgpu_pb2 as pb
    from rgpu.remoting.pool.telemetry import TelemetryBoard

    receiver, shower = (TelemetryBoard(PostgresStore(postgres.url)) for _ in range(2))
    heartbeat = pb.HeartbeatRequest(address="h:1", sent_unix=100.0,
                                    telemetry=[pb.GpuTelemetry(gpu_uuid="GPU-1", source="nvml", power_watts=250.0)],
                                    usage=[pb.SliceUsage(job_key="job-1", slice_number=0, compute_used_percent=7.0)])
    receiver.record("h:1", heartbeat, {"GPU-1"}, now=100.0)
    receiver.record("h:1", heartbeat, {"GPU-1"}, now=101.0)   # the same server again: one row, replaced
    assert [r.power_watts for r in shower.readings("h:1")] == [250.0]
    assert shower.compute_used("h:1", "job-1", 0) == 7.0
