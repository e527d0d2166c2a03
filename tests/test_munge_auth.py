"""Two kinds of caller, against a real rgpu-poold and a real munged (private socket and key):
users authenticate with MUNGE and get least privilege; daemons and admins hold the cluster secret.

The user is a separate uid without the secret (`nobody`). Some tests make its MUNGE credentials
with munge(1) and send them as a client would; others run rgpu's own CLIs (rgpu-admin, flexrun)
as that uid, with this run's Python and rgpu put where it can run them (tests/user_runtime.py).
A user charges only accounts it belongs to: a map in rgpu.toml, or Slurm's associations from a
real slurmdbd (tests/slurmdbd.py, marked slurm)."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rgpu.proto import rgpu_pb2 as pb
from rgpu.proto import rgpu_pb2_grpc as pb_grpc
from rgpu.remoting.pool.auth import MUNGE_HEADER
from rgpu.remoting.pool.client import PoolClient
from tests import munged
from tests.daemons import EXAMPLES, RgpuCluster, register_servers
from tests.user_runtime import UserRuntime

pytestmark = pytest.mark.integration
USER = "nobody"


@pytest.fixture(scope="module")
def munge_socket() -> Iterator[str]:
    if munged.missing():
        pytest.skip(munged.missing())
    key = munged.MungeKey()
    try:
        yield key.start().socket
    finally:
        key.remove()


@pytest.fixture
def cluster(tmp_path: Path, munge_socket: str) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "cluster")
    c.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                   munge_socket=munge_socket, account_check="map",
                   user_accounts={USER: ["physics", "chem"], pwd.getpwuid(os.getuid()).pw_name: ["ops"]})
    c.start_pool()
    with c.client() as client:
        register_servers(client, servers=1, gpus=4)
    try:
        yield c
    finally:
        c.stop_all()


def user_credential(munge_socket: str, cluster: RgpuCluster, name: str, request: Any) -> str:
    """A MUNGE credential made by USER (a separate uid, without the secret) for one call at `cluster`'s pool."""
    return munged.user_credential(munge_socket, f"/rgpu.v1.Pool/{name}", request.SerializeToString(),
                                  munged.pool_name(cluster.pool_address), USER)


def as_user(cluster: RgpuCluster, munge_socket: str, name: str, request: Any, credential: str | None = None) -> Any:
    with grpc.insecure_channel(cluster.pool_address) as channel:
        return getattr(pb_grpc.PoolStub(channel), name)(
            request, metadata=[(MUNGE_HEADER, credential or user_credential(munge_socket, cluster, name, request))],
            timeout=10)


def refused(code: grpc.StatusCode, call: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()   # type: ignore[operator]
    assert info.value.code() == code, info.value.details()
    details = info.value.details()
    assert "\n" not in details and details.startswith("rgpu: pool: ")
    return details


def test_a_user_leases_as_who_munge_says_never_as_someone_else(cluster: RgpuCluster, munge_socket: str) -> None:
    lease = as_user(cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key="u1", count=1, percent=50))
    assert lease.user == USER and lease.slices[0].token   # type: ignore[attr-defined]
    text = refused(grpc.StatusCode.PERMISSION_DENIED, lambda: as_user(
        cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key="u2", user="victim", count=1, percent=50)))
    assert "cannot lease GPUs as victim" in text and f"MUNGE says you are {USER}" in text
    with cluster.client() as admin:
        assert [(x.job_key, x.user) for x in admin.list_leases()] == [("u1", USER)]
        admin.set_quota("user", USER, 0)
    refused(grpc.StatusCode.PERMISSION_DENIED, lambda: as_user(
        cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key="u3", count=1, percent=50)))


def test_a_user_sees_others_leases_without_tokens_and_cannot_touch_them(cluster: RgpuCluster,
                                                                       munge_socket: str) -> None:
    with cluster.client() as admin:
        admin.allocate("alice-job", "alice", 1, percent=50)
    as_user(cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key="mine", count=1, percent=25))
    leases = {x.job_key: x for x in as_user(cluster, munge_socket, "ListLeases", pb.ListLeasesRequest()).leases}
    assert leases["alice-job"].user == "alice" and all(s.token == "" for s in leases["alice-job"].slices)
    assert all(s.token for s in leases["mine"].slices)
    other = as_user(cluster, munge_socket, "GetLease", pb.GetLeaseRequest(job_key="alice-job"))
    assert all(s.token == "" for s in other.slices)   # type: ignore[attr-defined]
    for name, request in (("Release", pb.ReleaseRequest(job_key="alice-job")),
                          ("Renew", pb.RenewRequest(job_key="alice-job", ttl_seconds=60)),
                          ("Allocate", pb.AllocateRequest(job_key="alice-job", count=1, percent=50))):
        text = refused(grpc.StatusCode.PERMISSION_DENIED, lambda: as_user(cluster, munge_socket, name, request))
        assert "belongs to alice" in text
    assert as_user(cluster, munge_socket, "Release", pb.ReleaseRequest(job_key="mine")).released
    with cluster.client() as admin:
        assert [x.job_key for x in admin.list_leases()] == ["alice-job"]


@pytest.mark.parametrize("name, request_", [
    ("RegisterServer", pb.RegisterServerRequest(server=pb.Server(address="127.0.0.1:56000"))),
    ("Heartbeat", pb.HeartbeatRequest(address="127.0.0.1:56000")),
    ("SetServerState", pb.SetServerStateRequest(server="127.0.0.1:56000", drained=True)),
    ("RemoveServer", pb.RemoveServerRequest(server="127.0.0.1:56000")),
    ("SetQuota", pb.SetQuotaRequest(kind="user", name=USER, limit_units=10000)),
    ("Usage", pb.UsageRequest()),
])
def test_only_daemons_and_admins_register_drain_and_set_quotas(cluster: RgpuCluster, munge_socket: str, name: str,
                                                                request_: object) -> None:
    text = refused(grpc.StatusCode.PERMISSION_DENIED, lambda: as_user(cluster, munge_socket, name, request_))
    assert f"{name} is for daemons and admins" in text
    with cluster.client() as admin:
        assert [s.state for s in admin.list_servers().servers] == ["up"]


def test_munge_credentials_are_bound_to_one_call_and_used_once(cluster: RgpuCluster, munge_socket: str) -> None:
    cred = user_credential(munge_socket, cluster, "ListGpus", pb.ListGpusRequest())
    as_user(cluster, munge_socket, "ListGpus", pb.ListGpusRequest(), cred)
    assert "replayed" in refused(grpc.StatusCode.UNAUTHENTICATED,
                                 lambda: as_user(cluster, munge_socket, "ListGpus", pb.ListGpusRequest(), cred))
    other = user_credential(munge_socket, cluster, "ListGpus", pb.ListGpusRequest())
    assert "made for another call" in refused(grpc.StatusCode.UNAUTHENTICATED, lambda: as_user(
        cluster, munge_socket, "ListLeases", pb.ListLeasesRequest(), other))


def test_a_credential_sent_with_a_rewritten_request_is_refused(cluster: RgpuCluster, munge_socket: str) -> None:
    """Issue 26, MED 7: a Release credential with the request rewritten released another lease of the user's."""
    for key in ("keep", "drop"):
        as_user(cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key=key, count=1, percent=25,
                                                                          ttl_seconds=60))
    for name, signed, sent in (
            ("Release", pb.ReleaseRequest(job_key="drop"), pb.ReleaseRequest(job_key="keep")),
            ("Renew", pb.RenewRequest(job_key="keep", ttl_seconds=60), pb.RenewRequest(job_key="keep",
                                                                                       ttl_seconds=10**7)),
            ("Allocate", pb.AllocateRequest(job_key="small", count=1, percent=10),
             pb.AllocateRequest(job_key="small", count=1, percent=90))):
        cred = user_credential(munge_socket, cluster, name, signed)
        text = refused(grpc.StatusCode.UNAUTHENTICATED, lambda: as_user(cluster, munge_socket, name, sent, cred))
        assert text == ("rgpu: pool: call refused (MUNGE credential made for another request (the request was "
                        "changed after it was signed); make a new credential for each call, with the same rgpu "
                        "version as the pool's (rgpu's client does); the pool's name is what PoolName answers)"), text
    with cluster.client() as admin:
        leases = {x.job_key: x for x in admin.list_leases()}
        assert sorted(leases) == ["drop", "keep"] and leases["keep"].expires_unix - leases["keep"].created_unix < 10**6
    # An older rgpu's credential (the method alone) is refused, saying so.
    done = subprocess.run(["runuser", "-u", USER, "--", "munge", "-S", munge_socket, "-s",
                           "rgpu-grpc:/rgpu.v1.Pool/ListGpus"], capture_output=True, text=True, timeout=10, check=True)
    text = refused(grpc.StatusCode.UNAUTHENTICATED, lambda: as_user(
        cluster, munge_socket, "ListGpus", pb.ListGpusRequest(), done.stdout.strip()))
    assert "not in this rgpu's format (the client runs another rgpu version)" in text and "same rgpu version" in text
    # Signed as sent, each works.
    assert as_user(cluster, munge_socket, "Release", pb.ReleaseRequest(job_key="drop")).released
    assert as_user(cluster, munge_socket, "Renew", pb.RenewRequest(job_key="keep", ttl_seconds=60)).job_key == "keep"


def test_a_credential_made_for_one_pool_is_refused_at_another(tmp_path: Path) -> None:
    """Issue 26, MED 7: a credential used at pool A was accepted at pool B, whose munged (same key, other
    host) had not seen it. Two pools, each with its own munged on one key; PoolClient at both works."""
    if munged.missing():
        pytest.skip(munged.missing())
    key = munged.MungeKey()
    pools = []
    try:
        sockets = {name: key.start(name).socket for name in ("a", "b")}
        munge_socket = sockets["a"]   # the user's node's munged
        for name in ("a", "b"):
            c = RgpuCluster(tmp_path / name)
            c.write_config(munge_socket=sockets[name], account_check="off")
            c.start_pool()
            with c.client() as admin:
                register_servers(admin, servers=1, gpus=2)
            pools.append(c)
        a, b = pools
        assert munged.pool_name(a.pool_address) != munged.pool_name(b.pool_address)
        request = pb.AllocateRequest(job_key="at-a", count=1, percent=90)
        cred = user_credential(munge_socket, a, "Allocate", request)   # made by the munged the user's node runs
        assert as_user(a, munge_socket, "Allocate", request, cred).user == USER
        text = refused(grpc.StatusCode.UNAUTHENTICATED, lambda: as_user(b, munge_socket, "Allocate", request, cred))
        assert f"MUNGE credential made for another pool (this is {munged.pool_name(b.pool_address)!r})" in text
        assert "same rgpu version" in text, text
        with b.client() as admin:
            assert admin.list_leases() == []
        # rgpu's own client learns each pool's name: allocate, renew, list and release at both.
        for c in pools:
            with PoolClient(c.pool_address, None, munge_socket=munge_socket) as client:
                assert client.allocate("mine", "", 1, percent=25, ttl_seconds=60).job_key == "mine"
                assert client.renew("mine", 120).job_key == "mine"
                assert "mine" in [x.job_key for x in client.list_leases()]
                assert client.list_gpus() and client.capacity().gpus == 2
                assert client.release("mine")
    finally:
        for c in pools:
            c.stop_all()
        key.remove()


def test_rgpus_own_client_uses_munge_without_the_secret(cluster: RgpuCluster, munge_socket: str,
                                                        tmp_path: Path) -> None:
    me = pwd.getpwuid(os.getuid()).pw_name
    with PoolClient(cluster.pool_address, None, munge_socket=munge_socket) as client:
        lease = client.allocate("via-libmunge", "", 1, percent=50)
        assert lease.user == me
    env = cluster.env(RGPU_SECRET_FILE=str(tmp_path / "no-secret-here"))
    admin = [sys.executable, "-m", "rgpu.remoting.admin.cli"]
    done = subprocess.run([*admin, "leases"], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0 and "via-libmunge" in done.stdout, done.stderr
    done = subprocess.run([*admin, "drain", "127.0.0.1:56000"], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "SetServerState is for daemons and admins" in lines[0], done.stderr
    conf = tmp_path / "a.conf"
    done = subprocess.run([*admin, "request-gpus", "-n", "1", "-p", "0.25", "-o", str(conf), "--ttl", "1h"], env=env,
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*admin, "release-gpus", "-f", str(conf)], env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 0, done.stderr



PWNED = "/tmp/rgpu-account-pwned"
HOSTILE_ACCOUNTS = ["x" * 100_000, "chem\nphysics", f"chem;touch {PWNED}", f"$(touch {PWNED})", f"`touch {PWNED}`",
                    "chem physics", "chem,bio", "-chem"]


def test_a_user_charges_only_accounts_the_map_gives_them(cluster: RgpuCluster, munge_socket: str) -> None:
    def lease(job_key: str, account: str) -> object:
        return as_user(cluster, munge_socket, "Allocate",
                       pb.AllocateRequest(job_key=job_key, account=account, count=1, percent=10))

    assert lease("own", "chem").account == "chem"             # type: ignore[attr-defined]
    assert lease("default", "").account == "physics"          # type: ignore[attr-defined]
    text = refused(grpc.StatusCode.PERMISSION_DENIED, lambda: lease("other", "bio"))
    assert text == (f"rgpu: pool: {USER} may not charge account bio (user_accounts in rgpu.toml give {USER} only: "
                    "physics, chem; name one of those with --account, or leave it out for your default)")
    for i, account in enumerate(HOSTILE_ACCOUNTS):
        with pytest.raises(grpc.RpcError) as info:
            lease(f"hostile-{i}", account)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        details = info.value.details()
        assert "\n" not in details and len(details) < 700 and details.startswith("rgpu: request: invalid account ")
    assert not Path(PWNED).exists()
    with cluster.client() as admin:                           # the secret: Slurm's prologs charge the job's account
        assert admin.allocate("slurm:job", USER, 1, percent=10, account="bio").account == "bio"
        assert sorted((x.job_key, x.account) for x in admin.list_leases()) == [
            ("default", "physics"), ("own", "chem"), ("slurm:job", "bio")]


@pytest.mark.slurm
def test_accounts_come_from_a_real_slurmdbd_and_fail_closed_without_it(tmp_path: Path, munge_socket: str) -> None:
    from tests import slurmdbd

    if slurmdbd.missing():
        pytest.skip(slurmdbd.missing())
    dbd = slurmdbd.SlurmDbd(munge_socket).start()
    c = RgpuCluster(tmp_path / "cluster")
    try:
        dbd.sacctmgr("add", "account", "physics,chem,bio")
        dbd.sacctmgr("add", "user", USER, "account=physics,chem", "defaultaccount=chem")
        c.write_config(munge_socket=munge_socket, account_check="slurm", slurm_cluster=slurmdbd.CLUSTER,
                       account_cache_seconds=0, slurm_reconcile_interval_seconds=0)
        c.start_pool(env=c.env(**dbd.env))
        with c.client() as admin:
            register_servers(admin, servers=1, gpus=4)

        def lease(job_key: str, account: str) -> object:
            return as_user(c, munge_socket, "Allocate",
                           pb.AllocateRequest(job_key=job_key, account=account, count=1, percent=10))

        assert lease("default", "").account == "chem"        # type: ignore[attr-defined]
        assert lease("own", "physics").account == "physics"  # type: ignore[attr-defined]
        text = refused(grpc.StatusCode.PERMISSION_DENIED, lambda: lease("other", "bio"))
        assert text == (f"rgpu: pool: {USER} may not charge account bio (Slurm's associations (sacctmgr) give {USER} "
                        "only: chem, physics; name one of those with --account, or leave it out for your default)")
        dbd.sacctmgr("add", "user", USER, "account=bio")      # Slurm's word, as it is now (no cache here)
        assert lease("now-bio", "bio").account == "bio"      # type: ignore[attr-defined]
        dbd.stop_dbd()
        with pytest.raises(grpc.RpcError) as info:
            lease("dbd-down", "chem")
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = info.value.details()
        assert "\n" not in details and details.startswith(f"rgpu: pool: cannot check which accounts {USER} may charge")
        assert "sacctmgr" in details and "Connection refused" in details and "slurmdbd" in details, details
        with c.client() as admin:                            # daemons and admins do not depend on slurmdbd
            assert admin.allocate("slurm:job", USER, 1, percent=10, account="physics").account == "physics"
    finally:
        c.stop_all()
        dbd.stop()


@pytest.fixture(scope="module")
def user_runtime(munge_socket: str) -> Iterator[UserRuntime]:
    """rgpu and this run's Python where USER can run them (tests/user_runtime.py), with the native
    client libraries flexrun preloads built there too."""
    from rgpu.remoting.native import build

    runtime = UserRuntime(USER).build()
    try:
        build.build(runtime.root / "native")
        for path in (runtime.root / "native").rglob("*"):
            path.chmod(path.stat().st_mode | 0o555 if path.is_dir() else path.stat().st_mode | 0o444)
        (runtime.root / "native").chmod(0o755)
        yield runtime
    finally:
        runtime.remove()


def user_config(runtime: UserRuntime, cluster: RgpuCluster, munge_socket: str) -> dict[str, str]:
    """The user's rgpu.toml: the pool, the MUNGE socket, and the cluster's secret file, which this
    user cannot read (it lies in the test's private folder), as on a client node."""
    conf = runtime.home / "rgpu.toml"
    conf.write_text(f'pool = "{cluster.pool_address}"\nmunge_socket = "{munge_socket}"\n'
                    f'secret_file = "{cluster.secret_file}"\n')
    assert runtime.run(["-c", f"open({str(cluster.secret_file)!r})"]).returncode != 0   # not readable by the user
    return {"RGPU_CONFIG": str(conf), "RGPU_NATIVE_DIR": str(runtime.root / "native")}


def one_line_refusal(done: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert done.returncode != 0, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and all(p in lines[0] for p in parts), done.stderr


def test_rgpu_admin_run_by_another_uid_acts_as_that_user_only(cluster: RgpuCluster, munge_socket: str,
                                                             user_runtime: UserRuntime) -> None:
    env = user_config(user_runtime, cluster, munge_socket)
    admin = ["-m", "rgpu.remoting.admin.cli"]
    request = [*admin, "request-gpus", "-n", "1", "-p", "0.25", "-o", "mine.conf", "--ttl", "1h"]
    done = user_runtime.run([*request, "--job-key", "cli-mine"], env)
    assert done.returncode == 0, done.stderr
    with cluster.client() as root:
        mine = root.get_lease("cli-mine")
        assert (mine.user, mine.account) == (USER, "physics")     # who MUNGE says; their default account
        root.allocate("root-job", "root", 1, percent=10)
    one_line_refusal(user_runtime.run([*request, "--job-key", "as-root", "--user", "root"], env),
                     "cannot lease GPUs as root", f"MUNGE says you are {USER}")
    one_line_refusal(user_runtime.run([*request, "--job-key", "env-root"], {**env, "USER": "root", "LOGNAME": "root"}),
                     "cannot lease GPUs as root", f"MUNGE says you are {USER}")
    one_line_refusal(user_runtime.run([*request, "--job-key", "ops", "--account", "ops"], env),
                     f"{USER} may not charge account ops")
    one_line_refusal(user_runtime.run([*admin, "release-gpus", "--job-key", "root-job"], env),
                     "cannot release lease root-job", "it belongs to root")
    one_line_refusal(user_runtime.run([*admin, "drain", "127.0.0.1:56000"], env), "SetServerState is for daemons")
    done = user_runtime.run([*admin, "leases", "--json"], env)
    assert done.returncode == 0, done.stderr
    assert {row["job_key"]: row["user"] for row in json.loads(done.stdout)} == {"cli-mine": USER, "root-job": "root"}
    done = user_runtime.run([*admin, "release-gpus", "-f", "mine.conf"], env)
    assert done.returncode == 0, done.stderr
    with cluster.client() as root:
        assert [x.job_key for x in root.list_leases()] == ["root-job"]


def test_flexrun_run_by_another_uid_leases_as_that_user(tmp_path: Path, munge_socket: str,
                                                       user_runtime: UserRuntime) -> None:
    from tests.dispatcher_helpers import wait_state

    c = RgpuCluster(tmp_path / "cluster")
    c.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                   munge_socket=munge_socket, account_check="map", user_accounts={USER: ["physics"]})
    try:
        c.start_pool()
        _d, port = c.start_dispatcher(EXAMPLES / "inventory-a.toml")
        wait_state(c, f"127.0.0.1:{port}", "up")
        env = user_config(user_runtime, c, munge_socket)
        # The application, run by flexrun as the user, lists the leases it can see (as the user).
        app = [user_runtime.python, "-m", "rgpu.remoting.admin.cli", "leases", "--json"]
        done = user_runtime.run(["-m", "rgpu.remoting.client.flexrun", "-n", "1", "-p", "0.5", "--", *app], env,
                                timeout=120)
        assert done.returncode == 0, done.stderr
        seen = [(row["user"], row["account"]) for row in json.loads(done.stdout)
                if row["job_key"].startswith("flexrun-")]
        assert seen == [(USER, "physics")], done.stdout
        with c.client() as root:
            assert root.list_leases() == []                    # released when the application ended
    finally:
        c.stop_all()


def test_slurm_job_keys_are_reserved_for_the_daemons(cluster: RgpuCluster, munge_socket: str) -> None:
    """A user cannot squat the key the real job's PrologSlurmctld will lease (issue 26, MED 5)."""
    key = "slurm:test:4242:0:c1"
    for squat in (key, "SLURM:test:4243:0:c1"):
        text = refused(grpc.StatusCode.PERMISSION_DENIED, lambda: as_user(
            cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key=squat, count=1, percent=25)))
        assert "is reserved" in text and "Slurm prologs" in text and "pick another key" in text, text
    with cluster.client() as prolog:   # the secret: what PrologSlurmctld holds
        lease = prolog.allocate(key, USER, 1, percent=25, account="physics")
        assert lease.job_key == key and lease.user == USER
    lease = as_user(cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key="my-slurm:run", count=1,
                                                                         percent=25))
    assert lease.job_key == "my-slurm:run"   # type: ignore[attr-defined]


def test_a_users_lease_calls_are_rate_limited_with_the_time_to_retry(cluster: RgpuCluster, munge_socket: str) -> None:
    """Issue 26 (LOW): one user's Allocate/Renew/Release calls are a token bucket of their own
    (burst 3, then one every 2 s here); the refusal is one RESOURCE_EXHAUSTED line with the time
    to retry. Another user and the secret holders are not held back by it."""
    from rgpu.errors import CapacityError
    assert cluster.pool is not None
    cluster.pool.kill()
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                         munge_socket=munge_socket, account_check="off", user_lease_calls_burst=3,
                         user_lease_calls_per_second=0.5)
    cluster.start_pool()
    with PoolClient(cluster.pool_address, None, munge_socket=munge_socket) as me:
        for n in range(3):
            me.allocate(f"burst-{n}", "", 1, percent=10)
        with pytest.raises(CapacityError) as info:
            me.release("burst-0")
        text = str(info.value)
        assert "\n" not in text and text.startswith("rgpu: pool: user ") and "faster than this pool allows" in text
        assert "retry in " in text and "user_lease_calls_per_second" in text, text
        assert [x.job_key for x in me.list_leases()]          # listing is not a lease call: not limited
    lease = as_user(cluster, munge_socket, "Allocate", pb.AllocateRequest(job_key="other-user", count=1, percent=10))
    assert lease.user == USER                                  # another user's own bucket
    with cluster.client() as admin:
        for n in range(10):                                    # the secret holders: not limited
            admin.allocate(f"admin-{n}", "ops", 1, percent=5)
            admin.release(f"admin-{n}")
