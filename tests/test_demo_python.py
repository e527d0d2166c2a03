"""scripts/pick-python.sh, which chooses the Python of the demo's virtual environment: as root, one
every user can run (jobs and flexrun run as the job's user). A pyenv under root's 0700 home, as on
machines where python3 comes only from pyenv, must not be chosen; when nothing else is there, one
line says what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = Path("/usr/bin/python3")

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                                 reason="the choice differs for root, who must pick a Python `nobody` can run"),
              pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="no /usr/bin/python3 to stand for Debian's")]


def pick(*candidates: str) -> subprocess.CompletedProcess[str]:
    script = f'. {REPO}/scripts/pick-python.sh; pick_python "$@" || {{ why_no_python "$@"; exit 1; }}'
    return subprocess.run(["bash", "-c", script, "pick", *candidates], capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.fixture
def pyenv_home() -> Iterator[Path]:
    """A pyenv-like layout in a 0700 home: a shim script running the real interpreter kept under
    versions/ (a copy of this host's Python, as pyenv builds its own)."""
    home = Path(tempfile.mkdtemp(prefix="rgpu-pyenv-home-"))          # 0700, as /root
    try:
        real = home / ".pyenv" / "versions" / "3.11.7" / "bin" / "python3.11"
        real.parent.mkdir(parents=True)
        shutil.copy2(os.path.realpath(SYSTEM_PYTHON), real)
        shim = home / ".pyenv" / "shims" / "python3"
        shim.parent.mkdir(parents=True)
        shim.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
        shim.chmod(0o755)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_pyenv_shim_in_roots_home_is_passed_over_for_a_python_every_user_can_run(pyenv_home: Path) -> None:
    shim = pyenv_home / ".pyenv" / "shims" / "python3"
    done = pick(str(shim), str(SYSTEM_PYTHON))
    assert done.returncode == 0, done
    assert done.stdout.strip() == os.path.realpath(SYSTEM_PYTHON)


def test_with_only_a_pyenv_python_the_demo_says_in_one_line_what_to_do(pyenv_home: Path) -> None:
    shim = pyenv_home / ".pyenv" / "shims" / "python3"
    done = pick("", str(shim), str(pyenv_home / "missing" / "python3"))
    assert done.returncode == 1 and done.stdout.count("\n") == 1, done
    line = done.stdout.strip()
    assert line.startswith("rgpu: demo: no Python 3.11 or later that every user can run (")
    assert f"{shim} runs {pyenv_home}/.pyenv/versions/3.11.7/bin/python3.11, which user nobody cannot run" in line
    assert "apt-get install python3 python3-venv, or set RGPU_PYTHON" in line


def test_a_candidate_that_does_not_run_or_none_at_all_is_named_as_such(tmp_path: Path) -> None:
    old = tmp_path / "python3"
    old.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.exit(1)'\n")   # runs, answers nothing
    old.chmod(0o755)
    done = pick(str(old))
    assert done.returncode == 1 and f"{old} does not run" in done.stdout, done
    assert "(no python3 found;" in pick("").stdout
