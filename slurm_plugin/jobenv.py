"""What the environment Slurm gives a prolog or epilog says about rgpu, read without asking
anything: a job that asked for no rgpu must cost nothing beyond this (no Slurm query, no pool
call). Pure, and imports only `re`, so the prologs' fast path starts in a few milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

LICENSE_NAME = "rgpu"


def license_units(licenses: str | None, name: str = LICENSE_NAME) -> int | None:
    """Units of license `name` in a job's license list, as Slurm shows it and hands the slurmctld
    prologs in $SLURM_JOB_LICENSES ("matlab:1,rgpu:100"; '*' also separates); None: not held."""
    for entry in (licenses or "").split(","):
        lic, _, count = entry.strip().replace("*", ":").partition(":")
        if lic == name:
            return int(count) if count.isdigit() else 1
    return None


def holds_rgpu_license(env: Mapping[str, str]) -> bool:
    """Whether the job holds the rgpu license, from $SLURM_JOB_LICENSES, which slurmctld hands
    PrologSlurmctld and EpilogSlurmctld (22.05, 24.11, 26.05; unset when the job holds none).
    job_submit.lua adds the license to every rgpu job and lets no one remove it."""
    return license_units(env.get("SLURM_JOB_LICENSES"), LICENSE_NAME) is not None


# job_submit.lua writes a size word into the comment of every rgpu job (`fraction=1` when the
# user gave none), so a node Prolog, which Slurm tells neither the licenses nor the GRES, can pass
# over a job whose comment has none without asking the pool.
_SIZE_WORD_RE = re.compile(r"(?:^|[ ,])(?:fraction|memory)=", re.IGNORECASE)


def comment_may_ask_rgpu(comment: str | None) -> bool:
    """False: the job's comment ($SLURM_JOB_COMMENT) has no fraction= or memory= word, so the job
    is not an rgpu job (job_submit.lua puts one in every rgpu job's comment). Pure."""
    return bool(_SIZE_WORD_RE.search(comment or ""))
