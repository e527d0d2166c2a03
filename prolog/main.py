"""Entry points of the prolog/ scripts: read the environment, call one function, map the outcome to
the exit code Slurm needs. Contracts: prolog/README.md.

Every message is one line on stderr (and syslog when /dev/log exists), prefixed with the script
and job: Slurm 22.05 drops prolog output, so syslog is where an admin finds it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, NoReturn

from rgpu.slurm_plugin.jobenv import comment_may_ask_rgpu, holds_rgpu_license

from rgpu.errors import RgpuError, Unavailable

# Well under Slurm's default MessageTimeout (10 s); one pool call per node at most.
POOL_TIMEOUT_SECONDS = 4.0
SLURM_QUERY_TIMEOUT_SECONDS = 4.0
# While the pool is unreachable EpilogSlurmctld retries this long, then leaves the release to the
# reconciler in rgpu-poold. Slurm keeps the job COMPLETING (its nodes busy) meanwhile: keep it short.
EPILOG_RETRY_SECONDS = 15.0


def log_line(script: str, env: Mapping[str, str], message: str) -> None:
    line = f"rgpu-{script}[job {env.get('SLURM_JOB_ID', '?')}]: {message}"
    print(line, file=sys.stderr, flush=True)
    if os.path.exists("/dev/log"):
        try:
            import syslog
            syslog.openlog(f"rgpu-{script}", 0, syslog.LOG_DAEMON)
            syslog.syslog(syslog.LOG_WARNING, line)
        except OSError:
            pass


def connect_pool(env: Mapping[str, str]) -> Any:
    """The pool client from rgpu settings (RGPU_CONFIG / RGPU_POOL / RGPU_SECRET_FILE / rgpu.toml), TLS included."""
    from rgpu.remoting.pool.client import connect

    from rgpu.config import load_settings

    return connect(load_settings(env=env), timeout=POOL_TIMEOUT_SECONDS)


def set_admin_comment(env: Mapping[str, str]) -> Any:
    """`scontrol update jobid=ID admincomment=TEXT` (PrologSlurmctld runs as SlurmUser, an admin)."""
    from rgpu.slurm_plugin.proc import run_command
    from rgpu.slurm_plugin.waiting import mark_command

    def update(job_id: int, text: str) -> None:
        try:
            run_command(mark_command(job_id, text), env=env, timeout=SLURM_QUERY_TIMEOUT_SECONDS)
        except RgpuError as exc:   # the job still waits and starts; only the note is missing
            log_line("prolog-slurmctld", env, f"could not note the job's state in its admin comment: {exc}")

    return update


def notify_user(env: Mapping[str, str]) -> Any:
    """`scontrol notify`: the message reaches the job's srun/salloc terminal."""
    from rgpu.slurm_plugin.proc import run_command
    from rgpu.slurm_plugin.scontrol import notify_command

    def notify(job_id: int, message: str) -> None:
        try:
            run_command(notify_command(job_id, message), env=env, timeout=SLURM_QUERY_TIMEOUT_SECONDS)
        except RgpuError as exc:
            log_line("prolog-slurmctld", env, f"could not tell the job's user: {exc}")

    return notify


def cancel_job(env: Mapping[str, str]) -> Any:
    """`scancel`: for a job no GPU of the pool can ever serve (its admin comment says why)."""
    from rgpu.slurm_plugin.proc import run_command

    def cancel(job_id: int) -> None:
        try:
            run_command(["scancel", str(int(job_id))], env=env, timeout=SLURM_QUERY_TIMEOUT_SECONDS)
        except RgpuError as exc:
            log_line("prolog-slurmctld", env, f"could not cancel the job: {exc}")

    return cancel


def requeue_job(env: Mapping[str, str]) -> str:
    """`scontrol requeue` this job (the node Prolog runs as root, a Slurm admin). Returns what
    became of the job, for the log line; never raises."""
    from rgpu.slurm_plugin.proc import run_command
    from rgpu.slurm_plugin.scontrol import requeue_command

    try:
        run_command(requeue_command(int(env.get("SLURM_JOB_ID", ""))), env=env, timeout=SLURM_QUERY_TIMEOUT_SECONDS)
    except (RgpuError, ValueError) as exc:
        # Interactive jobs and --no-requeue ones cannot be requeued: their tasks then fail in the
        # TaskProlog, which prints this reason into the job's output.
        return f"not requeued ({' '.join(str(exc).split())[:300]}): its tasks fail with this reason"
    return "requeued: it runs again once rgpu can give it its slices"


def version_asked(script: str, argv: list[str] | None = None) -> bool:
    """`rgpu-<script> --version` (or -V) by hand prints the version; Slurm passes no arguments."""
    args = sys.argv[1:] if argv is None else argv
    if args in (["--version"], ["-V"]):
        from rgpu import __version__
        print(f"rgpu-{script}, version {__version__}")
        return True
    return False


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RgpuError) else f"rgpu: internal error: {type(exc).__name__}: {exc}"


def prolog_slurmctld_main(env: Mapping[str, str] | None = None) -> int:
    """0: leases allocated (or no rgpu asked); 1: failed, Slurm requeues the job (no node drained)."""
    if env is None and version_asked("prolog-slurmctld"):
        return 0
    env = os.environ if env is None else env
    if not holds_rgpu_license(env):
        return 0                     # a plain job: no Slurm query, no pool call
    from rgpu.prolog.logic import NeverServable, prolog_slurmctld
    from rgpu.slurm_plugin import scontrol

    started = time.monotonic()
    try:
        keys = prolog_slurmctld(env, lambda: connect_pool(env),
                                lambda job_id: scontrol.query_job(str(job_id), env=env,
                                                                  timeout=SLURM_QUERY_TIMEOUT_SECONDS),
                                set_admin_comment=set_admin_comment(env), notify=notify_user(env),
                                cancel=cancel_job(env))
    except NeverServable as exc:
        log_line("prolog-slurmctld", env, f"{_describe(exc)} -- the job was cancelled")
        return 1
    except Exception as exc:
        log_line("prolog-slurmctld", env, f"{_describe(exc)} -- the job will be requeued")
        return 1
    if keys:
        log_line("prolog-slurmctld", env, f"allocated {', '.join(keys)} in {time.monotonic() - started:.2f} s")
    return 0


def prolog_main(env: Mapping[str, str] | None = None) -> int:
    """Always 0: an rgpu problem must never drain a node. On failure the reason goes to
    <run dir>/<job>/error and the job is requeued; where it cannot be, the TaskProlog fails its
    tasks with that reason: a job never runs without the slices it was charged for."""
    if env is None and version_asked("prolog"):
        return 0
    env = os.environ if env is None else env
    if not comment_may_ask_rgpu(env.get("SLURM_JOB_COMMENT")):
        return 0                     # not an rgpu job: no pool call
    from rgpu.prolog.logic import node_prolog, record_node_error
    from rgpu.slurm_plugin import scontrol

    try:
        # Slurm is asked only when the pool has no lease for the job (query_job's one call).
        node_prolog(env, lambda: connect_pool(env),
                    lambda job_id: scontrol.query_job(str(job_id), env=env, timeout=SLURM_QUERY_TIMEOUT_SECONDS))
    except Exception as exc:
        message = _describe(exc)
        record_node_error(env, message)
        log_line("prolog", env, f"{message} -- the job {requeue_job(env)}")
    return 0


def epilog_slurmctld_main(env: Mapping[str, str] | None = None) -> int:
    """0: released (or nothing to release); 1: the pool could not be asked (Slurm only logs it;
    the reconciler releases the lease later). Run by Slurm (no `env` given), the process ends the
    moment its work is done: see exit_at_once."""
    if env is None and version_asked("epilog-slurmctld"):
        return 0
    if env is not None:
        return _release_job(env)
    code = _release_job(os.environ)
    if holds_rgpu_license(os.environ):     # the pool client is loaded (a plain job loaded nothing)
        exit_at_once(code)
    return code


def exit_at_once(code: int) -> NoReturn:
    """End the process without the interpreter's teardown: Slurm frees an ended job's license
    only when EpilogSlurmctld exits, and the next job waits for it, while unloading gRPC and the
    other modules takes 20-30 ms of an idle core (several times that on a loaded one). The
    output is flushed first; the pool calls are done, and nothing else is left to close."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _release_job(env: Mapping[str, str]) -> int:
    if not holds_rgpu_license(env):
        return 0                     # a plain job: no pool call, no retries while the pool is away
    from rgpu.prolog.epilogs import epilog_slurmctld

    started = time.monotonic()
    deadline = started + EPILOG_RETRY_SECONDS
    delay = 0.5
    while True:
        try:
            released = epilog_slurmctld(env, lambda: connect_pool(env))
            break
        except Unavailable as exc:
            if time.monotonic() + delay > deadline:
                log_line("epilog-slurmctld", env, f"{_describe(exc)} -- gave up after {EPILOG_RETRY_SECONDS:g} s; "
                         "the reconciler in rgpu-poold releases the job's slices once the pool is back")
                return 1
            time.sleep(delay)
            delay = min(delay * 2, 4.0)
        except Exception as exc:
            log_line("epilog-slurmctld", env, f"{_describe(exc)} -- the reconciler in rgpu-poold releases the "
                     "job's slices later")
            return 1
    if released:
        log_line("epilog-slurmctld", env, f"released {', '.join(released)} in {time.monotonic() - started:.2f} s")
    return 0


def epilog_main(env: Mapping[str, str] | None = None) -> int:
    """Always 0: a failing node Epilog would drain the node. Run by Slurm (no `env` given), an
    rgpu job's Epilog ends the moment its work is done (exit_at_once): its completion is what lets
    the job the pool released into its room start (await_admission)."""
    if env is None and version_asked("epilog"):
        return 0
    from rgpu.paths import run_dir

    by_slurm = env is None
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    if job_id.isdigit() and not os.path.lexists(run_dir(env) / job_id):
        return 0                     # the node Prolog made no folder: nothing of rgpu's to remove
    from rgpu.prolog.epilogs import node_epilog

    try:
        removed = node_epilog(env)
    except Exception as exc:
        log_line("epilog", env, _describe(exc))
        removed = False
    if removed:
        _await_admission(env)
        if by_slurm:
            exit_at_once(0)
    return 0


def _await_admission(env: Mapping[str, str]) -> None:
    """Wait (slurm_epilog_admission_wait_seconds at most) until the pool let go the jobs this
    job's room lets start (prolog/epilogs.py, await_admission); never raises."""
    from rgpu.prolog.epilogs import await_admission
    from rgpu.remoting.pool.client import connect

    from rgpu.config import load_settings

    started = time.monotonic()
    try:
        settings = load_settings(env=env)
        budget = settings.slurm_epilog_admission_wait_seconds
        if budget <= 0:
            return
        if await_admission(env, lambda: connect(settings, timeout=budget), budget=budget):
            log_line("epilog", env, f"the pool's admission caught up with the job's end in "
                     f"{time.monotonic() - started:.2f} s")
        else:
            log_line("epilog", env, f"the pool's admission did not catch up with the job's end within {budget:g} s "
                     "(slurm_epilog_admission_wait_seconds); the jobs it lets go start at Slurm's next scheduling pass")
    except Exception as exc:
        log_line("epilog", env, f"{_describe(exc)} -- not waiting for the pool's admission")


ENTRY_POINTS = {
    "prolog-slurmctld": prolog_slurmctld_main,
    "prolog": prolog_main,
    "epilog-slurmctld": epilog_slurmctld_main,
    "epilog": epilog_main,
}


def main(argv: list[str] | None = None) -> int:
    """`python -m rgpu.prolog.main CONTEXT`: the same entry points by name."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in ENTRY_POINTS:
        print(f"usage: python -m rgpu.prolog.main {{{','.join(ENTRY_POINTS)}}}", file=sys.stderr)
        return 2
    return ENTRY_POINTS[args[0]]()


if __name__ == "__main__":
    sys.exit(main())
