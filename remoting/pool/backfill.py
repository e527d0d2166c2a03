"""Room kept for the job at the head of the queue. Pure: no I/O.

The Slurm admission (slurm_plugin/waiting.py) lets held jobs start oldest first. A job that does
not fit yet (the head) would wait for ever if younger, smaller jobs kept taking each GPU as it
frees: two whole GPUs never come free together while quarter-GPU jobs backfill them one at a
time. So the admission keeps for the head the GPUs it will get once the leases that hold them
end, and younger jobs start only where they leave those GPUs alone (backfill that does not delay
the head). No job states how long it runs, so leases are taken to end in the order they started:
the head's room is where `place` would put it after the oldest leases ended, as few as it needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from rgpu.errors import CapacityError
from rgpu.model import LeaseRecord
from rgpu.remoting.pool.placement import GpuSlot, PlacedSlice, SliceRequest, place

Avoid = frozenset[tuple[str, str]]       # GPUs as (server address, UUID)


def without(slots: list[GpuSlot], avoid: Avoid) -> list[GpuSlot]:
    """The slots with those in `avoid` out of placement."""
    return [replace(g, eligible=False) if (g.server, g.uuid) in avoid else g for g in slots] if avoid else slots


def with_placed(slots: list[GpuSlot], placed: list[PlacedSlice]) -> list[GpuSlot]:
    """The slots after `placed` went on them."""
    taken = {id(p.gpu): p for p in placed}
    return [g if id(g) not in taken else
            replace(g, allocated_percent=g.allocated_percent + taken[id(g)].compute_percent,
                    allocated_memory_bytes=g.allocated_memory_bytes + taken[id(g)].memory_limit_bytes)
            for g in slots]


def place_one(slots: list[GpuSlot], request: SliceRequest, avoid: Avoid,
              policy: str) -> tuple[list[GpuSlot], list[PlacedSlice]]:
    """`place` off the GPUs in `avoid`: the slots after it, and its slices (on those slots)."""
    placed = place(without(slots, avoid), request, policy)
    by_key = {(p.gpu.server, p.gpu.uuid): p for p in placed}
    placed = [replace(by_key[(g.server, g.uuid)], gpu=g) for g in slots if (g.server, g.uuid) in by_key]
    return with_placed(slots, placed), placed


def place_in_turn(slots: list[GpuSlot], requests: Iterable[tuple[SliceRequest, Avoid]],
                  policy: str) -> list[GpuSlot]:
    """Each request placed on what the ones before it left (none on the GPUs in its avoid set);
    CapacityError when one does not fit."""
    for request, avoid in requests:
        slots, _ = place_one(slots, request, avoid, policy)
    return slots


def head_room(slots: list[GpuSlot], leases: Sequence[LeaseRecord], head: Sequence[SliceRequest],
              policy: str) -> Avoid:
    """The GPUs the head job's leases (one request per node) would be placed on once the oldest
    leases ended (in the order given: oldest first), as few as it takes; empty when it would not
    fit even with all of them gone."""
    state = list(slots)
    index = {(g.server, g.uuid): i for i, g in enumerate(state)}
    for lease in [None, *leases]:
        if lease is not None:
            for s in lease.slices:
                i = index.get((s.server, s.gpu_uuid))
                if i is not None:
                    g = state[i]
                    state[i] = replace(g, allocated_percent=max(0, g.allocated_percent - s.compute_percent),
                                       allocated_memory_bytes=max(0, g.allocated_memory_bytes - s.memory_limit_bytes))
        try:
            after = place_in_turn(state, [(r, frozenset()) for r in head], policy)
        except CapacityError:
            continue
        return frozenset((g.server, g.uuid) for g, before in zip(after, state) if g != before)
    return frozenset()
