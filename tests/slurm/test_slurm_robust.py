"""Slurm under real conditions (issue 23, part B) on the session's real cluster: plain jobs owe rgpu
nothing, no job runs without its slices, requests no GPU can serve are refused at submission,
heterogeneous jobs. The pool is frozen with SIGSTOP (a hung pool host: connections are accepted
by the kernel, nothing answers), which is harder on deadlines than a dead one.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import pytest

from tests.slurm.cluster import missing_requirements, wait_until
from tests.slurm.conftest import Harness, pool_ready
from tests.slurm.e2e_helpers import FINISHED, JOB_USER, diagnostics, finished

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]


@contextmanager
def pool_frozen(harness: Harness) -> Iterator[None]:
    """SIGSTOP the pool daemon (its whole process group) for the block, SIGCONT after."""
    assert harness.pool.pool is not None and harness.pool.pool.proc is not None
    group = harness.pool.pool.proc.pid
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


def node_prolog_pids(harness: Harness, job_id: str | None = None) -> list[int]:
    """Node Prolog processes of this cluster (the wrapper script, or rgpu-prolog after its exec)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            if not any(a.endswith((b"/bin/Prolog", b"/rgpu-prolog")) for a in args):
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(harness.slurm.conf).encode() not in b"".join(environ):
            continue
        if job_id is None or f"SLURM_JOB_ID={job_id}".encode() in environ:
            found.append(int(proc.name))
    return found


class NodePrologTrap:
    """Catches the next node Prolog of this cluster as it starts (before it can import its pool
    client, ~100 ms later), stops it, freezes the pool (or runs `meanwhile`), and lets the Prolog
    go on: a deterministic 'the pool hung between PrologSlurmctld and the node Prolog'."""

    def __init__(self, harness: Harness, meanwhile: Callable[[], None] | None = None) -> None:
        self.harness = harness
        self.meanwhile = meanwhile
        self.caught: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        deadline = time.monotonic() + 60
        while not self._done.is_set() and time.monotonic() < deadline:
            pids = node_prolog_pids(self.harness)
            if pids:
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                assert self.harness.pool.pool is not None and self.harness.pool.pool.proc is not None
                if self.meanwhile is not None:
                    self.meanwhile()
                else:
                    os.killpg(self.harness.pool.pool.proc.pid, signal.SIGSTOP)
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                self.caught = pids
                return
            time.sleep(0.002)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)
        assert self.harness.pool.pool is not None and self.harness.pool.pool.proc is not None
        os.killpg(self.harness.pool.pool.proc.pid, signal.SIGCONT)


def wait_requeued(h: Harness, job: str) -> dict:  # type: ignore[type-arg]
    """Until the job is PENDING again after a requeue; fails at once should it end instead."""
    def requeued() -> dict | None:  # type: ignore[type-arg]
        info = h.slurm.job_json(job)
        assert info["job_state"] not in FINISHED, f"{info}\n{h.slurm.job_output(job)}\n{diagnostics(h)}"
        return info if int(info["restart_cnt"]) >= 1 and info["job_state"] == "PENDING" else None

    return wait_until("the job to be requeued", requeued, 30)


def wait_pool_back(harness: Harness) -> None:
    wait_until("the pool to answer with 4 GPUs", lambda: pool_ready(harness.pool, 400) or None, 30)


# 1. Plain jobs cost nothing ---------------------------------------------------------------------
def test_plain_jobs_start_and_end_promptly_while_the_pool_is_frozen(h: Harness) -> None:
    """No Slurm query and no pool call in any prolog or epilog of a job without the rgpu license:
    before, PrologSlurmctld ran squeue for every job and EpilogSlurmctld retried the frozen pool
    for 15 s (the job sat in COMPLETING)."""
    with pool_frozen(h):
        started = time.monotonic()
        jobs = [h.slurm.submit(args, "echo PLAIN_RAN\n", user=JOB_USER)
                for args in ([], ["--comment=my run, seed=4"], ["-N", "2"])]
        for job in jobs:
            info = finished(h, job, 20)
            assert info["JobState"] == "COMPLETED", f"{info}\n{diagnostics(h)}"
            assert "PLAIN_RAN" in h.slurm.job_output(job)
        took = time.monotonic() - started
    wait_pool_back(h)
    assert took < 8, f"3 plain jobs took {took:.1f} s from submission to COMPLETED with the pool frozen"
    assert all(int(h.slurm.job_json(j)["restart_cnt"]) == 0 for j in jobs)



def test_a_plain_job_whose_comment_names_a_size_runs_while_the_pool_is_frozen(h: Harness) -> None:
    """A job without --gres=rgpu whose comment happens to hold a size word ("memory=4G" is a
    common note) is a plain job: the node Prolog, which Slurm tells neither GRES nor licenses,
    asks the pool about it, but a pool that does not answer must not requeue it (before: the
    Prolog's 4 s pool timeout, then a requeue, of a job that owes rgpu nothing)."""
    with pool_frozen(h):
        job = h.slurm.submit(["--comment=memory=4G fraction=0.5 seed=4"], "echo PLAIN_RAN\n", user=JOB_USER)

        def ended_or_requeued() -> dict | None:  # type: ignore[type-arg]
            info = h.slurm.job_json(job)
            return info if info["job_state"] in FINISHED or int(info["restart_cnt"]) >= 1 else None

        info = wait_until("the plain job to end (or be requeued)", ended_or_requeued, 60)
    wait_pool_back(h)
    assert info["job_state"] == "COMPLETED" and int(info["restart_cnt"]) == 0, f"{info}\n{diagnostics(h)}"
    assert "PLAIN_RAN" in h.slurm.job_output(job)
    states = h.slurm.node_states()
    assert not [s for s in states.values() if "drain" in s or "down" in s], states

# 2. No job runs without its slices --------------------------------------------------------------
SHOW_SLICES = 'echo "RAN conf=$RGPU_ADAPTOR_CONF"; test -s "$RGPU_ADAPTOR_CONF" && echo HAS_CONF\n'


def test_a_job_whose_node_prolog_cannot_reach_the_pool_is_requeued_not_run(h: Harness) -> None:
    """PrologSlurmctld leased the slices, then the pool hung before the node Prolog could fetch
    them: the job is requeued (never run without its slices, no node drained); once the pool is
    back the reconciler releases the first attempt's lease, and the job runs with its slices."""
    with NodePrologTrap(h) as trap:
        job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.3"], SHOW_SLICES, user=JOB_USER)
        wait_until("the node Prolog to be caught", lambda: trap.caught or None, 30)
        info = wait_requeued(h, job)
        assert "RAN" not in h.slurm.job_output(job), h.slurm.job_output(job)
        # Past EpilogSlurmctld's 15 s of retries: only the reconciler can release the lease now.
        time.sleep(17)
    wait_pool_back(h)
    try:
        wait_until("the first attempt's lease to be released by the reconciler",
                   lambda: not [le for le in h.job_leases(job) if le.job_key.endswith(":0:c1")] or None, 30)
    except TimeoutError:
        raise AssertionError(f"{[le.job_key for le in h.job_leases(job)]}\n{diagnostics(h)}") from None
    states = h.slurm.node_states()
    assert not [s for s in states.values() if "drain" in s or "down" in s], states
    # Slurm holds a requeued job a while (BeginTime, ~2 min in 22.05); an admin's starttime=now
    # stands in for the wait: the next attempt gets its slices.
    h.slurm.command(["scontrol", "update", f"jobid={job}", "starttime=now"])
    assert finished(h, job, 60)["JobState"] == "COMPLETED", diagnostics(h)
    out = h.slurm.job_output(job)
    assert "HAS_CONF" in out, f"{out}\n{info}\n{diagnostics(h)}"


def test_a_job_whose_lease_is_gone_when_its_node_prolog_runs_is_requeued_not_run_plain(h: Harness) -> None:
    """PrologSlurmctld leased the slices; an admin (or a pool that lost its state) released the
    lease before the node Prolog fetched it. The node Prolog finds no lease for a job that holds
    the rgpu license: the job is requeued, not run without its slices, no node drained."""
    def release_the_lease() -> None:
        leases = h.job_leases(job)
        assert leases, "PrologSlurmctld's lease should exist when the node Prolog starts"
        with h.client() as c:
            for lease in leases:
                c.release(lease.job_key)

    job = ""
    with NodePrologTrap(h, meanwhile=release_the_lease) as trap:
        job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.3"], SHOW_SLICES, user=JOB_USER)
        wait_until("the node Prolog to be caught", lambda: trap.caught or None, 30)
        wait_requeued(h, job)
    assert "RAN" not in h.slurm.job_output(job), h.slurm.job_output(job)
    log = (h.slurm.logs / "Prolog.log").read_text()
    line = next(line for line in log.splitlines() if f"[job {job}]" in line and "has no lease" in line)
    assert "which holds the rgpu license" in line and line.endswith("-- the job requeued: it runs again once rgpu "
                                                                    "can give it its slices"), line
    states = h.slurm.node_states()
    assert not [s for s in states.values() if "drain" in s or "down" in s], states
    # The next attempt, restarted at once (past Slurm's requeue delay): it leases new slices and runs
    # with them, or, where slurmd starts it without running the node Prolog again (seen on 22.05:
    # "reissued job credential"), the TaskProlog finds the first attempt's ended mark and no job
    # folder and refuses it. Either way it never runs without its slices.
    def started() -> bool | None:
        # Again until it takes: an update that lands before the requeue's own begin time is overwritten.
        if h.slurm.job_json(job)["job_state"] != "PENDING":
            return True
        h.slurm.command(["scontrol", "update", f"jobid={job}", "starttime=now"])
        return None

    wait_until("the requeued job to start again", started, 60, interval=2.0)
    info = finished(h, job, 60)
    out = h.slurm.job_output(job)
    ran = [line for line in out.splitlines() if line.startswith("RAN")]
    outcome = ("with its slices" if "HAS_CONF" in out else
               "refused by the TaskProlog" if "restarted on this node without its node Prolog" in out else
               "never launched" if not ran else "RAN WITHOUT ITS SLICES")
    print(f"next attempt: {info['JobState']}, {outcome}")
    # 22.05 has also been seen to kill the restarted attempt before launching it ("Job already
    # killed, do not launch batch job"): FAILED, nothing ran. What must never happen: a run without slices.
    assert outcome != "RAN WITHOUT ITS SLICES", f"{info}\n{out}\n{diagnostics(h)}"
    assert info["JobState"] != "COMPLETED" or outcome == "with its slices", f"{info}\n{out}\n{diagnostics(h)}"


def test_a_job_that_cannot_be_requeued_fails_with_the_reason_in_its_output(h: Harness) -> None:
    with NodePrologTrap(h) as trap:
        job = h.slurm.submit(["--no-requeue", "--gres=rgpu:1", "--comment=fraction=0.3"], SHOW_SLICES, user=JOB_USER)
        wait_until("the node Prolog to be caught", lambda: trap.caught or None, 30)
        info = finished(h, job, 40)
    wait_pool_back(h)
    out = h.slurm.job_output(job)
    assert info["JobState"] == "FAILED", f"{info}\n{out}\n{diagnostics(h)}"
    assert "RAN" not in out, out
    lines = [line for line in out.splitlines() if line.startswith("rgpu: ")]
    assert len(lines) == 1 and "did not answer" in lines[0] and "does not start without its GPU slices" in lines[0], out
    wait_until("the job's lease to be released", lambda: not h.job_leases(job) or None, 40)


def test_the_admission_watch_reads_this_slurms_held_jobs(h: Harness) -> None:
    """rgpu-poold's admission watch (slurm_plugin/heldwatch.py) against this version's squeue: a job
    held by its user (as job_submit holds every new rgpu job) is seen, and seeing it wakes the
    reconciler once; a running one is not."""
    from rgpu.slurm_plugin.heldwatch import HeldJobWatch

    wakes: list[int] = []
    watch = HeldJobWatch(lambda: wakes.append(1), 1.0, lambda argv: h.slurm.command(argv).stdout,
                         logging.getLogger("test"))
    watch.poll_once()
    job = h.slurm.submit(["--hold"], "sleep 1\n", user=JOB_USER)
    try:
        assert watch.poll_once() and wakes == [1], h.slurm.command(["squeue"]).stdout
        assert not watch.poll_once() and wakes == [1]
        assert job in watch._seen
    finally:
        h.slurm.command(["scancel", job])


# 3. Requests no GPU can ever serve; waiting only for capacity -----------------------------------
def test_a_strict_job_a_stale_config_let_through_is_cancelled_with_the_reason(h: Harness) -> None:
    """job_submit_rgpu.conf without the pool's numbers (pool_gpus = 0: checks off) accepts
    isolation=strict on an all-MPS pool; PrologSlurmctld then sees that no GPU could ever hold it
    and cancels it with the reason, instead of a requeue every ~2 minutes for ever."""
    from tests.slurm.conftest import lua_conf_from_pool

    conf = lua_conf_from_pool(h.pool)
    h.slurm.set_lua_conf(conf.replace("pool_gpus = 4", "pool_gpus = 0"))
    try:
        job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5 isolation=strict"], "echo RAN\n", user=JOB_USER)
        info = finished(h, job, 40)
    finally:
        h.slurm.set_lua_conf(conf)
    shown = h.slurm.job_json(job)
    assert info["JobState"] == "CANCELLED" and int(shown["restart_cnt"]) <= 1, f"{info}\n{diagnostics(h)}"
    record, _, reason = shown["admin_comment"].partition(" | ")
    assert record == "rgpu:v1 nodes=1 count=1 percent=50 units=50 isolation=strict", shown["admin_comment"]
    assert reason.startswith("rgpu: refused: prolog-slurmctld: no GPU of the pool can ever hold job"), reason
    assert "isolation=strict" in reason and "\n" not in reason
    assert "RAN" not in h.slurm.job_output(job) and not h.job_leases(job)


ISOLATED_INVENTORY = """\
format = 1
hostname = "test-gpu-isolated"
driver_version = "580.82.07"
cuda_version = "13.0"

[[gpu]]
uuid = "GPU-7b1d5a3e-0c44-4e0b-9a51-3f6d2c8e9a10"
index = 0
name = "NVIDIA H100 80GB HBM3"
memory = "80G"
compute_capability = "9.0"
"""


@contextmanager
def isolated_gpu(h: Harness, tmp_path: Path) -> Iterator[None]:
    """A third dispatcher serving one GPU shared "isolated", and job_submit_rgpu.conf saying so;
    removed again after (server and config), so the session pool is back to its 4 MPS GPUs."""
    from tests.slurm.conftest import lua_conf_from_pool

    conf = lua_conf_from_pool(h.pool)
    inventory = tmp_path / "inventory-isolated.toml"
    inventory.write_text(ISOLATED_INVENTORY)
    daemon, _ = h.pool.start_dispatcher(inventory, env=h.pool.env(RGPU_GPU_SHARING="isolated"))
    try:
        wait_until("the isolated GPU to register", lambda: pool_ready(h.pool, 500) or None, 30)
        h.slurm.set_lua_conf(lua_conf_from_pool(h.pool))
        assert "isolated_gpus = 1\n" in lua_conf_from_pool(h.pool)
        yield
    finally:
        h.slurm.set_lua_conf(conf)
        daemon.kill()
        with h.client() as c:
            for server in c.list_servers().servers:
                if server.hostname == "test-gpu-isolated":
                    wait_until("the isolated dispatcher to be down and removed",
                               lambda address=server.address: removed(c, address), 20)
        wait_pool_back(h)


def removed(client, address: str) -> bool | None:  # type: ignore[no-untyped-def]
    from rgpu.errors import RgpuError

    try:
        client.remove_server(address)     # refused while the server is up
    except RgpuError:
        return None
    return True


def test_a_strict_job_waits_for_an_isolated_gpu_without_a_requeue(h: Harness, tmp_path: Path) -> None:
    """The only isolated GPU is taken: a second strict job waits PENDING, held and marked, while
    4 MPS GPUs stand free, is never started on them (no requeue at all), and starts within seconds
    once the isolated GPU is free."""
    with isolated_gpu(h, tmp_path):
        blocker = h.slurm.submit(["--gres=rgpu:1", "--comment=isolation=strict"], "sleep 300\n", user=JOB_USER)
        h.slurm.wait_job_state(blocker, "RUNNING", 30)
        waiter = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.5 isolation=strict"], SHOW_SLICES, user=JOB_USER)

        def marked() -> dict | None:
            info = h.slurm.job_json(waiter)
            assert info["job_state"] not in FINISHED, f"{info}\n{diagnostics(h)}"
            return info if info["job_state"] == "PENDING" and "| rgpu: waiting: " in info["admin_comment"] else None

        info = wait_until("the strict job to wait, marked", marked, 60)
        assert info["admin_comment"].startswith("rgpu:v1 nodes=1 count=1 percent=50 units=50 isolation=strict | "), info
        time.sleep(12)                                   # a dozen reconciler passes
        info = h.slurm.job_json(waiter)
        assert info["job_state"] == "PENDING" and int(info["restart_cnt"]) == 0, f"{info}\n{diagnostics(h)}"
        h.slurm.command(["scancel", blocker])
        freed = time.monotonic()
        assert finished(h, waiter, 60)["JobState"] == "COMPLETED", diagnostics(h)
        took = time.monotonic() - freed
        assert took < 30, f"the strict job took {took:.0f} s to run after the isolated GPU freed"
        assert "HAS_CONF" in h.slurm.job_output(waiter)
        assert int(h.slurm.job_json(waiter)["restart_cnt"]) == 0


# 4. Heterogeneous jobs --------------------------------------------------------------------------
@pytest.mark.parametrize("components", [
    (["--gres=rgpu:1", "--comment=fraction=0.5"], []),
    ([], ["--gres=rgpu:1", "--comment=fraction=0.5"]),
], ids=["leader", "component1"])
def test_a_heterogeneous_job_asking_for_rgpu_is_refused_at_submit(h: Harness, components: tuple[list[str], list[str]]) -> None:
    first, second = components
    out = h.slurm.sbatch([*first, ":", *second], "srun --het-group=0,1 true\n", user=JOB_USER, check=False)
    assert out.returncode != 0, out
    lines = [line for line in out.stderr.splitlines() if "rgpu" in line]
    assert len(lines) == 1 and "a heterogeneous job cannot ask for rgpu" in lines[0], out.stderr
    assert "as a job of its own" in lines[0]


@pytest.mark.parametrize("component", ["+0", "+1"], ids=["leader", "component1"])
def test_a_heterogeneous_job_cannot_be_updated_into_asking_for_rgpu(h: Harness, component: str) -> None:
    """The refusal at submission is not bypassed by an update of a pending component (before: the
    update was accepted and the component charged for slices its tasks could not find)."""
    job = h.slurm.submit(["--hold", ":", "-N", "1"], "srun --het-group=0,1 true\n", user=JOB_USER)
    out = h.slurm.command(["scontrol", "update", f"jobid={job}{component}", "gres=rgpu:1", "comment=fraction=0.5"],
                          check=False)
    shown = h.slurm.command(["scontrol", "show", "job", f"{job}{component}"]).stdout
    h.slurm.command(["scancel", job])
    assert out.returncode != 0, f"{out}\n{shown}"
    assert "rgpu" not in shown.split("Licenses=", 1)[1].split()[0], shown
    assert "TresPerNode=gres" not in shown or "rgpu" not in shown.split("TresPerNode=", 1)[1].split()[0], shown


def test_a_heterogeneous_job_without_rgpu_runs_untouched(h: Harness) -> None:
    job = h.slurm.submit([":", "-N", "1"], "srun --het-group=0,1 true && echo HET_RAN\n", user=JOB_USER)
    assert finished(h, job, 40)["JobState"] == "COMPLETED", diagnostics(h)
    assert "HET_RAN" in h.slurm.job_output(job)


# 5. Refusals say what is wrong, once -------------------------------------------------------------
@pytest.mark.parametrize("args, rgpu_text, slurm_text", [
    (["--gres=rgpu:1", "-L", "rgpu:10"], "do not ask for the rgpu license yourself", "Invalid license specification"),
    (["--gres=rgpu:1", "-N", "1-3"], "variable node count", "Node count specification invalid"),
    (["--gres=rgpu:1", "--comment=fraction=0.3333333"], "slices are whole hundredths of a GPU; write fraction=0.33",
     None),
    (["--gres=rgpu:1", "--comment=fraction=0.005"], "slices are whole hundredths of a GPU; write fraction=0.01", None),
    (["--gres=rgpu:1", "--comment=fraction=0.5;$(touch /tmp/rgpu-pwned)"], "characters rgpu does not accept", None),
    (["--gres=rgpu:1", "--comment=memory=" + "9" * 60 + "T"], "invalid memory", None),
    (["--gres=rgpu:1", "--comment=fraction=1" + "0" * 5000 + "1"], "invalid fraction", None),
    (["--gres=rgpu:5"], "count of slices per node", "Invalid generic resource"),
], ids=["license", "nodes", "third", "half-percent", "injection", "huge-memory", "huge-fraction", "gres"])
def test_a_refusal_is_one_rgpu_line_and_slurms_code_fits_it(h: Harness, args: list[str], rgpu_text: str,
                                                            slurm_text: str | None) -> None:
    out = h.slurm.sbatch(args, "true\n", user=JOB_USER, check=False)
    assert out.returncode != 0, out
    lines = [line for line in out.stderr.splitlines() if "rgpu" in line]
    assert len(lines) == 1 and lines[0].startswith("sbatch: error: rgpu: job_submit: "), out.stderr
    assert rgpu_text in lines[0] and len(lines[0]) < 400, out.stderr
    if slurm_text:
        assert slurm_text in out.stderr, out.stderr
    if "gres" not in rgpu_text and "slices per node" not in rgpu_text:
        assert "Invalid generic resource" not in out.stderr, out.stderr
    assert not Path("/tmp/rgpu-pwned").exists()


def test_an_interactive_srun_whose_node_prolog_cannot_reach_the_pool_prints_the_reason_and_runs_nothing(
        h: Harness) -> None:
    """srun cannot be requeued: its task fails in the TaskProlog, and the reason reaches the terminal."""
    with NodePrologTrap(h) as trap:
        out = h.slurm.command(["srun", f"--chdir={h.slurm.jobs_dir}", "--gres=rgpu:1", "--comment=fraction=0.2",
                               "sh", "-c", "echo RAN"], user=JOB_USER, timeout=60, check=False)
        assert trap.caught, out
    wait_pool_back(h)
    assert out.returncode != 0 and "RAN" not in out.stdout, out
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("rgpu: ")]
    assert len(lines) == 1 and "did not answer" in lines[0] and "does not start without its GPU slices" in lines[0], out


def test_a_job_submitted_while_the_pool_is_frozen_waits_and_starts_once_it_answers(h: Harness) -> None:
    """Nobody can tell whether the pool can place the job: it waits PENDING, held and marked, never
    started (no requeue), and is released within seconds of the pool answering."""
    with pool_frozen(h):
        job = h.slurm.submit(["--gres=rgpu:1", "--comment=fraction=0.4"], SHOW_SLICES, user=JOB_USER)

        def marked() -> dict | None:
            info = h.slurm.job_json(job)
            assert info["job_state"] not in FINISHED, f"{info}\n{diagnostics(h)}"
            return info if info["job_state"] == "PENDING" and "| rgpu: waiting: " in info["admin_comment"] else None

        wait_until("the job to wait for the pool", marked, 30)
        time.sleep(5)
        info = h.slurm.job_json(job)
        assert info["job_state"] == "PENDING" and info["state_reason"] == "JobHeldUser", info
        assert "RAN" not in h.slurm.job_output(job)
    resumed = time.monotonic()
    assert finished(h, job, 60)["JobState"] == "COMPLETED", diagnostics(h)
    took = time.monotonic() - resumed
    assert took < 30, f"the job took {took:.0f} s to run after the pool answered again"
    assert "HAS_CONF" in h.slurm.job_output(job)
    assert h.slurm.job_json(job)["admin_comment"] == "rgpu:v1 nodes=1 count=1 percent=40 units=40"
    assert int(h.slurm.job_json(job)["restart_cnt"]) == 0
