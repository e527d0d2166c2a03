"""Placement: property tests (never over-commit, distinct GPUs, policies) and examples."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rgpu.errors import CapacityError, InvalidRequest
from rgpu.remoting.pool.placement import GpuSlot, SliceRequest, place

GiB = 2**30


def gpus(servers: int, per_server: int, memory: int = 80 * GiB, name: str = "NVIDIA H100") -> list[GpuSlot]:
    return [GpuSlot(server=f"10.0.0.{s}:55001", hostname=f"gpu{s}", uuid=f"GPU-{s}-{i}", index=i, name=name,
                    usable_memory_bytes=memory) for s in range(servers) for i in range(per_server)]


def apply(slots: list[GpuSlot], placed) -> list[GpuSlot]:  # type: ignore[no-untyped-def]
    by_uuid = {p.gpu.uuid: p for p in placed}
    out = []
    for g in slots:
        p = by_uuid.get(g.uuid)
        if p:
            g = replace(g, allocated_percent=g.allocated_percent + p.compute_percent,
                        allocated_memory_bytes=g.allocated_memory_bytes + p.memory_limit_bytes)
        out.append(g)
    return out


requests = st.builds(
    SliceRequest,
    count=st.integers(1, 6),
    percent=st.one_of(st.none(), st.integers(1, 100)),
    memory_bytes=st.none(),
).map(lambda r: r if r.percent is not None else SliceRequest(count=r.count, memory_bytes=r.count * 7 * GiB))


@settings(max_examples=200, deadline=None)
@given(st.lists(requests, min_size=1, max_size=40), st.sampled_from(["binpack", "spread"]),
       st.integers(1, 4), st.integers(1, 8))
def test_never_overcommits_and_uses_distinct_gpus(reqs, policy, servers, per_server):  # type: ignore[no-untyped-def]
    slots = gpus(servers, per_server, memory=40 * GiB)
    for req in reqs:
        try:
            placed = place(slots, req, policy)
        except CapacityError:
            continue
        assert len(placed) == req.count
        assert len({p.gpu.uuid for p in placed}) == req.count, "slices must be on distinct GPUs"
        slots = apply(slots, placed)
        for g in slots:
            assert 0 <= g.allocated_percent <= 100
            assert 0 <= g.allocated_memory_bytes <= g.usable_memory_bytes


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 100))
def test_percent_sizes(percent):  # type: ignore[no-untyped-def]
    [placed] = place(gpus(1, 1), SliceRequest(count=1, percent=percent))
    assert placed.memory_limit_bytes == 80 * GiB * percent // 100
    assert placed.compute_percent == percent


def test_half_slices_binpack_fill_one_gpu_before_the_next() -> None:
    slots = gpus(2, 2)
    a = place(slots, SliceRequest(count=1, percent=50))
    slots = apply(slots, a)
    b = place(slots, SliceRequest(count=1, percent=50))
    assert a[0].gpu.uuid == b[0].gpu.uuid  # binpack keeps the other GPUs whole


def test_spread_uses_empty_gpus_first() -> None:
    slots = gpus(1, 2)
    a = place(slots, SliceRequest(count=1, percent=50), "spread")
    b = place(apply(slots, a), SliceRequest(count=1, percent=50), "spread")
    assert a[0].gpu.uuid != b[0].gpu.uuid


def test_job_prefers_one_server_and_spans_servers_only_when_needed() -> None:
    slots = gpus(3, 4)
    placed = place(slots, SliceRequest(count=4, percent=100))
    assert len({p.gpu.server for p in placed}) == 1
    placed = place(slots, SliceRequest(count=6, percent=100))
    assert len({p.gpu.server for p in placed}) == 2


def test_a_same_node_job_goes_on_one_server_or_is_refused_saying_so() -> None:
    slots = gpus(3, 4)
    placed = place(slots, SliceRequest(count=4, percent=100, same_node=True))
    assert len({p.gpu.server for p in placed}) == 1
    with pytest.raises(CapacityError) as refused:
        place(slots, SliceRequest(count=6, percent=100, same_node=True))   # spreads without same_node (above)
    assert str(refused.value) == (
        "rgpu: pool: cannot place 6 slice(s) of fraction 1 (same node) on one GPU server (12 GPU(s) can take one "
        "now, at most 4 of them on one server; wait for capacity, ask for fewer or smaller slices, or ask without "
        "--same-node so the slices may spread over several GPU servers)")


def test_never_places_on_ineligible_servers() -> None:
    slots = [replace(g, eligible=g.server.startswith("10.0.0.1")) for g in gpus(2, 2)]
    placed = place(slots, SliceRequest(count=2, percent=100))
    assert {p.gpu.server for p in placed} == {"10.0.0.1:55001"}
    with pytest.raises(CapacityError):
        place(slots, SliceRequest(count=3, percent=100))


def test_capacity_error_says_what_is_free_and_what_was_asked() -> None:
    with pytest.raises(CapacityError) as err:
        place(gpus(1, 2), SliceRequest(count=3, percent=50))
    text = str(err.value)
    assert text.startswith("rgpu: pool: cannot place 3 slice(s) of fraction 0.5")
    assert "200 GPU-percent" in text and "asked 3" in text


def test_filters() -> None:
    slots = gpus(1, 2, name="NVIDIA H100") + [
        GpuSlot(server="10.0.0.9:55001", hostname="big", uuid="GPU-big", index=0, name="NVIDIA H200",
                usable_memory_bytes=141 * GiB)]
    assert place(slots, SliceRequest(count=1, percent=50, gpu_model="h200"))[0].gpu.uuid == "GPU-big"
    assert place(slots, SliceRequest(count=1, percent=50, server="big"))[0].gpu.uuid == "GPU-big"
    assert place(slots, SliceRequest(count=1, percent=50, min_memory_bytes=100 * GiB))[0].gpu.uuid == "GPU-big"
    with pytest.raises(CapacityError):
        place(slots, SliceRequest(count=2, percent=50, gpu_model="h200"))


def test_memory_sized_slices() -> None:
    [placed] = place(gpus(1, 1), SliceRequest(count=1, memory_bytes=20 * GiB))
    assert placed.memory_limit_bytes == 20 * GiB and placed.compute_percent == 25
    with pytest.raises(CapacityError):
        place(gpus(1, 1), SliceRequest(count=1, memory_bytes=81 * GiB))


def test_bad_requests() -> None:
    with pytest.raises(InvalidRequest):
        place(gpus(1, 1), SliceRequest(count=1))
    with pytest.raises(InvalidRequest):
        place(gpus(1, 1), SliceRequest(count=1, percent=50), "random")


def test_strict_isolation_goes_only_on_isolated_or_exclusive_gpus() -> None:
    slots = [GpuSlot(server="10.0.0.1:55001", hostname="a", uuid="GPU-mps", index=0, name="NVIDIA H100",
                     usable_memory_bytes=80 * GiB, sharing="mps"),
             GpuSlot(server="10.0.0.1:55001", hostname="a", uuid="GPU-iso", index=1, name="NVIDIA H100",
                     usable_memory_bytes=80 * GiB, sharing="isolated"),
             GpuSlot(server="10.0.0.1:55001", hostname="a", uuid="GPU-excl", index=2, name="NVIDIA H100",
                     usable_memory_bytes=80 * GiB, sharing="exclusive")]
    (half,) = place(slots, SliceRequest(count=1, percent=50, isolation="strict"))
    assert half.gpu.uuid == "GPU-iso"                  # the exclusive GPU takes whole GPUs only
    both = place(slots, SliceRequest(count=2, percent=100, isolation="strict"))
    assert {p.gpu.uuid for p in both} == {"GPU-iso", "GPU-excl"}
    with pytest.raises(CapacityError, match="isolation=strict"):
        place(slots, SliceRequest(count=3, percent=100, isolation="strict"))
    # Without isolation a partial slice may go on mps or isolated GPUs, never on the exclusive one.
    placed = place(slots, SliceRequest(count=2, percent=25))
    assert {p.gpu.uuid for p in placed} == {"GPU-mps", "GPU-iso"}
    with pytest.raises(CapacityError):
        place(slots, SliceRequest(count=3, percent=25))


def place_in_turn(gpus: list[GpuSlot], requests: list[SliceRequest]) -> None:
    """Place each request on what the ones before it left; CapacityError when one does not fit."""
    gpus = list(gpus)
    for request in requests:
        for p in place(gpus, request):
            i = gpus.index(p.gpu)
            gpus[i] = replace(p.gpu, allocated_percent=p.gpu.allocated_percent + p.compute_percent,
                              allocated_memory_bytes=p.gpu.allocated_memory_bytes + p.memory_limit_bytes)


def test_fits_in_every_order_tries_each_order_the_leases_may_come_in() -> None:
    """Jobs let start together reach the pool in any order, and binpack's choice depends on it:
    the mixed batch's first seven jobs (400 GPU-percent on 4 GPUs) fit in some orders, not in
    every one (in the batch the 2x0.25 job came last and found one GPU with room)."""
    from rgpu.remoting.pool.placement import fits_in_every_order

    gpus = [GpuSlot(server=f"s{i // 2}", hostname=f"h{i // 2}", uuid=f"GPU-{i}", index=i % 2, name="H100",
                    usable_memory_bytes=80 << 30) for i in range(4)]
    quarter, half, whole = (SliceRequest(count=1, percent=p) for p in (25, 50, 100))
    two_quarters, two_halves = SliceRequest(count=2, percent=25), SliceRequest(count=2, percent=50)
    place_in_turn(gpus, [two_halves, two_quarters, half, half, quarter, quarter, whole])
    with pytest.raises(CapacityError):
        place_in_turn(gpus, [quarter, half, two_halves, whole, quarter, half, two_quarters])
    assert not fits_in_every_order(gpus, [quarter, half, whole, two_quarters, two_halves, quarter, half])
    assert fits_in_every_order(gpus, [half] * 8) and not fits_in_every_order(gpus, [half] * 9)
    assert fits_in_every_order(gpus, [quarter, half, two_quarters, quarter, two_halves])
    assert not fits_in_every_order(gpus, [quarter] * 16, budget=3)        # too many states to look at: "no"
