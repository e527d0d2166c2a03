"""Log lines whose rate a remote party decides, let through once per key per period.

A client that sends malformed frames, a host retrying with the wrong secret, a scanner on the
dashboard: each chooses how often a daemon would log, so each kind of line is let through once a
period, and the next one says how many were held back (issue 26: 120 KB of malformed frames made
4 MB of tracebacks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

MAX_KEYS = 1024   # kinds of line remembered; beyond, the oldest are forgotten (they log again)


class LogLimit:
    def __init__(self, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._period, self._clock = period, clock
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: hold this line back (counted); else log it, with this many held back since the last."""
        now = self._clock()
        with self._lock:
            if now - self._last.get(key, -1e18) < self._period:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            if key not in self._last and len(self._last) >= MAX_KEYS:
                oldest = next(iter(self._last))
                del self._last[oldest]
                self._held.pop(oldest, None)
            self._last.pop(key, None)
            self._last[key] = now
            return self._held.pop(key, 0)


def held_note(held: int, period: float = 60.0) -> str:
    """" (N more like it in the last minute)" for a count allow() returned, or ""."""
    return f" ({held} more like it in the last {'minute' if period == 60 else f'{period:g} s'})" if held else ""
