"""py_client: runs a small Python program that drives libcuda.so.1 through ctypes, for the data-path tests."""

from __future__ import annotations

import struct
import subprocess
import textwrap
from pathlib import Path
from rgpu.remoting.native import build
from tests.remoting.conftest import (EXAMPLES, PY, run_client)


HERE = Path(__file__).parent


def py_client(libs: build.Libraries, slices: str, code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a small Python program that drives libcuda.so.1 through ctypes (tests/remoting/ctcuda.py)."""
    program = f"import sys; sys.path.insert(0, {str(HERE)!r})\nfrom ctcuda import *\nimport ctypes\n" + textwrap.dedent(code)
    return run_client(libs, slices, [PY, "-c", program], timeout=timeout, **env)


def vecadd_container_for(arch: int) -> bytes:
    """examples/cuda/vecadd.fatbin's one container (an sm_90 cubin and compute_90 PTX) with every
    entry's architecture set to `arch` (100: code no Hopper GPU runs)."""
    image = bytearray((EXAMPLES / "vecadd.fatbin").read_bytes())
    _magic, _version, header, body = struct.unpack_from("<IHHQ", image)
    at, end = header, header + body
    while at + 16 <= end:
        _kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", image, at)
        struct.pack_into("<I", image, at + 28, arch)
        at += entry_header + payload
    return bytes(image[:end])

