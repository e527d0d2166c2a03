"""A worker lives no longer than the dispatcher that started it.

A worker serves a lease the dispatcher keeps checking against the pool; without the dispatcher
nobody would end it when the lease is released, so an orphaned worker would go on serving a GPU
share that may belong to another job. Two ties: the kernel's parent-death signal (SIGKILL, set
with prctl; Linux sends it when the thread that forked us ends, so the dispatcher forks workers
from one long-lived thread), and a watch of our parent pid for kernels or sandboxes where prctl
is unavailable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import threading

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5

log = logging.getLogger("rgpu.worker")


def _set_parent_death_signal(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tie_to_parent(parent_pid: int) -> None:
    """Die (SIGKILL) when `parent_pid` is gone; returns at once. A parent_pid of 0 (older
    dispatchers do not pass it) ties to the parent we have now."""
    parent_pid = parent_pid or os.getppid()
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:   # the dispatcher died before prctl took effect
        os._exit(70)

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(WATCH_INTERVAL_S)
        log.error("rgpu: worker: the dispatcher (pid %d) is gone, so this session ends (nobody would end "
                  "it when its lease is released; the client sees the session lost and reruns)", parent_pid)
        os._exit(70)

    threading.Thread(target=watch, name="rgpu-worker-lifeline", daemon=True).start()
