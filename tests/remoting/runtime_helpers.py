"""The runner shared by the runtime-API tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rgpu.remoting.native import build

from tests.remoting.conftest import Server, _cudart_dir, run_client


GiB = 1 << 30


def _run(libs: build.Libraries, emulated: Server, program: Path, **env: str) -> subprocess.CompletedProcess[str]:
    slices = emulated.slices(emulated.token(memory_limit=GiB))
    cudart = _cudart_dir()
    extra = {"LD_LIBRARY_PATH": f"{libs.folder}{os.pathsep}{cudart}" if cudart else str(libs.folder)}
    extra.update(env)
    return run_client(libs, slices, [str(program)], timeout=120, **extra)
