"""End to end on a real Slurm cluster (munge, slurmctld, slurmd c1..c3) with a real rgpu pool and
two dispatchers (4 GPUs): real sbatch / srun / scancel / scontrol. Issue 3, item 6.

Tests run in file order; the last one checks that no node was drained by anything before it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rgpu.adaptor import parse_adaptor_conf
from rgpu.slurm_plugin.versions import tres_gres_prefix
from tests.slurm.cluster import missing_requirements, wait_until
from tests.slurm.conftest import PROLOG_DIR, Harness, pool_ready
from tests.slurm.e2e_helpers import FINISHED, JOB_USER, diagnostics, finished

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]


def no_lease_soon(h: Harness, job_id: str, timeout: float = 15.0) -> None:
    try:
        wait_until(f"job {job_id}'s leases to be released", lambda: not h.job_leases(job_id) or None, timeout)
    except TimeoutError:
        raise AssertionError(f"job {job_id} still holds {[lease.job_key for lease in h.job_leases(job_id)]}\n"
                             f"{diagnostics(h)}") from None


def slices_ready(h: Harness, job_id: str, timeout: float = 30.0) -> None:
    """Until the job's node Prolog wrote its adaptor.conf: a job is RUNNING (reason None) while its
    node Prolog still runs, and one that then cannot reach the pool is requeued, not run."""
    wait_until(f"job {job_id}'s node Prolog to write its adaptor.conf",
               lambda: any(h.run_dir.glob(f"*/{job_id}/adaptor.conf")) or None, timeout)


def confs_in_output(text: str) -> list[str]:
    """adaptor.conf texts a job printed between BEGIN/END markers."""
    return re.findall(r"^BEGIN\n(.*?)^END$", text, re.DOTALL | re.MULTILINE)


SHOW_CONF = """\
echo "CONF=$RGPU_ADAPTOR_CONF NODE=$SLURMD_NODENAME"
ls -ln "$RGPU_ADAPTOR_CONF"
echo BEGIN; cat "$RGPU_ADAPTOR_CONF"; echo END
"""


# 1 -----------------------------------------------------------------------------------------------
def test_fraction_job_gets_two_half_slices_on_distinct_gpus(h: Harness) -> None:
    job = h.slurm.submit(["--gres=rgpu:2", "--comment=fraction=0.5"], SHOW_CONF, user=JOB_USER)
    info = finished(h, job)
    out = h.slurm.job_output(job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{out}\n{diagnostics(h)}"
    assert info["Licenses"] == "rgpu:100"
    (text,) = confs_in_output(out)
    conf = parse_adaptor_conf(text)
    assert conf.user == JOB_USER and conf.job_id == f"slurm:rgputest:{job}:0:{info['NodeList']}"
    assert len(conf.slices) == 2 and len({s.gpu_uuid for s in conf.slices}) == 2
    with h.client() as c:
        usable = {g.gpu.uuid: g.gpu.usable_memory_bytes for g in c.list_gpus()}
    for s in conf.slices:
        assert s.compute_percent == 50
        assert s.memory_limit_bytes == usable[s.gpu_uuid] // 2
    # mode 0600, owned by the job's user (uid of nobody)
    listing = next(line for line in out.splitlines() if line.startswith("-"))
    assert listing.startswith("-rw------- ") and listing.split()[2] == str(65534), listing
    no_lease_soon(h, job)
    assert not (h.run_dir / info["NodeList"] / job).exists(), "the node Epilog left the job's files"
    # PrologSlurmctld logged its one line, well inside MessageTimeout (10 s).
    log = (h.slurm.logs / "PrologSlurmctld.log").read_text()
    (seconds,) = re.findall(rf"rgpu-prolog-slurmctld\[job {job}\]: allocated \S+ in ([0-9.]+) s", log)
    assert float(seconds) < 3.0, log


# 2 -----------------------------------------------------------------------------------------------
def test_demand_above_capacity_waits_held_by_rgpu_then_runs(h: Harness) -> None:
    # 3 jobs of 2 whole GPUs each on a pool of 4 GPUs: the third waits, held until the pool can
    # place it (job_submit_rgpu.conf: hold_until_placed = 1), then runs; nothing is requeued.
    jobs = [h.slurm.submit(["--gres=rgpu:2", "--comment=fraction=1"], "sleep 4\n", user=JOB_USER) for _ in range(3)]
    wait_until("two jobs running", lambda: sum(h.slurm.job_state(j) == "RUNNING" for j in jobs) == 2 or None, 30)
    (waiting,) = [j for j in jobs if h.slurm.job_state(j) == "PENDING"]
    shown = h.slurm.show_job(waiting)
    assert shown.get("Reason") == "JobHeldUser", shown
    assert " | rgpu: waiting: held until the pool can place its slices" in shown.get("AdminComment", ""), shown
    states = [finished(h, j, 60)["JobState"] for j in jobs]
    assert states == ["COMPLETED"] * 3, f"{states}\n{diagnostics(h)}"
    assert all(h.slurm.show_job(j)["Restarts"] == "0" for j in jobs), "a job was requeued: the prolog failed"


def held_behind_a_full_pool(h: Harness) -> tuple[list[str], str]:
    """Two jobs running on all 4 GPUs, and a half-GPU job held until the pool can place it."""
    blockers = [h.slurm.submit(["--gres=rgpu:2", "--comment=fraction=1"], "sleep 300\n", user=JOB_USER)
                for _ in range(2)]
    for job in blockers:
        h.slurm.wait_job_state(job, "RUNNING", 30)
    waiting = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], "true\n", user=JOB_USER)
    wait_until("the job to wait held", lambda: h.slurm.show_job(waiting).get("Reason") == "JobHeldUser" or None, 30)
    return blockers, waiting


def test_a_user_cannot_release_his_job_held_for_the_pool_and_the_pool_releases_it(h: Harness) -> None:
    """Slurm counts rgpu's hold as the user's own (JobHeldUser): `scontrol release` and `scontrol
    update priority=` by the user reach job_submit.lua's job_modify, which refuses them for a marked
    job; the job stays held and marked, and runs once the pool releases it (its scontrol runs as
    root here, SlurmUser)."""
    blockers, waiting = held_behind_a_full_pool(h)
    uid = h.slurm.install.passwd_ids(JOB_USER)[0]
    for argv, priority in ((["scontrol", "release", waiting], "4294967295"),
                           (["scontrol", "update", f"jobid={waiting}", "priority=100"], "100")):
        out = h.slurm.command(argv, user=JOB_USER, check=False)
        assert out.returncode != 0, out
        if h.version >= "23.02":       # 22.05 shows no job_submit text for updates: its log has it
            (line,) = [line for line in out.stderr.splitlines() if "rgpu" in line]
            assert f"job {waiting} is held until the pool can place its slices, and only rgpu-poold releases it" in line
        log = (h.slurm.logs / "slurmctld.log").read_text(errors="replace")
        assert f"rgpu: refused a release of job {waiting} by uid {uid} (priority={priority}): " in log, log[-3000:]
    time.sleep(2)                    # several reconciler passes: still held, never started
    job = h.slurm.job_json(waiting)
    assert job["job_state"] == "PENDING" and job["state_reason"] == "JobHeldUser", job
    assert "| rgpu: waiting: held until the pool can place its slices" in job["admin_comment"], job
    h.slurm.command(["scancel", blockers[0]])
    info = finished(h, waiting, 60)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{diagnostics(h)}"


def test_the_node_epilog_of_an_ended_rgpu_job_ends_once_the_pool_let_go_the_job_held_for_its_room(h: Harness) -> None:
    """Slurm schedules at once when a node Epilog completes, while the pool's `scontrol release`
    only queues a pass for slurmctld's next whole second: the node Epilog of an rgpu job asks the
    pool (AdmissionPending) until its admission caught up with the job's end, so the job its room
    lets go starts at the Epilog's completion (prolog/README.md, rgpu-epilog)."""
    blockers, waiting = held_behind_a_full_pool(h)
    h.slurm.command(["scancel", blockers[0]])
    info = finished(h, waiting, 60)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{diagnostics(h)}"
    log = h.slurm.logs / "Epilog.log"
    # It says how the wait ended: caught up, or (on a loaded machine, as CI's 2 cores once were)
    # past slurm_epilog_admission_wait_seconds; either way the Epilog asked the pool.
    said = (f"rgpu-epilog[job {blockers[0]}]: the pool's admission caught up with the job's end in ",
            f"rgpu-epilog[job {blockers[0]}]: the pool's admission did not catch up with the job's end within ")
    try:
        wait_until("the ended job's node Epilog to have waited for the pool's admission",
                   lambda: log.exists() and any(line in log.read_text(errors="replace") for line in said) or None, 60)
    except TimeoutError as exc:   # what the Epilog said instead, for whoever reads the failure
        raise AssertionError(f"{exc}\nEpilog.log:\n{log.read_text(errors='replace')[-3000:] if log.exists() else '(none)'}"
                             f"\n{diagnostics(h)}") from None
    h.slurm.command(["scancel", blockers[1]])


def test_a_released_job_the_pool_cannot_place_is_held_again_before_slurm_starts_it(h: Harness) -> None:
    """A job let go whose room went (here: an admin released it while every GPU is busy; in the
    mixed batch: a lease that ended changed where the next slices go) is marked and given a user
    hold again by the pool before Slurm starts it (it waits on the license), then released once it
    fits, and runs without a requeue."""
    blockers, waiting = held_behind_a_full_pool(h)
    h.slurm.command(["scontrol", "release", waiting])              # root: the job waits on the license now

    def held_again() -> dict | None:
        job = h.slurm.job_json(waiting)
        assert job["job_state"] == "PENDING", f"the job left PENDING: {job}\n{diagnostics(h)}"
        return job if job["state_reason"] == "JobHeldUser" and "| rgpu: waiting: held again" in job["admin_comment"] else None

    wait_until("the pool to hold the job again", held_again, 20)
    h.slurm.command(["scancel", blockers[0]])
    info = finished(h, waiting, 60)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{diagnostics(h)}"


def test_a_lease_change_right_after_admission_cannot_take_the_released_jobs_room(h: Harness) -> None:
    """Issue 23's requeue window: between the pool's release of a job and its PrologSlurmctld's
    Allocate, another lease ended and the next lease took the room the job was released into. Now
    the admission reserves the job's placement (a reservation under its key, `+r0`), no other
    request can take it, and the job's Allocate claims it. The job is kept from starting (its node
    is busy) so the window is as long as the test needs; a mixed batch of other jobs runs beside."""
    busy = h.slurm.submit(["-w", "c1", "--exclusive"], "sleep 300\n", user=JOB_USER)   # plain: no rgpu
    h.slurm.wait_job_state(busy, "RUNNING", 30)
    with h.client() as c:
        c.allocate("test-fill-a", "root", 2, percent=100)               # one server's two GPUs
        fill_b = c.allocate("test-fill-b", "root", 1, percent=100)      # one of the other's
    try:
        job = h.slurm.submit(["-w", "c1", "--gres=rgpu:1", "--comment=fraction=1.0"], "true\n", user=JOB_USER)

        def released_and_reserved() -> list | None:
            shown = h.slurm.show_job(job)
            assert shown["JobState"] == "PENDING", f"{shown}\n{diagnostics(h)}"
            held = [le for le in h.job_leases(job) if le.job_key == f"slurm:rgputest:{job}:0:+r0"]
            return held if shown.get("Reason") != "JobHeldUser" and held else None

        (reservation,) = wait_until("the pool to release the job into a reserved GPU", released_and_reserved, 30)
        others = [h.slurm.submit(["--gres=rgpu:1", f"--comment=fraction={f}"], "sleep 1\n", user=JOB_USER)
                  for f in ("0.25", "0.5")]
        with h.client() as c:
            c.release("test-fill-b")                                     # a lease ends: one GPU free
            with pytest.raises(Exception, match="cannot place 2 slice"):
                c.allocate("test-steal", "root", 2, percent=50)        # it would need the reserved GPU
        for other in others:
            assert finished(h, other, 60)["JobState"] == "COMPLETED", diagnostics(h)
        time.sleep(2)                                                    # passes renew the reservation
        assert [le.slices for le in h.job_leases(job)] == [reservation.slices]
        h.slurm.command(["scancel", busy])
        info = finished(h, job, 60)
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{diagnostics(h)}"
        log = h.pool.pool.log() if h.pool.pool else ""
        assert f"lease slurm:rgputest:{job}:0:c1 for {JOB_USER}: {reservation.slices[0].server}/" \
               f"{reservation.slices[0].gpu_index}@100%" in log, log[-3000:]
        assert fill_b.slices[0].gpu_uuid != reservation.slices[0].gpu_uuid
    finally:
        with h.client() as c:
            for key in ("test-fill-a", "test-fill-b", "test-steal"):
                c.release(key)


# 3 -----------------------------------------------------------------------------------------------
def test_scancel_releases_the_lease_within_seconds(h: Harness) -> None:
    job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.25"], "sleep 300\n", user=JOB_USER)
    h.slurm.wait_job_state(job, "RUNNING", 30)
    wait_until("the job's lease", lambda: h.job_leases(job) or None, 10)
    started = time.monotonic()
    h.slurm.command(["scancel", job])
    no_lease_soon(h, job, timeout=10)
    assert time.monotonic() - started < 10


# 4 -----------------------------------------------------------------------------------------------
BAD_REQUESTS = [
    (["--gres=rgpu:1", "--comment=fraction=0"], "invalid fraction '0'"),
    (["--gres=rgpu:1", "--comment=fraction=-1"], "invalid fraction '-1'"),
    (["--gres=rgpu:1", "--comment=fraction=1.5"], "invalid fraction '1.5'"),
    (["--gres=rgpu:1", "--comment=fraction=abc"], "invalid fraction 'abc'"),
    (["--gres=rgpu:0"], "count of slices per node must be from 1 to 4"),
    (["--gres=rgpu:5"], "count of slices per node must be from 1 to 4"),
    (["--gres=rgpu:1", "-N", "1-3"], "variable node count"),
    (["--gres=rgpu:1", "--comment=fraction=0.5 memory=8G"], "both fraction and memory"),
    (["--gres=rgpu:1", "--comment=fraction=0.5 isolation=loose"], "invalid isolation 'loose'"),
    (["--gres=rgpu:1", '--comment=fraction=0.5"\ntoken = "forged'], "characters rgpu does not accept"),
    (["--gres=rgpu:1", "--comment=fraction=$(touch /tmp/rgpu-pwned)"], "characters rgpu does not accept"),
    (["--gres=rgpu:1", "--comment=fraction=0.5; touch /tmp/rgpu-pwned"], "characters rgpu does not accept"),
    (["--gres=rgpu:1", "-L", "rgpu:10"], "do not ask for the rgpu license yourself"),
]


@pytest.mark.parametrize("args, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_requests_are_refused_at_submit(h: Harness, args: list[str], message: str) -> None:
    out = h.slurm.sbatch(args, "true\n", user=JOB_USER, check=False)
    assert out.returncode != 0, f"sbatch {args} was accepted: {out.stdout}"
    assert "rgpu: job_submit: " in out.stderr and message in out.stderr, out.stderr
    assert not Path("/tmp/rgpu-pwned").exists()


def test_update_of_a_pending_job_recomputes_or_refuses(h: Harness) -> None:
    job = h.slurm.submit(["--hold", "--gres=rgpu:2", "--comment=fraction=0.5"], "true\n")
    assert h.slurm.show_job(job)["Licenses"] == "rgpu:100"
    h.slurm.command(["scontrol", "update", f"job={job}", "comment=fraction=0.25"])
    assert h.slurm.show_job(job)["Licenses"] == "rgpu:50"
    h.slurm.command(["scontrol", "update", f"job={job}", "gres=rgpu:3"])
    assert h.slurm.show_job(job)["Licenses"] == "rgpu:75"
    bad = h.slurm.command(["scontrol", "update", f"job={job}", "comment=fraction=2"], check=False)
    assert bad.returncode != 0 and "Invalid generic resource" not in bad.stderr, bad   # a comment error
    assert h.slurm.show_job(job)["Comment"] == "fraction=0.25"
    h.slurm.command(["scancel", job])


# 5 -----------------------------------------------------------------------------------------------
def test_pool_killed_and_restarted_while_a_job_runs(h: Harness) -> None:
    job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], "sleep 6\n" + SHOW_CONF, user=JOB_USER)
    h.slurm.wait_job_state(job, "RUNNING", 30)
    wait_until("the job's lease", lambda: h.job_leases(job) or None, 10)
    slices_ready(h, job)
    assert h.pool.pool is not None
    h.pool.pool.kill()                       # SIGKILL: no clean shutdown
    time.sleep(1)
    h.pool.start_pool(env=h.pool_env())   # same port, same state file
    wait_until("the dispatchers to re-register", lambda: pool_ready(h.pool, 400) or None, 30)
    info = finished(h, job, 60)
    assert info["JobState"] == "COMPLETED", f"{info}\n{h.slurm.job_output(job)}\n{diagnostics(h)}"
    assert len(confs_in_output(h.slurm.job_output(job))) == 1
    no_lease_soon(h, job, timeout=20)


# 6 -----------------------------------------------------------------------------------------------
def test_two_nodes_get_one_slice_each_in_their_own_adaptor_conf(h: Harness) -> None:
    # --label prefixes each line with its task: the two tasks write to one output file at once.
    body = "srun --label -N 2 -n 2 sh -c '" + SHOW_CONF.replace("'", "'\\''") + "'\n"
    job = h.slurm.submit(["-N", "2", "--gres=rgpu:1", "--comment=fraction=0.5"], body, user=JOB_USER)
    info = finished(h, job)
    out = h.slurm.job_output(job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{out}\n{diagnostics(h)}"
    assert info["Licenses"] == "rgpu:100"
    tasks: dict[str, list[str]] = {}
    for line in out.splitlines():
        labelled = re.match(r"^\s*(\d+): ?(.*)$", line)
        if labelled:
            tasks.setdefault(labelled[1], []).append(labelled[2])
    confs = [parse_adaptor_conf(t) for lines in tasks.values() for t in confs_in_output("\n".join(lines) + "\n")]
    assert len(confs) == 2
    assert {c.job_id.rsplit(":", 1)[1] for c in confs} == set(re.findall(r"NODE=(\S+)", out)) and len(set(re.findall(r"NODE=(\S+)", out))) == 2
    assert all(len(c.slices) == 1 and c.slices[0].compute_percent == 50 for c in confs)
    no_lease_soon(h, job)


def test_interactive_srun_gets_its_slices_too(h: Harness) -> None:
    out = h.slurm.command(["srun", f"--chdir={h.slurm.jobs_dir}", "--gres=rgpu:1", "--comment=fraction=0.25",
                           "sh", "-c", SHOW_CONF], user=JOB_USER, timeout=60)
    (text,) = confs_in_output(out.stdout)
    conf = parse_adaptor_conf(text)
    assert len(conf.slices) == 1 and conf.slices[0].compute_percent == 25 and conf.user == JOB_USER
    job = conf.job_id.split(":")[2]
    no_lease_soon(h, job)


# 7 -----------------------------------------------------------------------------------------------
def run_script(h: Harness, name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**h.slurm.client_env, "PYTHONPATH": str(PROLOG_DIR.parent), "SLURM_CLUSTER_NAME": "rgputest",
            "RGPU_CONFIG": str(h.pool.root / "rgpu.toml"), "RGPU_POOL": h.pool.pool_address,
            "RGPU_SECRET_FILE": str(h.pool.secret_file), **env}
    return subprocess.run([sys.executable, str(PROLOG_DIR / name)], env=full, capture_output=True, text=True,
                          timeout=30)


def test_epilogs_run_twice_or_after_release_are_harmless(h: Harness) -> None:
    job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], SHOW_CONF, user=JOB_USER)
    info = finished(h, job)
    assert info["JobState"] == "COMPLETED"
    no_lease_soon(h, job)
    node = info["NodeList"]
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_RESTART_COUNT": "0", "SLURM_JOB_NODELIST": node,
           "SLURMD_NODENAME": node, "RGPU_RUN_DIR": str(h.run_dir / node), "SLURM_JOB_LICENSES": "rgpu:50"}
    for _ in range(2):   # after Slurm's own run: twice more, late
        for script in ("rgpu-epilog-slurmctld", "rgpu-epilog"):
            out = run_script(h, script, env)
            assert out.returncode == 0 and out.stderr == "", (script, out)
    # A lease the epilog has to release, twice, and one of a later restart it must not touch.
    with h.client() as c:
        c.allocate(f"slurm:rgputest:{job}:0:{node}", JOB_USER, 1, percent=10)
        c.allocate(f"slurm:rgputest:{job}:1:{node}", JOB_USER, 1, percent=10)
    assert run_script(h, "rgpu-epilog-slurmctld", env).returncode == 0
    assert run_script(h, "rgpu-epilog-slurmctld", env).returncode == 0
    assert [lease.job_key for lease in h.job_leases(job)] == [f"slurm:rgputest:{job}:1:{node}"]
    with h.client() as c:
        c.release(f"slurm:rgputest:{job}:1:{node}")


def test_the_epilog_slurmctld_slurm_runs_loads_only_the_release_and_exits_at_once(h: Harness) -> None:
    """Slurm holds an ended job's license until its EpilogSlurmctld exits, and the next held job
    waits for its release: the script Slurm runs for an rgpu job loads no jinja2, Slurm query or
    admission module, and ends without the interpreter's teardown (no exit handler runs). Its
    wrapper runs it with PYTHONPROFILEIMPORTTIME and an exit-handler hook for this one job."""
    wrapper = h.slurm.root / "bin" / "EpilogSlurmctld"
    saved = wrapper.read_text()
    hook = h.slurm.root / "epilog-hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text("import atexit, sys\natexit.register(lambda: print('teardown', file=sys.stderr))\n")
    trace = h.slurm.root / "epilog-hook" / "stderr.txt"
    trace.unlink(missing_ok=True)
    lines = saved.splitlines()
    exec_at = next(i for i, line in enumerate(lines) if line.startswith("exec "))
    lines[exec_at] = re.sub(r" 2>>'[^']*'$", f" 2>>'{trace}'", lines[exec_at])
    lines[exec_at:exec_at] = ["export PYTHONPROFILEIMPORTTIME=1", f'export PYTHONPATH="$PYTHONPATH:{hook}"']
    try:
        wrapper.write_text("\n".join(lines) + "\n")
        job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], "true\n", user=JOB_USER)
        assert finished(h, job)["JobState"] == "COMPLETED"
        no_lease_soon(h, job)
        wait_until("the EpilogSlurmctld's line", lambda: "released" in (trace.read_text() if trace.exists() else "")
                   or None, 15)
    finally:
        wrapper.write_text(saved)
    text = trace.read_text()
    loaded = {line.split("|")[-1].strip() for line in text.splitlines() if line.startswith("import time:")}
    heavy = ("jinja2", "rgpu.adaptor", "rgpu.prolog.logic", "rgpu.slurm_plugin.scontrol", "rgpu.slurm_plugin.waiting",
             "rgpu.remoting.pool.convert")
    assert "rgpu.prolog.main" in loaded and f"rgpu-epilog-slurmctld[job {job}]: released" in text, text[-2000:]
    assert sorted(m for m in loaded if m.startswith(heavy)) == [] and "teardown" not in text, text[-2000:]


# ----------------------------------------------------------------------------------------------
def test_reconciler_releases_leases_of_gone_jobs_and_reports_missing(h: Harness) -> None:
    import logging

    from rgpu.slurm_plugin.reconcile import Reconciler
    from rgpu.slurm_plugin.squeue import SqueueBackend

    job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], "sleep 300\n", user=JOB_USER)
    h.slurm.wait_job_state(job, "RUNNING", 30)
    wait_until("the job's lease", lambda: h.job_leases(job) or None, 10)
    with h.client() as pool:
        pool.allocate("slurm:rgputest:999999:0:c1", "nobody", 1, percent=10)   # its job never existed
        pool.allocate("slurm:othercluster:999999:0:c1", "nobody", 1, percent=10)
        pool.allocate("admin-request-1", "nobody", 1, percent=10)
        rec = Reconciler(pool, SqueueBackend(env=h.slurm.env), interval_seconds=0.5, grace_seconds=1.0,
                         log=logging.getLogger("test-reconciler"), cluster_lookup=lambda: "rgputest")
        first = rec.run_once()
        assert first is not None and first.release == () and first.missing == ()
        time.sleep(1.1)
        second = rec.run_once()
        assert second is not None and second.release == ("slurm:rgputest:999999:0:c1",)
        keys = {lease.job_key for lease in pool.list_leases()}
        assert "slurm:rgputest:999999:0:c1" not in keys
        assert {"slurm:othercluster:999999:0:c1", "admin-request-1"} <= keys
        assert h.job_leases(job), "the running job's lease was released"
        for lease in h.job_leases(job):
            pool.release(lease.job_key)
        third = rec.run_once()
        assert third is not None and third.missing == (int(job),)
        pool.release("slurm:othercluster:999999:0:c1")
        pool.release("admin-request-1")
    assert rec.cluster == "rgputest"


def test_license_reservation_follows_drained_servers(h: Harness) -> None:
    import logging

    from rgpu.slurm_plugin.licenses import LicenseSync, SlurmLicenses

    slurm = SlurmLicenses(env=h.slurm.env)
    with h.client() as pool:
        sync = LicenseSync(pool, slurm, logging.getLogger("test-licenses"))
        server = pool.list_servers().servers[0].address
        assert sync.sync_once().action == "none" and slurm.current_hold() is None
        pool.set_server_state(server, drained=True)
        try:
            plan = sync.sync_once()
            assert plan is not None and (plan.action, plan.units) == ("create", 200)
            assert slurm.current_hold() == 200 and slurm.license().reserved == 200
            job = h.slurm.submit(["--gres=rgpu:3", "--comment=fraction=1"], "true\n", user=JOB_USER)
            # Held by rgpu (the pool cannot place 3 GPUs now) and, without that, by the license.
            time.sleep(3)
            assert h.slurm.show_job(job).get("Reason") in ("Licenses", "JobHeldUser"), h.slurm.show_job(job)
        finally:
            pool.set_server_state(server, drained=False)
        # The loop the pool daemon runs: a trigger (capacity listener) syncs at once.
        sync.start(interval_seconds=3600)
        try:
            sync.trigger()
            wait_until("the reservation to go", lambda: slurm.current_hold() is None or None, 10)
        finally:
            sync.stop()
        assert finished(h, job)["JobState"] == "COMPLETED"


def test_pool_daemon_hooks_reconcile_and_sync_licenses(h: Harness, tmp_path: Path) -> None:
    """start_slurm_integration on a real in-process pool core, as rgpu-poold will run it."""
    import logging

    from rgpu.config import Settings
    from rgpu.model import GpuInfo, ServerInfo
    from rgpu.remoting.pool.rules import AllocationRequest
    from rgpu.remoting.pool.daemon import running_pool
    from rgpu.slurm_plugin.licenses import ReservationPlan, SlurmLicenses
    from rgpu.slurm_plugin.poolhooks import start_slurm_integration

    licenses = SlurmLicenses(env=h.slurm.env)
    settings = Settings(listen="127.0.0.1:0", state=str(tmp_path / "pool.db"))
    gpus = tuple(GpuInfo(f"GPU-0000000{i}-hook", i, "Test GPU", 80 << 30, 80 << 30, "9.0") for i in range(2))
    with running_pool(settings, h.pool.secret) as (_, core):
        core.register(ServerInfo("127.0.0.1:1", "hooks", "580", "13.0", gpus, static_inventory=True))
        core.allocate(AllocationRequest(job_key="slurm:rgputest:999998:0:c1", user="nobody", count=1, percent=50))
        hooks = start_slurm_integration(core, interval_seconds=0.3, grace_seconds=0.5, backend="squeue",
                                        license_sync=True, log=logging.getLogger("test-hooks"), env=h.slurm.env)
        try:
            wait_until("the reconciler to release the gone job's lease", lambda: not core.list_leases() or None, 10)
            # 2 healthy GPUs against Licenses=rgpu:400: 200 units held back.
            wait_until("the reservation", lambda: licenses.current_hold() == 200 or None, 10)
            core.set_drained("127.0.0.1:1", True)       # a capacity listener call: sync at once
            wait_until("the reservation to grow", lambda: licenses.current_hold() == 400 or None, 5)
        finally:
            hooks.stop()
            licenses.apply(ReservationPlan("delete", 0))
    assert hooks.reconciler is not None and hooks.reconciler.cluster == "rgputest"


def test_squeue_json_of_the_live_cluster_parses(h: Harness) -> None:
    from rgpu.slurm_plugin.scontrol import show_job_json_command
    from rgpu.slurm_plugin.squeue import SqueueBackend, squeue_command

    plain = h.slurm.submit([], "true\n")
    finished(h, plain)
    held = h.slurm.submit(["--hold", "-N", "2", "--gres=rgpu:2", "--comment=memory=8G"], "true\n", user=JOB_USER)
    job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], "sleep 300\n", user=JOB_USER)
    h.slurm.wait_job_state(job, "RUNNING", 30)
    capture = os.environ.get("RGPU_CAPTURE_DIR")   # set to tests/data to refresh the captured samples
    if capture:
        version = h.slurm.command(["squeue", "--version"]).stdout.split()[-1]
        Path(capture, f"squeue-{version}-captured.json").write_text(h.slurm.command(squeue_command()).stdout)
        Path(capture, f"scontrol-show-job-{version}-captured.txt").write_text(
            h.slurm.command(["scontrol", "show", "job", "-d", job]).stdout)
        shown = h.slurm.command(show_job_json_command(job), check=False)
        if shown.returncode == 0:   # 23.02 and later
            Path(capture, f"scontrol-json-show-job-{version}-captured.json").write_text(shown.stdout)
    jobs = {str(j.job_id): j for j in SqueueBackend(env=h.slurm.env).jobs()}
    mine = jobs[job]
    assert (mine.state, mine.user, mine.cluster, mine.rgpu_count(), mine.comment, mine.live) == (
        "RUNNING", JOB_USER, "rgputest", 1, "fraction=0.5", True)
    assert (jobs[held].state, jobs[held].rgpu_count(), jobs[held].live) == ("PENDING", 2, True)
    assert (jobs[plain].state, jobs[plain].rgpu_count(), jobs[plain].live) == ("COMPLETED", None, False)


# No leak without configuration (issue 10) ----------------------------------------------------------
def test_jobs_ending_while_the_pool_is_down_leak_nothing(h: Harness) -> None:
    jobs = [h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.1"], "sleep 300\n", user=JOB_USER) for _ in range(2)]
    for job in jobs:
        wait_until(f"job {job} to run past its prologs",
                   lambda j=job: h.slurm.job_json(j).get("state_reason") == "None" or None, 30)
        wait_until(f"job {job}'s lease", lambda j=job: h.job_leases(j) or None, 10)
        slices_ready(h, job)
    assert h.pool.pool is not None
    h.pool.pool.kill()                                   # the pool is away while the jobs end
    h.slurm.command(["scancel", *jobs])
    time.sleep(5)
    h.pool.start_pool(env=h.pool_env())
    for job in jobs:   # EpilogSlurmctld retried until the pool was back
        no_lease_soon(h, job, timeout=30)
        assert finished(h, job, 30)["JobState"] == "CANCELLED"
    wait_until("the dispatchers to re-register", lambda: pool_ready(h.pool, 400) or None, 30)


def test_the_pool_releases_leases_of_gone_jobs_by_default(h: Harness) -> None:
    """The reconciler runs in rgpu-poold because Slurm is configured beside it (the session pool's
    rgpu.toml sets only the interval and grace, for speed)."""
    with h.client() as pool:
        pool.allocate("slurm:rgputest:999999:0:c1", JOB_USER, 1, percent=10)   # its job never existed
        pool.allocate("admin-kept", JOB_USER, 1, percent=10)
    try:
        wait_until("the gone job's lease to be released", lambda: not h.job_leases("999999") or None, 30)
        assert "admin-kept" in {lease.job_key for lease in h.leases()}
    finally:
        with h.client() as pool:
            pool.release("admin-kept")


# Hostile fields (issue 10) -----------------------------------------------------------------------
FORGED = "Comment=fraction=1 TresPerNode=gres:rgpu:4 Licenses=rgpu:400"
FORGED_RECORD = "AdminComment=rgpu:v1 nodes=1 count=4 percent=100 units=400"


def assert_license_and_lease_agree(h: Harness, job_id: str, percent: int) -> None:
    """The license charged, the record, and the lease are all one slice of `percent`."""
    job = h.slurm.job_json(job_id)
    leases = h.job_leases(job_id)
    context = f"job {job_id}: {job.get('licenses')!r} {job.get('admin_comment')!r} {leases}\n{diagnostics(h)}"
    assert job["licenses"] == f"rgpu:{percent}", context
    assert job["admin_comment"] == f"rgpu:v1 nodes=1 count=1 percent={percent} units={percent}", context
    assert len(leases) == 1 and [s.compute_percent for s in leases[0].slices] == [percent], context


def test_hostile_names_comments_workdirs_and_updates_never_change_what_is_leased(h: Harness) -> None:
    workdir = h.slurm.jobs_dir / f"w {FORGED}"
    workdir.mkdir(exist_ok=True)
    workdir.chmod(0o777)
    sleep = "sleep 30\n"
    jobs = {
        h.slurm.submit(["-J", f"x {FORGED}", "--gres=rgpu:1", "--comment=fraction=0.01"], sleep, user=JOB_USER): 1,
        h.slurm.submit(["--gres=rgpu:1", "--comment= fraction=0.02"], sleep, user=JOB_USER): 2,
        h.slurm.submit(["--gres=rgpu:1", "--comment=  fraction=0.25"], sleep, user=JOB_USER): 25,
        h.slurm.submit(["-J", f"x\n   {FORGED_RECORD}\n   {FORGED}", "--gres=rgpu:1", "--comment=fraction=0.03"], sleep,
                       user=JOB_USER): 3,
        h.slurm.submit([f"--chdir={workdir}", "--gres=rgpu:1", f"--comment=fraction=0.04 {FORGED}"],
                       sleep, user=JOB_USER): 4,
    }
    # Updates by the user of a held job: a name that embeds fields goes through; a comment that
    # asks for more, or a forged admin comment, is refused; the job is leased what it was charged.
    renamed = h.slurm.submit(["--hold", "--gres=rgpu:1", "--comment=fraction=0.05"], sleep, user=JOB_USER)
    upd = h.slurm.command(["scontrol", "update", f"job={renamed}", f"name=y {FORGED} {FORGED_RECORD}"], user=JOB_USER,
                          check=False)
    assert upd.returncode == 0, upd
    for change in ("comment=fraction=1", "comment= fraction=1", "gres=rgpu:4",
                   "admincomment=rgpu:v1 nodes=1 count=4 percent=100 units=400"):
        refused = h.slurm.command(["scontrol", "update", f"job={renamed}", change], user=JOB_USER, check=False)
        assert refused.returncode != 0, (change, refused)
    job = h.slurm.job_json(renamed)
    assert (job["comment"], job["licenses"], job["tres_per_node"]) == (
        "fraction=0.05", "rgpu:5", f"{tres_gres_prefix(h.version)}rgpu:1"), job
    h.slurm.command(["scontrol", "release", renamed], user=JOB_USER)
    jobs[renamed] = 5
    for job_id, percent in jobs.items():
        h.slurm.wait_job_state(job_id, "RUNNING", 30)
        wait_until(f"job {job_id}'s lease", lambda j=job_id: h.job_leases(j) or None, 10)
        assert_license_and_lease_agree(h, job_id, percent)
    h.slurm.command(["scancel", *jobs])
    for job_id in jobs:
        no_lease_soon(h, job_id)


# Fragmentation -----------------------------------------------------------------------------------
def test_fragmented_capacity_makes_a_job_wait_pending_then_start_within_seconds(h: Harness) -> None:
    # Four 0.6 slices leave 40% on each GPU: 160 GPU-percent free in licenses, yet no GPU can hold
    # a 0.5 slice. The job waits PENDING, held and marked (it was never started: no requeue), and
    # starts within seconds of a blocker leaving.
    blockers = [h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.6"], "sleep 300\n", user=JOB_USER)
                for _ in range(4)]
    for job in blockers:
        h.slurm.wait_job_state(job, "RUNNING", 30)
    waiting = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5"], "true\n", user=JOB_USER)

    def marked_and_pending() -> dict | None:
        job = h.slurm.job_json(waiting)
        assert job["job_state"] not in FINISHED, f"the fragmented job ended: {job}\n{diagnostics(h)}"
        return job if job["job_state"] == "PENDING" and "| rgpu: waiting: " in job["admin_comment"] else None

    wait_until("the fragmented job to be pending and marked", marked_and_pending, 60)
    time.sleep(3)                                    # a few reconciler passes: still held, never started
    job = marked_and_pending()
    assert job is not None and int(job["restart_cnt"]) == 0 and job["state_reason"] == "JobHeldUser", job
    shown = h.slurm.command(["scontrol", "show", "job", waiting]).stdout
    assert "AdminComment=rgpu:v1 nodes=1 count=1 percent=50 units=50 | rgpu: waiting: " in shown, shown
    # No Slurm lets anyone but slurmctld write a job's Reason: squeue shows rgpu's beside it.
    line = h.slurm.command(["squeue", "-h", "-j", waiting, "-O", "Reason:14,admin_comment:200"]).stdout.strip()
    assert line.startswith("JobHeldUser") and "| rgpu: waiting: held until the pool can place its slices" in line, line
    assert not h.job_leases(waiting)
    h.slurm.command(["scancel", blockers[0]])
    freed = time.monotonic()
    info = finished(h, waiting, 60)
    assert info["JobState"] == "COMPLETED", diagnostics(h)
    started = time.monotonic() - freed
    assert started < 30, f"the waiting job took {started:.0f} s to run after capacity freed"
    job = h.slurm.job_json(waiting)
    assert job["admin_comment"] == "rgpu:v1 nodes=1 count=1 percent=50 units=50", job["admin_comment"]
    assert int(job["restart_cnt"]) == 0, job


def test_a_strict_isolation_job_is_refused_at_submit_while_every_gpu_is_shared_by_mps(h: Harness) -> None:
    # The test pool's dispatchers share their GPUs by MPS (the default), and job_submit_rgpu.conf
    # (rendered from the live pool) says so: isolation=strict could never be placed, so it is
    # refused in one line instead of waiting for ever (issue 23).
    out = h.slurm.sbatch(["--gres=rgpu:1", "--comment=fraction=0.5 isolation=strict"], "true\n", user=JOB_USER,
                         check=False)
    assert out.returncode != 0, out
    (line,) = [line for line in out.stderr.splitlines() if "rgpu" in line]
    assert "no GPU of the pool can ever serve 1 slice(s) per node with isolation=strict" in line, out.stderr
    assert "Invalid generic resource" not in out.stderr, out.stderr


def test_interactive_srun_the_pool_cannot_place_waits_then_runs(h: Harness) -> None:
    """srun cannot be requeued: it waits, held until the pool can place its slice, and runs then."""
    blockers = [h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.6"], "sleep 300\n", user=JOB_USER)
                for _ in range(4)]
    for job in blockers:
        h.slurm.wait_job_state(job, "RUNNING", 30)
    argv = h.slurm.install.wrap(["runuser", "-u", JOB_USER, "--", "srun", f"--chdir={h.slurm.jobs_dir}", "--gres=rgpu:1",
                                 "--comment=fraction=0.5", "sh", "-c", 'test -s "$RGPU_ADAPTOR_CONF" && echo SRUN_HAS_CONF'])
    srun = subprocess.Popen(argv, env=h.slurm.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def held() -> dict | None:
            pending = [j for j in h.slurm.command(["squeue", "-h", "-t", "PD", "-o", "%i %r"]).stdout.split("\n") if j]
            return dict(line.split() for line in pending) or None   # type: ignore[misc]

        waiting = wait_until("srun's job to wait", held, 30)
        time.sleep(3)
        assert srun.poll() is None and list(held().values()) == ["JobHeldUser"], waiting   # type: ignore[union-attr]
        h.slurm.command(["scancel", blockers[0]])
        out, err = srun.communicate(timeout=60)
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.communicate()
    assert srun.returncode == 0 and "SRUN_HAS_CONF" in out, f"{out}\n{err}\n{diagnostics(h)}"
    assert not [line for line in err.splitlines() if "rgpu" in line], err


# Versions ----------------------------------------------------------------------------------------
def test_slurm_config_prints_lines_for_the_slurm_it_finds(h: Harness) -> None:
    from click.testing import CliRunner

    from rgpu.slurm_plugin.cli import slurm_config
    from rgpu.slurm_plugin.scontrol import parse_show_config

    result = CliRunner().invoke(slurm_config, ["--section", "slurm.conf"], env={**h.pool.env(), **h.slurm.client_env})
    assert result.exit_code == 0, result.output
    assert f"for Slurm {h.version})" in result.output
    assert f"TresPerNode={tres_gres_prefix(h.version)}rgpu:N" in result.output
    # The cluster runs with the timeout lines printed for its version, and Slurm took them.
    config = parse_show_config(h.slurm.command(["scontrol", "show", "config"]).stdout)
    timeouts = {k: v.split()[0] for k, v in config.items() if k.endswith("Timeout") and "log" in k}
    if h.version >= "26.05":
        assert "PrologTimeout=20\nEpilogTimeout=30\n" in result.output and "PrologEpilogTimeout" not in result.output
        assert (timeouts["PrologTimeout"], timeouts["EpilogTimeout"]) == ("20", "30"), timeouts
    else:
        assert "PrologEpilogTimeout=30\n" in result.output and "PrologTimeout" not in result.output
        assert timeouts["PrologEpilogTimeout"] == "30", timeouts


# 8 (last) ----------------------------------------------------------------------------------------
def test_no_node_was_drained(rgpu_slurm: Harness) -> None:
    states = rgpu_slurm.slurm.node_states()
    assert len(states) == 3
    assert not [s for s in states.values() if "drain" in s or "down" in s], f"{states}\n{diagnostics(rgpu_slurm)}"
