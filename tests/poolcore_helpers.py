"""Builders for PoolCore tests (a fake clock, servers, requests), shared by test modules that
must not import each other."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from rgpu.model import GpuInfo, ServerInfo
from rgpu.remoting.pool.rules import AllocationRequest, PoolCore
from rgpu.remoting.pool.store import PoolStore, Store

GiB = 2**30
SECRET = b"s" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def server(n: int, gpus: int = 2) -> ServerInfo:
    return ServerInfo(address=f"127.0.0.1:{55001 + n}", hostname=f"gpu{n}", driver_version="580", cuda_version="13.0",
                      gpus=tuple(GpuInfo(f"GPU-{n}-{i}", i, "NVIDIA H100", 80 * GiB, 80 * GiB, "9.0")
                                 for i in range(gpus)))


def make_core(path: Path, clock: Clock | None = None, servers: int = 2) -> PoolCore:
    core = PoolCore(store=Store(path), secret=SECRET, down_after_seconds=10, clock=clock or Clock())
    for n in range(servers):
        core.register(server(n))
    return core


def req(key: str, count: int = 1, percent: int = 50, user: str = "alice", **kw) -> AllocationRequest:  # type: ignore[no-untyped-def]
    return AllocationRequest(job_key=key, user=user, count=count, percent=percent, **kw)


def pool_state(core: PoolCore) -> tuple[object, ...]:
    """What a pool daemon shows of the state: leases, GPUs (allocation, state), quotas, capacity."""
    return (sorted(core.list_leases(), key=lambda lease: lease.job_key), core.gpu_statuses(), core.quota_usage(),
            core.capacity())


@contextlib.contextmanager
def two_cores(make_store: Callable[[], PoolStore]) -> Iterator[tuple[PoolCore, PoolCore, Clock]]:
    """Two pool cores (what two rgpu-poold, or two processes of one, hold in memory) on one store,
    one clock."""
    clock = Clock()
    cores = [PoolCore(store=make_store(), secret=SECRET, down_after_seconds=1e6, clock=clock,
                      idle_after_seconds=600.0) for _ in range(2)]
    try:
        yield cores[0], cores[1], clock
    finally:
        for core in cores:
            core.store.close()
