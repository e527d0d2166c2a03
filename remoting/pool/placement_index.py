"""Placement over an index of servers grouped by what they have free. Pure logic, no I/O.

`place()` (placement.py) is the reference: it looks at every GPU of the pool on each request. This
index decides exactly as it does (tests/test_placement_index.py checks that on random pools) while
looking at each *distinct* server shape once: servers whose GPUs (in order: index, model, usable
memory, allocated percent and memory) are alike form one group, and the reference's choices depend
on a server only through its shape and its address. A pool of 1,250 servers of 8 GPUs where most
are either empty or full has a handful of groups, so a request costs the same as on 64 servers.

Servers that are drained are left out of the index by the caller; servers that are down are
skipped when met (`is_up`), since they go down with time rather than by an event. A request with
a server filter is answered by the reference over that server's GPUs. When the index finds no
room, it returns None and the caller asks the reference, which raises the CapacityError that says
what is free.
"""

from __future__ import annotations

import bisect
import functools
import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from rgpu.errors import CapacityError
from rgpu.model import isolation_allows
from rgpu.slice_size import memory_of_percent, percent_of_memory
from rgpu.remoting.pool.placement import (GpuSlot, PlacedSlice, SliceRequest, check_request, place,
                                          sharing_allows)

# A GPU as the shape of a server sees it: (index, name, usable memory, allocated %, allocated memory,
# sharing).
GpuShape = tuple[int, str, int, int, int, str]
Shape = tuple[GpuShape, ...]


@dataclass
class _Group:
    shape: Shape
    members: list[str] = field(default_factory=list)   # addresses, sorted


@dataclass(frozen=True)
class _Fit:
    """What one request can use on every server of one group."""

    candidates: tuple[tuple[int, int, int], ...]   # (position in the server's GPUs, memory, percent), best first
    free: int                                     # free percent over the fitting GPUs


def shape_of(slots: Sequence[GpuSlot]) -> Shape:
    return tuple((g.index, g.name, g.usable_memory_bytes, g.allocated_percent, g.allocated_memory_bytes, g.sharing)
                 for g in slots)


class PlacementIndex:
    def __init__(self) -> None:
        self._slots: dict[str, tuple[GpuSlot, ...]] = {}
        self._shape_of: dict[str, Shape] = {}
        self._groups: dict[Shape, _Group] = {}
        self._by_hostname: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def set_server(self, address: str, slots: Sequence[GpuSlot] | None) -> None:
        """Put a server in the index with its GPUs as they are now, or take it out (None)."""
        self._remove(address)
        if slots is None or not slots:
            return
        shape = shape_of(slots)
        self._slots[address] = tuple(slots)
        self._shape_of[address] = shape
        group = self._groups.get(shape)
        if group is None:
            group = self._groups[shape] = _Group(shape)
        bisect.insort(group.members, address)
        self._by_hostname.setdefault(slots[0].hostname, set()).add(address)

    def _remove(self, address: str) -> None:
        slots = self._slots.pop(address, None)
        if slots is None:
            return
        shape = self._shape_of.pop(address)
        group = self._groups[shape]
        del group.members[bisect.bisect_left(group.members, address)]
        if not group.members:
            del self._groups[shape]
        same_host = self._by_hostname.get(slots[0].hostname)
        if same_host is not None:
            same_host.discard(address)
            if not same_host:
                del self._by_hostname[slots[0].hostname]

    def place(self, request: SliceRequest, policy: str, is_up: Callable[[str], bool]) -> list[PlacedSlice] | None:
        """The reference's choice for this request over the indexed servers that are up, or None
        when it cannot be placed (ask the reference for the error)."""
        check_request(request, policy)
        if request.server:
            return self._place_on_named(request, policy, is_up)
        sign = 1 if policy == "binpack" else -1
        fits: list[tuple[_Group, _Fit]] = []
        for group in self._groups.values():
            fit = _fit(group.shape, request, policy)
            if fit is not None:
                fits.append((group, fit))
        # One server: binpack the fullest that can hold the job, spread the emptiest; ties by address.
        single: dict[int, list[tuple[_Group, _Fit]]] = {}
        for group, fit in fits:
            if len(fit.candidates) >= request.count:
                single.setdefault(sign * fit.free, []).append((group, fit))
        for key in sorted(single):
            best: tuple[str, _Fit] | None = None
            for group, fit in single[key]:
                address = next(self._up_members(group, is_up), None)
                if address is not None and (best is None or address < best[0]):
                    best = (address, fit)
            if best is not None:
                return self._placed(best[0], best[1].candidates[: request.count])
        if request.same_node:
            return None   # one server or none: the reference says so
        # Several servers: most candidates first, then fullest (binpack) or emptiest (spread), then address.
        by_key: dict[tuple[int, int], list[_Group]] = {}
        fit_of: dict[int, _Fit] = {}
        for group, fit in fits:
            by_key.setdefault((-len(fit.candidates), sign * fit.free), []).append(group)
            fit_of[id(group)] = fit
        chosen: list[PlacedSlice] = []
        for order in sorted(by_key):
            groups = by_key[order]
            for address, fit in heapq.merge(*(self._up_members_with(group, fit_of[id(group)], is_up)
                                               for group in groups), key=lambda each: each[0]):
                chosen.extend(self._placed(address, fit.candidates[: request.count - len(chosen)]))
                if len(chosen) == request.count:
                    return chosen
        return None

    def _up_members(self, group: _Group, is_up: Callable[[str], bool]) -> Iterator[str]:
        for address in group.members:
            if is_up(address):
                yield address

    def _up_members_with(self, group: _Group, fit: _Fit,
                         is_up: Callable[[str], bool]) -> Iterator[tuple[str, _Fit]]:
        for address in self._up_members(group, is_up):
            yield address, fit

    def _placed(self, address: str, candidates: Sequence[tuple[int, int, int]]) -> list[PlacedSlice]:
        slots = self._slots[address]
        return [PlacedSlice(slots[position], memory, percent) for position, memory, percent in candidates]

    def _place_on_named(self, request: SliceRequest, policy: str, is_up: Callable[[str], bool]) -> list[PlacedSlice] | None:
        addresses = set(self._by_hostname.get(request.server, ()))
        if request.server in self._slots:
            addresses.add(request.server)
        slots = [g for address in sorted(addresses) if is_up(address) for g in self._slots[address]]
        try:
            return place(slots, request, policy)
        except CapacityError:
            return None



@functools.lru_cache(maxsize=4096)
def _fit(shape: Shape, request: SliceRequest, policy: str) -> _Fit | None:
    """The reference's candidates on a server of this shape, in the reference's order."""
    model = request.gpu_model.lower()
    found: list[tuple[tuple[int, int, int], tuple[int, int, int]]] = []
    free = 0
    for position, (index, name, usable, allocated, allocated_memory, sharing) in enumerate(shape):
        if model and model not in name.lower():
            continue
        if not isolation_allows(request.isolation, sharing):
            continue
        if usable < request.min_memory_bytes:
            continue
        if request.percent is not None:
            memory, percent = memory_of_percent(request.percent, usable), request.percent
        else:
            assert request.memory_bytes is not None
            if request.memory_bytes > usable:
                continue
            memory = request.memory_bytes
            percent = percent_of_memory(memory, usable)
        if not sharing_allows(sharing, percent):
            continue
        if allocated + percent <= 100 and allocated_memory + memory <= usable:
            # The reference's GPU order within one server (the server name is the same for all).
            order = ((-allocated, -allocated_memory, index) if policy == "binpack"
                     else (allocated, allocated_memory, index))
            found.append((order, (position, memory, percent)))
            free += 100 - allocated
    if not found:
        return None
    found.sort(key=lambda each: each[0])
    return _Fit(tuple(c for _, c in found), free)
