"""The one Slurm query PrologSlurmctld makes for a job, read from structured output only.

A job's name, comment, work dir and other user-controlled fields may hold any text, including
`Key=value` pairs and newlines, so the text of `scontrol show job` is never searched for keys:
the job is read from JSON. `scontrol --json show job ID` asks for one job (Slurm 23.02 and
later); Slurm 22.05 has no `scontrol --json` (it exits 1: "unrecognized option"), and its
`squeue --json` ignores `-j` and prints every job, from which this job is picked by id.

The request itself comes from the job's admin comment (job_submit.lua records it there; only
Slurm and admins write it) and is checked against the job's GRES, node count and license
(`plan_from_job` in prolog/logic.py).

Build / run / parse are separate so the parser is tested on captured output.
`parse_show_job` (key search) remains only for the test harness's state polling.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rgpu.slurm_plugin.proc import run_command
from rgpu.slurm_plugin.squeue import _admin_comment, _number, _state, _text

from rgpu.errors import RgpuError

# Keys whose value runs to the end of its line (it may hold spaces and '=').
_WHOLE_LINE_KEYS = ("Comment", "AdminComment", "SystemComment", "Command", "WorkDir", "StdErr",
                    "StdIn", "StdOut", "Reason", "Power", "MailUser", "Extra", "SubmitLine")
_KEY_RE = re.compile(r"^([A-Za-z_:/]+)=(.*)$")


def show_job_json_command(job_id: str) -> list[str]:
    return ["scontrol", "--json", "show", "job", str(int(job_id))]


def squeue_json_command() -> list[str]:
    return ["squeue", "--json"]


def parse_show_job(text: str) -> dict[str, str]:
    """Key/value pairs of one job by key search: for the test harness only, never for a decision."""
    fields: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        whole = next((k for k in _WHOLE_LINE_KEYS if line.startswith(k + "=")), None)
        if whole is not None and " " in line.split("=", 1)[1].strip():
            fields.setdefault(whole, line.split("=", 1)[1].rstrip())
            continue
        for token in line.split():
            m = _KEY_RE.match(token)
            if m:
                fields.setdefault(m.group(1), m.group(2))
    return fields


@dataclass(frozen=True)
class JobInfo:
    """What the prologs need to know about one job."""

    job_id: str
    user: str
    uid: int
    account: str
    state: str
    restart_count: int
    node_names: str          # Slurm host list expression, e.g. "c[1-2]"
    node_count: int
    tres_per_node: str
    comment: str
    admin_comment: str = ""  # the request record job_submit.lua wrote (only Slurm/admins write it)
    licenses: str = ""       # e.g. "rgpu:100" (job_submit.lua sets the rgpu entry)
    batch: bool = True       # False for srun/salloc: no requeue, the user waits on a terminal


def job_info_from_json(raw: Mapping[str, Any]) -> JobInfo:
    """One job object of `scontrol --json show job` / `squeue --json` (22.05 to 24.x shapes)."""
    state, _ = _state(raw.get("job_state"))
    return JobInfo(job_id=str(_number(raw.get("job_id"))), user=_text(raw.get("user_name")),
                   uid=_number(raw.get("user_id"), -1), account=_text(raw.get("account")), state=state,
                   restart_count=_number(raw.get("restart_cnt")), node_names=_text(raw.get("nodes")),
                   node_count=_number(raw.get("node_count")), tres_per_node=_text(raw.get("tres_per_node")),
                   comment=_text(raw.get("comment")), admin_comment=_admin_comment(raw),
                   licenses=_text(raw.get("licenses")), batch=bool(raw.get("batch_flag", True)))


def notify_command(job_id: int, message: str) -> list[str]:
    """`scontrol notify`: slurmctld sends the message to the job's srun/salloc, which prints it."""
    return ["scontrol", "notify", str(int(job_id)), message]


def requeue_command(job_id: int) -> list[str]:
    """`scontrol requeue`: the job goes back to PENDING (a new restart count) and runs again later."""
    return ["scontrol", "requeue", str(int(job_id))]


def parse_jobs_json(text: str, command: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RgpuError("slurm", f"`{command}` printed something that is not JSON", str(exc),
                        "run it by hand; Slurm 22.05 or later is needed") from None
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        raise RgpuError("slurm", f"`{command}` reported errors", json.dumps(errors)[:300], "check slurmctld and its log")
    jobs = data.get("jobs") or []
    return [j for j in jobs if isinstance(j, dict)]


def find_job(jobs: list[dict[str, Any]], job_id: str, command: str) -> JobInfo:
    found = [j for j in jobs if str(_number(j.get("job_id"))) == str(int(job_id))]
    if len(found) != 1:
        raise RgpuError("slurm", f"`{command}` shows {len(found)} jobs with id {job_id}", "expected exactly one",
                        "check that the job still exists (scontrol show job)")
    return job_info_from_json(found[0])


def query_job(job_id: str, *, env: Mapping[str, str] | None = None, timeout: float = 5.0) -> JobInfo:
    """The job from `scontrol --json show job` (23.02+), else from `squeue --json` (22.05)."""
    argv = show_job_json_command(job_id)
    out = run_command(argv, component="slurm", env=env, timeout=timeout, check=False)
    if out.returncode != 0 and ("unrecognized option" in out.stderr or "invalid option" in out.stderr):
        argv = squeue_json_command()
        out = run_command(argv, component="slurm", env=env, timeout=timeout)
    elif out.returncode != 0:
        out = run_command(argv, component="slurm", env=env, timeout=timeout)   # raises with the full context
    command = " ".join(argv)
    return find_job(parse_jobs_json(out.stdout, command), job_id, command)


def parse_show_config(text: str) -> dict[str, str]:
    """`scontrol show config` lines `Name   = value`."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() and " " not in name.strip():
            out.setdefault(name.strip(), value.strip())
    return out


def cluster_name(env: Mapping[str, str] | None = None, timeout: float = 10.0) -> str:
    out = run_command(["scontrol", "show", "config"], component="slurm", env=env, timeout=timeout)
    name = parse_show_config(out.stdout).get("ClusterName", "")
    if not name:
        raise RgpuError("slurm", "`scontrol show config` names no ClusterName", "",
                        "set ClusterName in slurm.conf")
    return name
