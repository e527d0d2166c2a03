"""run_admin and admin: rgpu-admin run in-process, for the tests that drive real daemons through it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

from click.testing import CliRunner
from rgpu.remoting.admin.cli import main as admin_main

from tests.daemons import RgpuCluster


def run_admin(args: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """rgpu-admin ARGS in-process, with `env` as its whole RGPU_* environment."""
    overlay: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("RGPU_", "BF_"))}
    overlay.update(env or {})
    result = CliRunner().invoke(admin_main, list(args), env=overlay, prog_name="rgpu-admin")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["rgpu-admin", *args], result.exit_code, result.stdout, result.stderr)


def admin(cluster: RgpuCluster, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    run = run_admin(args, {k: v for k, v in cluster.env().items() if k.startswith("RGPU_")})
    if ok:
        assert run.returncode == 0, run.stderr
    return run
