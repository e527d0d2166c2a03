"""flexrun's environment makes a library that finds NCCL through a DT_RPATH bind to rgpu's libnccl.so.2,
as PyTorch's libtorch_cuda.so does ($ORIGIN/../../nvidia/nccl/lib, an RPATH that the loader searches
before LD_LIBRARY_PATH). Reproduced with a tiny library linked `--disable-new-dtags -rpath` to a fake
NCCL whose ncclGetVersion says 99999."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from rgpu.remoting.client import flexrun
from rgpu.remoting.dispatcher.sessions import worker_environment
from rgpu.remoting.native import build

from .conftest import PY

FAKE_NCCL = "int ncclGetVersion(int *v) { *v = 99999; return 0; }\n"
USER = "int ncclGetVersion(int *v);\nint user_nccl_version(void) { int v = 0; ncclGetVersion(&v); return v; }\n"
ASK = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
       "print(lib.user_nccl_version(), ctypes.CDLL('libnccl.so.2')._name)")


@pytest.fixture(scope="module")
def rpath_user(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """libuser.so, NEEDED libnccl.so.2 with a DT_RPATH (not RUNPATH) to the fake's folder."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.skip("no C compiler")
    root = tmp_path_factory.mktemp("rpath")
    fake, user = root / "fake", root / "user"
    fake.mkdir()
    user.mkdir()
    (root / "fake.c").write_text(FAKE_NCCL)
    (root / "user.c").write_text(USER)
    for args in ([cc, "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", str(root / "fake.c"), "-o", str(fake / "libnccl.so.2")],
                 [cc, "-shared", "-fPIC", str(root / "user.c"), "-o", str(user / "libuser.so"), str(fake / "libnccl.so.2"),
                  f"-Wl,--disable-new-dtags,-rpath,{fake}"]):
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
    dynamic = subprocess.run(["readelf", "-d", str(user / "libuser.so")], capture_output=True, text=True, check=True).stdout
    assert "(RPATH)" in dynamic and "(RUNPATH)" not in dynamic, dynamic
    return user / "libuser.so"


def _version_under(env: dict[str, str], lib: Path) -> list[str]:
    done = subprocess.run([PY, "-c", ASK, str(lib)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_library_with_an_rpath_to_another_nccl_binds_to_rgpus_under_flexruns_environment(
        rpath_user: Path, native_libs: build.Libraries) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_") and k != "LD_PRELOAD"}
    plain = dict(base, LD_LIBRARY_PATH=str(native_libs.folder))
    assert _version_under(plain, rpath_user)[0] == "99999"   # LD_LIBRARY_PATH alone loses to the RPATH
    env = flexrun.build_env([flexrun.Slice("h:1", "t")], native_libs.folder, base)
    assert _version_under(env, rpath_user) == ["22809", "libnccl.so.2"]   # rgpu's NCCL_VERSION_CODE (2.28.9)


def test_flexrun_preloads_rgpus_nccl_in_front_of_an_existing_preload_once(tmp_path: Path) -> None:
    env = flexrun.build_env([flexrun.Slice("h:1", "t")], tmp_path, {"LD_PRELOAD": "/opt/a.so:/opt/b.so"})
    assert env["LD_PRELOAD"] == f"{tmp_path}/libnccl.so.2 /opt/a.so /opt/b.so"
    nested = flexrun.build_env([flexrun.Slice("h:1", "t")], tmp_path, env)   # flexrun inside a flexrun job
    assert nested["LD_PRELOAD"] == env["LD_PRELOAD"]


def test_a_dispatcher_started_under_flexrun_does_not_preload_rgpus_nccl_into_its_workers(
        native_libs: build.Libraries) -> None:
    env = flexrun.build_env([flexrun.Slice("h:1", "t")], native_libs.folder, {"LD_PRELOAD": "/opt/a.so"})
    assert worker_environment(env)["LD_PRELOAD"] == "/opt/a.so"
