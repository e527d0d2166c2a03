"""flexrun and the spin programs shared by the real-GPU tests."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

from rgpu.remoting.native import build
from rgpu.adaptor import AdaptorConf, AdaptorSlice, write_adaptor_conf

from tests.remoting.conftest import EXAMPLES, PY, Server


GiB = 1 << 30
HERE = Path(__file__).parent
OUT = Path(os.environ.get("RGPU_TEST_OUT", "/tmp"))


def flexrun(libs: build.Libraries, server: Server, tmp: Path, argv: list[str], *, memory: int = 4 * GiB,
            percent: int = 50, name: str = "app", timeout: float = 300, extra_env: dict[str, str] | None = None,
            slices: int = 1) -> subprocess.CompletedProcess[str]:
    token_slices = tuple(AdaptorSlice(server=server.address, gpu_uuid=server.gpus[0].uuid, gpu_index=0,
                                      memory_limit_bytes=memory, compute_percent=percent,
                                      token=server.token(memory_limit=memory, compute_percent=percent))
                         for _ in range(slices))
    conf = write_adaptor_conf(tmp / f"{name}.conf", AdaptorConf(job_id="gpu-test", user="tester", slices=token_slices))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    env.update({"RGPU_NATIVE_DIR": str(libs.folder), "PYTHONUNBUFFERED": "1", "RGPU_LOG": "info"})
    env.update(extra_env or {})
    done = subprocess.run([PY, "-m", "rgpu.remoting.client.flexrun", "-f", str(conf), "--", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    (OUT / f"gpu-{name}.log").write_text(f"$ flexrun {' '.join(argv)}\nexit {done.returncode}\n--- stdout\n"
                                          f"{done.stdout}\n--- stderr\n{done.stderr}\n")
    print(f"\n=== {name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def py(code: str) -> list[str]:
    return [PY, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r})\n" + textwrap.dedent(code)]


SPIN = """
import ctypes, time, json
from ctcuda import *
setup({device})
ptx = open({ptx!r}, "rb").read() + b"\\0"
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
check("cuModuleLoadData", ctypes.byref(mod), ptx)
check("cuModuleGetFunction", ctypes.byref(fn), mod, b"spin")
sms = ctypes.c_int()
check("cuDeviceGetAttribute", ctypes.byref(sms), 16, {device})
r, out = alloc(64)
iters = ctypes.c_int({iters})
ptr = ctypes.c_uint64(out)
params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(iters))
grid = sms.value * 16
check("cuLaunchKernel", fn, grid, 1, 1, 256, 1, 1, 0, None, params, None)
check("cuCtxSynchronize")
t0 = time.perf_counter()
for _ in range({launches}):
    check("cuLaunchKernel", fn, grid, 1, 1, 256, 1, 1, 0, None, params, None)
check("cuCtxSynchronize")
dt = time.perf_counter() - t0
flops = 4.0 * grid * 256 * {iters} * {launches}
print("SPIN", json.dumps({{"seconds": dt, "tflops": flops / dt / 1e12}}), flush=True)
"""


def spin_program(iters: int, launches: int, device: int = 0) -> list[str]:
    """A compute-bound loop on `device`; prints `SPIN {"seconds": .., "tflops": ..}`."""
    return py(SPIN.format(ptx=str(EXAMPLES / "vecadd.ptx"), iters=iters, launches=launches, device=device))


def spin_local(libs: build.Libraries, iters: int, launches: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RGPU_")}
    code = spin_program(iters, launches)
    done = subprocess.run(code, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.split("SPIN ", 1)[1])["tflops"]
