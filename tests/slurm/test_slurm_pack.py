"""`--comment=...,pack=node` on a real Slurm (issue 27): each node's slices on GPUs of one GPU
server, so NCCL's collectives between a node's ranks stay on that server's NVLink or PCIe. The
session pool's two dispatchers stand for two GPU servers of two GPUs each (examples/inventory-a.toml,
inventory-b.toml); one GPU of each is filled by a lease of the test's own, so two slices per node
fit on no single server until one of those leases ends.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import missing_requirements, wait_until
from tests.slurm.conftest import Harness
from tests.slurm.e2e_helpers import FINISHED, JOB_USER, diagnostics, finished

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))]

FILLS = {"test-pack-fill-a": "demo-gpu-a", "test-pack-fill-b": "demo-gpu-b"}


@pytest.fixture
def one_gpu_of_each_server_full(h: Harness) -> Iterator[Harness]:
    """A whole-GPU lease on one GPU of each server: each server has one GPU with room left."""
    with h.client() as c:
        for key, server in FILLS.items():
            c.allocate(key, "root", 1, percent=100, server=server)
    try:
        yield h
    finally:
        with h.client() as c:
            for key in FILLS:
                c.release(key)


def servers_per_node(h: Harness, job: str) -> dict[str, set[str]]:
    """The GPU servers of each node's lease of `job`, from rgpu-poold's log of the leases it made
    (`lease <key> for <user>: <server>/<gpu>@<percent>%, ...`)."""
    log = h.pool.pool.log() if h.pool.pool else ""
    found: dict[str, set[str]] = {}
    for node, slices in re.findall(rf"lease slurm:rgputest:{job}:0:(\w+) for {JOB_USER}: ([^\n]+)", log):
        found[node] = {s.strip().split("/")[0] for s in slices.split(",")}
    return found


def test_a_two_node_job_without_pack_spreads_each_nodes_slices_over_servers_as_before(
        one_gpu_of_each_server_full: Harness) -> None:
    h = one_gpu_of_each_server_full
    job = h.slurm.submit(["-N", "2", "--gres=rgpu:2", "--comment=fraction=0.5"], "true\n", user=JOB_USER)
    info = finished(h, job, 60)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{diagnostics(h)}"
    placed = servers_per_node(h, job)
    assert len(placed) == 2 and all(len(servers) == 2 for servers in placed.values()), \
        f"{placed}\n{diagnostics(h)}"


def test_a_two_node_pack_job_waits_for_a_server_that_holds_a_nodes_slices_then_gets_them_from_one(
        one_gpu_of_each_server_full: Harness) -> None:
    """The same job with pack=node waits held (a node's two slices fit on no one server; spread
    they would fit) and runs once a server has room for them; each node's slices from one server."""
    h = one_gpu_of_each_server_full
    job = h.slurm.submit(["-N", "2", "--gres=rgpu:2", "--comment=fraction=0.5,pack=node"], "true\n", user=JOB_USER)

    def marked_and_pending() -> dict[str, str] | None:
        shown = h.slurm.show_job(job)
        assert shown.get("JobState") not in FINISHED | {"RUNNING"}, \
            f"the pack=node job ran on slices spread over servers: {servers_per_node(h, job)}\n{diagnostics(h)}"
        return shown if "| rgpu: waiting: " in shown.get("AdminComment", "") else None

    shown = wait_until("the pack=node job to wait, marked", marked_and_pending, 30)
    assert shown["Reason"] == "JobHeldUser" and shown["AdminComment"].startswith(
        "rgpu:v1 nodes=2 count=2 percent=50 units=200 pack=node | rgpu: waiting: "), shown
    time.sleep(3)                         # several admission passes (one per 0.5 s): still waiting
    assert marked_and_pending() is not None
    assert not h.job_leases(job), [le.job_key for le in h.job_leases(job)]
    with h.client() as c:
        c.release("test-pack-fill-a")                     # server A has two GPUs with room now
    info = finished(h, job, 60)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{diagnostics(h)}"
    placed = servers_per_node(h, job)
    assert len(placed) == 2 and all(len(servers) == 1 for servers in placed.values()), \
        f"{placed}\n{diagnostics(h)}"


def test_a_pack_no_server_could_ever_hold_is_cancelled_with_the_reason_the_user_can_read(h: Harness) -> None:
    """Three slices per node with pack=node: job_submit.lua lets it through (4 GPUs in the pool; it
    does not know how they are spread over servers), no server of two GPUs could ever hold it, so
    PrologSlurmctld cancels it, and the job's user reads why with squeue and scontrol."""
    job = h.slurm.submit(["--gres=rgpu:3", "--comment=fraction=0.5,pack=node"], "echo RAN\n", user=JOB_USER)
    info = finished(h, job, 60)
    assert info["JobState"] == "CANCELLED", f"{info}\n{diagnostics(h)}"
    assert "RAN" not in h.slurm.job_output(job) and not h.job_leases(job)
    shown = h.slurm.command(["scontrol", "show", "job", job], user=JOB_USER).stdout
    (comment,) = re.findall(r"AdminComment=(.*)", shown)
    record, _, reason = comment.partition(" | ")
    assert record == "rgpu:v1 nodes=1 count=3 percent=50 units=150 pack=node", comment
    assert reason.startswith("rgpu: refused: prolog-slurmctld: no GPU of the pool can ever hold job "
                             f"{job}'s slices (pool: cannot place 3 slice(s) of fraction 0.5 (same node) on one "
                             "GPU server"), reason
    line = h.slurm.command(["squeue", "-h", "-t", "all", "-j", job, "-O", "State:12,admin_comment:400"],
                           user=JOB_USER).stdout.strip()
    assert line.startswith("CANCELLED") and "rgpu: refused: " in line and "on one GPU server" in line, line
