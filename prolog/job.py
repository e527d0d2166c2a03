"""The job as Slurm's prolog/epilog environment describes it. Pure, and light on imports: the
EpilogSlurmctld reads it before its release, which Slurm waits on (release.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rgpu.slurm_plugin.hostlist import expand_hostlist
from rgpu.slurm_plugin.jobkey import job_key

from rgpu.errors import ConfigError, InvalidRequest
from rgpu.paths import ENDED_SUFFIX


def env_value(env: Mapping[str, str], name: str, context: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ConfigError(context, f"${name} is not set", "this script must be run by Slurm",
                          f"configure it in slurm.conf, not by hand (or export {name} to test it)")
    return value


def _null(value: str | None) -> str:
    return "" if value in (None, "(null)") else str(value)


@dataclass(frozen=True)
class JobContext:
    """The job as Slurm's prolog/epilog environment describes it."""

    cluster: str
    job_id: int
    restart_count: int
    user: str = ""
    uid: int = -1
    gid: int = -1
    account: str = ""
    nodes: tuple[str, ...] = ()
    node: str = ""              # this node (node Prolog/Epilog only)

    @classmethod
    def from_env(cls, env: Mapping[str, str], context: str) -> JobContext:
        job_id = env_value(env, "SLURM_JOB_ID", context)
        if not job_id.isdigit():
            raise InvalidRequest(context, f"$SLURM_JOB_ID is {job_id!r}", "not a job number", "")
        restart = env.get("SLURM_JOB_RESTART_COUNT", "0") or "0"
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        uid, gid = env.get("SLURM_JOB_UID", ""), env.get("SLURM_JOB_GID", "")
        return cls(cluster=env_value(env, "SLURM_CLUSTER_NAME", context), job_id=int(job_id),
                   restart_count=int(restart) if restart.isdigit() else 0,
                   user=_null(env.get("SLURM_JOB_USER")), uid=int(uid) if uid.isdigit() else -1,
                   gid=int(gid) if gid.isdigit() else -1, account=_null(env.get("SLURM_JOB_ACCOUNT")),
                   nodes=tuple(expand_hostlist(nodes)), node=env.get("SLURMD_NODENAME", ""))

    def key_for(self, node: str) -> str:
        return job_key(self.cluster, self.job_id, self.restart_count, node)


def job_dir(run_dir: Path, job_id: int) -> Path:
    return run_dir / str(int(job_id))


def ended_mark(run_dir: Path, job_id: int) -> Path:
    """Where the node Epilog records that an rgpu job ran here (rgpu.paths.ENDED_SUFFIX)."""
    return run_dir / f"{int(job_id)}{ENDED_SUFFIX}"
