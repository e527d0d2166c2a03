"""The job user and finished-job checks shared by the real-Slurm tests."""

from __future__ import annotations

from tests.slurm.conftest import Harness


JOB_USER = "nobody"   # jobs run as an ordinary user, so file ownership is tested for real
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def diagnostics(h: Harness) -> str:
    prolog_logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                            for p in sorted(h.slurm.logs.glob("*Prolog*.log")) + sorted(h.slurm.logs.glob("*Epilog*.log")))
    return f"{h.slurm.log_tail(25)}\n{prolog_logs}\n--- poold\n{h.pool.pool.log()[-2000:] if h.pool.pool else ''}"


def finished(h: Harness, job_id: str, timeout: float = 60.0) -> dict[str, str]:
    try:
        return h.slurm.wait_job_state(job_id, FINISHED, timeout)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{h.slurm.show_job(job_id)}\n{diagnostics(h)}") from None
