"""py_client: runs a small Python program that drives libcuda.so.1 through ctypes, for the data-path tests."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from rgpu.remoting.native import build
from tests.remoting.conftest import (PY, run_client)


HERE = Path(__file__).parent


def py_client(libs: build.Libraries, slices: str, code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a small Python program that drives libcuda.so.1 through ctypes (tests/remoting/ctcuda.py)."""
    program = f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ctcuda import *\nimport ctypes\n" + textwrap.dedent(code)
    return run_client(libs, slices, [PY, "-c", program], timeout=timeout, **env)
