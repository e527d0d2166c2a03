"""Pure parts of the Slurm integration: host lists, lease keys, reconciler decisions, license plans
and the slurm-config rendering."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from rgpu.slurm_plugin.hostlist import expand_hostlist
from rgpu.slurm_plugin.jobkey import JobKey, job_key, parse_job_key
from rgpu.slurm_plugin.licenses import (
    config_values,
    parse_reservation_licenses,
    parse_show_license,
    plan_reservation,
    render_slurm_config,
)
from rgpu.prolog.epilogs import keys_to_release
from rgpu.slurm_plugin.reconcile import decide
from rgpu.slurm_plugin.squeue import SlurmJob

from rgpu.errors import InvalidRequest
from tests.slurm.pure_helpers import held, waiting


@pytest.mark.parametrize("expr, hosts", [
    ("c1", ["c1"]), ("c[1-3]", ["c1", "c2", "c3"]), ("c[1-2,5]", ["c1", "c2", "c5"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]), ("a[1-2]b[1-2]", ["a1b1", "a1b2", "a2b1", "a2b2"]),
    ("c[1-2],login1,d[3]", ["c1", "c2", "login1", "d3"]), ("", []), ("(null)", []),
])
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["c[1-", "c[a-b]", "c[3-1]", "c]1["])
def test_bad_hostlists_are_refused(expr: str) -> None:
    with pytest.raises(InvalidRequest):
        expand_hostlist(expr)


def test_job_keys_round_trip() -> None:
    key = job_key("hpc", 4242, 1, "c17")
    assert key == "slurm:hpc:4242:1:c17"
    assert parse_job_key(key) == JobKey("hpc", 4242, 1, "c17")
    for other in ("admin-request-1", "slurm:hpc:x:0:c1", "slurm:hpc:1:0", "slurm:hpc:1:0:c1:extra"):
        assert parse_job_key(other) is None
    with pytest.raises(InvalidRequest):
        job_key("hpc", 1, 0, "c1;rm")


@dataclass
class Lease:
    job_key: str
    created_unix: float = 0.0


def sjob(job_id: int, state: str = "RUNNING", restart: int = 0, tres: str = "gres:rgpu:1",
         cluster: str = "hpc", flags: tuple[str, ...] = (), reason: str = "None") -> SlurmJob:
    return SlurmJob(job_id=job_id, state=state, flags=flags, restart_count=restart, user="alice", cluster=cluster,
                    nodes="c1", tres_per_node=tres, comment="", reason=reason)


def test_decide_waits_the_grace_period_then_releases() -> None:
    leases = [Lease("slurm:hpc:1:0:c1"), Lease("slurm:hpc:2:0:c1"), Lease("slurm:other:2:0:c1"), Lease("adhoc")]
    jobs = [sjob(1)]
    first = decide(jobs, leases, cluster="hpc", now=100.0, grace_seconds=30)
    assert first.release == () and first.absent_since == {"slurm:hpc:2:0:c1": 100.0}
    early = decide(jobs, leases, cluster="hpc", now=120.0, grace_seconds=30, absent_since=first.absent_since)
    assert early.release == ()
    late = decide(jobs, leases, cluster="hpc", now=131.0, grace_seconds=30, absent_since=early.absent_since)
    assert late.release == ("slurm:hpc:2:0:c1",) and late.absent_since == {}


def test_decide_never_releases_a_fresh_lease_nor_forgets_a_returning_job() -> None:
    fresh = [Lease("slurm:hpc:5:0:c1", created_unix=200.0)]
    assert decide([], fresh, cluster="hpc", now=210.0, grace_seconds=30, absent_since={"slurm:hpc:5:0:c1": 0.0}).release == ()
    back = decide([sjob(5)], fresh, cluster="hpc", now=300.0, grace_seconds=30, absent_since={"slurm:hpc:5:0:c1": 0.0})
    assert back.release == () and back.absent_since == {}


@pytest.mark.parametrize("job, stale", [
    (sjob(1, state="PENDING", restart=1, flags=("REQUEUED",)), True),     # requeued since
    (sjob(1, state="COMPLETED"), True),
    (sjob(1, state="CANCELLED"), True),
    (sjob(1, state="COMPLETED", flags=("COMPLETING",)), False),         # epilog still to run
    (sjob(1, state="RUNNING"), False),
])
def test_decide_stale_cases(job: SlurmJob, stale: bool) -> None:
    d = decide([job], [Lease("slurm:hpc:1:0:c1")], cluster="hpc", now=1000.0, grace_seconds=0)
    assert d.release == (("slurm:hpc:1:0:c1",) if stale else ())


def test_decide_reports_running_rgpu_jobs_without_lease() -> None:
    jobs = [sjob(1), sjob(2), sjob(3, tres=""), sjob(4, reason="Prolog"), sjob(5, state="PENDING"), sjob(6, cluster="x")]
    d = decide(jobs, [Lease("slurm:hpc:1:0:c1")], cluster="hpc", now=0.0, grace_seconds=0)
    assert d.missing == (2,)


def test_keys_to_release_stop_at_the_restart_count() -> None:
    leases = [Lease(k) for k in ("slurm:hpc:7:0:c1", "slurm:hpc:7:1:c1", "slurm:hpc:7:1:c2", "slurm:hpc:7:2:c1",
                                 "slurm:hpc:70:0:c1", "slurm:x:7:0:c1", "other")]
    assert keys_to_release(leases, "hpc", 7, 1) == ["slurm:hpc:7:0:c1", "slurm:hpc:7:1:c1", "slurm:hpc:7:1:c2"]


@pytest.mark.parametrize("total, healthy, current, action, units", [
    (400, 400, None, "none", 0), (400, 200, None, "create", 200), (400, 200, 200, "none", 200),
    (400, 300, 200, "update", 100), (400, 400, 100, "delete", 0), (400, 0, None, "create", 400),
])
def test_plan_reservation(total: int, healthy: int, current: int | None, action: str, units: int) -> None:
    plan = plan_reservation(total, healthy, current)
    assert (plan.action, plan.units, plan.warning) == (action, units, "")


def test_plan_reservation_warns_when_slurm_has_fewer_units_than_the_pool() -> None:
    plan = plan_reservation(400, 600, None)
    assert plan.action == "none" and "scontrol reconfigure" in plan.warning


def test_parse_license_and_reservation() -> None:
    lic = parse_show_license("LicenseName=rgpu\n    Total=400 Used=150 Free=50 Reserved=200 Remote=no\n")
    assert lic is not None and (lic.total, lic.used, lic.reserved) == (400, 150, 200)
    assert parse_show_license("LicenseName=matlab\n Total=4 Used=0\n") is None
    resv = ("ReservationName=rgpu_capacity StartTime=2026-11-22T03:02:28 EndTime=2027-11-22T03:02:28\n"
            "   Users=root Groups=(null) Accounts=(null) Licenses=matlab:1,rgpu:300 State=ACTIVE\n")
    assert parse_reservation_licenses(resv) == 300
    assert parse_reservation_licenses("Reservation rgpu_capacity not found") is None


def gpu(server: str, memory: int) -> SimpleNamespace:
    return SimpleNamespace(server=server, gpu=SimpleNamespace(usable_memory_bytes=memory))


def test_render_slurm_config_with_live_numbers() -> None:
    values = config_values([gpu("a:1", 80 << 30), gpu("a:1", 80 << 30), gpu("b:1", 40 << 30)], 200, 16,
                           "/usr/libexec/rgpu/")
    text = render_slurm_config(values)
    assert "Licenses=rgpu:300\n" in text and "GresTypes=rgpu\n" in text
    assert "PrologSlurmctld=/usr/libexec/rgpu/rgpu-prolog-slurmctld\n" in text
    assert "Name=rgpu Count=3\n" in text                  # slices per node: at most the GPU count
    assert "max_per_node = 3\n" in text and f"gpu_memory_bytes = {40 << 30}\n" in text
    assert "pool_gpus = 3\nisolated_gpus = 0\nexclusive_gpus = 0\n" in text
    assert "3 GPU(s) on 2 server(s), 200 of 300 GPU-percent healthy" in text
    only = render_slurm_config(values, ("gres.conf",))
    assert only.startswith("# rgpu: lines for gres.conf") and "Licenses" not in only


# ---------------------------------------------------------------- jobs waiting for the pool

def room_gpu(allocated: int, usable: int = 80 << 30, state: str = "up", memory: int | None = None,
             sharing: str = "mps", server: str = "gpu1:7000") -> SimpleNamespace:
    used = usable * allocated // 100 if memory is None else memory
    return SimpleNamespace(server_state=state, gpu=SimpleNamespace(usable_memory_bytes=usable, sharing=sharing),
                           allocated_percent=allocated, allocated_memory_bytes=used, server=server)


def admitted(job_id: int, record: str, reason: str = "Priority", **kw) -> SlurmJob:  # type: ignore[no-untyped-def]
    """Released by rgpu, not yet holding its lease (pending, or in its PrologSlurmctld)."""
    from dataclasses import replace

    return replace(held(job_id, record, **kw), reason=reason)


def lease(job_id: int, restart: int = 0) -> SimpleNamespace:
    return SimpleNamespace(job_key=f"slurm:hpc:{job_id}:{restart}:c1")


def test_held_jobs_are_released_only_into_room_no_released_job_has_taken_yet() -> None:
    """The admission: jobs released but not yet leased (pending, or in PrologSlurmctld) keep their
    room, so the next pass (or an epilog's, at once) never releases a job into the same room."""
    from rgpu.slurm_plugin.waiting import jobs_to_start

    half = "rgpu:v1 nodes=1 count=1 percent=50 units=50"
    whole = "rgpu:v1 nodes=1 count=1 percent=100 units=100"
    two_halves = "rgpu:v1 nodes=1 count=2 percent=50 units=100"
    two_gpus = [room_gpu(0), room_gpu(0)]
    assert jobs_to_start([held(1, whole), held(2, whole), held(3, half)], two_gpus) == [(1, ("reserve", "release")), (2, ("reserve", "release"))]
    for state, flags, reason in (("PENDING", (), "Priority"), ("PENDING", (), "None"), ("PENDING", (), "Resources"),
                                 ("RUNNING", ("CONFIGURING",), "None"), ("RUNNING", (), "Prolog"),
                                 ("CONFIGURING", (), "None")):            # 22.05's squeue --json
        job = admitted(1, whole, state=state, flags=flags, reason=reason)
        assert jobs_to_start([job, held(2, whole), held(3, whole)], two_gpus) == [(2, ("reserve", "release"))], (state, reason)
    # Once its lease is in the pool, the pool's room already shows it: not counted twice.
    running = admitted(1, whole, state="RUNNING", reason="None")
    assert jobs_to_start([running, held(2, whole)], [room_gpu(100), room_gpu(0)], [lease(1)]) == [(2, ("reserve", "release"))]
    assert jobs_to_start([admitted(1, whole), held(2, whole)], [room_gpu(100), room_gpu(0)], [lease(1)]) == [(2, ("reserve", "release"))]
    # A lease of an earlier attempt does not stand for this one.
    assert jobs_to_start([admitted(1, whole, restart=1), held(2, whole)], [room_gpu(0)], [lease(1, 0)]) == []
    # Fragmentation: 160 GPU-percent free as 40 per GPU holds no half-GPU slice; a job waits held.
    assert jobs_to_start([held(1, half)], [room_gpu(60)] * 4) == []
    # Two slices go on two distinct GPUs.
    assert jobs_to_start([held(1, two_halves)], [room_gpu(0), room_gpu(60)]) == []
    assert jobs_to_start([held(1, two_halves)], [room_gpu(50), room_gpu(50)]) == [(1, ("reserve", "release"))]


def test_jobs_rgpu_did_not_hold_or_that_cannot_start_yet_are_left_alone() -> None:
    from dataclasses import replace

    from rgpu.slurm_plugin.waiting import jobs_to_start

    half = "rgpu:v1 nodes=1 count=1 percent=50 units=50"
    free = [room_gpu(0)]
    unmarked = replace(held(1, half), admin_comment=half)                  # an admin's own hold
    assert jobs_to_start([unmarked], free) == []
    assert jobs_to_start([replace(held(1, half), reason="JobHeldAdmin")], free) == []    # an admin hold
    assert jobs_to_start([held(1, half, dependency="afterok:7(unfulfilled)")], free) == []
    # A released job waiting on something else than resources (a dependency) keeps no room.
    assert jobs_to_start([admitted(1, half, reason="Dependency", dependency="afterok:7"), held(2, half)],
                         free) == [(2, ("reserve", "release"))]


def test_a_held_job_no_gpu_could_ever_serve_is_released_for_its_prolog_to_cancel() -> None:
    from rgpu.slurm_plugin.waiting import jobs_to_start

    strict = "rgpu:v1 nodes=1 count=1 percent=50 units=50 isolation=strict"
    assert jobs_to_start([held(1, strict)], [room_gpu(100)] * 2) == [(1, ("release",))]
    assert jobs_to_start([held(1, strict)], [room_gpu(100, sharing="isolated")]) == []     # busy: it waits


def test_waiting_comment_is_one_line_and_keeps_the_record() -> None:
    from rgpu.slurm_plugin.request import parse_record
    from rgpu.slurm_plugin.waiting import waiting_record

    job = waiting(1, "rgpu:v1 nodes=1 count=1 percent=50 units=50")
    assert "\n" not in job.admin_comment and job.admin_comment.count(" | ") == 1
    assert job.admin_comment.startswith("rgpu:v1 nodes=1 count=1 percent=50 units=50 | rgpu: waiting: ")
    assert parse_record(job.admin_comment).units == 50
    assert waiting_record(job.admin_comment) is not None
    assert waiting_record("rgpu:v1 nodes=1 count=1 percent=50 units=50") is None   # not marked: not ours to start


def test_jobs_to_start_counts_each_against_the_free_room() -> None:
    from rgpu.slurm_plugin import waiting as w

    def jobs_to_start(jobs, gpus):  # type: ignore[no-untyped-def]
        return [job_id for job_id, _ in w.jobs_to_start(jobs, gpus)]

    half = "rgpu:v1 nodes=1 count=1 percent=50 units=50"
    two_halves = "rgpu:v1 nodes=1 count=2 percent=50 units=100"
    # Fragmented: 40% free on each of 4 GPUs: nothing fits.
    assert jobs_to_start([waiting(1, half)], [room_gpu(60)] * 4) == []
    # One GPU freed: the oldest waiting half-GPU job, and only one of the two two-slice jobs.
    gpus = [room_gpu(0), room_gpu(60), room_gpu(60), room_gpu(60)]
    assert jobs_to_start([waiting(3, half), waiting(2, half), waiting(4, two_halves)], gpus) == [2, 3]
    assert jobs_to_start([waiting(4, two_halves), waiting(5, two_halves)], gpus) == []
    assert jobs_to_start([waiting(4, two_halves), waiting(5, two_halves)], [room_gpu(0), room_gpu(50), room_gpu(60)]) == [4]
    # Down servers do not count; running jobs are never started again.
    assert jobs_to_start([waiting(1, half)], [room_gpu(0, state="down")]) == []
    assert jobs_to_start([waiting(1, half, state="RUNNING")], [room_gpu(0)]) == []
    # Memory slices need memory, and two nodes need room for both.
    mem = "rgpu:v1 nodes=1 count=1 memory=42949672960 units=50"
    assert jobs_to_start([waiting(1, mem)], [room_gpu(10, memory=60 << 30)]) == []
    assert jobs_to_start([waiting(1, mem)], [room_gpu(10, memory=30 << 30)]) == [1]
    assert jobs_to_start([waiting(1, "rgpu:v1 nodes=2 count=1 percent=60 units=120")], [room_gpu(0), room_gpu(50)]) == []
    assert jobs_to_start([waiting(1, "rgpu:v1 nodes=2 count=1 percent=60 units=120")], [room_gpu(0), room_gpu(40)]) == [1]


def test_waiting_jobs_are_started_only_where_the_pool_would_place_them() -> None:
    """Isolation and exclusive GPUs count: a strict job is never started on free MPS GPUs (it would
    fail again: a requeue loop), a fractional one never on a free exclusive GPU."""
    from rgpu.slurm_plugin import waiting as w

    strict_half = "rgpu:v1 nodes=1 count=1 percent=50 units=50 isolation=strict"
    strict_whole = "rgpu:v1 nodes=1 count=1 percent=100 units=100 isolation=strict"
    half = "rgpu:v1 nodes=1 count=1 percent=50 units=50"
    free_mps = [room_gpu(0)] * 3
    assert w.jobs_to_start([waiting(1, strict_half)], free_mps) == []
    assert w.jobs_to_start([waiting(1, strict_half)], [*free_mps, room_gpu(60, sharing="isolated")]) == []
    assert w.jobs_to_start([waiting(1, strict_half)], [*free_mps, room_gpu(50, sharing="isolated")]) == [(1, ("reserve", "start"))]
    assert w.jobs_to_start([waiting(1, strict_half)], [room_gpu(0, sharing="exclusive")]) == []
    assert w.jobs_to_start([waiting(1, strict_whole)], [room_gpu(0, sharing="exclusive")]) == [(1, ("reserve", "start"))]
    assert w.jobs_to_start([waiting(1, half)], [room_gpu(0, sharing="exclusive")]) == []


def test_never_fits_ignores_what_is_allocated_now() -> None:
    from rgpu.slurm_plugin.request import parse_record
    from rgpu.slurm_plugin.waiting import never_fits, refused_comment

    strict = parse_record("rgpu:v1 nodes=1 count=1 percent=50 units=50 isolation=strict")
    assert never_fits(strict, [room_gpu(0)] * 4)
    assert not never_fits(strict, [room_gpu(100, sharing="isolated", state="down")])   # busy or away: it waits
    two = parse_record("rgpu:v1 nodes=1 count=2 percent=50 units=100")
    assert never_fits(two, [room_gpu(0)]) and not never_fits(two, [room_gpu(90), room_gpu(90)])
    big = parse_record(f"rgpu:v1 nodes=1 count=1 memory={100 << 30} units=100")
    assert never_fits(big, [room_gpu(0)]) and not never_fits(big, [room_gpu(0, usable=141 << 30)])
    # pack=node: a node's slices on GPUs of one server
    packed = parse_record("rgpu:v1 nodes=1 count=2 percent=50 units=100 pack=node")
    split = [room_gpu(0, server="gpu1:7000"), room_gpu(0, server="gpu2:7000")]
    assert never_fits(packed, split) and not never_fits(two, split)
    assert not never_fits(packed, split + [room_gpu(0, server="gpu2:7000")])
    text = refused_comment("rgpu:v1 nodes=1 count=1 percent=50 units=50", "rgpu: prolog-slurmctld: x | y\nz")
    assert text == "rgpu:v1 nodes=1 count=1 percent=50 units=50 | rgpu: refused: prolog-slurmctld: x / y z"
    assert w_record_none(text)


def w_record_none(admin_comment: str) -> bool:
    from rgpu.slurm_plugin.waiting import waiting_record

    return waiting_record(admin_comment) is None     # a refused job is never woken


def test_slurm_integration_is_on_by_default_only_where_slurm_is_configured(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path) -> None:  # type: ignore[no-untyped-def]
    import logging

    from rgpu.config import Settings
    from rgpu.slurm_plugin.poolhooks import slurm_configured, start_from_settings

    defaults = Settings()
    assert defaults.slurm_reconcile_interval_seconds > 0 and defaults.slurm_license_sync
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
    assert "no Slurm configuration" in (slurm_configured() or "")
    off = start_from_settings(object(), defaults, logging.getLogger("t"))      # nothing touches the core
    assert off.reconciler is None and off.license_sync is None
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "not installed" in (slurm_configured() or "")


def test_pyslurm_jobs_are_read_from_their_documented_shapes() -> None:
    from rgpu.slurm_plugin.squeue import backend_for, job_from_pyslurm, tres_from_gres_per_node, SqueueBackend

    assert tres_from_gres_per_node({"rgpu": 2}) == "gres:rgpu:2"
    assert tres_from_gres_per_node({"gpu:a100": 1, "rgpu": 1}) == "gres:gpu:a100:1,gres:rgpu:1"
    assert tres_from_gres_per_node(None) == "" and tres_from_gres_per_node("gres:rgpu:3") == "gres:rgpu:3"
    job = job_from_pyslurm(SimpleNamespace(id=9, state="RUNNING", requeue_count=1, user_name="alice", cluster="hpc",
                                           allocated_nodes="c1", gres_per_node={"rgpu": 2}, comment="fraction=0.5",
                                           state_reason="None", admin_comment="rgpu:v1 nodes=1 count=2 percent=50 units=100"))
    assert (job.rgpu_count(), job.restart_count, job.running, job.admin_comment) == (
        2, 1, True, "rgpu:v1 nodes=1 count=2 percent=50 units=100")
    assert isinstance(backend_for("auto"), SqueueBackend)   # pyslurm only when chosen


def test_demo_never_shows_whole_lease_tokens() -> None:
    from rgpu.slurm_plugin.demo import without_tokens

    text = '[[slice]]\nserver = "h:1"\ntoken = "v1.abcdefghijklmnopqrstuvwxyz0123456789"\n'
    shown = without_tokens(text)
    assert "abcdefghijklmnop" not in shown and 'token = "v1.abcdefghi..."' in shown and 'server = "h:1"' in shown


def test_a_job_slurm_held_after_repeated_requeues_is_released_when_it_fits() -> None:
    from rgpu.slurm_plugin.waiting import jobs_to_start

    half = "rgpu:v1 nodes=1 count=1 percent=50 units=50"
    jobs = [waiting(1, half, reason="JobHoldMaxRequeue"), waiting(2, half)]
    assert jobs_to_start(jobs, [room_gpu(0)]) == [(1, ("reserve", "release", "start")), (2, ("reserve", "start"))]


def test_a_job_over_its_quota_is_marked_but_not_started_early() -> None:
    from rgpu.slurm_plugin.waiting import jobs_to_start, waiting_comment, waiting_record

    text = waiting_comment("rgpu:v1 nodes=1 count=1 percent=50 units=50",
                           "rgpu: pool: quota of user alice exceeded (uses 100 of 100)")
    assert " | rgpu: waiting for quota: rgpu: pool: quota of user alice" in text and waiting_record(text) is None
    job = SlurmJob(job_id=1, state="PENDING", flags=(), restart_count=1, user="alice", cluster="hpc", nodes="",
                   tres_per_node="gres:rgpu:1", comment="", reason="BeginTime", admin_comment=text)
    assert jobs_to_start([job], [room_gpu(0)]) == []


# ---------------------------------------------------------------- Slurm versions

@pytest.mark.parametrize("version, prefix, split", [
    ("22.05", "gres:", False), ("23.02", "gres:", False), ("23.11", "gres/", False), ("24.11", "gres/", False),
    ("26.05", "gres/", True), ("", "gres/", False),
])
def test_slurm_config_lines_follow_the_slurm_version(version: str, prefix: str, split: bool) -> None:
    values = config_values([gpu("a:1", 80 << 30)], 100, 16, "/opt/rgpu", slurm_version=version)
    text = render_slurm_config(values, ("slurm.conf",))
    assert f"TresPerNode={prefix}rgpu:N" in text
    assert ("PrologTimeout=20\nEpilogTimeout=30\n" in text) == split
    assert ("PrologEpilogTimeout=30\n" in text) == (not split)
    assert "AccountingStorageTRES=gres/rgpu,license/rgpu\n" in text      # "gres/" there in every version
    # A job rgpu-poold releases starts within about a second, not Slurm's default 3 s.
    assert "\nSchedulerParameters=batch_sched_delay=1\n" in text
    assert (f"for Slurm {version})" in text) == bool(version)


@pytest.mark.parametrize("text, version", [
    ("slurm 24.11.5\n", "24.11"), ("slurm-wlm 22.05.8\n", "22.05"), ("slurm 26.05.5\n", "26.05"),
    ("scontrol: fatal: Could not establish a configuration source\n", ""),
])
def test_versions_are_read_from_version_output(text: str, version: str) -> None:
    from rgpu.slurm_plugin.versions import parse_version_output

    assert parse_version_output(text) == version


def test_roots_are_keyed_by_suite_mirror_and_packages_and_use_the_hosts_mirror() -> None:
    from rgpu.slurm_plugin.slurmroot import DEFAULT_MIRROR, PACKAGES, mirror_from_sources, root_key

    deb822 = "Types: deb\n# http://snapshot.debian.org/x\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
    assert mirror_from_sources([deb822]) == "http://mirror.example/debian"
    assert mirror_from_sources(["deb [arch=amd64] http://m.example/debian/ bookworm main\n"]) == "http://m.example/debian"
    assert mirror_from_sources(["deb https://packages.cloud.google.com/apt cloud-sdk main\n"]) == DEFAULT_MIRROR
    key = root_key("trixie", DEFAULT_MIRROR)
    assert key.startswith("trixie-") and key == root_key("trixie", DEFAULT_MIRROR, tuple(reversed(PACKAGES)))
    assert key != root_key("trixie", DEFAULT_MIRROR, (*PACKAGES, "python3"))
    assert key != root_key("trixie", "http://mirror.example/debian")


def test_pyslurm_backend_without_a_usable_pyslurm_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from rgpu.errors import RgpuError
    from rgpu.slurm_plugin.squeue import backend_for

    monkeypatch.setitem(sys.modules, "pyslurm", None)     # as where none is installed
    with pytest.raises(RgpuError) as info:
        backend_for("pyslurm")
    text = str(info.value)
    assert text.startswith("rgpu: slurm: slurm_backend = pyslurm, but pyslurm cannot be imported (")
    assert "\n" not in text and "slurm_backend = auto" in text and "25.11" in text


def test_the_mixed_batchs_ideal_counts_rounds_of_jobs_started_as_soon_as_they_fit() -> None:
    from benchmarks.slurm_mixed_batch import batch, ideal_rounds

    assert ideal_rounds([(1, "1.0")] * 4) == 1 and ideal_rounds([(1, "1.0")] * 5) == 2
    assert ideal_rounds([(2, "0.5")] * 4) == 1 and ideal_rounds([(2, "1.0"), (1, "0.25"), (2, "1.0")]) == 2
    assert ideal_rounds(batch()) == 5          # 1,650 GPU-percent of jobs on 400: at least 5 rounds


def test_a_released_job_a_lease_end_left_without_room_is_held_again_before_it_starts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Found in the mixed batch: jobs 10, 9, 16 (2x0.25, 1x1.0, 2x0.25) released, not yet leased,
    then 15 (1x1.0): all four fit in every order. Then job 13's lease ends, and binpack puts the
    whole-GPU job on the GPU 13 left and both 2x0.25 on the other server: no whole GPU for 15. The
    next pass holds the youngest job Slurm has not started again (a job in PrologSlurmctld cannot be)."""
    from rgpu.slurm_plugin.waiting import jobs_to_start
    from tests.poolcore_helpers import make_core, req

    core = make_core(tmp_path / "pool.db", servers=2)                  # 2 servers x 2 GPUs
    core.allocate(req("slurm:hpc:20:0:c1", percent=50))              # GPU 0 of server 0: 50%
    core.allocate(req("filler", percent=60, server="127.0.0.1:55001"))
    core.allocate(req("slurm:hpc:13:0:c1", percent=25, server="127.0.0.1:55001"))   # GPU 1: 25%
    core.release("filler")
    whole, quarters = "rgpu:v1 nodes=1 count=1 percent=100 units=100", "rgpu:v1 nodes=1 count=2 percent=25 units=50"
    jobs = [admitted(10, quarters), admitted(9, whole, state="CONFIGURING", reason="None"),
            admitted(16, quarters), admitted(15, whole)]

    def look() -> list[tuple[int, tuple[str, ...]]]:
        leases = core.list_leases()
        return jobs_to_start(jobs, core.gpu_statuses(), leases, core.fits_in_every_order)

    assert look() == []                                                 # all four fit: nothing to do
    core.release("slurm:hpc:13:0:c1")
    assert look() == [(15, ("hold",))]
    jobs[3] = held(15, whole)                                           # held again and marked
    assert look() == []                                                 # it waits
    core.release("slurm:hpc:20:0:c1")
    assert look() == [(15, ("reserve", "release"))]


def test_a_job_held_again_is_marked_first_then_given_a_user_hold() -> None:
    """Marked first, so a held job always carries the mark rgpu releases it by; a job Slurm started
    meanwhile fails the hold and is unmarked again."""
    import logging

    from rgpu.errors import RgpuError
    from rgpu.slurm_plugin.waiting import start_waiting_jobs, waiting_record

    whole = "rgpu:v1 nodes=1 count=1 percent=100 units=100"
    ran: list[list[str]] = []

    def scontrol(argv: list[str]) -> None:
        ran.append(argv)
        if argv[:2] == ["scontrol", "uhold"] and argv[2] == "2":
            raise RgpuError("slurm", "`scontrol uhold 2` exited 1", "Job has already started", "")

    jobs = [admitted(1, whole), admitted(2, whole)]
    started = start_waiting_jobs(jobs, [room_gpu(0)], logging.getLogger("test.waiting"), scontrol=scontrol,
                                 fits=lambda requests, first=None: len(requests) <= 0)
    assert started == []
    assert [argv[:3] for argv in ran] == [["scontrol", "update", "jobid=2"], ["scontrol", "uhold", "2"],
                                          ["scontrol", "update", "jobid=2"],     # started meanwhile: unmarked
                                          ["scontrol", "update", "jobid=1"], ["scontrol", "uhold", "1"]]
    assert ran[2][3] == f"admincomment={whole}"
    assert waiting_record(ran[3][3].split("=", 1)[1]) is not None      # the mark rgpu releases it by


def test_a_released_job_no_gpu_could_ever_serve_is_not_held_again_and_takes_no_room(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """It was released for its PrologSlurmctld to cancel with the reason: holding it again would
    keep it waiting for ever, and counting it would keep every other job waiting."""
    from rgpu.slurm_plugin.waiting import jobs_to_start
    from tests.poolcore_helpers import make_core

    core = make_core(tmp_path / "pool.db", servers=1)                   # GPUs shared by MPS
    strict = "rgpu:v1 nodes=1 count=1 percent=50 units=50 isolation=strict"
    jobs = [admitted(1, strict), held(2, "rgpu:v1 nodes=1 count=2 percent=50 units=100")]
    assert jobs_to_start(jobs, core.gpu_statuses(), [], core.fits_in_every_order) == [(2, ("reserve", "release"))]


def test_the_admission_reserves_a_released_jobs_room_and_its_allocate_claims_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The requeue window of issue 23: a job released into the one whole GPU left; right after, a
    lease ends and another request (2 half GPUs) would take that GPU and the freed one, and the
    job's PrologSlurmctld would find no room. The admission reserves the job's placement before it
    releases the job: the request is refused, and the job's Allocate gets the reserved GPU."""
    import logging

    import pytest as _pytest

    from rgpu.errors import CapacityError
    from rgpu.slurm_plugin.poolhooks import Admission
    from tests.poolcore_helpers import make_core, req

    core = make_core(tmp_path / "pool.db", servers=1)                   # 2 GPUs
    core.allocate(req("slurm:hpc:7:0:c1", percent=50))                # GPU 0: 50
    ran: list[list[str]] = []
    admission = Admission(core, logging.getLogger("test.admission"), None, ran.append, cluster=lambda: "hpc")
    whole = "rgpu:v1 nodes=1 count=1 percent=100 units=100"
    admission.run([held(15, whole)])
    assert ran[0] == ["scontrol", "release", "15"]
    assert [le.job_key for le in core.list_leases()] == ["slurm:hpc:7:0:c1", "slurm:hpc:15:0:+r0"]
    core.release("slurm:hpc:7:0:c1")                                    # a lease ends
    with _pytest.raises(CapacityError):
        core.allocate(req("manual", count=2, percent=50))
    lease = core.allocate(req("slurm:hpc:15:0:c1", percent=100))       # its PrologSlurmctld
    assert lease.slices[0].gpu_index == 1 and [le.job_key for le in core.list_leases()] == ["slurm:hpc:15:0:c1"]


def test_reservations_are_renewed_while_their_job_is_let_go_and_given_back_when_it_is_not(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import logging
    from dataclasses import replace

    from rgpu.slurm_plugin.poolhooks import Admission
    from rgpu.slurm_plugin.waiting import reservation_upkeep
    from tests.poolcore_helpers import Clock, make_core, server

    clock = Clock()
    core = make_core(tmp_path / "pool.db", clock=clock, servers=1)
    half = "rgpu:v1 nodes=1 count=1 percent=50 units=50"
    admission = Admission(core, logging.getLogger("test.admission"), None, lambda argv: None, cluster=lambda: "hpc",
                          reservation_seconds=30)
    admission.run([held(1, half), held(2, half), held(3, half)])
    assert len(core.reservations()) == 3
    jobs = [replace(admitted(1, half), admin_comment=half),                       # let go, pending
            replace(admitted(2, half, state="RUNNING"), admin_comment=half),      # past its prologs
            replace(held(3, half), reason="JobHeldAdmin")]                        # held by an admin
    keep, drop = reservation_upkeep(jobs, core.list_leases())
    assert [j.job_id for j in keep] == [1] and drop == [(2, 0), (3, 0)]
    clock.now += 20
    core.heartbeat(server(0).address)
    admission.run(jobs)
    assert {p: [r.expires_unix for r in rs] for p, rs in core.reservations().items()} == {"slurm:hpc:1:0:": [clock.now + 30]}
    # A requeued attempt's reservation goes too; one of a job gone from Slurm is the reconciler's.
    assert reservation_upkeep([replace(jobs[0], restart_count=1)], core.list_leases()) == ([], [(1, 0)])
    assert reservation_upkeep([replace(jobs[0], state="CANCELLED")], core.list_leases()) == ([], [(1, 0)])
    assert reservation_upkeep([], core.list_leases()) == ([], [])


def test_jobs_one_pass_reserves_are_placed_in_turn_so_the_first_round_fills_the_pool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The mixed batch on 4 empty GPUs: the jobs one pass lets go are reserved one after the other,
    so they are checked in that order, not in every order their prologs might ask in (which let 5
    of the 7 jobs that fit go, and the other two only once the first leases were in)."""
    from benchmarks.slurm_mixed_batch import batch
    from rgpu.slurm_plugin.waiting import jobs_to_start
    from tests.poolcore_helpers import make_core

    core = make_core(tmp_path / "pool.db", servers=2)
    jobs = [held(i + 1, f"rgpu:v1 nodes=1 count={n} percent={round(100 * float(f))} "
                        f"units={n * round(100 * float(f))}") for i, (n, f) in enumerate(batch())]
    chosen = jobs_to_start(jobs, core.gpu_statuses(), [], core.fits_in_every_order)
    assert [job_id for job_id, _ in chosen] == [1, 2, 3, 4, 5, 7, 10]
    assert sum(int(jobs[i - 1].admin_comment.split("units=")[1].split()[0]) for i, _ in chosen) == 400


def test_the_batch_trace_times_each_hand_over_from_the_ended_jobs_end() -> None:
    """benchmarks/slurm_batch_trace.py on lines shaped as 22.05's slurmctld, rgpu-poold and the
    scripts' wrappers write them: job 1 ends, its lease goes, the pool lets job 2 go (slurmctld's
    `release hold` line is when; the pool's own line comes after it unmarked the jobs)."""
    import datetime

    from benchmarks.slurm_batch_trace import parse, report, transitions

    def epoch(clock: str) -> float:
        return datetime.datetime.fromisoformat(f"2026-11-28T10:00:{clock}").timestamp()

    slurmctld = ["[2026-11-28T10:00:00.101] sched: _release_job_rec: release hold on JobId=1 by uid 0",
                 "[2026-11-28T10:00:00.300] sched/backfill: _start_job: Started JobId=1 in cpu on c1",
                 "[2026-11-28T10:00:05.000] _job_complete: JobId=1 WEXITSTATUS 0",
                 "[2026-11-28T10:00:05.000] _job_complete: JobId=1 done",
                 "[2026-11-28T10:00:05.551] sched: _release_job_rec: release hold on JobId=2 by uid 0",
                 "[2026-11-28T10:00:06.050] sched: Allocate JobId=2 NodeList=c1 #CPUs=1 Partition=cpu"]
    pool = ["2026-11-28 10:00:00,100 rgpu: slurm: the pool can place waiting job(s) 1 now: released",
            "2026-11-28 10:00:00,900 rgpu-poold: lease slurm:rgputest:1:0:c1 for nobody: 127.0.0.1:1/0@100%",
            "2026-11-28 10:00:05,500 rgpu-poold: released lease slurm:rgputest:1:0:c1",
            "2026-11-28 10:00:05,550 rgpu: slurm: the pool can place waiting job(s) 2, 3 now: released"]
    trace = [f"EpilogSlurmctld start 1 {epoch('05.010')}", f"Epilog start 1 {epoch('05.020')}",
             f"Epilog end 1 {epoch('05.300')}", f"EpilogSlurmctld end 1 {epoch('05.600')}", "garbage line"]
    found = transitions(parse(slurmctld, pool, trace))
    assert [(t.ended, t.released) for t in found] == [(1, 2)]      # job 3 never started; job 1: first pass
    assert {k: round(v, 3) for k, v in found[0].stages.items()} == {
        "EpilogSlurmctld start": 0.01, "lease released": 0.5, "job released": 0.551, "EpilogSlurmctld end": 0.6,
        "Epilog end": 0.3, "job started": 1.05}
    assert "    1 ->   2: 0.01, 0.50, 0.55, 0.60, 0.30, 1.05" in report(found)


def test_pack_node_takes_a_nodes_slices_from_one_server_the_fullest_that_holds_them() -> None:
    from rgpu.slurm_plugin.request import parse_record
    from rgpu.slurm_plugin.waiting import rooms, take

    packed = parse_record("rgpu:v1 nodes=2 count=2 percent=50 units=200 pack=node")
    gpus = rooms([room_gpu(0, server="a"), room_gpu(40, server="b"), room_gpu(40, server="b"), room_gpu(0, server="c"),
                  room_gpu(0, server="c")])
    assert take(packed, gpus)          # node 1 on b (the fullest that holds two), node 2 on c; a has one GPU
    assert [g.free_percent for g in gpus] == [100, 10, 10, 50, 50]
    assert not take(packed, gpus) and [g.free_percent for g in gpus] == [100, 10, 10, 50, 50]   # unchanged
