"""held: a held SlurmJob as squeue reports it, for the tests of the Slurm glue's pure logic."""

from __future__ import annotations

from rgpu.slurm_plugin.squeue import SlurmJob


def waiting(job_id: int, record: str, state: str = "PENDING", reason: str = "BeginTime", restart: int = 1,
            flags: tuple[str, ...] = (), dependency: str = "") -> SlurmJob:
    from rgpu.slurm_plugin.waiting import waiting_comment

    return SlurmJob(job_id=job_id, state=state, flags=flags, restart_count=restart, user="alice", cluster="hpc",
                    nodes="", tres_per_node="gres:rgpu:1", comment="", reason=reason, dependency=dependency,
                    admin_comment=waiting_comment(record, "rgpu: pool: cannot place 1 slice(s) | of 50%\nnext"))


def held(job_id: int, record: str, **kw) -> SlurmJob:  # type: ignore[no-untyped-def]
    """A job as job_submit.lua submits it with hold_until_placed: held by an admin hold, marked."""
    from dataclasses import replace

    return replace(waiting(job_id, record, reason="JobHeldUser", **{"restart": 0, **kw}),
                   admin_comment=record + " | rgpu: waiting: held until the pool can place its slices")
