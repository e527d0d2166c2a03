"""`pip install` puts every script Slurm runs where `rgpu-admin slurm-config` points (issue 10):
the wheel is built and installed into a fresh virtual environment, and every path the generated
slurm.conf lines name must exist and run with that environment's rgpu."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemons import EXAMPLES, REPO, RgpuCluster, wait_for

pytestmark = pytest.mark.integration

SCRIPT_KEYS = ("PrologSlurmctld", "Prolog", "TaskProlog", "Epilog", "EpilogSlurmctld")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the built wheel; its dependencies come from the test interpreter's
    site-packages through a plain path entry (no network; the editable rgpu there is not seen)."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"          # setuptools writes build/ into the tree it builds: not ours
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__"))
    wheels = root / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("rgpu-*.whl")
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
                              "--no-deps", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    purelib = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "zz-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env_dir


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path_factory.mktemp("pool"))
    c.start_pool()
    c.start_dispatcher(EXAMPLES / "inventory-a.toml")

    def ready() -> bool:
        with c.client() as client:
            return client.capacity().total_units == 200

    wait_for(ready, timeout=30, what="2 GPUs in the pool")
    yield c
    c.stop_all()


def test_every_script_slurm_config_names_exists_and_runs_from_the_installed_wheel(venv: Path, pool: RgpuCluster) -> None:
    py = venv / "bin" / "python"
    where = subprocess.run([str(py), "-c", "import rgpu; print(rgpu.__file__)"], capture_output=True, text=True, check=True,
                           cwd=venv, env={"PATH": "/usr/bin:/bin"})
    assert where.stdout.startswith(str(venv)), f"rgpu came from {where.stdout.strip()}, not the fresh install"
    out = subprocess.run([str(venv / "bin" / "rgpu-admin"), "slurm-config", "--section", "slurm.conf"], env=pool.env(),
                         capture_output=True, text=True, timeout=60, cwd=venv)
    assert out.returncode == 0, out.stderr
    paths = dict(re.findall(r"^(\w+)=(/\S+)$", out.stdout, re.MULTILINE))
    assert set(SCRIPT_KEYS) <= set(paths), out.stdout
    clean = {"PATH": "/usr/bin:/bin"}    # Slurm gives its scripts no PATH to the venv
    for key in SCRIPT_KEYS:
        path = Path(paths[key])
        assert path.parent == venv / "bin" and path.is_file(), (key, path)
        # What Slurm hands the prologs of an rgpu job (others return at once: issue 23).
        rgpu_job = {**clean, "SLURM_JOB_LICENSES": "rgpu:100", "SLURM_JOB_COMMENT": "fraction=1"}
        run = subprocess.run([str(path)], env=rgpu_job, capture_output=True, text=True, timeout=60, cwd=venv)
        if key == "TaskProlog":
            assert (run.returncode, run.stdout, run.stderr) == (0, "", ""), run
            continue
        # Outside Slurm each says in one line what is missing: proof it started and imported rgpu.
        assert run.returncode == (1 if key.endswith("Slurmctld") else 0), (key, run)
        (line,) = run.stderr.strip().splitlines()
        assert "$SLURM_JOB_ID is not set" in line and "Traceback" not in run.stderr, (key, run.stderr)
    # The TaskProlog of an rgpu job, run as Slurm would.
    run = subprocess.run([paths["TaskProlog"]], env={**clean, "SLURM_JOB_ID": "5", "RGPU_RUN_DIR": str(venv)},
                         capture_output=True, text=True, timeout=10)
    assert run.stdout == ""   # no <run dir>/5: not an rgpu job


def test_the_installed_wheel_carries_client_libraries_so_a_first_flexrun_builds_nothing(venv: Path, tmp_path: Path) -> None:
    """Issue 29: built at install time where a C compiler is present (setup.py), found by flexrun
    before any cache, so the first run on a node neither waits for a build nor prints its line."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the wheel carries no libraries (flexrun builds them on first use)")
    code = ("from rgpu.remoting.native import build; built = []; "
            "libs = build.ensure_built(lambda: built.append(1)); print(libs.folder, len(built))")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "TMPDIR": str(tmp_path)}
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path)   # not the checkout: its rgpu/ would shadow
    assert done.returncode == 0, done.stderr
    folder, builds = done.stdout.split()
    assert folder.startswith(str(venv)) and folder.endswith("rgpu/remoting/native/lib") and builds == "0", done.stdout
    assert not (tmp_path / "cache").exists()
