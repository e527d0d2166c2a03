"""Wake rgpu-poold's reconciler when a new job waits held in Slurm's queue.

job_submit.lua submits every rgpu job held until the pool can place its slices, and the
reconciler is the one place that releases such jobs (prolog/README.md, "Admission"). Its full
pass (`squeue --json` of every live job, the pool's leases) runs every
`slurm_reconcile_interval_seconds` (10 s by default) and whenever a lease ends, so on an idle pool
a new job would wait up to a whole interval for nothing. This watch asks Slurm for the ids of the
held pending jobs every `slurm_admission_poll_seconds` (one short `squeue` line per job) and wakes
the reconciler at once when one appears that it has not seen yet.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from rgpu.errors import RgpuError

# Slurm shows a hold that job_submit set (priority 0) as the submitting user's own.
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin"})
_JOB_ID = re.compile(r"^[0-9]+(_[0-9\[\]\-,%]+)?$")   # 123, or an array task 123_4 / 123_[5-9]


def held_command() -> list[str]:
    return ["squeue", "--noheader", "--states=PENDING", "--format=%i %r"]


def held_job_ids(text: str) -> set[str]:
    """The ids of the held jobs in `squeue --format='%i %r'` output; lines of any other shape are
    skipped. Pure."""
    held = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1] in HELD_REASONS and _JOB_ID.match(fields[0]):
            held.add(fields[0])
    return held


class HeldJobWatch:
    """`HeldJobWatch(wake, poll_seconds, run).start()`: `run(argv)` returns squeue's output."""

    def __init__(self, wake: Callable[[], Any], poll_seconds: float, run: Callable[[list[str]], str],
                 log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.wake = wake
        self.poll_seconds = poll_seconds
        self.run = run
        self.log = log
        self._seen: set[str] = set()
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> bool:
        """One look; True when a held job appeared that the last look did not see (and the
        reconciler was woken)."""
        try:
            held = held_job_ids(self.run(held_command()))
        except RgpuError as exc:
            if not self._failing:       # once per outage: the reconciler's own pass still runs
                self.log.warning("rgpu admission watch: %s (new held jobs wait for the reconciler's next pass)",
                                 " ".join(str(exc).split())[:300])
            self._failing = True
            return False
        self._failing = False
        new = held - self._seen
        self._seen = held
        if new:
            self.wake()
        return bool(new)

    def run_forever(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll_once()
            except Exception:
                self.log.exception("rgpu admission watch: poll failed (will retry)")

    def start(self) -> HeldJobWatch:
        self._thread = threading.Thread(target=self.run_forever, name="rgpu-admission-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def squeue_runner(env: Mapping[str, str] | None, timeout: float = 10.0) -> Callable[[list[str]], str]:
    from rgpu.slurm_plugin.proc import run_command

    return lambda argv: run_command(argv, component="slurm", env=env, timeout=timeout).stdout
