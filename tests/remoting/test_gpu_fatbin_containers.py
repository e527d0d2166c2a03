"""A fatbin load on a real GPU: rgpu sends the one container cudart registered, sized by its
header, never the containers after it (a library's .nv_fatbin: one per translation unit). This
checks that NVIDIA's driver reads a container the same way: for a container followed by others,
the load's result and the kernels it finds are the same locally and through rgpu.

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_fatbin_containers.py -v -s
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.client_helpers import vecadd_container_for
from tests.remoting.conftest import Server
from tests.remoting.gpu_helpers import flexrun, py

pytestmark = pytest.mark.gpu

PROGRAM = """
from ctcuda import *
setup()
for name in ("sm90-then-foreign", "foreign-then-sm90", "foreign-alone"):
    data = open({folder!r} + "/" + name, "rb").read()
    buf = ctypes.create_string_buffer(data, len(data))
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    r = lib.cuModuleLoadData(ctypes.byref(mod), buf)
    found = lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"vecadd") if r == 0 else -1
    print("LOAD", name, r, found, flush=True)
"""


def test_the_driver_and_rgpu_agree_on_containers_back_to_back(native_libs: build.Libraries,
                                                              gpu_server: Server,  # noqa: F811
                                                              tmp_path: Path) -> None:
    sm90, foreign = vecadd_container_for(90), vecadd_container_for(100)
    for name, parts in {"sm90-then-foreign": [sm90, foreign], "foreign-then-sm90": [foreign, sm90],
                        "foreign-alone": [foreign]}.items():
        (tmp_path / name).write_bytes(b"".join(parts))
    argv = py(PROGRAM.format(folder=str(tmp_path)))
    local = subprocess.run(argv, env={k: v for k, v in os.environ.items() if not k.startswith("RGPU_")},
                           capture_output=True, text=True, timeout=120, check=False)
    assert local.returncode == 0, local.stdout + local.stderr
    through = flexrun(native_libs, gpu_server, tmp_path, argv, name="fatbin-containers")
    assert through.returncode == 0, through.stdout + through.stderr
    lines = sorted(line for line in local.stdout.splitlines() if line.startswith("LOAD"))
    print("NVIDIA's driver:", lines)
    assert "LOAD sm90-then-foreign 0 0" in lines
    assert sorted(line for line in through.stdout.splitlines() if line.startswith("LOAD")) == lines
