"""rgpu's own compute limiter, for sessions on GPUs shared `isolated` (no MPS).

Without MPS the driver time-slices the contexts that have work pending, so a session's share of
the GPU is what it can keep pending. The limiter makes the isolated sessions of one GPU take
turns: a session submits GPU work only while it holds the GPU's turn (an exclusive lock on a file
the GPU's workers share), for at most QUANTUM_S at a time; before giving the turn back it waits
for its own work to finish (cuCtxSynchronize), so the time it held the turn is the GPU time it
used, and no other session's work ran then. A token bucket then holds it back until its share of
wall time pays for that: a 0.25 slice that held the GPU for 20 ms waits 60 ms before its next
turn, whatever the others do (HAMi-core's limiter works the same way inside the application;
this one sits in the worker, which sees every submission).

With `compute_lending` on, a session may take more than its share while the GPU's other sessions
leave theirs idle: each worker publishes its recent use, and a session's allowance is its share
or the part of the GPU the others did not use, whichever is more.

The pure parts (TokenBucket, allowance, RecentUse) are tested with a made-up clock; GpuTurns and
ComputeLimiter do the I/O.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rgpu.slice_size import SliceLimits

QUANTUM_S = 0.020          # the longest turn before the GPU is offered to the others
OVERRUN_S = 0.250          # a turn held this long (a kernel that runs on) is yielded to the driver's time-slicing
IDLE_RELEASE_S = 0.002     # a turn is given back when the application sends nothing for this long
BURST_S = 0.050            # how much unused share a session may save up (its burst)
LOAD_SUFFIX = ".load"
TURN_FILE = "isolated.turn"


@dataclass
class TokenBucket:
    """GPU seconds a session may still use: refilled at `share` per wall second, up to BURST_S."""

    share: float
    now: float
    burst_s: float = BURST_S
    tokens: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.tokens = self.burst_s * self.share

    def _refill(self, now: float, rate: float) -> None:
        self.tokens = min(self.burst_s * max(rate, self.share), self.tokens + (now - self.now) * rate)
        self.now = now

    def charge(self, busy_s: float, now: float, rate: float | None = None) -> None:
        self._refill(now, self.share if rate is None else rate)
        self.tokens -= busy_s

    def wait_s(self, now: float, rate: float | None = None) -> float:
        """How long before the session may take its next turn (0: now)."""
        rate = self.share if rate is None else rate
        self._refill(now, rate)
        return 0.0 if self.tokens >= 0 else -self.tokens / rate


def allowance(share: float, others_use: float, lending: bool) -> float:
    """The fraction of the GPU a session may use now."""
    if not lending:
        return share
    return max(share, min(1.0, 1.0 - others_use))


@dataclass
class RecentUse:
    """The fraction of wall time a session held the GPU, averaged over about `span_s`."""

    span_s: float = 0.5
    value: float = 0.0
    since: float | None = None

    def add(self, busy_s: float, now: float) -> float:
        if self.since is None:
            self.since = now - busy_s
        elapsed = max(now - self.since, 1e-6)
        weight = min(1.0, elapsed / self.span_s)
        self.value = (1 - weight) * self.value + weight * min(1.0, busy_s / elapsed)
        self.since = now
        return self.value


class GpuTurns:
    """The GPU's turn: an exclusive lock on a file every isolated worker of that GPU opens."""

    def __init__(self, gpu_dir: str) -> None:
        self.path = Path(gpu_dir) / TURN_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def take(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def give_back(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def others_use(gpu_dir: str, me: int, now: float, stale_s: float = 2.0) -> float:
    """The recent use the GPU's other isolated sessions published (files of dead or quiet ones skipped)."""
    total = 0.0
    for path in Path(gpu_dir).glob(f"*{LOAD_SUFFIX}"):
        if path.stem == str(me):
            continue
        try:
            if now - path.stat().st_mtime > stale_s:
                continue
            total += float(path.read_text() or 0)
        except (OSError, ValueError):
            continue
    return total


class ComputeLimiter:
    """The worker's side: gate submissions on the GPU's turn and the session's share."""

    def __init__(self, limits: SliceLimits, gpu_dir: str, lending: bool, fence: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share = limits.share        # 0.01-1.0: SliceLimits checked the percent
        self.gpu_dir = gpu_dir
        self.lending = lending
        self.fence = fence               # waits for the session's GPU work to finish
        self.clock = clock
        self.turns = GpuTurns(gpu_dir)
        self.bucket = TokenBucket(self.share, clock())
        self.use = RecentUse()
        self.holding_since: float | None = None
        self.load_path = Path(gpu_dir) / f"{os.getpid()}{LOAD_SUFFIX}"
        self.busy_s = 0.0                # GPU time used in all (turns held)
        self.held_back_s = 0.0           # time spent waiting for the share to pay off
        self.overruns = 0                # turns yielded by the watchdog
        # A kernel that runs for seconds (or for ever) must not starve the GPU's other sessions: a
        # watchdog gives the turn back after OVERRUN_S, leaving the driver to time-slice; the whole
        # time is still charged when the session's work ends.
        self._state = threading.Lock()
        self._yielded = False
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="rgpu-limiter-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._stop.wait(OVERRUN_S / 5):
            with self._state:
                if (self.holding_since is not None and not self._yielded
                        and self.clock() - self.holding_since >= OVERRUN_S):
                    self.turns.give_back()
                    self._yielded = True
                    self.overruns += 1

    def _rate(self) -> float:
        if not self.lending:
            return self.share
        return allowance(self.share, others_use(self.gpu_dir, os.getpid(), time.time()), True)

    def before_submit(self) -> None:
        """Called before GPU work is submitted: take a turn if the session has none."""
        if self.holding_since is not None:
            return
        rate = self._rate()
        wait = self.bucket.wait_s(self.clock(), rate)
        if wait > 0:
            self.held_back_s += wait
            time.sleep(wait)
        self.turns.take()
        with self._state:
            self.holding_since = self.clock()
            self._yielded = False

    def after_op(self) -> None:
        """Called after each operation: a turn held for QUANTUM_S is given back."""
        if self.holding_since is not None and self.clock() - self.holding_since >= QUANTUM_S:
            self.release()

    def before_wait(self, sock: socket.socket) -> None:
        """Called before the worker waits for the application: give the turn back when it is quiet."""
        if self.holding_since is None:
            return
        readable, _, _ = select.select([sock], [], [], IDLE_RELEASE_S)
        if not readable:
            self.release()

    def release(self) -> None:
        if self.holding_since is None:
            return
        try:
            self.fence()
        finally:
            with self._state:
                now = self.clock()
                busy = now - self.holding_since if self.holding_since is not None else 0.0
                self.holding_since = None
                if not self._yielded:
                    self.turns.give_back()
                self._yielded = False
            self.busy_s += busy
            self.bucket.charge(busy, now, self._rate() if self.lending else None)
            use = self.use.add(busy, now)
            try:
                self.load_path.write_text(f"{use:.4f}")
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.release()
        self.load_path.unlink(missing_ok=True)
        os.close(self.turns.fd)
