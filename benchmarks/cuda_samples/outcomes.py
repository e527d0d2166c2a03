"""Results of running the samples locally and through rgpu, compared (pure: no processes, no files)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

# The session server's refusal while an MPS-shared GPU recovers from another client's fault
# (remoting/dispatcher/sessions.py); the client library writes it to the program's stderr.
_RECOVERING = re.compile(r"rgpu: session: GPU \d+ \(.*\) of \S+ is recovering from a GPU fault")

# cuda-python's examples waive (a capability missing: two GPUs, peer access, ...) through
# cuda.bindings._example_helpers.requirement_not_met, which prints the reason to stderr and exits with
# $CUDA_BINDINGS_SKIP_EXAMPLE (default 1, so run.py sets it to this); some releases exit 2 outright.
# cuda-samples' EXIT_WAIVED is 2 as well.
WAIVE_CODE = 2


@dataclass(frozen=True)
class Run:
    """One run of one program: exit code (None: it did not finish in time or did not start)."""
    name: str
    mode: str                 # "local" or "rgpu"
    rc: int | None
    seconds: float
    last_line: str = ""       # the last non-empty stderr line (stdout's when stderr has none)
    timed_out: bool = False
    attempts: int = 1
    waived: bool = False      # exited with the program's waive code: a capability it needs is missing

    @property
    def passed(self) -> bool:
        return self.rc == 0

    def describe(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.rc is None:
            return "not run"
        if self.waived:
            return "waived"
        return "ok" if self.rc == 0 else f"exit {self.rc}"


def refused_recovering(stderr: str) -> bool:
    """Whether the program's session was refused because its GPU is recovering from a fault."""
    return bool(_RECOVERING.search(stderr))


def should_retry(stderr: str, waited: float, limit: float) -> bool:
    """Retry a program refused by a recovering GPU, until `limit` seconds have been spent waiting."""
    return refused_recovering(stderr) and waited < limit


def is_waived(rc: int | None, waive_code: int | None, stderr: str) -> bool:
    """Whether a run waived itself: it exited with its waive code (None: the program has none) and
    did not end in a Python traceback or fail to start (Python exits 2 for those too)."""
    if waive_code is None or rc != waive_code:
        return False
    return "Traceback (most recent call last)" not in stderr and "can't open file" not in stderr


def last_line(stderr: str, stdout: str = "") -> str:
    for text in (stderr, stdout):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1][:300]
    return ""


def verdict(local: Run | None, rgpu: Run | None) -> str:
    """pass: passed through rgpu (and locally, when it ran there); rgpu-fail: passed locally, not
    through rgpu (a waiver through rgpu after a local pass counts here: rgpu hid a capability);
    local-waived: waived locally (not a local pass, not counted against rgpu); local-fail: failed
    locally (not counted against rgpu); fail: failed through rgpu with no local run to compare
    with; waived: waived through rgpu with no local run; not-run: no rgpu run."""
    if local is not None and not local.passed:
        return "local-waived" if local.waived else "local-fail"
    if rgpu is None:
        return "not-run"
    if rgpu.passed:
        return "pass"
    if local is None:
        return "waived" if rgpu.waived else "fail"
    return "rgpu-fail"


@dataclass
class Summary:
    programs: int = 0
    local_ran: bool = False
    local_passes: int = 0
    rgpu_passes: int = 0          # of those that passed locally (or of all, without local runs)
    failures: list[str] = field(default_factory=list)   # names, rgpu failures first
    waived: list[str] = field(default_factory=list)     # waived locally (or through rgpu, without local runs)

    @property
    def percent(self) -> float:
        base = self.local_passes if self.local_ran else self.programs
        return 100.0 * self.rgpu_passes / base if base else 0.0

    def line(self) -> str:
        waived = f"; waived {len(self.waived)}" if self.waived else ""
        if self.local_ran:
            return (f"local passes {self.local_passes}, also through rgpu {self.rgpu_passes} ({self.percent:.0f}%)"
                    f"{waived.replace('waived', 'waived locally')}")
        return f"through rgpu {self.rgpu_passes} of {self.programs} pass ({self.percent:.0f}%) (no local runs){waived}"


def summarize(names: list[str], local: dict[str, Run], rgpu: dict[str, Run]) -> Summary:
    s = Summary(programs=len(names), local_ran=bool(local))
    rgpu_failed: list[str] = []
    local_failed: list[str] = []
    for name in names:
        v = verdict(local.get(name) if local else None, rgpu.get(name))
        if local and local.get(name) is not None and local[name].passed:
            s.local_passes += 1
        if v == "pass":
            s.rgpu_passes += 1
        elif v in ("rgpu-fail", "fail", "not-run"):
            rgpu_failed.append(name)
        elif v == "local-fail":
            local_failed.append(name)
        elif v in ("local-waived", "waived"):
            s.waived.append(name)
    s.failures = rgpu_failed + local_failed
    return s


def table(names: list[str], local: dict[str, Run], rgpu: dict[str, Run]) -> list[str]:
    width = max([len(n) for n in names] + [7])
    rows = [f"{'program':<{width}}  {'local':>10}  {'rgpu':>10}  {'local s':>8}  {'rgpu s':>8}  verdict"]
    for name in names:
        lo, re_ = local.get(name), rgpu.get(name)
        rows.append(f"{name:<{width}}  {lo.describe() if lo else '-':>10}  {re_.describe() if re_ else '-':>10}  "
                    f"{f'{lo.seconds:.1f}' if lo else '-':>8}  {f'{re_.seconds:.1f}' if re_ else '-':>8}  "
                    f"{verdict(lo if local else None, re_)}")
    return rows


def failure_lines(summary: Summary, local: dict[str, Run], rgpu: dict[str, Run]) -> list[str]:
    """One line per failing program: where it failed and its last stderr line."""
    out = []
    for name in summary.failures:
        lo, re_ = local.get(name), rgpu.get(name)
        run = lo if lo is not None and not lo.passed else re_
        if run is None:
            out.append(f"{name} [rgpu]: not run")
            continue
        retried = f", {run.attempts} attempts" if run.attempts > 1 else ""
        out.append(f"{name} [{run.mode}]: {run.describe()}{retried}: {run.last_line or '(no output)'}")
    return out


def to_json(names: list[str], local: dict[str, Run], rgpu: dict[str, Run], summary: Summary, **about: object) -> dict:
    return {**about, "summary": {"programs": summary.programs, "local_ran": summary.local_ran,
                                 "local_passes": summary.local_passes, "rgpu_passes": summary.rgpu_passes,
                                 "percent": round(summary.percent, 1), "line": summary.line(),
                                 "failures": summary.failures, "waived": summary.waived},
            "programs": [{"name": n, "verdict": verdict(local.get(n) if local else None, rgpu.get(n)),
                          "local": asdict(local[n]) if n in local else None,
                          "rgpu": asdict(rgpu[n]) if n in rgpu else None} for n in names]}


def waived_lines(summary: Summary, local: dict[str, Run], rgpu: dict[str, Run]) -> list[str]:
    """One line per waived program: where it waived and its reason (its last stderr line)."""
    out = []
    for name in summary.waived:
        run = local.get(name) or rgpu.get(name)
        if run is not None:
            out.append(f"{name} [{run.mode}]: {run.last_line or '(no output)'}")
    return out
