"""Whether rgpu-poold's admission has caught up with the last lease that ended.

Slurm starts a job the pool let go (`scontrol release`) only at its scheduler's next pass. From
22.05 to 26.05 a release only queues that pass, which slurmctld's background loop runs on a
whole second (at most once per `batch_sched_delay`), while a node Epilog's completion runs one at
once (`_slurm_rpc_epilog_complete`); an ended job's license comes back when both its
EpilogSlurmctld and its node Epilogs are done (`cleanup_completing`). So a held job the ended
job's room lets go starts at once only when the node Epilog completes after the pool released it:
the node Epilog of an rgpu job asks the pool (AdmissionPending) until this clock says the pass
that follows the job's lease end has finished (prolog/README.md, rgpu-epilog).

`AdmissionClock` is told of lease ends (the pool core's lease listener) and of the reconciler's
passes (when each starts, and when its admission's releases are done or it ends); `pending(job)` stays true until a pass that started after
that job's lease end has finished. Thread-safe; no I/O.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

# Lease ends remembered, and how long an asked job's answer is kept (a node Epilog asks for at
# most a few seconds).
ENDS_KEPT = 1024
ASKED_KEPT_SECONDS = 60.0


class AdmissionClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._ends: list[float] = []          # the lease ends this daemon saw, oldest first
        self._started = float("-inf")         # the start of the current (or last) pass
        self._done_since = float("-inf")      # the start of the latest pass that finished
        # Per job asked about: ("held", when its lease was last seen) or ("gone", the end to wait for).
        self._asked: dict[str, tuple[str, float, float]] = {}

    def lease_ended(self) -> None:
        """Before the reconciler is woken (the pool core's lease listener: quick, under its lock)."""
        with self._lock:
            self._ends.append(self.clock())
            del self._ends[:-ENDS_KEPT]

    def pass_started(self) -> None:
        """A pass of the reconciler starts (it reads Slurm's jobs and the pool after this)."""
        with self._lock:
            self._started = self.clock()

    def pass_done(self) -> None:
        """The current pass let go every job it lets go (its admission's releases are done; the
        marks may still be coming off), or ended."""
        with self._lock:
            self._done_since = max(self._done_since, self._started)

    def pending(self, job_key_prefix: str, held: bool) -> bool:
        """Whether the admission has yet to catch up with the end of the job whose leases start with
        `job_key_prefix` (`held`: it holds one now). Its end is the first lease end after the job
        was last seen holding one; for a job first asked about once its leases were gone, the
        last end before that ask (the job's, or a later one). Caught up: a pass that started at or
        after that end has finished (it read the pool after it, so it let go every job the freed
        room holds). Later ends, of other jobs, do not keep it waiting."""
        with self._lock:
            now = self.clock()
            for prefix in [p for p, (_, _, asked) in self._asked.items() if now - asked > ASKED_KEPT_SECONDS]:
                del self._asked[prefix]
            if held:
                self._asked[job_key_prefix] = ("held", now, now)
                return True
            state, at, asked = self._asked.get(job_key_prefix, ("new", now, now))
            if state == "held":
                later = bisect.bisect_right(self._ends, at)
                # No end after it here: another daemon of the pool released it; nothing to wait for.
                end = self._ends[later] if later < len(self._ends) else float("-inf")
            elif state == "new":
                end = self._ends[-1] if self._ends else float("-inf")
            else:
                end = at
            self._asked[job_key_prefix] = ("gone", end, asked)
            return self._done_since < end


def admission_pending(clock: AdmissionClock, leases: Callable[[], Iterable[Any]], job_key_prefix: str) -> bool:
    """AdmissionPending's answer for the job whose lease keys start with `job_key_prefix`: it still
    holds a lease, or the admission has not caught up with its end (AdmissionClock.pending).
    `leases()` lists the pool's."""
    if not job_key_prefix:
        return False
    held = any(str(lease.job_key).startswith(job_key_prefix) for lease in leases())
    return clock.pending(job_key_prefix, held)
