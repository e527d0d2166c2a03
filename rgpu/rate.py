"""Token buckets: a burst, then a steady rate (the dispatcher's session opens per slice, the pool's
lease calls per user). Pure: the caller passes the time."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class TokenBucket:
    """`capacity` takes at once, refilled at `rate` a second."""
    capacity: float
    rate: float
    tokens: float = -1.0
    at: float = 0.0

    def take(self, now: float) -> float:
        """Take one token: 0.0 when taken, else the seconds until one is there (nothing taken)."""
        if self.tokens < 0:
            self.tokens, self.at = self.capacity, now
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def full(self, now: float) -> bool:
        return self.tokens < 0 or self.tokens + max(0.0, now - self.at) * self.rate >= self.capacity


class KeyedBuckets:
    """One bucket per key (a user), thread-safe. At most `max_keys` are kept: when full, buckets
    that have refilled (they hold nothing a new bucket would not) make way first."""

    def __init__(self, capacity: float, rate: float, max_keys: int = 10_000) -> None:
        self.capacity, self.rate, self.max_keys = capacity, rate, max_keys
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def take(self, key: str, now: float) -> float:
        """0.0 when `key` may go on, else the seconds until it may (rate 0: never limited)."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                if len(self._buckets) >= self.max_keys:
                    for old in [k for k, b in self._buckets.items() if b.full(now)]:
                        del self._buckets[old]
                    if len(self._buckets) >= self.max_keys:   # all busy: the oldest goes
                        del self._buckets[next(iter(self._buckets))]
                bucket = self._buckets[key] = TokenBucket(self.capacity, self.rate)
            return bucket.take(now)
