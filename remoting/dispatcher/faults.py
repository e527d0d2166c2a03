"""GPU faults that cross sessions: what the dispatcher decides from its workers' reports. Pure.

A worker whose context died of a sticky error on a GPU shared by MPS reports it (worker/faults.py).
Under MPS the fault of one client reaches every client on that GPU, so the dispatcher ends every
session of that GPU at once, each with a one-line verdict naming the GPU, that a session sharing
it faulted (which one, where the MPS server's log names its pid) and that isolation=strict avoids
it. On an isolated or exclusive GPU a fault is the session's own and ends nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rgpu.remoting.datapath.worker.faults import STICKY_ERRORS

# Reports arriving within this long of the first one belong to the same fault.
SETTLE_S = 0.3


@dataclass(frozen=True)
class FaultReport:
    pid: int
    gpu_uuid: str
    code: int
    unix: float
    job_key: str
    slice_number: int
    last_op: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> FaultReport:
        return cls(pid=int(data["pid"]), gpu_uuid=str(data["gpu_uuid"])[:128], code=int(data["code"]),
                   unix=float(data["unix"]), job_key=str(data.get("job_key", ""))[:200],
                   slice_number=int(data.get("slice_number", 0)), last_op=str(data.get("last_op", ""))[:64])


@dataclass(frozen=True)
class SessionView:
    """A live CUDA session as the decision needs it."""

    pid: int
    gpu_uuid: str
    job_key: str
    slice_number: int


@dataclass(frozen=True)
class GpuView:
    uuid: str
    index: int
    name: str
    sharing: str


@dataclass
class FaultEvent:
    """One fault on one GPU and what it ended."""

    gpu: GpuView
    code: int
    unix: float
    cross_tenant: bool                        # more than one session ended
    affected: list[SessionView]
    faulting: SessionView | None              # None: the driver did not say which
    how_identified: str = ""
    verdicts: dict[int, str] = field(default_factory=dict)   # pid -> the line its application gets
    recovered_seconds: float = -1.0           # until the GPU served new sessions again; -1: not yet

    @property
    def error_name(self) -> str:
        return STICKY_ERRORS.get(self.code, str(self.code))

    def summary(self) -> str:
        who = (f"job {self.faulting.job_key} slice {self.faulting.slice_number} (pid {self.faulting.pid}, "
               f"{self.how_identified})" if self.faulting else "the faulting session is not identified")
        scope = (f"{len(self.affected)} session(s) sharing it under MPS ended" if self.cross_tenant
                 else "only its own session ended")
        return f"GPU {self.gpu.index} ({self.gpu.uuid}): {self.error_name}; {scope}; {who}"


_PID_LINE = re.compile(r"\b(?:pid|PID|client|Client)\D{0,12}(\d{2,9})")
_BAD_WORDS = re.compile(r"fault|error|exception|xid|illegal|terminat", re.IGNORECASE)


def faulting_pid_from_log(text: str, pids: set[int]) -> int | None:
    """The one candidate pid the MPS server's log names on an error line, if exactly one."""
    named = set()
    for line in text.splitlines()[-400:]:
        if not _BAD_WORDS.search(line):
            continue
        for match in _PID_LINE.finditer(line):
            pid = int(match.group(1))
            if pid in pids:
                named.add(pid)
    return named.pop() if len(named) == 1 else None


def decide(reports: list[FaultReport], sessions: list[SessionView], gpus: dict[str, GpuView], server: str,
           mps_log: str = "") -> list[FaultEvent]:
    """One event per GPU with reports: which sessions end, and the line each application gets."""
    events = []
    by_gpu: dict[str, list[FaultReport]] = {}
    for report in sorted(reports, key=lambda r: r.unix):
        if report.gpu_uuid in gpus:
            by_gpu.setdefault(report.gpu_uuid, []).append(report)
    for uuid, gpu_reports in by_gpu.items():
        gpu = gpus[uuid]
        first = gpu_reports[0]
        reporters = {r.pid: r for r in gpu_reports}
        on_gpu = {s.pid: s for s in sessions if s.gpu_uuid == uuid}
        for r in gpu_reports:   # a reporter that already left still counts
            on_gpu.setdefault(r.pid, SessionView(r.pid, uuid, r.job_key, r.slice_number))
        shared = gpu.sharing == "mps"
        affected = list(on_gpu.values()) if shared else [on_gpu[pid] for pid in reporters]
        faulting: SessionView | None = None
        how = ""
        if not shared or len(affected) == 1:
            faulting, how = (affected[0], "its own context") if len(affected) == 1 else (None, "")
        else:
            pid = faulting_pid_from_log(mps_log, set(on_gpu))
            if pid is not None:
                faulting, how = on_gpu[pid], "named by the MPS server's log"
        event = FaultEvent(gpu=gpu, code=first.code, unix=first.unix, cross_tenant=shared and len(affected) > 1,
                           affected=sorted(affected, key=lambda s: s.pid), faulting=faulting, how_identified=how)
        event.verdicts = {s.pid: verdict(event, s, server) for s in event.affected}
        events.append(event)
    return events


def verdict(event: FaultEvent, session: SessionView, server: str) -> str:
    gpu = f"GPU {event.gpu.index} ({event.gpu.name}, {event.gpu.uuid}) of {server}"
    name = event.error_name
    if not event.cross_tenant:
        return (f"rgpu: session: this session's kernel faulted on {gpu} ({name}); its GPU context is lost and no "
                "other session was touched (fix the kernel and rerun)")
    others = len(event.affected) - 1
    if event.faulting is not None and event.faulting.pid == session.pid:
        return (f"rgpu: session: this session's kernel faulted on {gpu} ({name}); the GPU is shared by MPS, so the "
                f"fault also ended {others} other session(s) on it (fix the kernel; isolation=strict keeps a fault "
                "to its own session)")
    if event.faulting is not None:
        what = f"another session sharing {gpu} under MPS faulted (job {event.faulting.job_key} slice " \
               f"{event.faulting.slice_number}; {name}), which ended this session's GPU context too"
    else:
        what = f"a session sharing {gpu} under MPS faulted ({name}; this one or another, the driver does not say " \
               f"which), which ended every session on it ({len(event.affected)})"
    return (f"rgpu: session: {what} (rerun the job; ask for isolation=strict to run only on GPUs no other job's "
            "fault can reach)")
