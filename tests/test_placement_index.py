"""The indexed placement decides exactly as the reference `place()` on random pools."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rgpu.errors import CapacityError, InvalidRequest
from rgpu.remoting.pool.placement import GpuSlot, PlacedSlice, SliceRequest, place
from rgpu.remoting.pool.placement_index import PlacementIndex

GiB = 2**30
SHARINGS = ["mps", "mps", "isolated", "exclusive"]
NAMES = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L4"]

# Few distinct allocations, so that servers share shapes (the index's groups) as in a real pool.
gpu_state = st.tuples(st.sampled_from([0, 0, 25, 50, 50, 75, 100]), st.sampled_from([0, 1, 2]),
                      st.sampled_from([40 * GiB, 80 * GiB]))


@st.composite
def pools(draw: st.DrawFn) -> tuple[list[GpuSlot], dict[str, bool]]:
    slots: list[GpuSlot] = []
    up: dict[str, bool] = {}
    for s in range(draw(st.integers(1, 12))):
        address = f"10.0.{s % 3}.{s}:55001"
        hostname = f"gpu{s % 5}"       # several dispatchers on one host, sometimes
        up[address] = draw(st.booleans()) or draw(st.booleans())
        name = draw(st.sampled_from(NAMES))
        for i in range(draw(st.integers(1, 8))):
            percent, name_pick, usable = draw(gpu_state)
            slots.append(GpuSlot(server=address, hostname=hostname, uuid=f"GPU-{s}-{i}", index=i,
                                 name=NAMES[name_pick] if draw(st.booleans()) else name,
                                 usable_memory_bytes=usable, allocated_percent=percent,
                                 allocated_memory_bytes=usable * percent // 100,
                                 sharing=draw(st.sampled_from(SHARINGS))))
    return slots, up


requests = st.builds(
    SliceRequest,
    count=st.integers(1, 9),
    percent=st.one_of(st.none(), st.sampled_from([10, 25, 30, 50, 75, 100]), st.integers(1, 100)),
    memory_bytes=st.sampled_from([5 * GiB, 20 * GiB, 41 * GiB]),
    gpu_model=st.sampled_from(["", "", "", "h100", "A100", "l4"]),
    server=st.sampled_from(["", "", "", "", "gpu1", "10.0.1.1:55001", "10.0.0.3:55001", "nowhere"]),
    min_memory_bytes=st.sampled_from([0, 0, 0, 60 * GiB]),
    isolation=st.sampled_from(["", "", "strict"]),
    same_node=st.sampled_from([False, False, True]),
).map(lambda r: replace(r, memory_bytes=None) if r.percent is not None else r)


def indexed(slots: list[GpuSlot], up: dict[str, bool]) -> PlacementIndex:
    index = PlacementIndex()
    for address in up:
        index.set_server(address, [g for g in slots if g.server == address])
    return index


def reference(slots: list[GpuSlot], up: dict[str, bool], request: SliceRequest, policy: str) -> list[PlacedSlice] | None:
    try:
        return place([replace(g, eligible=up[g.server]) for g in slots], request, policy)
    except CapacityError:
        return None


def apply(slots: list[GpuSlot], placed: list[PlacedSlice]) -> list[GpuSlot]:
    by_uuid = {p.gpu.uuid: p for p in placed}
    return [replace(g, allocated_percent=g.allocated_percent + by_uuid[g.uuid].compute_percent,
                    allocated_memory_bytes=g.allocated_memory_bytes + by_uuid[g.uuid].memory_limit_bytes)
            if g.uuid in by_uuid else g for g in slots]


@settings(max_examples=400, deadline=None)
@given(pools(), requests, st.sampled_from(["binpack", "spread"]))
def test_indexed_placement_decides_as_the_reference(pool, request, policy) -> None:  # type: ignore[no-untyped-def]
    slots, up = pool
    expected = reference(slots, up, request, policy)
    got = indexed(slots, up).place(request, policy, lambda address: up[address])
    assert got == expected


@settings(max_examples=100, deadline=None)
@given(pools(), st.lists(st.tuples(requests, st.booleans()), min_size=1, max_size=25),
       st.sampled_from(["binpack", "spread"]))
def test_indexed_placement_follows_a_sequence_of_leases(pool, steps, policy) -> None:  # type: ignore[no-untyped-def]
    """Kept current server by server (as the pool does after each lease), it still decides as the
    reference and never over-commits."""
    slots, up = pool
    index = indexed(slots, up)
    for request, toggle in steps:
        if toggle:   # a server goes down or comes back between requests
            address = sorted(up)[len(slots) % len(up)]
            up[address] = not up[address]
        expected = reference(slots, up, request, policy)
        got = index.place(request, policy, lambda address: up[address])
        assert got == expected
        if got:
            slots = apply(slots, got)
            for address in {p.gpu.server for p in got}:
                index.set_server(address, [g for g in slots if g.server == address])
            assert all(g.allocated_percent <= 100 and g.allocated_memory_bytes <= g.usable_memory_bytes
                       for g in slots)


def test_servers_left_out_of_the_index_are_never_used() -> None:
    index = PlacementIndex()
    slot = GpuSlot(server="10.0.0.1:55001", hostname="gpu1", uuid="GPU-1", index=0, name="NVIDIA H100",
                   usable_memory_bytes=80 * GiB)
    index.set_server(slot.server, [slot])
    assert index.place(SliceRequest(count=1, percent=50), "binpack", lambda a: True)
    index.set_server(slot.server, None)   # drained: the pool takes it out
    assert index.place(SliceRequest(count=1, percent=50), "binpack", lambda a: True) is None
    assert len(index) == 0


def test_bad_requests_are_refused_as_by_the_reference() -> None:
    with pytest.raises(InvalidRequest):
        PlacementIndex().place(SliceRequest(count=1, percent=50), "roundrobin", lambda a: True)
    with pytest.raises(InvalidRequest):
        PlacementIndex().place(SliceRequest(count=0, percent=50), "binpack", lambda a: True)


@settings(max_examples=300, deadline=None)
@given(pools(), requests, st.sampled_from(["binpack", "spread"]))
def test_strict_isolation_never_lands_on_an_mps_gpu(pool, request, policy) -> None:  # type: ignore[no-untyped-def]
    """Both placements: isolation=strict only on isolated/exclusive GPUs, exclusive GPUs only whole."""
    slots, up = pool
    for placed in (reference(slots, up, request, policy),
                   indexed(slots, up).place(request, policy, lambda address: up[address])):
        for p in placed or []:
            if request.isolation == "strict":
                assert p.gpu.sharing in ("isolated", "exclusive")
            if p.gpu.sharing == "exclusive":
                assert p.compute_percent == 100
