"""Per-session usage a worker publishes for its dispatcher: calls, busy time, memory high-water
mark and last activity, in a small memory-mapped file beside the slice's `.used` files.

A worker writes `<pid>.stats` in its slice's usage folder and leaves it there when it exits, so the
dispatcher's totals per slice (read_slice_stats) cover ended sessions too. The serving loop only
adds numbers (two attribute writes per call); a publisher thread writes the file twice a second,
counting a call still running (a long cuCtxSynchronize) as busy and active now, so such a
session never looks idle.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

STATS = struct.Struct("<QQQdd")    # high-water bytes, busy ns, calls, last active (unix), started (unix)
STATS_SUFFIX = ".stats"
PUBLISH_EVERY_NS = 250_000_000


class SessionStats:
    """Owned by the serving loop: set `call_started_ns` (perf_counter_ns) before a call, then
    account(started) after it."""

    def __init__(self, path: Path, publish_every_s: float = PUBLISH_EVERY_NS / 1e9) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, STATS.size)
            self._map: mmap.mmap | None = mmap.mmap(fd, STATS.size)
        finally:
            os.close(fd)
        self.path = path
        self.busy_ns = 0
        self.calls = 0
        self.high_water = 0
        self.started = time.time()
        self.call_started_ns = 0          # a call is running since then; 0: none
        self._last_call_end_ns = 0
        self._lock = threading.Lock()     # publisher thread vs close()
        self._stop = threading.Event()
        self.publish()
        self._thread = threading.Thread(target=self._publish_loop, args=(publish_every_s,),
                                        name="rgpu-worker-stats", daemon=True)
        self._thread.start()

    def account(self, started_ns: int, high_water: int, calls: int = 1) -> None:
        """The call that began at perf_counter_ns() == started_ns has finished (or `calls` calls,
        run together by the worker's C loop)."""
        now = time.perf_counter_ns()
        self.busy_ns += now - started_ns
        self.calls += calls
        self._last_call_end_ns = now
        self.call_started_ns = 0
        if high_water > self.high_water:
            self.high_water = high_water

    def _snapshot(self) -> bytes:
        now_ns, now_unix = time.perf_counter_ns(), time.time()
        running = self.call_started_ns
        busy = self.busy_ns + (now_ns - running if running else 0)
        if running:
            last_active = now_unix
        elif self._last_call_end_ns:
            last_active = now_unix - (now_ns - self._last_call_end_ns) / 1e9
        else:
            last_active = 0.0
        return STATS.pack(self.high_water, busy, self.calls, last_active, self.started)

    def publish(self) -> None:
        with self._lock:
            if self._map is not None:
                self._map[:] = self._snapshot()

    def _publish_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.publish()

    def close(self, high_water: int = 0) -> None:
        """Final numbers; the file stays for the dispatcher's totals."""
        self._stop.set()
        self.high_water = max(self.high_water, high_water)
        self.call_started_ns = 0
        self.publish()
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None


@dataclass(frozen=True)
class SliceStats:
    sessions_seen: int = 0
    busy_seconds: float = 0.0
    calls: int = 0
    memory_high_water_bytes: int = 0   # the largest of its sessions' high-water marks
    last_active_unix: float = 0.0


def read_slice_stats(folder: Path) -> SliceStats:
    """Totals over every session (live or ended) of one slice."""
    seen = calls = high = 0
    busy = last = 0.0
    try:
        entries = [e for e in folder.iterdir() if e.name.endswith(STATS_SUFFIX)]
    except OSError:
        return SliceStats()
    for entry in entries:
        try:
            data = entry.read_bytes()
        except OSError:
            continue
        if len(data) < STATS.size:
            continue
        hw, busy_ns, n, active, _started = STATS.unpack_from(data)
        seen += 1
        calls += n
        busy += busy_ns / 1e9
        high = max(high, hw)
        last = max(last, active)
    return SliceStats(seen, busy, calls, high, last)
