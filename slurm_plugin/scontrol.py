"""`scontrol show job -d <id>`: the one Slurm query PrologSlurmctld makes for a job.

Why this and not `squeue --json -j ID`: Slurm 22.05's `squeue --json` ignores job filters and
dumps every job (slow on a big cluster), and `scontrol --json` only exists from 23.02. The text
form of `scontrol show job` asks slurmctld for one job in every version.

Build / run / parse are separate so the parser is tested on captured output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rgpu.slurm_plugin.proc import run_command
from rgpu.slurm_plugin.request import RgpuRequest, parse_comment, parse_tres_per_node

from rgpu.errors import RgpuError

# Keys whose value runs to the end of its line (it may hold spaces and '=').
_WHOLE_LINE_KEYS = ("Comment", "AdminComment", "SystemComment", "Command", "WorkDir", "StdErr",
                    "StdIn", "StdOut", "Reason", "Power", "MailUser", "Extra")
_KEY_RE = re.compile(r"^([A-Za-z_:/]+)=(.*)$")


def show_job_command(job_id: str) -> list[str]:
    return ["scontrol", "show", "job", "-d", str(job_id)]


def parse_show_job(text: str) -> dict[str, str]:
    """Key/value pairs of one job; for a repeated key the first value is kept."""
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


def _user_and_uid(value: str) -> tuple[str, int]:
    # "alice(1000)"
    m = re.match(r"^(.*)\((\d+)\)$", value)
    return (m.group(1), int(m.group(2))) if m else (value, -1)


def _null(value: str) -> str:
    return "" if value in ("(null)", "None") else value


def job_info_from_fields(fields: Mapping[str, str]) -> JobInfo:
    try:
        user, uid = _user_and_uid(fields["UserId"])
        return JobInfo(
            job_id=fields["JobId"], user=user, uid=uid, account=_null(fields.get("Account", "")),
            state=fields.get("JobState", ""), restart_count=int(fields.get("Restarts", "0") or 0),
            node_names=_null(fields.get("NodeList", "")), node_count=int(fields.get("NumNodes", "0").split("-")[0] or 0),
            tres_per_node=_null(fields.get("TresPerNode", "")), comment=_null(fields.get("Comment", "")))
    except (KeyError, ValueError) as exc:
        raise RgpuError("slurm", "cannot read the job from `scontrol show job`", f"missing or bad field {exc}",
                        "check that this Slurm version is supported (22.05 and later)") from None


def query_job(job_id: str, *, env: Mapping[str, str] | None = None, timeout: float = 5.0) -> JobInfo:
    out = run_command(show_job_command(job_id), component="slurm", env=env, timeout=timeout)
    return job_info_from_fields(parse_show_job(out.stdout))


def rgpu_request_of(info: JobInfo, gres_name: str = "rgpu") -> RgpuRequest | None:
    """The job's rgpu request (None when it asked for no rgpu GRES)."""
    count = parse_tres_per_node(info.tres_per_node, gres_name)
    if count is None:
        return None
    return parse_comment(info.comment, count=count)


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
