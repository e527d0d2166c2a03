"""Where host-to-device copies wait in pinned memory until the GPU has read them: one pinned
buffer handed out as a ring, first in, first out.

A worker copies the client's bytes into pinned memory and queues an asynchronous DMA from there;
the bytes must stay put until the GPU has read them. Fixed slots (one copy each) made the worker
wait for the GPU after a few dozen small copies, which drained the GPU's queue in training steps
that copy many small tensors; the ring keeps thousands of small copies in flight and waits only
when the bytes themselves run out. Pure bookkeeping: the backend records an event after each copy
and waits on the oldest one when take() says the ring is full.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")
ALIGN = 256


class StagingRing(Generic[T]):
    def __init__(self, size: int) -> None:
        self.size = size
        self._flight: deque[tuple[int, int, T]] = deque()   # (start, end, tag), oldest first

    def __len__(self) -> int:
        return len(self._flight)

    def take(self, n: int, tag: T) -> int | None:
        """The offset of n free bytes, now in flight under tag; None while the oldest copies still
        hold the room (retire them, then ask again). n must not exceed the ring's size."""
        if n > self.size:
            raise ValueError(f"a {n}-byte copy does not fit a {self.size}-byte staging ring")
        n = max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN) if n < self.size else n
        if not self._flight:
            start = 0
        else:
            head, tail = self._flight[-1][1], self._flight[0][0]
            if head > tail:          # in flight: [tail, head); free: [head, size) and [0, tail)
                if head + n <= self.size:
                    start = head
                elif n <= tail:
                    start = 0
                else:
                    return None
            elif head + n <= tail:   # wrapped: free is [head, tail)
                start = head
            else:
                return None
        self._flight.append((start, start + n, tag))
        return start

    def oldest(self) -> T:
        return self._flight[0][2]

    def retire_oldest(self) -> T:
        """Forget the oldest copy (the caller has waited for it)."""
        return self._flight.popleft()[2]

    def tags(self) -> list[T]:
        return [tag for _, _, tag in self._flight]

    def clear(self) -> None:
        self._flight.clear()
