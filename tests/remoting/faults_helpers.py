"""The attacker programs and client runner shared by the fault and runaway tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rgpu.remoting.native import build

from tests.remoting.conftest import client_env


HERE = Path(__file__).parent
PY = sys.executable
FAKE_PTX = """.version 8.0
.target sm_90
.address_size 64
.visible .entry rgpu_emulated_wild_write(.param .u64 p) { ret; }
.visible .entry rgpu_emulated_spin_forever() { ret; }
"""
PRELUDE = f"import sys, os, time; sys.path.insert(0, {str(HERE)!r})\nfrom ctcuda import *\nimport ctypes\n"


def launch_fake(kernel: str) -> str:
    """Client code: load the fake kernels and launch one."""
    return f"""
        ptx = {FAKE_PTX!r}.encode() + b"\\0"
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        check("cuModuleLoadData", ctypes.byref(mod), ptx)
        check("cuModuleGetFunction", ctypes.byref(fn), mod, {kernel.encode()!r})
        arg = ctypes.c_uint64(0xdead0000)
        params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
        print("LAUNCH", lib.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, params, None), flush=True)
        """


def attacker_code(kernel: str, tail: str) -> str:
    return "setup()\n" + textwrap.dedent(launch_fake(kernel)) + textwrap.dedent(tail)


def start_client(libs: build.Libraries, slices: str, code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-c", PRELUDE + textwrap.dedent(code)], env=client_env(libs, slices),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 30.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} line; stderr: {proc.stderr.read() if proc.stderr else ''}")
