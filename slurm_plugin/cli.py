"""`rgpu-admin slurm-config`: the Slurm lines for this pool, rendered with its live numbers.

rgpu-admin finds these commands through the `rgpu.admin_commands` entry points (pyproject.toml).
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import click
from rgpu.slurm_plugin.licenses import SECTIONS, config_values, render_slurm_config

from rgpu.errors import InvalidRequest, RgpuError

_PATH_RE = re.compile(r"^/[A-Za-z0-9_./+@-]*$")


def default_prolog_dir() -> str:
    """Where `pip install` put the scripts Slurm runs: the console scripts' directory of this
    installation (a virtual environment's bin/, or e.g. /usr/local/bin), whose Python ones start
    with this installation's interpreter, so they import this rgpu."""
    return sysconfig.get_path("scripts")


def task_prolog_problem(prolog_dir: str) -> str | None:
    """One line when the TaskProlog in `prolog_dir` exists here and other users cannot run it:
    Slurm runs it as the job's user, and fails every task of every job, rgpu or not, with
    "TaskProlog failed status=126" when that user cannot reach it. None when it is fine, or not on
    this host (slurm-config may run elsewhere than the CPU nodes)."""
    from rgpu.paths import unreadable_folder

    script = Path(prolog_dir) / "rgpu-task-prolog"
    try:
        mode = script.stat().st_mode
    except OSError:
        return None
    blocked = unreadable_folder(script) or (script if mode & 0o005 != 0o005 else None)
    if blocked is None:
        return None
    return (f"rgpu: slurm-config: other users cannot reach the TaskProlog {script} ({blocked} is not open to them); "
            "Slurm runs it as the job's user and would fail every job, rgpu or not, with 'TaskProlog failed "
            "status=126' -- install rgpu where every user can read it (e.g. a venv in /opt/rgpu) and run "
            "slurm-config from there")


def _client(ctx: click.Context):  # type: ignore[no-untyped-def]
    obj = ctx.obj
    if obj is not None and hasattr(obj, "client") and hasattr(obj, "settings"):
        return obj.client(), obj.settings          # inside rgpu-admin: its --pool/--config apply
    from rgpu.remoting.pool.client import connect

    from rgpu.config import load_settings

    settings = load_settings()
    return connect(settings), settings


def detect_slurm_version() -> str:
    """major.minor of the Slurm whose `scontrol` is on PATH here ('' when none answers)."""
    from rgpu.slurm_plugin.proc import run_command
    from rgpu.slurm_plugin.versions import parse_version_output

    try:
        out = run_command(["scontrol", "--version"], component="slurm-config", timeout=10, check=False)
    except RgpuError:
        return ""
    return parse_version_output(out.stdout + out.stderr)


@click.command("slurm-config")
@click.option("--prolog-dir", default=None, metavar="DIR",
              help="Where the rgpu-prolog* and rgpu-epilog* scripts are on the Slurm hosts "
                   "(default: where pip installed them, this installation's scripts directory).")
@click.option("--section", "sections", multiple=True, type=click.Choice(list(SECTIONS)),
              help="Print only this file's lines (repeatable; default: all).")
@click.option("--slurm-version", default=None, metavar="X.Y",
              help="The Slurm the lines are for (default: what `scontrol --version` here says; "
                   "where none answers, lines every tested version accepts).")
@click.pass_context
def slurm_config(ctx: click.Context, prolog_dir: str | None, sections: tuple[str, ...],
                 slurm_version: str | None) -> None:
    """Print slurm.conf, gres.conf and job_submit_rgpu.conf lines for the pool as it is now."""
    from rgpu.slurm_plugin.versions import TESTED, version_tuple

    try:
        if slurm_version is not None and version_tuple(slurm_version) == (0, 0):
            raise InvalidRequest("slurm-config", f"--slurm-version {slurm_version!r} is not a version",
                                 "it picks the lines to print", f"give major.minor, e.g. {TESTED[-1]}")
        if slurm_version is not None:
            slurm_version = "%d.%02d" % version_tuple(slurm_version)
        prolog_dir = prolog_dir or default_prolog_dir()
        if not _PATH_RE.match(prolog_dir):
            raise InvalidRequest("slurm-config", f"--prolog-dir {prolog_dir!r} is not a plain absolute path",
                                 "it is written into slurm.conf", "use letters, digits and / . _ - + @ only")
        problem = task_prolog_problem(prolog_dir)
        if problem:
            click.echo(problem, err=True)
        client, settings = _client(ctx)
        with client:
            gpus, units = client.list_gpus(), int(client.capacity().total_units)
        values = config_values(gpus, units, settings.max_slices_per_job, prolog_dir,
                               detect_slurm_version() if slurm_version is None else slurm_version)
        click.echo(render_slurm_config(values, sections or tuple(SECTIONS)), nl=False)
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        ctx.exit(exc.exit_code)


# rgpu-admin picks these up through the rgpu.admin_commands entry points (pyproject.toml).