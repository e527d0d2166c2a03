"""Live Slurm jobs for the reconciler, behind one small interface with two backends.

- `SqueueBackend`: `squeue --json`, parsed in both shapes seen in the field: Slurm 22.05-23.02
  (`job_state` a string, plain numbers) and 23.11/24.x (`job_state` a list of the base state and
  flags, numbers as `{"set", "infinite", "number"}` objects). Build / run / parse are separate;
  the parser is tested on tests/data/squeue-*.json.
- `PyslurmBackend`: pyslurm when importable (`pip install rgpu[pyslurm]`; its version must
  match Slurm's, so it is optional).

`backend_for(prefer)`: "auto" and "squeue" use squeue (the backend tested on a real cluster);
"pyslurm" must be chosen explicitly (its job records are mapped from pyslurm's documented
shapes, `gres_per_node` a dict, and tested on those shapes only).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rgpu.slurm_plugin.proc import run_command
from rgpu.slurm_plugin.request import parse_tres_per_node

from rgpu.errors import RgpuError

# Base states of a job that holds (or may soon hold) its allocation.
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED",
                         "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})
BASE_STATES = frozenset({"PENDING", "RUNNING", "SUSPENDED", "COMPLETE", "COMPLETED", "CANCELLED", "FAILED",
                         "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    state: str                 # base state, e.g. "RUNNING"
    flags: tuple[str, ...]     # state flags, e.g. ("COMPLETING",) (24.x lists them with the state)
    restart_count: int
    user: str
    cluster: str
    nodes: str                 # host list expression, "" while pending
    tres_per_node: str
    comment: str
    reason: str = ""           # state_reason, e.g. "Licenses", "Prolog"
    admin_comment: str = ""    # job_submit.lua's request record (waiting.py adds a mark)
    dependency: str = ""       # dependencies not yet satisfied ("" none)

    @property
    def live(self) -> bool:
        """Could hold an rgpu lease now or after requeue: not finished, or still completing."""
        return self.state in LIVE_STATES or "COMPLETING" in self.flags or "CONFIGURING" in self.flags

    @property
    def running(self) -> bool:
        """Running with its prologs done (22.05 shows a job in PrologSlurmctld as RUNNING/Prolog)."""
        return self.state == "RUNNING" and "CONFIGURING" not in self.flags and self.reason != "Prolog"

    def rgpu_count(self, gres_name: str = "rgpu") -> int | None:
        try:
            return parse_tres_per_node(self.tres_per_node, gres_name)
        except RgpuError:
            return None


class JobSource(Protocol):
    """What the reconciler needs from Slurm."""

    def live_jobs(self) -> list[SlurmJob]: ...


# ---------------------------------------------------------------- parsing (pure)

def _number(value: Any, default: int = 0) -> int:
    """A plain number (22.05) or a `{set, infinite, number}` object (23.11+)."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return default
        value = value.get("number", default)
    if isinstance(value, bool) or value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):     # 23.11+ puts some strings in objects (e.g. comment.job)
        return _text(value.get("job", ""))
    return "" if str(value) == "(null)" else str(value)


def _state(value: Any) -> tuple[str, tuple[str, ...]]:
    """(base state, flags) from "RUNNING" (22.05) or ["RUNNING", "COMPLETING"] (24.x)."""
    words = [str(v) for v in value] if isinstance(value, list) else [str(value or "")]
    base = next((w for w in words if w in BASE_STATES), words[0] if words else "")
    return base, tuple(w for w in words if w != base)


def parse_job(raw: Mapping[str, Any]) -> SlurmJob:
    state, flags = _state(raw.get("job_state"))
    return SlurmJob(job_id=_number(raw.get("job_id")), state=state, flags=flags,
                    restart_count=_number(raw.get("restart_cnt")), user=_text(raw.get("user_name")),
                    cluster=_text(raw.get("cluster")), nodes=_text(raw.get("nodes")),
                    tres_per_node=_text(raw.get("tres_per_node")), comment=_text(raw.get("comment")),
                    reason=_text(raw.get("state_reason")), admin_comment=_admin_comment(raw),
                    dependency=_text(raw.get("dependency")))


def _admin_comment(raw: Mapping[str, Any]) -> str:
    value = raw.get("admin_comment")
    if value is None and isinstance(raw.get("comment"), dict):   # a shape where comments are grouped
        value = raw["comment"].get("administrator")
    return _text(value)


def parse_squeue_json(text: str) -> list[SlurmJob]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RgpuError("slurm", "`squeue --json` printed something that is not JSON", str(exc),
                        "run it by hand; this Slurm may be too old (22.05 or later is needed)") from None
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        raise RgpuError("slurm", "`squeue --json` reported errors", json.dumps(errors)[:300],
                        "check slurmctld and its log")
    return [parse_job(raw) for raw in data.get("jobs") or []]


# ---------------------------------------------------------------- squeue backend

def squeue_command() -> list[str]:
    # 22.05 ignores filters with --json and dumps every job slurmctld still knows; later
    # versions honour them and by default hide finished jobs (24.11: PENDING, RUNNING and
    # COMPLETING only, per the man page), so ask for all states everywhere.
    return ["squeue", "--json", "--states=all"]


@dataclass
class SqueueBackend:
    env: Mapping[str, str] | None = None
    timeout: float = 30.0

    def jobs(self) -> list[SlurmJob]:
        out = run_command(squeue_command(), component="slurm", env=self.env, timeout=self.timeout)
        return parse_squeue_json(out.stdout)

    def live_jobs(self) -> list[SlurmJob]:
        return [j for j in self.jobs() if j.live]


# ---------------------------------------------------------------- pyslurm backend

def tres_from_gres_per_node(value: Any) -> str:
    """pyslurm's `gres_per_node` ({"rgpu": 2}, {"gpu:a100": 1}, or a string) as Slurm's
    tres_per_node text ("gres:rgpu:2,gres:gpu:a100:1"). Pure."""
    if isinstance(value, Mapping):
        return ",".join(f"gres:{name}:{int(count)}" for name, count in value.items())
    text = "" if value is None else str(value)
    return "" if text == "(null)" else text


def job_from_pyslurm(job: Any) -> SlurmJob:
    """One pyslurm.Job (pyslurm 23.x/24.x attribute names). Pure."""
    state = str(getattr(job, "state", "") or "")
    return SlurmJob(
        job_id=int(job.id), state=state.split(",")[0].strip(), flags=(),
        restart_count=int(getattr(job, "requeue_count", 0) or getattr(job, "restart_count", 0) or 0),
        user=str(getattr(job, "user_name", "") or ""), cluster=str(getattr(job, "cluster", "") or ""),
        nodes=str(getattr(job, "allocated_nodes", "") or ""),
        tres_per_node=tres_from_gres_per_node(getattr(job, "gres_per_node", None)),
        comment=str(getattr(job, "comment", "") or ""), reason=str(getattr(job, "state_reason", "") or ""),
        admin_comment=str(getattr(job, "admin_comment", "") or ""))


class PyslurmBackend:
    """Reads jobs through pyslurm (API of pyslurm >= 23: `pyslurm.Jobs.load()`)."""

    def __init__(self) -> None:
        try:
            import pyslurm
        except Exception as exc:  # noqa: BLE001 - a pyslurm built for another Slurm fails in many ways
            raise RgpuError("slurm", "slurm_backend = pyslurm, but pyslurm cannot be imported",
                            f"{type(exc).__name__}: {exc}; pyslurm must be built for this Slurm's major.minor "
                            "(PyPI has 25.11.x only)",
                            "build pyslurm from its release tag for this Slurm, or set slurm_backend = auto "
                            "(squeue --json)") from None
        self._pyslurm = pyslurm

    def live_jobs(self) -> list[SlurmJob]:
        return [j for j in (job_from_pyslurm(job) for job in self._pyslurm.Jobs.load().values()) if j.live]


def pyslurm_available() -> bool:
    try:
        import pyslurm  # noqa: F401
    except Exception:  # noqa: BLE001 - a pyslurm built for another Slurm fails in many ways
        return False
    return True


def backend_for(prefer: str = "auto", env: Mapping[str, str] | None = None) -> JobSource:
    """"auto" and "squeue": squeue --json; "pyslurm" only when asked for."""
    if prefer == "pyslurm":
        return PyslurmBackend()
    if prefer not in ("auto", "squeue"):
        raise RgpuError("slurm", f"unknown Slurm backend {prefer!r}", "", "use auto, squeue or pyslurm")
    return SqueueBackend(env=env)


def job_ids(jobs: Sequence[SlurmJob]) -> list[int]:
    return [j.job_id for j in jobs]
