"""Reservations (remoting/pool/reservations.py): room the admission holds for a Slurm job between
its release and its PrologSlurmctld's Allocate. Pool cores on real SQLite stores, a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from rgpu.errors import CapacityError, InvalidRequest, QuotaExceeded
from rgpu.remoting.pool.reservations import claim_prefixes, reservation_key, reservation_prefix
from rgpu.remoting.pool.rules import PoolCore
from rgpu.remoting.pool.store import Store
from tests.poolcore_helpers import SECRET, Clock, make_core, req, server, two_cores

JOB = "slurm:hpc:42:0:"
WHOLE, HALF, QUARTER = (1, 100, 0, "", False), (1, 50, 0, "", False), (1, 25, 0, "", False)


def gpus_used(core: PoolCore) -> list[int]:
    return [g.allocated_percent for g in core.gpu_statuses()]


def test_reservation_keys_are_told_apart_from_every_lease_key() -> None:
    assert reservation_key(JOB, 1) == "slurm:hpc:42:0:+r1" and reservation_prefix("slurm:hpc:42:0:+r1") == JOB
    assert reservation_prefix("slurm:hpc:42:0:c1") is None and reservation_prefix("x+r1") is None
    assert claim_prefixes("slurm:hpc:42:0:c1") == ["slurm:", "slurm:hpc:", "slurm:hpc:42:", JOB]
    assert claim_prefixes("slurm:hpc:42:0:+r1") == []        # a reservation claims nothing


def test_nobody_makes_a_reservation_through_allocate(tmp_path: Path) -> None:
    """A lease with a reservation's key would leave no usage history and never be released as idle."""
    core = make_core(tmp_path / "pool.db", servers=1)
    for key in ("mine:+r0", "slurm:hpc:42:0:+r1"):
        with pytest.raises(InvalidRequest, match="has the form of a reservation"):
            core.allocate(req(key, percent=50))
    assert core.list_leases() == []


def test_an_allocate_of_the_job_claims_its_reserved_slices(tmp_path: Path) -> None:
    core = make_core(tmp_path / "pool.db", servers=2)
    [reservation] = core.reserve(JOB, "alice", [(2, 50, 0, "", False)], ttl_seconds=30)
    assert reservation.job_key == "slurm:hpc:42:0:+r0" and sum(gpus_used(core)) == 100
    lease = core.allocate(req("slurm:hpc:42:0:c1", count=2, percent=50, account="physics"))
    assert lease.slices == reservation.slices and lease.account == "physics" and lease.expires_unix == 0.0
    assert [le.job_key for le in core.list_leases()] == ["slurm:hpc:42:0:c1"]
    assert sum(gpus_used(core)) == 100 and core.reservations() == {}
    core.release("slurm:hpc:42:0:c1")
    assert [row[0] for row in core.store.dump_history()] == ["slurm:hpc:42:0:c1"]   # the reservation left none


def test_a_pack_node_job_is_reserved_and_checked_on_one_server_or_not_at_all(tmp_path: Path) -> None:
    """pack=node (issue 27): the admission's check, its reservation and the claim keep a node's
    slices on one GPU server. Two servers of two GPUs, one GPU of each full: two half slices fit
    spread, never on one server; found on a real Slurm, where such a job ran spread."""
    core = make_core(tmp_path / "pool.db", servers=2)
    for n in range(2):
        core.allocate(req(f"fill-{n}", percent=100, server=f"gpu{n}"))
    spread, packed = (2, 50, 0, "", False), (2, 50, 0, "", True)
    assert core.fits_in_every_order([spread]) and not core.fits_in_every_order([packed])
    with pytest.raises(CapacityError, match="on one GPU server"):
        core.reserve(JOB, "alice", [packed], ttl_seconds=30)
    assert core.reservations() == {}
    # A spread reservation is not what a same-node Allocate would get: it places anew (and cannot).
    core.reserve(JOB, "alice", [spread], ttl_seconds=30)
    with pytest.raises(CapacityError, match="on one GPU server"):
        core.allocate(req("slurm:hpc:42:0:c1", count=2, percent=50, same_node=True))
    core.drop_reservations(JOB)
    core.release("fill-0")
    [reservation] = core.reserve(JOB, "alice", [packed], ttl_seconds=30)
    assert len({s.server for s in reservation.slices}) == 1
    lease = core.allocate(req("slurm:hpc:42:0:c1", count=2, percent=50, same_node=True))
    assert lease.slices == reservation.slices


def test_other_requests_cannot_take_reserved_room(tmp_path: Path) -> None:
    core = make_core(tmp_path / "pool.db", servers=1)                    # 2 GPUs
    core.reserve(JOB, "alice", [(2, 100, 0, "", False)], ttl_seconds=30)
    for other in (req("manual", percent=25), req("slurm:hpc:43:0:c1", percent=25),
                  req("slurm:hpc:42:1:c1", count=2, percent=100),       # a later attempt of the job: not its room
                  req("slurm:hpc:42:0:c1", count=2, percent=100, user="bob"),     # another user
                  req("slurm:hpc:42:0:c1", count=1, percent=100)):      # another request
        with pytest.raises(CapacityError):
            core.allocate(other)
    assert gpus_used(core) == [100, 100]
    assert core.allocate(req("slurm:hpc:42:0:c1", count=2, percent=100)).units == 200


def test_a_lease_that_ends_after_the_admission_no_longer_moves_the_jobs_placement(tmp_path: Path) -> None:
    """The requeue of issue 23: a job released for a whole GPU, then a lease ends and binpack puts a
    quarter on the GPU that was to be the job's own. With the reservation the quarter goes elsewhere
    (or waits), and the job's Allocate gets the GPU it was admitted for."""
    core = make_core(tmp_path / "pool.db", servers=1)                    # 2 GPUs
    core.allocate(req("slurm:hpc:7:0:c1", percent=50))                 # GPU 0: 50
    [reservation] = core.reserve(JOB, "alice", [WHOLE], ttl_seconds=30)  # GPU 1: the job's
    core.release("slurm:hpc:7:0:c1")                                     # GPU 0 empty again
    assert core.allocate(req("slurm:hpc:8:0:c1", percent=25)).slices[0].gpu_index == 0
    lease = core.allocate(req("slurm:hpc:42:0:c1", percent=100))
    assert lease.slices == reservation.slices and gpus_used(core) == [25, 100]


def test_a_reservation_nobody_claims_expires_and_gives_its_room_back(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "pool.db", clock=clock, servers=1)
    core.reserve(JOB, "alice", [WHOLE, WHOLE], ttl_seconds=30)           # a two-node job

    def later(seconds: float) -> None:
        clock.now += seconds
        core.heartbeat(server(0).address)

    later(20)
    assert [r.expires_unix for r in core.reserve(JOB, "alice", [WHOLE, WHOLE], ttl_seconds=30)] == [clock.now + 30] * 2
    later(29)
    assert gpus_used(core) == [100, 100]
    later(2)
    with pytest.raises(CapacityError):      # an expired reservation is claimed by nobody, not even its job
        core.allocate(req("slurm:hpc:42:0:c1", percent=100, server="gpu0"))
    assert sorted(core.reclaim_expired()) == ["slurm:hpc:42:0:+r0", "slurm:hpc:42:0:+r1"]
    assert gpus_used(core) == [0, 0] and core.store.dump_history() == []
    assert core.allocate(req("manual", count=2, percent=100)).units == 200


def test_a_reservation_is_all_or_nothing_and_dropped_on_request(tmp_path: Path) -> None:
    core = make_core(tmp_path / "pool.db", servers=1)
    with pytest.raises(CapacityError):
        core.reserve(JOB, "alice", [WHOLE, WHOLE, WHOLE], ttl_seconds=30)
    assert gpus_used(core) == [0, 0] and core.list_leases() == []
    core.reserve(JOB, "alice", [HALF, QUARTER], ttl_seconds=30)
    assert core.drop_reservations(JOB) == 2 and gpus_used(core) == [0, 0] and core.drop_reservations(JOB) == 0


def test_a_claim_on_a_server_that_went_down_places_anew(tmp_path: Path) -> None:
    clock = Clock()
    core = make_core(tmp_path / "pool.db", clock=clock, servers=2)
    [reservation] = core.reserve(JOB, "alice", [WHOLE], ttl_seconds=300)
    clock.now += 20                                                      # every server missed heartbeats
    core.heartbeat(server(1 - int(reservation.slices[0].server.endswith("55002"))).address)
    lease = core.allocate(req("slurm:hpc:42:0:c1", percent=100))
    assert lease.slices[0].server != reservation.slices[0].server


def test_a_claim_counts_against_the_quota_once(tmp_path: Path) -> None:
    core = make_core(tmp_path / "pool.db", servers=1)
    core.set_quota("user", "alice", 100)
    core.reserve(JOB, "alice", [WHOLE], ttl_seconds=30)
    assert core.allocate(req("slurm:hpc:42:0:c1", percent=100)).units == 100
    core.reserve("slurm:hpc:43:0:", "alice", [WHOLE], ttl_seconds=30)
    with pytest.raises(QuotaExceeded):
        core.allocate(req("slurm:hpc:43:0:c1", percent=100))
    assert gpus_used(core) == [100, 100]                                 # the reservation is still held


def test_a_reservation_made_by_one_daemon_is_claimed_through_another(tmp_path: Path) -> None:
    with two_cores(lambda: Store(tmp_path / "pool.db", shared=True)) as (a, b, _clock):
        a.register(server(0))
        [reservation] = a.reserve(JOB, "alice", [HALF], ttl_seconds=30)
        with pytest.raises(CapacityError):
            b.allocate(req("other", count=2, percent=75))
        assert b.allocate(req("slurm:hpc:42:0:c1", percent=50)).slices == reservation.slices
        assert a.reservations() == {} and [le.job_key for le in a.list_leases()] == ["slurm:hpc:42:0:c1"]


def test_reservations_survive_a_restart_of_the_pool(tmp_path: Path) -> None:
    core = make_core(tmp_path / "pool.db", servers=1)
    [reservation] = core.reserve(JOB, "alice", [HALF], ttl_seconds=30)
    core.store.close()
    again = PoolCore(store=Store(tmp_path / "pool.db"), secret=SECRET, down_after_seconds=10, clock=core.clock)
    assert again.reservations() == {JOB: [reservation]}
    assert again.allocate(req("slurm:hpc:42:0:c1", percent=50)).slices == reservation.slices
