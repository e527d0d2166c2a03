"""Room kept for the job at the head of the queue (remoting/pool/backfill.py) and the Slurm
admission that uses it (slurm_plugin/waiting.py, `slurm_keep_room_for_head`). Pool cores on real
SQLite stores, a fake clock."""

from __future__ import annotations

import logging
from pathlib import Path

from rgpu.slurm_plugin.poolhooks import Admission
from rgpu.slurm_plugin.waiting import plan_admission
from tests.poolcore_helpers import Clock, make_core, req
from tests.slurm.pure_helpers import held

S0, S1 = "127.0.0.1:55001", "127.0.0.1:55002"
THREE_WHOLE = "rgpu:v1 nodes=1 count=3 percent=100 units=300"
HALF, QUARTER = "rgpu:v1 nodes=1 count=1 percent=50 units=50", "rgpu:v1 nodes=1 count=1 percent=25 units=25"


def busy_pool(tmp_path: Path):  # type: ignore[no-untyped-def]
    """4 GPUs on 2 servers: an old lease of two halves on server 0, a young quarter beside one of
    them; server 1 empty. A job of three whole GPUs does not fit; it will once the old lease ends,
    on server 1's two GPUs and GPU 1 of server 0."""
    clock = Clock()
    core = make_core(tmp_path / "pool.db", clock=clock, servers=2)
    core.allocate(req("slurm:hpc:1:0:c1", count=2, percent=50))
    clock.now += 5
    core.allocate(req("slurm:hpc:2:0:c1", percent=25))
    return core


def used(core) -> dict[tuple[str, int], int]:  # type: ignore[no-untyped-def]
    return {(g.server, g.gpu.index): g.allocated_percent for g in core.gpu_statuses()}


def test_the_head_jobs_room_is_where_it_goes_once_the_oldest_leases_end(tmp_path: Path) -> None:
    core = busy_pool(tmp_path)
    assert used(core) == {(S0, 0): 75, (S0, 1): 50, (S1, 0): 0, (S1, 1): 0}
    room = core.room_for_head([(3, 100, 0, "", False)])
    assert room == {(S0, "GPU-0-1"), (S1, "GPU-1-0"), (S1, "GPU-1-1")}
    assert core.room_for_head([(1, 100, 0, "", False)]) == {(S1, "GPU-1-0")}        # it fits now: where it goes
    assert core.room_for_head([(4, 100, 0, "", False), (4, 100, 0, "", False)]) == frozenset()   # never, even on an empty pool


def test_younger_jobs_start_only_off_the_head_jobs_room(tmp_path: Path) -> None:
    core = busy_pool(tmp_path)
    jobs = [held(10, THREE_WHOLE), held(11, HALF), held(12, QUARTER)]
    greedy = plan_admission(jobs, core.gpu_statuses(), core.list_leases(), core.fits_in_every_order)
    assert greedy.steps == [(11, ("reserve", "release")), (12, ("reserve", "release"))] and greedy.head is None
    kept = plan_admission(jobs, core.gpu_statuses(), core.list_leases(), core.fits_in_every_order, core.room_for_head)
    room = frozenset({(S0, "GPU-0-1"), (S1, "GPU-1-0"), (S1, "GPU-1-1")})
    assert kept.head == 10 and kept.steps == [(12, ("reserve", "release"))] and kept.avoid == {12: room}


def test_the_admission_reserves_backfill_off_the_head_jobs_room_when_asked(tmp_path: Path) -> None:
    core = busy_pool(tmp_path)
    ran: list[list[str]] = []
    admission = Admission(core, logging.getLogger("test.backfill"), None, ran.append, cluster=lambda: "hpc",
                          keep_room_for_head=True)
    admission.run([held(10, THREE_WHOLE), held(11, HALF), held(12, QUARTER)])
    assert [argv for argv in ran if argv[1] == "release"] == [["scontrol", "release", "12"]]
    assert used(core) == {(S0, 0): 100, (S0, 1): 50, (S1, 0): 0, (S1, 1): 0}   # the quarter went beside the others
    core.release("slurm:hpc:1:0:c1")                                           # the old lease ends
    ran.clear()
    admission.run([held(10, THREE_WHOLE), held(11, HALF)])
    assert [argv for argv in ran if argv[1] == "release"] == [["scontrol", "release", "10"], ["scontrol", "release", "11"]]
    assert used(core) == {(S0, 0): 100, (S0, 1): 100, (S1, 0): 100, (S1, 1): 100}
