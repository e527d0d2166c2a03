"""flexrun run by a user without a writable home, as Slurm runs the demo's jobs (`nobody`,
HOME=/nonexistent): it builds its client libraries in a private folder under the job's temp dir,
and where nothing can be written it says so in one line (issue 23, item 6).

The user is a real other uid (`nobody`), with this run's Python and rgpu put where it can run them
(tests/user_runtime.py); the slice is a real session server with an emulated GPU."""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.adaptor import AdaptorConf, AdaptorSlice, write_adaptor_conf
from tests.remoting.conftest import Server
from tests.user_runtime import UserRuntime

pytestmark = pytest.mark.integration
USER = "nobody"


@pytest.fixture(scope="module")
def runtime() -> Iterator[UserRuntime]:
    if os.geteuid() != 0 or not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("needs root (to run as another uid) and a C compiler")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        pytest.skip(f"needs the {USER} user")
    r = UserRuntime(USER).build()
    try:
        yield r
    finally:
        r.remove()


def _conf(runtime: UserRuntime, emulated: Server) -> Path:
    gpu = emulated.gpus[0]
    slices = (AdaptorSlice(server=emulated.address, gpu_uuid=gpu.uuid, gpu_index=gpu.index, memory_limit_bytes=1 << 30,
                           compute_percent=50, token=emulated.token()),)
    path = write_adaptor_conf(runtime.home / "adaptor.conf", AdaptorConf(job_id="7", user=USER, slices=slices))
    shutil.chown(path, USER)
    return path


def _user_folder(runtime: UserRuntime, name: str) -> Path:
    folder = runtime.root / name
    folder.mkdir()
    shutil.chown(folder, USER)
    folder.chmod(0o700)
    return folder


def test_flexrun_with_no_writable_home_builds_its_libraries_under_the_jobs_temp_dir(
        runtime: UserRuntime, emulated: Server) -> None:
    conf = _conf(runtime, emulated)
    job_tmp = _user_folder(runtime, "job-tmp")
    done = runtime.run(["-m", "rgpu.remoting.client.flexrun", "-f", str(conf), "--", "sh", "-c",
                        'echo "LIBS=${LD_LIBRARY_PATH%%:*}"'],
                       {"HOME": "/nonexistent", "TMPDIR": str(job_tmp)}, timeout=180)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    uid = pwd.getpwnam(USER).pw_uid
    libs = done.stdout.strip().removeprefix("LIBS=")
    assert libs.startswith(f"{job_tmp}/rgpu-{uid}/native/"), done.stdout
    assert (Path(libs) / "libcuda.so.1").is_file()
    assert (job_tmp / f"rgpu-{uid}").stat().st_mode & 0o777 == 0o700


def test_flexrun_with_nothing_writable_says_so_in_one_line(runtime: UserRuntime, emulated: Server) -> None:
    conf = _conf(runtime, emulated)
    done = runtime.run(["-m", "rgpu.remoting.client.flexrun", "-f", str(conf), "--", "true"],
                       {"HOME": "/nonexistent", "TMPDIR": "/nonexistent/tmp"}, timeout=120)
    assert done.returncode == 2, done
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("rgpu: native: no writable folder to build rgpu's client libraries in"), line
    assert "/nonexistent/.cache/rgpu/native: Permission denied" in line, line
    assert f"/nonexistent/tmp/rgpu-{pwd.getpwnam(USER).pw_uid}/native" in line, line
    assert "set XDG_CACHE_HOME or RGPU_NATIVE_DIR" in line, line


def test_a_temp_folder_another_user_made_is_not_used(runtime: UserRuntime, emulated: Server) -> None:
    """A shared /tmp: another uid may have made rgpu-<uid> first, with libraries of its own in it."""
    conf = _conf(runtime, emulated)
    shared = runtime.root / "shared-tmp"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    trap = shared / f"rgpu-{pwd.getpwnam(USER).pw_uid}"
    trap.mkdir(mode=0o777)        # root's, not the user's
    trap.chmod(0o777)
    done = runtime.run(["-m", "rgpu.remoting.client.flexrun", "-f", str(conf), "--", "true"],
                       {"HOME": "/nonexistent", "TMPDIR": str(shared)}, timeout=120)
    assert done.returncode == 2, done
    (line,) = done.stderr.strip().splitlines()
    assert f"{trap} is not a private folder of uid" in line, line
    assert not (trap / "native").exists()
