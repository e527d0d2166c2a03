"""A node Epilog of an rgpu job waits for the pool's admission to catch up with the job's end
(slurm_plugin/admission_clock.py, prolog/epilogs.py `await_admission`): Slurm schedules at once
when a node Epilog completes, but only queues a pass for its next whole second when the pool
releases a held job, so the Epilog ends after the pool let the next job go.

Against a real pool core and the pool's own reconciler and admission (poolhooks.py); Slurm's job
list is handed in (the whole path runs on real Slurm in tests/slurm/test_slurm_e2e.py)."""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any

import pytest
from rgpu.prolog.epilogs import await_admission
from rgpu.slurm_plugin.admission_clock import AdmissionClock
from rgpu.slurm_plugin.poolhooks import SlurmIntegration, admitting_reconciler, wake_on_lease_changes

from rgpu.errors import Unavailable
from tests.poolcore_helpers import make_core, req

KEY = "slurm:test:5:0:c1"


class GatedJobs:
    """Slurm's job list, handed out one pass at a time: each pass waits in live_jobs until let through."""

    def __init__(self) -> None:
        self.entered: queue.Queue[int] = queue.Queue()
        self.gate = threading.Semaphore(0)
        self.calls = 0

    def live_jobs(self) -> list[Any]:
        self.calls += 1
        self.entered.put(self.calls)
        self.gate.acquire()
        return []


def test_admission_is_pending_until_a_pass_that_began_after_the_lease_ended_has_finished(tmp_path: Path) -> None:
    core = make_core(tmp_path / "pool.db")
    jobs = GatedJobs()
    reconciler, admission = admitting_reconciler(core, jobs, 3600.0, 30.0, logging.getLogger("test"), cluster="test")
    clock = wake_on_lease_changes(core, reconciler, admission)
    finished: queue.Queue[int] = queue.Queue()

    def pass_done() -> None:
        clock.pass_done()
        finished.put(1)

    reconciler.pass_done = pass_done
    integration = SlurmIntegration(reconciler, None, core=core, clock=clock)
    core.allocate(req(KEY, user="nobody"))
    reconciler.start()
    try:
        jobs.entered.get(timeout=30)           # the first pass, at start
        jobs.gate.release()
        finished.get(timeout=30)
        assert integration.admission_pending("slurm:test:5:")          # the job still holds its lease
        assert not integration.admission_pending("slurm:test:6:")      # another job's: nothing to wait for

        core.release(KEY)                      # EpilogSlurmctld's release wakes the reconciler
        assert jobs.entered.get(timeout=30) == 2
        # The pass the release woke is under way: its admission has not let the next jobs go yet.
        assert integration.admission_pending("slurm:test:5:")
        assert integration.admission_pending("slurm:test:7:")   # first asked now: waits for the last end
        jobs.gate.release()
        finished.get(timeout=30)
        assert not integration.admission_pending("slurm:test:5:")
        assert not integration.admission_pending("slurm:test:7:")
    finally:
        reconciler.stop()
        jobs.gate.release()


def test_a_daemon_without_admission_never_keeps_an_epilog_waiting(tmp_path: Path) -> None:
    assert not SlurmIntegration(None, None).admission_pending("slurm:test:5:")


def test_a_job_waits_for_the_pass_after_its_own_end_not_after_later_ends_of_other_jobs() -> None:
    now = [0.0]
    clock = AdmissionClock(lambda: now[0])
    assert clock.pending("slurm:test:5:", held=True)
    now[0] = 1.0
    clock.lease_ended()                        # job 5's lease
    now[0] = 1.5
    clock.lease_ended()                        # another job's, later
    assert clock.pending("slurm:test:5:", held=False)
    now[0] = 1.2
    clock.pass_started()                       # after job 5's end, before the other's
    now[0] = 1.3
    clock.pass_done()
    assert not clock.pending("slurm:test:5:", held=False)
    assert clock.pending("slurm:test:9:", held=False)      # first asked once gone: the last end counts
    now[0] = 1.6
    clock.pass_started()
    clock.pass_done()
    assert not clock.pending("slurm:test:9:", held=False)


ENV = {"SLURM_JOB_ID": "5", "SLURM_CLUSTER_NAME": "test", "SLURMD_NODENAME": "c1"}


class Answers:
    def __init__(self, *answers: bool | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    def admission_pending(self, job_key_prefix: str, timeout: float | None = None) -> bool:
        self.asked.append(job_key_prefix)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_node_epilog_asks_until_the_admission_caught_up_and_gives_up_at_its_budget() -> None:
    pool, time_ = Answers(True, True, False), FakeTime()
    assert await_admission(ENV, lambda: pool, budget=1.0, clock=time_.clock, sleep=time_.sleep)
    assert pool.asked == ["slurm:test:5:"] * 3

    stuck, time_ = Answers(True), FakeTime()
    assert not await_admission(ENV, lambda: stuck, budget=1.0, clock=time_.clock, sleep=time_.sleep)
    assert time_.now == pytest.approx(1.0)

    away = Answers(Unavailable("pool", "127.0.0.1:1 did not answer", "", ""))
    with pytest.raises(Unavailable):
        await_admission(ENV, lambda: away, budget=1.0)
