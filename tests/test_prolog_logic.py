"""Prolog and epilog steps against a real rgpu-poold and two dispatchers (no Slurm needed: the
environment Slurm would give is written out, and the one Slurm query is passed in)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rgpu.prolog import main as prolog_main
from rgpu.prolog.logic import (
    node_prolog,
    prolog_slurmctld,
    sweep_stale_job_dirs,
)
from rgpu.prolog.epilogs import epilog_slurmctld, node_epilog
from rgpu.slurm_plugin.scontrol import JobInfo

from rgpu.adaptor import read_adaptor_conf
from rgpu.errors import CapacityError, InvalidRequest, RgpuError
from tests.daemons import EXAMPLES, REPO, RgpuCluster, wait_for

PROLOG_DIR = REPO / "prolog"
NOBODY = 65534


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "pool")
    c.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5)
    c.start_pool()
    for inventory in ("inventory-a.toml", "inventory-b.toml"):
        c.start_dispatcher(EXAMPLES / inventory)

    def ready() -> bool:
        with c.client() as client:
            return client.capacity().total_units == 400

    wait_for(ready, timeout=30, what="4 GPUs in the pool")
    yield c
    c.stop_all()


def job_env(pool: RgpuCluster, run_dir: Path, job_id: int = 42, nodes: str = "c[1-2]", node: str = "c1",
            restart: int = 0) -> dict[str, str]:
    return {"SLURM_CLUSTER_NAME": "hpc", "SLURM_JOB_ID": str(job_id), "SLURM_JOB_USER": "nobody",
            "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY), "SLURM_JOB_ACCOUNT": "(null)",
            "SLURM_JOB_RESTART_COUNT": str(restart), "SLURM_JOB_NODELIST": nodes, "SLURMD_NODENAME": node,
            "RGPU_POOL": pool.pool_address, "RGPU_SECRET_FILE": str(pool.secret_file),
            "RGPU_CONFIG": str(pool.root / "rgpu.toml"), "RGPU_RUN_DIR": str(run_dir),
            # What Slurm hands the prologs of an rgpu job (job_submit.lua set both).
            "SLURM_JOB_LICENSES": "rgpu:100", "SLURM_JOB_COMMENT": "fraction=0.5"}


def info(job_id: int = 42, tres: str = "gres:rgpu:2", comment: str = "fraction=0.5", nodes: str = "c[1-2]",
         record: str | None = None, licenses: str | None = None) -> JobInfo:
    """The job as Slurm shows it, with the record and license job_submit.lua would have set."""
    from rgpu.slurm_plugin.hostlist import expand_hostlist
    from rgpu.slurm_plugin.request import parse_comment, parse_tres_per_node

    count = parse_tres_per_node(tres)
    n = len(expand_hostlist(nodes))
    if record is None:
        record = parse_comment(comment, count).record(n) if count else ""
    if licenses is None:
        licenses = f"rgpu:{record.rsplit('=', 1)[1]}" if record else ""
    return JobInfo(job_id=str(job_id), user="nobody", uid=NOBODY, account="", state="RUNNING", restart_count=0,
                   node_names=nodes, node_count=n, tres_per_node=tres, comment=comment, admin_comment=record,
                   licenses=licenses)


def keys(pool: RgpuCluster) -> list[str]:
    with pool.client() as c:
        return sorted(lease.job_key for lease in c.list_leases())


def test_prolog_slurmctld_allocates_one_lease_per_node_once(pool: RgpuCluster, tmp_path: Path) -> None:
    env = job_env(pool, tmp_path)
    queries: list[int] = []

    def query(job_id: int) -> JobInfo:
        queries.append(job_id)
        return info()

    got = prolog_slurmctld(env, pool.client, query)
    assert got == ["slurm:hpc:42:0:c1", "slurm:hpc:42:0:c2"] and queries == [42]
    again = prolog_slurmctld(env, pool.client, query)         # a retried prolog: same leases, no new ones
    assert again == got and keys(pool) == got
    with pool.client() as c:
        for key in got:
            lease = c.get_lease(key)
            assert len(lease.slices) == 2 and len({s.gpu_uuid for s in lease.slices}) == 2
            assert {s.compute_percent for s in lease.slices} == {50} and lease.user == "nobody"


def test_prolog_slurmctld_skips_jobs_without_rgpu(pool: RgpuCluster, tmp_path: Path) -> None:
    def no_pool():  # type: ignore[no-untyped-def]
        raise AssertionError("a job without rgpu must not contact the pool")

    assert prolog_slurmctld(job_env(pool, tmp_path), no_pool, lambda _: info(tres="")) == []


@pytest.mark.parametrize("job, error", [
    # A comment that reads as a whole GPU, but the record (what the license charged) says 1%:
    # the record wins, whatever the user-controlled fields say.
    (dict(comment="x Comment=fraction=1 TresPerNode=gres:rgpu:4", record="rgpu:v1 nodes=2 count=2 percent=1 units=4"),
     None),
    (dict(record=""), "is not one job_submit.lua writes"),
    (dict(record="rgpu:v1 nodes=2 count=2 percent=100 units=400", licenses="rgpu:100"), "license rgpu 100 (recorded 400)"),
    (dict(record="rgpu:v1 nodes=2 count=4 percent=50 units=400", licenses="rgpu:400"), "--gres count 2 (recorded 4)"),
    (dict(record="rgpu:v1 nodes=1 count=2 percent=50 units=100", licenses="rgpu:100"), "node count 2 (recorded 1)"),
    (dict(tres="", record="rgpu:v1 nodes=2 count=2 percent=50 units=200"), "carries an rgpu record but no --gres"),
    (dict(record="rgpu:v1 nodes=2 count=2 percent=50 units=200 TresPerNode=gres:rgpu:8"), "is not one"),
])
def test_prolog_slurmctld_leases_the_record_or_nothing(pool: RgpuCluster, tmp_path: Path, job: dict, error: str | None) -> None:
    env = job_env(pool, tmp_path)
    if error is None:
        got = prolog_slurmctld(env, pool.client, lambda _: info(**job))
        with pool.client() as c:
            assert {s.compute_percent for key in got for s in c.get_lease(key).slices} == {1}
        return
    with pytest.raises(InvalidRequest) as exc:
        prolog_slurmctld(env, pool.client, lambda _: info(**job))
    assert error in str(exc.value) and str(exc.value).startswith("rgpu: prolog-slurmctld: ")
    assert keys(pool) == []


def test_prolog_slurmctld_failure_releases_what_it_got(pool: RgpuCluster, tmp_path: Path) -> None:
    env = job_env(pool, tmp_path, nodes="c[1-3]")
    with pytest.raises(RgpuError):          # 6 whole GPUs of 4: never (NeverServable)
        prolog_slurmctld(env, pool.client, lambda _: info(comment="fraction=1", nodes="c[1-3]"))
    assert keys(pool) == []


def test_a_request_no_gpu_can_ever_serve_is_cancelled_with_its_reason(pool: RgpuCluster, tmp_path: Path) -> None:
    """The pool's GPUs share by MPS: isolation=strict would wait for ever (job_submit.lua refuses it
    when its config knows the pool; this is the backstop for a stale config)."""
    from rgpu.prolog.logic import NeverServable

    notes: list[tuple[int, str]] = []
    cancelled: list[int] = []
    with pytest.raises(NeverServable, match="no GPU of the pool can ever hold job 42's slices"):
        prolog_slurmctld(job_env(pool, tmp_path, nodes="c1"), pool.client,
                         lambda _: info(comment="fraction=0.5 isolation=strict", nodes="c1", tres="gres:rgpu:1",
                                        licenses="rgpu:50"),
                         set_admin_comment=lambda job, text: notes.append((job, text)), cancel=cancelled.append)
    assert cancelled == [42] and keys(pool) == []
    ((_, text),) = notes
    assert text.startswith("rgpu:v1 nodes=1 count=1 percent=50 units=50 isolation=strict | rgpu: refused: "
                           "prolog-slurmctld: no GPU of the pool can ever hold job 42's slices"), text
    # Busy is not never: a request that fits an empty pool waits (marked), and is not cancelled.
    with pool.client() as c:
        c.allocate("admin-held", "nobody", 4, percent=100)
    with pytest.raises(CapacityError):
        prolog_slurmctld(job_env(pool, tmp_path, job_id=43, nodes="c1"), pool.client,
                         lambda _: info(job_id=43, comment="fraction=1", nodes="c1", tres="gres:rgpu:1"),
                         set_admin_comment=lambda job, text: notes.append((job, text)), cancel=cancelled.append)
    assert cancelled == [42] and notes[-1][0] == 43 and "| rgpu: waiting: " in notes[-1][1]


def test_a_job_the_pool_does_not_answer_for_is_marked_as_waiting(pool: RgpuCluster, tmp_path: Path) -> None:
    """So the reconciler starts it as soon as the pool is back (waiting.py), not after Slurm's delay."""
    from rgpu.errors import Unavailable

    env = {**job_env(pool, tmp_path, nodes="c1"), "RGPU_POOL": "127.0.0.1:1"}   # nothing listens there
    notes: list[str] = []
    with pytest.raises(Unavailable):
        prolog_slurmctld(env, lambda: prolog_main.connect_pool(env), lambda _: info(nodes="c1"),
                         set_admin_comment=lambda _job, text: notes.append(text))
    (note,) = notes
    assert note.startswith("rgpu:v1 nodes=1 count=2 percent=50 units=100 | rgpu: waiting: pool: "), note
    assert "did not answer" in note and note.endswith("it starts when the pool answers and can place it"), note


def test_prolog_slurmctld_entry_point_exit_codes(pool: RgpuCluster, tmp_path: Path) -> None:
    env = job_env(pool, tmp_path)
    env["PATH"] = "/nonexistent"           # scontrol cannot run: the failure is one line and exit 1
    assert prolog_main.prolog_slurmctld_main(env) == 1


def test_node_prolog_writes_a_private_adaptor_conf_for_the_job_user(pool: RgpuCluster, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give files to another user")
    prolog_slurmctld(job_env(pool, tmp_path), pool.client, lambda _: info())
    path = node_prolog(job_env(pool, tmp_path, node="c2"), pool.client)
    assert path == tmp_path / "42" / "adaptor.conf"
    st, dst = path.stat(), path.parent.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, NOBODY, NOBODY)
    assert (stat.S_IMODE(dst.st_mode), dst.st_uid) == (0o700, NOBODY)
    conf = read_adaptor_conf(path)
    assert conf.job_id == "slurm:hpc:42:0:c2" and conf.user == "nobody" and len(conf.slices) == 2


def test_node_prolog_without_a_lease_writes_nothing(pool: RgpuCluster, tmp_path: Path) -> None:
    assert node_prolog(job_env(pool, tmp_path, job_id=7), pool.client) is None
    assert not (tmp_path / "7").exists()


def test_node_prolog_of_a_job_charged_for_rgpu_whose_lease_is_gone_fails_instead_of_running_it_plain(
        pool: RgpuCluster, tmp_path: Path) -> None:
    """A lease released or lost between PrologSlurmctld and the node Prolog: Slurm is asked (only
    then) whether the job holds the rgpu license; it does, so the Prolog fails (prolog_main records
    why and requeues the job) rather than let it run without its slices."""
    from rgpu.errors import NotFound
    from rgpu.prolog.logic import charged_for_rgpu

    env = job_env(pool, tmp_path)
    prolog_slurmctld(env, pool.client, lambda _: info())
    with pool.client() as c:
        c.release("slurm:hpc:42:0:c1")
    asked: list[int] = []

    def query(job_id: int) -> JobInfo:
        asked.append(job_id)
        return info(record="rgpu:v1 nodes=2 count=2 percent=50 units=200", licenses="rgpu:200")

    with pytest.raises(NotFound) as caught:
        node_prolog(env, pool.client, query)
    assert asked == [42]
    text = str(caught.value)
    assert text.startswith("rgpu: prolog: the pool has no lease slurm:hpc:42:0:c1 for job 42, which holds the rgpu license")
    assert "job is requeued" in text and "\n" not in text
    assert not (tmp_path / "42" / "adaptor.conf").exists()
    # A plain job whose comment merely holds a size word: still nothing written, no failure.
    assert node_prolog(job_env(pool, tmp_path, job_id=7), pool.client, lambda _: info(tres="", licenses="")) is None
    assert not charged_for_rgpu(info(tres="", licenses="")) and charged_for_rgpu(info(licenses="matlab:1,rgpu:50"))
    # The other node's lease is there: that node's Prolog asks Slurm nothing.
    assert node_prolog({**env, "SLURMD_NODENAME": "c2"}, pool.client, query) is not None and asked == [42]


def test_node_prolog_never_fails_and_records_why(pool: RgpuCluster, tmp_path: Path) -> None:
    env = job_env(pool, tmp_path)
    env["RGPU_POOL"] = "127.0.0.1:1"       # nothing listens there
    assert prolog_main.prolog_main(env) == 0
    error = (tmp_path / "42" / "error").read_text()
    assert error.startswith("rgpu: pool: pool daemon at 127.0.0.1:1 did not answer") and error.count("\n") == 1
    assert not (tmp_path / "42" / "adaptor.conf").exists()
    # A later successful run replaces the error with the conf.
    prolog_slurmctld(job_env(pool, tmp_path), pool.client, lambda _: info())
    assert prolog_main.prolog_main(job_env(pool, tmp_path)) == 0
    assert (tmp_path / "42" / "adaptor.conf").exists() and not (tmp_path / "42" / "error").exists()


def test_epilogs_are_idempotent(pool: RgpuCluster, tmp_path: Path) -> None:
    env = job_env(pool, tmp_path)
    prolog_slurmctld(env, pool.client, lambda _: info())
    node_prolog(env, pool.client)
    assert epilog_slurmctld(env, pool.client) == ["slurm:hpc:42:0:c1", "slurm:hpc:42:0:c2"]
    assert epilog_slurmctld(env, pool.client) == []
    assert keys(pool) == []
    assert node_epilog(env) is True and node_epilog(env) is False
    assert not (tmp_path / "42").exists()
    assert prolog_main.epilog_slurmctld_main(env) == 0 and prolog_main.epilog_main(env) == 0


class RecordingPool:
    """A real pool client that notes the calls an epilog makes, in order."""

    def __init__(self, client: object) -> None:
        self.client, self.calls = client, []   # type: ignore[var-annotated]

    def release(self, job_key: str) -> bool:
        self.calls.append(f"release {job_key}")
        return self.client.release(job_key)   # type: ignore[attr-defined,no-any-return]

    def list_leases(self) -> list[object]:
        self.calls.append("list")
        return self.client.list_leases()      # type: ignore[attr-defined,no-any-return]


def test_epilog_slurmctld_releases_the_leases_it_can_name_before_it_lists_the_pool(pool: RgpuCluster,
                                                                                  tmp_path: Path) -> None:
    """Slurm keeps the job's license until EpilogSlurmctld exits, and the next held job waits for
    the room: the first call frees it. An earlier attempt's lease (restart 0, its epilog lost)
    is still found in the list and released."""
    prolog_slurmctld(job_env(pool, tmp_path, restart=0), pool.client, lambda _: info())
    env = job_env(pool, tmp_path, restart=1)
    prolog_slurmctld(env, pool.client, lambda _: info())
    recorder = RecordingPool(pool.client())
    released = epilog_slurmctld(env, lambda: recorder)
    assert recorder.calls[:2] == ["release slurm:hpc:42:1:c1", "release slurm:hpc:42:1:c2"], recorder.calls
    assert released == ["slurm:hpc:42:0:c1", "slurm:hpc:42:0:c2", "slurm:hpc:42:1:c1", "slurm:hpc:42:1:c2"]
    assert keys(pool) == []


@pytest.mark.integration   # runs each entry script
@pytest.mark.parametrize("script", ["rgpu-epilog-slurmctld", "rgpu-epilog"])
def test_epilogs_of_an_rgpu_job_load_only_what_the_release_needs(script: str, pool: RgpuCluster, tmp_path: Path) -> None:
    """The next held job waits for the ended job's release and license: the epilogs load neither
    the node Prolog's rendering (jinja2) nor the Slurm queries and admission (the prologs' logic),
    and, once done (the node Epilog: once the pool's admission caught up with the job's end), they
    exit without unloading what they loaded, their line written."""
    env = job_env(pool, tmp_path)
    prolog_slurmctld(env, pool.client, lambda _: info())
    node_prolog(env, pool.client)
    hook = tmp_path / "hook"        # an exit handler that says when the interpreter's teardown runs
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("import atexit, sys\natexit.register(lambda: print('teardown', file=sys.stderr))\n")
    out = subprocess.run([sys.executable, "-X", "importtime", str(PROLOG_DIR / script)], capture_output=True, text=True,
                         timeout=30, check=False,
                         env={**env, "PATH": os.environ["PATH"], "PYTHONPATH": f"{REPO}:{hook}"})
    loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    heavy = ("jinja2", "rgpu.adaptor", "rgpu.prolog.logic", "rgpu.slurm_plugin.scontrol", "rgpu.slurm_plugin.waiting",
             "rgpu.remoting.pool.convert")
    assert out.returncode == 0 and "rgpu.prolog.main" in loaded, out
    assert sorted(m for m in loaded if m.startswith(heavy)) == [], out
    if script == "rgpu-epilog-slurmctld":
        assert keys(pool) == [] and "rgpu-epilog-slurmctld[job 42]: released slurm:hpc:42:0:c1, slurm:hpc:42:0:c2 in " \
            in out.stderr, out.stderr
        assert "teardown" not in out.stderr
    else:
        # It waited for the pool's admission (none runs beside this pool: answered at once), then exited at once.
        assert not (tmp_path / "42").exists() and "teardown" not in out.stderr
        assert "rgpu-epilog[job 42]: the pool's admission caught up with the job's end in " in out.stderr, out.stderr


def test_epilog_slurmctld_reports_an_unreachable_pool(tmp_path: Path) -> None:
    env = {"SLURM_CLUSTER_NAME": "hpc", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "c1",
           "SLURM_JOB_LICENSES": "rgpu:100", "RGPU_POOL": "127.0.0.1:1", "RGPU_SECRET_FILE": str(tmp_path / "missing"),
           "RGPU_CONFIG": str(tmp_path / "none.toml")}
    (tmp_path / "none.toml").write_text("")
    assert prolog_main.epilog_slurmctld_main(env) == 1


def test_node_epilog_removes_what_the_job_left_without_following_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    job_dir = tmp_path / "run" / "9"
    job_dir.mkdir(parents=True)
    (job_dir / "link").symlink_to(outside)
    env = {"SLURM_CLUSTER_NAME": "hpc", "SLURM_JOB_ID": "9", "RGPU_RUN_DIR": str(tmp_path / "run")}
    assert prolog_main.epilog_main(env) == 0
    assert not job_dir.exists() and (outside / "keep").exists()
    assert prolog_main.epilog_main({"SLURM_JOB_ID": "not-a-number"}) == 0   # never fails


def test_an_ended_rgpu_job_leaves_a_mark_its_next_prolog_removes(pool: RgpuCluster, tmp_path: Path) -> None:
    env = job_env(pool, tmp_path)
    prolog_slurmctld(env, pool.client, lambda _: info())
    node_prolog(env, pool.client)
    assert node_epilog(env) is True
    mark = tmp_path / "42.ended"
    assert mark.is_file() and not (tmp_path / "42").exists()
    # The requeued attempt's Prolog sets the job up again and takes the mark away.
    prolog_slurmctld(dict(env, SLURM_RESTART_COUNT="1"), pool.client, lambda _: info())
    node_prolog(dict(env, SLURM_RESTART_COUNT="1"), pool.client)
    assert (tmp_path / "42" / "adaptor.conf").exists() and not mark.exists()


def test_the_prolog_sweep_removes_old_ended_marks_only(pool: RgpuCluster, tmp_path: Path) -> None:
    old, recent, odd = tmp_path / "7.ended", tmp_path / "8.ended", tmp_path / "x.ended"
    for mark in (old, recent, odd):
        mark.touch()
    week_ago = time.time() - 8 * 24 * 3600
    os.utime(old, (week_ago, week_ago))
    os.utime(odd, (week_ago, week_ago))
    assert old in sweep_stale_job_dirs(tmp_path, 42, pool.client())
    assert not old.exists() and recent.exists() and odd.exists()


def test_the_prolog_sweep_leaves_an_ended_jobs_folder_to_its_own_epilog(pool: RgpuCluster, tmp_path: Path) -> None:
    """EpilogSlurmctld ends a job's lease while, or before, its node Epilog runs (that one waits for
    the job's Prolog and tasks): the Prolog of a job starting beside it leaves the folder to that
    Epilog, which removes it and leaves the ended mark. On real Slurm job 1, cancelled during its
    Prolog, lost its folder to job 2's Prolog, and its Epilog found nothing to do."""
    ending, starting = job_env(pool, tmp_path, job_id=41), job_env(pool, tmp_path)
    for env, job_id in ((ending, 41), (starting, 42)):
        prolog_slurmctld(env, pool.client, lambda _, job_id=job_id: info(job_id))
    node_prolog(ending, pool.client)
    epilog_slurmctld(ending, pool.client)
    node_prolog(starting, pool.client)
    assert (tmp_path / "41" / "adaptor.conf").exists()
    assert node_epilog(ending) is True
    assert (tmp_path / "41.ended").is_file() and not (tmp_path / "41").exists()


def test_a_later_attempts_prolog_takes_away_the_earlier_attempts_lease_gone_note(pool: RgpuCluster,
                                                                                tmp_path: Path) -> None:
    env = job_env(pool, tmp_path, job_id=41)
    prolog_slurmctld(env, pool.client, lambda _: info(41))
    node_prolog(env, pool.client)
    epilog_slurmctld(env, pool.client)
    with pool.client() as c:
        sweep_stale_job_dirs(tmp_path, 42, c)
    assert (tmp_path / "41" / ".lease-gone").is_file()   # the sweep noted it: the later Prolog has one to take
    again = dict(env, SLURM_JOB_RESTART_COUNT="1")   # restarted here before its Epilog removed the folder
    prolog_slurmctld(again, pool.client, lambda _: info(41))
    node_prolog(again, pool.client)
    assert not (tmp_path / "41" / ".lease-gone").exists()


@pytest.mark.integration   # runs the TaskProlog script
def test_task_prolog_refuses_an_attempt_that_started_without_its_node_prolog(tmp_path: Path) -> None:
    # Slurm 22.05 can restart a requeued job on the same node without running the node Prolog again:
    # the Epilog of the earlier attempt left its mark, and there is no job folder.
    (tmp_path / "42.ended").touch()
    out = subprocess.run([str(PROLOG_DIR / "rgpu-task-prolog")], env={"SLURM_JOB_ID": "42", "RGPU_RUN_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=10, check=False)
    assert out.returncode == 1, out
    assert out.stdout.startswith("print rgpu: task prolog: job 42 was restarted on this node without its node Prolog")
    assert out.stdout.count("\n") == 1
    (tmp_path / "42").mkdir()                         # its Prolog ran after all: the folder wins
    (tmp_path / "42" / "adaptor.conf").write_text("")
    out = subprocess.run([str(PROLOG_DIR / "rgpu-task-prolog")], env={"SLURM_JOB_ID": "42", "RGPU_RUN_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=10, check=False)
    assert out.returncode == 0 and out.stdout.startswith("export RGPU_ADAPTOR_CONF="), out


@pytest.mark.parametrize("job_id, made, expected", [
    ("42", True, "export RGPU_ADAPTOR_CONF={run}/42/adaptor.conf\n"),
    ("42", False, ""),
    ("42;id", True, ""),
    ("", True, ""),
])
@pytest.mark.integration   # runs the TaskProlog script
def test_task_prolog(tmp_path: Path, job_id: str, made: bool, expected: str) -> None:
    if made:
        (tmp_path / "42").mkdir()
    out = subprocess.run([str(PROLOG_DIR / "rgpu-task-prolog")], env={"SLURM_JOB_ID": job_id, "RGPU_RUN_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=10)
    assert out.returncode == 0 and out.stdout == expected.format(run=tmp_path)


@pytest.mark.integration   # runs the TaskProlog script
def test_task_prolog_fails_a_task_whose_slices_the_node_prolog_could_not_set_up(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "error").write_text("rgpu: pool: pool daemon at 10.0.0.1:7000 did not answer (x\x1b[2J; y)\n")
    out = subprocess.run([str(PROLOG_DIR / "rgpu-task-prolog")], env={"SLURM_JOB_ID": "42", "RGPU_RUN_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=10, check=False)
    # Slurm ends the task (TaskProlog failed) and writes the "print" line into the job's output.
    assert out.returncode == 1, out
    assert out.stdout == ("print rgpu: pool: pool daemon at 10.0.0.1:7000 did not answer (x?[2J; y) -- this task does "
                          "not start without its GPU slices\n"), out.stdout
    (tmp_path / "42" / "adaptor.conf").write_text("")      # a later prolog succeeded: the conf wins
    out = subprocess.run([str(PROLOG_DIR / "rgpu-task-prolog")], env={"SLURM_JOB_ID": "42", "RGPU_RUN_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=10, check=False)
    assert out.returncode == 0 and out.stdout.startswith("export RGPU_ADAPTOR_CONF="), out


@pytest.mark.integration   # runs each entry script
@pytest.mark.parametrize("script", ["rgpu-prolog-slurmctld", "rgpu-prolog", "rgpu-epilog-slurmctld", "rgpu-epilog"])
def test_prologs_of_a_plain_job_ask_nothing_and_import_no_pool_client(script: str, tmp_path: Path) -> None:
    """A job without the rgpu license (and no size word in its comment) costs the interpreter's
    start and nothing else: no Slurm command (PATH leads nowhere), no pool (nothing listens)."""
    import time

    env = {"PATH": "/nonexistent", "PYTHONPATH": str(REPO), "RGPU_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "42",
           "SLURM_CLUSTER_NAME": "hpc", "SLURM_JOB_NODELIST": "c1", "SLURMD_NODENAME": "c1",
           "SLURM_JOB_LICENSES": "matlab:2", "SLURM_JOB_COMMENT": "my run, seed=4",
           "RGPU_POOL": "127.0.0.1:1", "RGPU_CONFIG": str(tmp_path / "none.toml")}
    code = ("import runpy, sys\n"
            "try:\n"
            f"    runpy.run_path({str(PROLOG_DIR / script)!r}, run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    print(exc.code, sorted(m for m in sys.modules if m.startswith(('grpc', 'rgpu.remoting', 'rgpu.prolog.logic'))))\n")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env, check=False)
    assert out.returncode == 0 and out.stdout == "0 []\n" and out.stderr == "", out
    assert time.monotonic() - started < 2.0


@pytest.mark.integration   # runs each entry script
@pytest.mark.parametrize("script", ["rgpu-prolog-slurmctld", "rgpu-prolog", "rgpu-epilog-slurmctld", "rgpu-epilog"])
def test_entry_scripts_run_without_slurm(script: str, tmp_path: Path) -> None:
    """The thin scripts start and map a missing Slurm environment to their documented exit code."""
    out = subprocess.run([sys.executable, str(PROLOG_DIR / script)], capture_output=True, text=True, timeout=30,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "RGPU_RUN_DIR": str(tmp_path),
                              "SLURM_JOB_LICENSES": "rgpu:100", "SLURM_JOB_COMMENT": "fraction=1"})
    expected = {"rgpu-prolog-slurmctld": 1, "rgpu-epilog-slurmctld": 1}.get(script, 0)
    assert out.returncode == expected, out
    assert "$SLURM_JOB_ID is not set" in out.stderr


def test_node_prolog_removes_folders_of_jobs_whose_lease_is_gone(pool: RgpuCluster, tmp_path: Path) -> None:
    from rgpu.adaptor import write_private_file

    # Job 7 ended while slurmd was down: its folder stayed, its lease was released.
    prolog_slurmctld(job_env(pool, tmp_path, job_id=7), pool.client, lambda _: info(job_id=7))
    node_prolog({**job_env(pool, tmp_path, job_id=7), "SLURM_JOB_UID": "", "SLURM_JOB_GID": ""}, pool.client)
    (tmp_path / "8").mkdir()                                  # a failed prolog's error: flexrun reports it
    write_private_file(tmp_path / "8" / "error", "rgpu: prolog: x\n", None, None)
    (tmp_path / "notajob").mkdir()
    epilog_slurmctld(job_env(pool, tmp_path, job_id=7), pool.client)
    assert (tmp_path / "7" / "adaptor.conf").exists()
    # A Prolog notes job 7's lease gone (its Epilog may yet come); one an hour later removes the folder.
    for job_id in (9, 10):
        prolog_slurmctld(job_env(pool, tmp_path, job_id=job_id), pool.client, lambda _, j=job_id: info(job_id=j))
        node_prolog({**job_env(pool, tmp_path, job_id=job_id), "SLURM_JOB_UID": "", "SLURM_JOB_GID": ""}, pool.client)
        if job_id == 9:
            assert (tmp_path / "7" / "adaptor.conf").exists()
            hour_ago = time.time() - 3600
            os.utime(tmp_path / "7" / ".lease-gone", (hour_ago, hour_ago))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["10", "8", "9", "notajob", "pool"]   # pool: the fixture's


def test_the_keys_the_prologs_make_are_reserved_for_the_daemons() -> None:
    from rgpu import validate
    from rgpu.slurm_plugin.jobkey import job_key
    key = job_key("hpc", 4242, 0, "c17")
    assert validate.reserved_job_key_prefix(key) == "slurm:"
    assert validate.reserved_job_key_prefix("flexrun-c17-42-abc") == ""


def test_pack_node_puts_each_nodes_slices_on_one_gpu_server_or_cancels_what_never_fits(
        pool: RgpuCluster, tmp_path: Path) -> None:
    """--comment=pack=node (issue 27): PrologSlurmctld asks the pool for each node's slices on one GPU
    server. Two half slices fit one server of two GPUs; three never do (each server has two), so the job
    is cancelled with the reason instead of waiting for ever, although the pool's four GPUs hold three
    unpacked."""
    from rgpu.prolog.logic import NeverServable

    got = prolog_slurmctld(job_env(pool, tmp_path, nodes="c1"), pool.client,
                           lambda _: info(comment="fraction=0.5 pack=node", nodes="c1", tres="gres:rgpu:2",
                                          licenses="rgpu:100"))
    with pool.client() as c:
        lease = c.get_lease(got[0])
    assert len(lease.slices) == 2 and len({s.server for s in lease.slices}) == 1, lease
    cancelled: list[int] = []
    with pytest.raises(NeverServable, match="no GPU of the pool can ever hold job 43's slices"):
        prolog_slurmctld(job_env(pool, tmp_path, job_id=43, nodes="c1"), pool.client,
                         lambda _: info(job_id=43, comment="fraction=0.5,pack=node", nodes="c1", tres="gres:rgpu:3",
                                        licenses="rgpu:150"),
                         set_admin_comment=lambda _job, _text: None, cancel=cancelled.append)
    assert cancelled == [43] and keys(pool) == got
