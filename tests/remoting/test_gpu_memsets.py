"""Pipelined 1-D memsets (cuMemsetD8Async, cuMemsetD16Async, cuMemsetD32Async) on NVIDIA's driver:
the worker's C loop runs them (PyTorch zeroes gradients and workspaces so, ~22 per ResNet-18 step;
through the generic Python path each cost 10-15 us and ended the loop's run), and the bytes read
back are the ones each memset set.

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_memsets.py -v -s
(CPU-only CI skips it; tests/remoting/test_native_memsets.py covers the loop with recording entry
points, and the same program through the chained backend.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import HERE, Server, driver_api_program
from tests.remoting.gpu_helpers import flexrun
from tests.remoting.worker_profiles import profile_total

pytestmark = pytest.mark.gpu
ROUNDS = 300


def test_memsets_of_each_width_run_in_the_c_loop_and_set_their_bytes_on_the_gpu(
        native_libs: build.Libraries, gpu_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = driver_api_program(native_libs, HERE / "memsets.c", tmp_path / "memsets")
    monkeypatch.setenv("RGPU_WORKER_PROFILE", str(tmp_path))   # the session server's workers inherit it
    done = flexrun(native_libs, gpu_server, tmp_path, [str(program), str(ROUNDS)], name="memsets", percent=100)
    assert done.returncode == 0 and "RESULT OK" in done.stdout, done.stdout + done.stderr
    # Every memset, the NULL stream's first one included, ran in C.
    assert profile_total(tmp_path, "native_memsets", 3 * ROUNDS + 1) >= 3 * ROUNDS + 1
