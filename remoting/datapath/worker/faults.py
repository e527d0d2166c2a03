"""A session whose GPU context died of a sticky fault (above all on a GPU shared by MPS).

Under MPS a fatal fault in one client's kernel (a wild write: CUDA_ERROR_ILLEGAL_ADDRESS) reaches
every client on that GPU, and the MPS server takes no new client until all of them have exited.
So a worker that sees a sticky error reports it to its dispatcher (a file in the dispatcher's
`faults` folder) and waits briefly for the dispatcher's verdict (which sessions the fault ended,
which one faulted where it can tell): the application's failing call gets that one line. The
dispatcher signals the GPU's other workers (SIGUSR1) with their own verdicts, so idle sessions
end at once too. Every such worker then lets go of the GPU at once by replacing itself with
`tombstone.py` (exec: its CUDA and MPS connections close, its pid and client socket stay), which
answers the application's next calls with the same error and message until it disconnects.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# Errors after which a context is unusable (CUDA's "sticky" errors) and, under MPS, the GPU's
# other clients may be gone too.
STICKY_ERRORS = {
    700: "CUDA_ERROR_ILLEGAL_ADDRESS", 714: "CUDA_ERROR_HARDWARE_STACK_ERROR",
    715: "CUDA_ERROR_ILLEGAL_INSTRUCTION", 716: "CUDA_ERROR_MISALIGNED_ADDRESS",
    717: "CUDA_ERROR_INVALID_ADDRESS_SPACE", 718: "CUDA_ERROR_INVALID_PC", 719: "CUDA_ERROR_LAUNCH_FAILED",
    805: "CUDA_ERROR_MPS_CONNECTION_FAILED", 806: "CUDA_ERROR_MPS_RPC_FAILURE",
    807: "CUDA_ERROR_MPS_SERVER_NOT_READY", 810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
}
VERDICT_WAIT_S = 2.0
REPORTS = "reports"
VERDICTS = "verdicts"
RELEASED = "released"


class SessionFaulted(Exception):
    """The session's GPU context is gone; the worker lets go of the GPU and answers with this."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def default_message(code: int, gpu: str) -> str:
    name = STICKY_ERRORS.get(code, str(code))
    return (f"rgpu: session: the GPU context of this session on {gpu} died ({name}); under MPS a fault in any "
            "session sharing the GPU ends them all (rerun; ask for isolation=strict to run only on GPUs no other "
            "job's fault can reach)")


def write_report(faults_dir: str, pid: int, report: dict) -> None:
    folder = Path(faults_dir) / REPORTS
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{pid}.tmp"
    tmp.write_text(json.dumps(report))
    os.replace(tmp, folder / f"{pid}.json")


def read_verdict(faults_dir: str, pid: int) -> str | None:
    try:
        return (Path(faults_dir) / VERDICTS / str(pid)).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def wait_verdict(faults_dir: str, pid: int, timeout: float = VERDICT_WAIT_S) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        verdict = read_verdict(faults_dir, pid)
        if verdict is not None or time.monotonic() >= deadline:
            return verdict
        time.sleep(0.02)


def become_tombstone(sock_fd: int, code: int, message: str, faults_dir: str) -> None:
    """Replace this process with the tombstone (never returns): every other file descriptor,
    the driver's and MPS's included, is closed first, so the GPU sees this client gone."""
    os.set_inheritable(sock_fd, True)
    os.closerange(3, sock_fd)
    os.closerange(sock_fd + 1, max(65536, os.sysconf("SC_OPEN_MAX")))
    args = [sys.executable, "-m", "rgpu.remoting.datapath.worker.tombstone", "--fd", str(sock_fd),
            "--code", str(code), "--message", message, "--faults-dir", faults_dir]
    os.execv(sys.executable, args)
