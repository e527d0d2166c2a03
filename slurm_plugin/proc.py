"""The one subprocess helper of the Slurm integration.

Every external command (squeue, scontrol, sbatch in tests) goes through `run_command`, so a
failure always shows the command, its exit code, stdout and stderr.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Mapping, Sequence

from rgpu.errors import RgpuError

_SHOWN_OUTPUT = 2000  # characters of stdout/stderr kept in an error message


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SHOWN_OUTPUT else "..." + text[-_SHOWN_OUTPUT:]


class CommandError(RgpuError):
    """An external command failed, timed out or could not be started."""

    def __init__(self, component: str, argv: Sequence[str], returncode: int | None,
                 stdout: str, stderr: str, why: str = "", fix: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        status = "timed out" if returncode is None else f"exited {returncode}"
        detail = why or f"stdout: {_tail(stdout)!r}; stderr: {_tail(stderr)!r}"
        super().__init__(component, f"`{shlex.join(self.argv)}` {status}", detail,
                         fix or "check that Slurm is running and this host can reach slurmctld")


def run_command(argv: Sequence[str], *, component: str = "slurm", timeout: float = 30.0,
                env: Mapping[str, str] | None = None, check: bool = True,
                input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run argv (never through a shell); raise CommandError on failure when check is true."""
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=dict(env) if env is not None else None, input=input_text,
                              stdin=None if input_text is not None else subprocess.DEVNULL)
    except FileNotFoundError:
        raise CommandError(component, argv, 127, "", "", why=f"{argv[0]} is not installed or not on PATH",
                           fix="install the Slurm client commands (Debian: slurm-client)") from None
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise CommandError(component, argv, None, out, err,
                           why=f"no answer within {timeout:g} s; stderr: {_tail(err)!r}") from None
    if check and proc.returncode != 0:
        raise CommandError(component, argv, proc.returncode, proc.stdout, proc.stderr)
    return proc
