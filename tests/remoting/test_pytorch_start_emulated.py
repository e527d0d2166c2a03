"""PyTorch's start through rgpu, on the emulated GPU: `import torch` with rgpu's libraries as flexrun
sets them (libnccl.so.2 preloaded), CUDA initialised, the device seen, and no "not remoted" line.
Two failures of PyTorch 2.14.1 were found this way: its libtorch_cuda.so links NCCL 2.30 calls rgpu's
libnccl.so.2 lacked (`import torch` failed), and its start-up `cuLogsRegisterCallback` printed a line
on every run. Needs a Python with torch: this one, or $RGPU_TEST_TORCH_PYTHON; skipped without."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from rgpu.remoting.client.flexrun import library_env
from rgpu.remoting.native import build

from tests.remoting.conftest import EMULATED_GPU, Server, client_env


def torch_python() -> str:
    for python in (os.environ.get("RGPU_TEST_TORCH_PYTHON", ""), sys.executable):
        if python and shutil.which(python) and subprocess.run([python, "-c", "import torch"], capture_output=True,
                                                              timeout=120, check=False).returncode == 0:
            return python
    pytest.skip("no Python with torch here (set RGPU_TEST_TORCH_PYTHON to one)")


def test_pytorch_starts_through_rgpu_as_flexrun_runs_it(native_libs: build.Libraries, emulated: Server) -> None:
    python = torch_python()
    env = client_env(native_libs, emulated.slices(emulated.token()))
    env.update(library_env(native_libs.folder, env))
    done = subprocess.run([python, "-c", "import torch; torch.cuda.init(); "
                           "print('DEVICES', torch.cuda.device_count(), torch.cuda.get_device_name(0))"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"DEVICES 1 {EMULATED_GPU.name}" in done.stdout, done.stdout
    assert "not remoted" not in done.stderr and "not supported by rgpu" not in done.stderr, done.stderr
