"""Launches with attributes (cuLaunchKernelEx) on NVIDIA's driver: the worker's C loop runs them
(cuBLAS and cuDNN launch their Hopper kernels with cluster dimensions and programmatic
serialisation; through the generic Python path each cost ~12 us), with a launch-completion event
translated from the client's handle to the driver's.

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_launch_attributes.py -v -s
(CPU-only CI skips it; tests/remoting/test_native_launches.py covers the loop with a recording
cuLaunchKernelEx in place of the driver's.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, HERE, Server, driver_api_program
from tests.remoting.gpu_helpers import flexrun

pytestmark = pytest.mark.gpu
ROUNDS = 300


def test_attributed_launches_run_in_the_c_loop_and_add_up_on_the_gpu(native_libs: build.Libraries,
                                                                     gpu_server: Server, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    program = driver_api_program(native_libs, HERE / "launch_attributes.c", tmp_path / "launch_attributes")
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))   # the session server's workers inherit it
    done = flexrun(native_libs, gpu_server, tmp_path, [str(program), str(EXAMPLES / "vecadd.ptx"), str(ROUNDS)],
                   name="launch-attributes", percent=100)
    assert done.returncode == 0 and "RESULT OK" in done.stdout, done.stdout + done.stderr
    deadline = time.monotonic() + 20
    while not (reports := list(tmp_path.glob("worker-*.json"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert reports, "the worker wrote no profile"
    report = json.loads(reports[0].read_text())
    generic = {k: v for k, v in report["generic_launches"].items() if k.startswith("attributes")}
    # The kernel's first launch is the Python worker's (it admits the kernel); the rest are C's.
    assert sum(generic.values()) <= 1, report["generic_launches"]
    assert report["native_launches"] >= 2 * ROUNDS - 1, report
