"""Slice placement: which GPUs a request's slices go on. Pure logic, no I/O.

Rules, all enforced here:
- a request's N slices go on N distinct GPUs;
- a GPU never holds more than 100% compute or more than its usable memory;
- only GPUs of servers that are up and not drained are candidates;
- a job's slices prefer one server; only when no single server can hold them all do they spread
  over several, using as few servers as possible (never with `same_node`: NCCL's collectives between
  slices of one node stay on NVLink or PCIe);
- a GPU shared `exclusive` takes whole-GPU slices only (100% compute); a request with
  isolation "strict" goes only on GPUs shared `isolated` or `exclusive` (never `mps`, where one
  tenant's fault ends the others' work);
- `binpack` (default) fills the most-used GPUs first so that whole GPUs stay free for whole-GPU
  jobs; `spread` uses the least-used GPUs first, for isolation.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from rgpu.errors import CapacityError, InvalidRequest
from rgpu.model import isolation_allows
from rgpu.slice_size import PERCENT_PER_GPU, format_hundredths, memory_of_percent, percent_of_memory

POLICIES = ("binpack", "spread")


@dataclass(frozen=True, slots=True)
class GpuSlot:
    """A GPU as placement sees it: identity, size and what is already allocated on it."""

    server: str
    hostname: str
    uuid: str
    index: int
    name: str
    usable_memory_bytes: int
    allocated_percent: int = 0
    allocated_memory_bytes: int = 0
    eligible: bool = True        # server up and not drained
    sharing: str = "mps"         # rgpu.model.SHARING_MODES

    @property
    def free_percent(self) -> int:
        return 100 - self.allocated_percent

    @property
    def free_memory_bytes(self) -> int:
        return self.usable_memory_bytes - self.allocated_memory_bytes


@dataclass(frozen=True)
class SliceRequest:
    count: int
    percent: int | None = None            # of one GPU (1-100); exactly one of percent / memory_bytes
    memory_bytes: int | None = None
    gpu_model: str = ""                   # case-insensitive substring of the GPU name
    server: str = ""                      # dispatcher address or hostname
    min_memory_bytes: int = 0
    isolation: str = ""                   # "strict": only GPUs shared isolated or exclusive
    same_node: bool = False               # every slice on one server (pack=node, flexrun --same-node)


@dataclass(frozen=True)
class PlacedSlice:
    gpu: GpuSlot
    memory_limit_bytes: int
    compute_percent: int


def slice_size(gpu: GpuSlot, request: SliceRequest) -> tuple[int, int]:
    """(memory_limit_bytes, compute_percent) a slice of this request takes on this GPU."""
    if request.percent is not None:
        return memory_of_percent(request.percent, gpu.usable_memory_bytes), request.percent
    assert request.memory_bytes is not None
    # A memory-sized slice gets the same share of compute as of memory, rounded up.
    return request.memory_bytes, percent_of_memory(request.memory_bytes, gpu.usable_memory_bytes)


def _matches_filters(gpu: GpuSlot, request: SliceRequest) -> bool:
    if request.gpu_model and request.gpu_model.lower() not in gpu.name.lower():
        return False
    if request.server and request.server not in (gpu.server, gpu.hostname):
        return False
    if request.memory_bytes is not None and request.memory_bytes > gpu.usable_memory_bytes:
        return False
    if not isolation_allows(request.isolation, gpu.sharing):
        return False
    return gpu.usable_memory_bytes >= request.min_memory_bytes


def sharing_allows(sharing: str, percent: int) -> bool:
    """An exclusive GPU takes whole-GPU slices only."""
    return sharing != "exclusive" or percent == 100


def _gpu_order(policy: str):  # type: ignore[no-untyped-def]
    if policy == "binpack":
        return lambda g: (-g.allocated_percent, -g.allocated_memory_bytes, g.server, g.index)
    return lambda g: (g.allocated_percent, g.allocated_memory_bytes, g.server, g.index)


def check_request(request: SliceRequest, policy: str) -> None:
    """Raise InvalidRequest for a request no placement can answer."""
    if policy not in POLICIES:
        raise InvalidRequest("placement", f"unknown policy {policy!r}", "", f"use one of {', '.join(POLICIES)}")
    if request.count < 1:
        raise InvalidRequest("placement", f"count {request.count}", "at least one slice", "ask for 1 or more")
    if (request.percent is None) == (request.memory_bytes is None):
        raise InvalidRequest("placement", "give either a fraction or a memory size per slice", "", "")


def place(gpus: Iterable[GpuSlot], request: SliceRequest, policy: str = "binpack") -> list[PlacedSlice]:
    """Choose GPUs for every slice of the request, or raise CapacityError saying what is free."""
    check_request(request, policy)

    all_gpus = gpus if isinstance(gpus, list) else list(gpus)
    model = request.gpu_model.lower()
    fixed_percent = request.percent
    filtered = bool(model or request.server or request.min_memory_bytes or request.isolation)
    # This loop runs over every GPU of the pool on each allocation: keep it to plain arithmetic
    # on locals.
    by_server: dict[str, list[tuple[GpuSlot, int, int]]] = defaultdict(list)
    server_free: dict[str, int] = defaultdict(int)  # free percent over a server's fitting GPUs
    fitting = 0
    for gpu in all_gpus:
        if not gpu.eligible or (filtered and not _matches_filters(gpu, request)):
            continue
        usable = gpu.usable_memory_bytes
        if fixed_percent is not None:
            memory, percent = usable * fixed_percent // PERCENT_PER_GPU, fixed_percent
        elif request.memory_bytes > usable:  # type: ignore[operator]
            continue
        else:
            memory, percent = slice_size(gpu, request)
        if percent != 100 and gpu.sharing == "exclusive":
            continue
        allocated = gpu.allocated_percent
        if allocated + percent <= 100 and gpu.allocated_memory_bytes + memory <= usable:
            by_server[gpu.server].append((gpu, memory, percent))
            server_free[gpu.server] += 100 - allocated
            fitting += 1

    if fitting < request.count:
        raise CapacityError("pool", f"cannot place {request.count} slice(s) of {_describe(request)}",
                            _free_summary(all_gpus, request, fitting),
                            "wait for capacity, ask for fewer or smaller slices, or relax the filters")

    order = _gpu_order(policy)
    # binpack: the fullest server that can hold the job; spread: the emptiest.
    sign = 1 if policy == "binpack" else -1
    single = [s for s, cands in by_server.items() if len(cands) >= request.count]
    if single:
        best = min(single, key=lambda s: (sign * server_free[s], s))
        chosen = sorted(by_server[best], key=lambda c: order(c[0]))[: request.count]
    elif request.same_node:
        most = max((len(c) for c in by_server.values()), default=0)
        raise CapacityError("pool", f"cannot place {request.count} slice(s) of {_describe(request)} on one GPU server",
                            f"{fitting} GPU(s) can take one now, at most {most} of them on one server",
                            "wait for capacity, ask for fewer or smaller slices, or ask without --same-node so "
                            "the slices may spread over several GPU servers")
    else:
        # Several servers: those with most candidates first, so the job touches few servers.
        chosen = []
        for server in sorted(by_server, key=lambda s: (-len(by_server[s]), sign * server_free[s], s)):
            cands = sorted(by_server[server], key=lambda c: order(c[0]))
            chosen.extend(cands[: request.count - len(chosen)])
            if len(chosen) == request.count:
                break
    return [PlacedSlice(gpu, memory, percent) for gpu, memory, percent in chosen]


def _describe(request: SliceRequest) -> str:
    if request.percent is not None:
        size = f"fraction {format_hundredths(request.percent)}"
    else:
        size = f"{(request.memory_bytes or 0) / 2**30:.1f} GiB"
    filters = [f"model~{request.gpu_model}"] if request.gpu_model else []
    filters += [f"server={request.server}"] if request.server else []
    filters += [f"min memory {request.min_memory_bytes / 2**30:.1f} GiB"] if request.min_memory_bytes else []
    filters += [f"isolation={request.isolation}"] if request.isolation else []
    filters += ["same node"] if request.same_node else []
    return size + (f" ({', '.join(filters)})" if filters else "")


def _free_summary(gpus: Sequence[GpuSlot], request: SliceRequest, fitting: int) -> str:
    eligible = [g for g in gpus if g.eligible]
    free_units = sum(g.free_percent for g in eligible)
    whole = sum(1 for g in eligible if g.allocated_percent == 0 and g.allocated_memory_bytes == 0)
    return (f"asked {request.count} slice(s); {fitting} GPU(s) can take one now; free: {free_units} "
            f"GPU-percent on {len(eligible)} usable GPU(s), {whole} of them wholly free")


def fits_in_every_order(gpus: Sequence[GpuSlot], requests: Sequence[SliceRequest], policy: str = "binpack",
                        budget: int = 5000) -> bool:
    """Whether every request can be placed (with `place`, each on what the ones before it left),
    in whatever order they come. Jobs let start together reach the pool in any order, and the
    order decides where each lands: binpack placing 1x0.25, 1x0.5, 2x0.5, 1x1, 1x0.25, 1x0.5 and
    then 2x0.25 on 4 GPUs leaves room for the last job's two slices in one order and not in
    another. False when more than `budget` distinct states would have to be looked at (so many
    requests at once: ask again once some are placed). Pure."""
    distinct = list(dict.fromkeys(requests))
    start = tuple(requests.count(r) for r in distinct)
    proven: set[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = set()
    looked = [0]

    def all_orders_fit(slots: tuple[GpuSlot, ...], left: tuple[int, ...]) -> bool:
        key = (tuple((g.allocated_percent, g.allocated_memory_bytes) for g in slots), left)
        if key in proven:
            return True
        looked[0] += 1
        if looked[0] > budget:
            raise OverflowError
        for i, n in enumerate(left):
            if not n:
                continue
            try:
                placed = place(list(slots), distinct[i], policy)
            except CapacityError:
                return False
            taken = {id(p.gpu): p for p in placed}
            after = tuple(g if id(g) not in taken else
                          replace(g, allocated_percent=g.allocated_percent + taken[id(g)].compute_percent,
                                  allocated_memory_bytes=g.allocated_memory_bytes + taken[id(g)].memory_limit_bytes)
                          for g in slots)
            if not all_orders_fit(after, left[:i] + (n - 1,) + left[i + 1:]):
                return False
        proven.add(key)
        return True

    try:
        return all_orders_fit(tuple(gpus), start)
    except OverflowError:
        return False
