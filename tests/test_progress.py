"""Progress on long admin commands: a bar on a terminal's stderr, nothing when it is not one."""

from __future__ import annotations

import io
import os
import select
from concurrent.futures import ThreadPoolExecutor, as_completed

from rgpu.remoting.admin.deep_health import HostOutcome, run_checks
from rgpu.remoting.admin.deepcheck import Finding, HostPlan
from rgpu.remoting.admin.progress import progress, shown


def _drawn(master: int, until: str) -> str:
    """What reached the terminal. The pty hands the slave's writes to the master asynchronously,
    so read until `until` arrived or nothing more comes for a while."""
    drawn = ""
    while until not in drawn and select.select([master], [], [], 5.0)[0]:
        drawn += os.read(master, 65536).decode(errors="replace")
    return drawn


def test_no_bar_when_stderr_is_not_a_terminal() -> None:
    stream = io.StringIO()
    assert not shown(stream)
    assert list(progress(range(3), "health", stream=stream)) == [0, 1, 2]
    assert stream.getvalue() == ""


def test_a_bar_on_a_terminal() -> None:
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert shown(tty)
            assert list(progress(["gpu1", "gpu2"], "health", stream=tty, describe=str)) == ["gpu1", "gpu2"]
            tty.flush()
        drawn = _drawn(master, "2/2")
    finally:
        os.close(master)
        os.close(slave)
    assert "health" in drawn and "2/2" in drawn


def test_results_as_they_complete_with_a_known_length() -> None:
    master, slave = os.openpty()
    try:
        with ThreadPoolExecutor(2) as pool, os.fdopen(slave, "w", closefd=False) as tty:
            futures = [pool.submit(lambda n=n: n * n) for n in range(4)]
            done = list(progress(as_completed(futures), "net-perf", length=len(futures), stream=tty))
            tty.flush()
        drawn = _drawn(master, "4/4")
    finally:
        os.close(master)
        os.close(slave)
    assert sorted(f.result() for f in done) == [0, 1, 4, 9] and "4/4" in drawn


def test_hosts_are_checked_at_once_and_reported_in_order() -> None:
    from rgpu.remoting.admin.deep_health import HostJob
    from rgpu.remoting.admin.ssh import SshTarget

    jobs = [HostJob(HostPlan(f"h{i}", frozenset({"pool" if i == 0 else "client"}), ()), SshTarget(f"h{i}"))
            for i in range(5)]
    seen: list[str] = []

    def check(job: HostJob, _version: str) -> HostOutcome:
        seen.append(job.plan.host)
        return HostOutcome(job.plan.host, [Finding(job.plan.host, "ssh", "ok", "")], (10.0 if job.plan.host == "h0" else 10.5, 0.01))

    findings = run_checks(jobs, check=check, each=lambda done: list(done))
    assert sorted(seen) == [f"h{i}" for i in range(5)]
    assert [f.host for f in findings if f.check == "ssh"] == [f"h{i}" for i in range(5)]
    clocks = {f.host: f.detail for f in findings if f.check == "clock"}
    assert clocks["h0"].startswith("+0.000 s against the pool's host h0") and clocks["h3"].startswith("+0.500 s")
