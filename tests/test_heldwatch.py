"""The admission watch: new held jobs wake the reconciler (slurm_plugin/heldwatch.py).

Pure parsing and the wake decision, with squeue's output handed in as text; the real Slurm path
is covered by tests/slurm (the test cluster's pool runs this watch)."""

from __future__ import annotations

import logging

import pytest
from rgpu.slurm_plugin.heldwatch import HeldJobWatch, held_command, held_job_ids

from rgpu.errors import RgpuError

SQUEUE = """\
101 JobHeldUser
102 Resources
103_4 JobHeldUser
104_[5-9] JobHeldAdmin
105 Priority
garbage line here
106;rm JobHeldUser
 107   JobHeldUser
"""


def test_held_job_ids_reads_holds_only_and_skips_odd_lines() -> None:
    assert held_job_ids(SQUEUE) == {"101", "103_4", "104_[5-9]", "107"}
    assert held_job_ids("") == set()
    assert held_command() == ["squeue", "--noheader", "--states=PENDING", "--format=%i %r"]


class Outputs:
    def __init__(self, *outputs: str | Exception) -> None:
        self.outputs = list(outputs)

    def __call__(self, argv: list[str]) -> str:
        item = self.outputs.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def test_a_new_held_job_wakes_the_reconciler_once(caplog: pytest.LogCaptureFixture) -> None:
    wakes: list[int] = []
    failure = RgpuError("slurm", "`squeue` exited 1", "slurmctld did not answer", "check slurmctld")
    watch = HeldJobWatch(lambda: wakes.append(1), 1.0,
                         Outputs("", "7 JobHeldUser\n", "7 JobHeldUser\n", failure, failure,
                                 "7 JobHeldUser\n8 JobHeldUser\n", "8 JobHeldUser\n"),
                         logging.getLogger("test"))
    assert [watch.poll_once() for _ in range(7)] == [False, True, False, False, False, True, False]
    assert len(wakes) == 2
    # A Slurm outage is said once, not at every poll.
    assert sum("admission watch" in r.getMessage() for r in caplog.records) == 1
