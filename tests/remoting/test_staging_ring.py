"""The host-to-device staging ring's bookkeeping (remoting/datapath/backends/staging_ring.py)."""

from __future__ import annotations

import random

import pytest
from rgpu.remoting.datapath.backends.staging_ring import ALIGN, StagingRing

pytestmark = pytest.mark.unit


def test_small_copies_fill_the_ring_before_anyone_waits() -> None:
    ring: StagingRing[int] = StagingRing(16 << 20)
    offsets = [ring.take(100, i) for i in range((16 << 20) // ALIGN)]
    assert None not in offsets and len(set(offsets)) == len(offsets)   # 65,536 copies in flight
    assert ring.take(1, -1) is None                                       # full: the oldest must finish
    assert ring.retire_oldest() == 0
    assert ring.take(1, -1) == 0                                          # its room is reused


def test_a_copy_that_does_not_fit_the_end_wraps_to_the_start() -> None:
    ring: StagingRing[str] = StagingRing(4096)
    assert ring.take(3000, "a") == 0
    assert ring.take(1000, "b") == 3072
    assert ring.take(1024, "c") is None          # neither the end nor the start has room
    ring.retire_oldest()
    assert ring.take(1024, "c") == 0             # wrapped
    assert ring.take(2048, "d") == 1024
    assert ring.take(256, "e") is None           # [3072, 4096) still holds b
    assert ring.tags() == ["b", "c", "d"]


def test_too_big_a_copy_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        StagingRing(4096).take(4097, None)


def test_copies_in_flight_never_overlap() -> None:
    rng = random.Random(7)
    ring: StagingRing[int] = StagingRing(1 << 16)
    spans: dict[int, tuple[int, int]] = {}   # tag -> bytes it holds
    order: list[int] = []
    for tag in range(20000):
        if order and rng.random() < 0.45:
            assert ring.retire_oldest() == order[0]
            del spans[order.pop(0)]
            continue
        n = rng.choice([1, 100, 256, 4000, 1 << 14, 1 << 16])
        while (start := ring.take(n, tag)) is None:
            assert ring.retire_oldest() == order[0]
            del spans[order.pop(0)]
        spans[tag] = (start, start + n)
        order.append(tag)
        held = sorted(spans.values())
        assert all(a[1] <= b[0] for a, b in zip(held, held[1:])), held
        assert all(0 <= a and b <= ring.size for a, b in held)
