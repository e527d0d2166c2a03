"""The pool as sites run it beside a real Slurm, other than the session's one root daemon: a pool
that does not run as root (job_submit.lua's `release_uid`), and two pool daemons on one
PostgreSQL store (issue 23). Each test stops the session's pool, runs its own, and starts the
session's pool again as it was.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.daemons import RgpuCluster
from tests.postgres import Postgres, server_bin
from tests.user_runtime import UserRuntime
from tests.slurm.cluster import missing_requirements, wait_until
from tests.slurm.conftest import (
    MAX_SLICES_PER_JOB,
    RECONCILE_GRACE_SECONDS,
    RECONCILE_INTERVAL_SECONDS,
    Harness,
    lua_conf_from_pool,
    pool_ready,
)
from tests.slurm.e2e_helpers import JOB_USER, diagnostics, finished

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]

# The session pool's settings (conftest.start_pool), written for a pool of our own.
POOL_SETTINGS = dict(down_after_seconds=3.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5,
                     max_slices_per_job=MAX_SLICES_PER_JOB,
                     slurm_reconcile_interval_seconds=RECONCILE_INTERVAL_SECONDS,
                     slurm_reconcile_grace_seconds=RECONCILE_GRACE_SECONDS, slurm_admission_poll_seconds=0.5,
                     slurm_license_sync=False)


@contextmanager
def session_pool_stopped(h: Harness) -> Iterator[None]:
    """The session's pool stopped for the block, then started again as it was (same state, port)."""
    assert h.pool.pool is not None
    h.pool.pool.stop()
    try:
        yield
    finally:
        if h.pool.pool.alive:
            h.pool.pool.stop()
        h.pool.start_pool(env=h.pool_env())
        wait_until("the session pool's 4 GPUs", lambda: pool_ready(h.pool, 400) or None, 30)


def chown_tree(path: Path, uid: int, gid: int) -> None:
    for folder, _dirs, files in os.walk(path):
        os.chown(folder, uid, gid)
        for name in files:
            os.chown(os.path.join(folder, name), uid, gid)


def test_a_pool_that_is_not_root_releases_held_jobs_as_release_uid_and_only_so(h: Harness) -> None:
    """rgpu-poold run as an ordinary user (here the jobs' own user, `nobody`, whom Slurm lets
    release his own jobs): job_submit.lua refuses its `scontrol release` of a job held for the pool
    until `release_uid` in job_submit_rgpu.conf names its uid; then the job runs, never requeued.
    Not covered: a pool user releasing other users' jobs, which Slurm allows only to operators
    (AdminLevel in slurmdbd); the Lua check is the same."""
    if h.slurm.install.root is not None:
        pytest.skip("a Slurm root's commands enter it with unshare and chroot, which only root may run")
    uid, gid = h.slurm.install.passwd_ids(JOB_USER)
    conf = lua_conf_from_pool(h.pool)
    runtime = UserRuntime(JOB_USER).build()      # this run's Python may be under /root (0700)
    with session_pool_stopped(h):
        chown_tree(h.pool.root, uid, gid)
        try:
            env = {k: v for k, v in h.pool_env().items() if k.startswith(("RGPU_", "SLURM_", "PYTHONUNBUFFERED"))}
            # PYTHONSAFEPATH: `-m` would put the working folder (this checkout, whose rgpu/ is only
            # the core package) first on sys.path.
            h.pool.start_pool(env=runtime.env({**env, "PATH": h.pool_env()["PATH"], "PYTHONSAFEPATH": "1"}),
                              ids=(uid, gid),
                              python=runtime.python)
            wait_until("the pool (as nobody) to see 4 GPUs", lambda: pool_ready(h.pool, 400) or None, 30)
            job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], "true\n", user=JOB_USER)
            assert h.pool.pool is not None
            try:
                wait_until("the pool's release to be refused",
                           lambda: f"could not start waiting job {job}" in h.pool.pool.log() or None, 30)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}\n--- poold\n{h.pool.pool.log()[-3000:]}\n{diagnostics(h)}") from None
            shown = h.slurm.show_job(job)
            assert shown["JobState"] == "PENDING" and shown["Reason"] == "JobHeldUser", shown
            log = (h.slurm.logs / "slurmctld.log").read_text(errors="replace")
            assert f"rgpu: refused a release of job {job} by uid {uid}" in log, log[-3000:]
            h.slurm.set_lua_conf(conf.replace("release_uid = 0", f"release_uid = {uid}"))
            info = finished(h, job, 60)
            assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{diagnostics(h)}"
            assert f"the pool can place waiting job(s) {job} now: released" in h.pool.pool.log()
        finally:
            h.slurm.set_lua_conf(conf)
            if h.pool.pool is not None and h.pool.pool.alive:
                h.pool.pool.stop()
            chown_tree(h.pool.root, 0, 0)
            runtime.remove()


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    if server_bin() is None:
        pytest.skip("PostgreSQL's server is not installed (apt-get install postgresql)")
    server = Postgres().start()
    try:
        yield server
    finally:
        server.stop()


def test_two_pool_daemons_on_postgresql_admit_a_mixed_batch_without_over_commit_or_requeue(
        h: Harness, postgres: Postgres) -> None:
    """Two rgpu-poold on one PostgreSQL store, each running its Slurm reconciler and admission
    (one pass at a time: the store's admission lock); PrologSlurmctld asks daemon A, so a job that
    daemon B admitted (and reserved) is claimed through A. A mixed batch of 12 jobs: every job runs
    once (no requeue), and no GPU ever holds more than 100% in the leases either daemon lists."""
    b = RgpuCluster(h.pool.root.parent / "pool-b")
    shutil.copy(h.pool.secret_file, b.secret_file)
    b.secret = h.pool.secret
    session_config = (h.pool.root / "rgpu.toml").read_text()
    configs = {}
    for name, cluster in (("a", h.pool), ("b", b)):
        cluster.write_config(**POOL_SETTINGS, store_url=postgres.url)
        configs[name] = cluster.root / f"rgpu-{name}.toml"
        shutil.move(cluster.root / "rgpu.toml", configs[name])
    (h.pool.root / "rgpu.toml").write_text(session_config)
    with session_pool_stopped(h):
        earlier = len(h.pool.pool.log()) if h.pool.pool else 0        # poold.log is appended to
        try:
            h.pool.start_pool(env=h.pool.env(RGPU_CONFIG=str(configs["a"]), **h.slurm.client_env))
            b.start_pool(env=b.env(RGPU_CONFIG=str(configs["b"]), **h.slurm.client_env))
            wait_until("both daemons to see 4 GPUs",
                       lambda: (pool_ready(h.pool, 400) and pool_ready(b, 400)) or None, 30)
            shapes = [(1 + (i // 3) % 2, ("0.25", "0.5", "1.0")[i % 3]) for i in range(12)]
            jobs = [h.slurm.submit([f"--gres=rgpu:{n}", f"--comment=fraction={f}"], "sleep 2\n", user=JOB_USER)
                    for n, f in shapes]
            worst: dict[str, int] = {}

            def all_done() -> bool:
                for cluster in (h.pool, b):
                    with cluster.client() as c:
                        per_gpu: dict[str, int] = defaultdict(int)
                        for lease in c.list_leases():
                            for s in lease.slices:
                                per_gpu[s.gpu_uuid] += s.compute_percent
                    for gpu, percent in per_gpu.items():
                        worst[gpu] = max(worst.get(gpu, 0), percent)
                return all(h.slurm.show_job(j)["JobState"] in {"COMPLETED", "FAILED", "CANCELLED"} for j in jobs)

            wait_until("the batch to finish", all_done, 240, interval=0.2)
            shown = [h.slurm.show_job(j) for j in jobs]
            assert [s["JobState"] for s in shown] == ["COMPLETED"] * len(jobs), diagnostics(h)
            assert [s["Restarts"] for s in shown] == ["0"] * len(jobs), f"a job was requeued\n{diagnostics(h)}"
            assert worst and max(worst.values()) <= 100, worst
            logs = {"a": h.pool.pool.log()[earlier:] if h.pool.pool else "", "b": b.pool.log() if b.pool else ""}
            released = [line for text in logs.values() for line in text.splitlines()
                        if "the pool can place waiting job(s)" in line]
            ids = [j for line in released for j in line.split("job(s) ")[1].split(" now")[0].split(", ")]
            assert sorted(ids, key=int) == sorted(jobs, key=int), released     # each released once
            assert all("rgpu reconciler every" in text or "Slurm reconciler every" in text for text in logs.values())
        finally:
            b.stop_all()
            if h.pool.pool is not None and h.pool.pool.alive:
                h.pool.pool.stop()
            shutil.rmtree(b.root, ignore_errors=True)
