"""rgpu's libnvidia-ml.so.1 through nvidia-ml-py (pynvml): the slice's memory, not the GPU's."""

from __future__ import annotations

import textwrap
from pathlib import Path

from rgpu.remoting.native import build

from tests.remoting.conftest import PY, Server, run_client

HERE = Path(__file__).parent


def test_pynvml_sees_the_slice_and_what_its_sessions_hold(native_libs: build.Libraries, emulated: Server) -> None:
    limit = 256 << 20
    token = emulated.token(memory_limit=limit, job_key="nvml")
    done = run_client(native_libs, emulated.slices(token), [PY, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        from ctcuda import *
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        print("COUNT", pynvml.nvmlDeviceGetCount())
        print("NAME", pynvml.nvmlDeviceGetName(h))
        print("UUID", pynvml.nvmlDeviceGetUUID(h))
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        print("BEFORE", m.total, m.used, m.free)
        setup()
        r, p = alloc(100 << 20)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        print("AFTER", m.total, m.used, m.free)
        print("CC", pynvml.nvmlDeviceGetCudaComputeCapability(h))
        print("PROCS", pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        print("DRIVER", pynvml.nvmlSystemGetDriverVersion())
        print("CUDA", pynvml.nvmlSystemGetCudaDriverVersion())
        try:
            pynvml.nvmlDeviceGetFanSpeed(h)
        except pynvml.NVMLError_NotSupported:
            print("FAN not supported")
        try:
            pynvml.nvmlDeviceGetEncoderSessions(h)
        except pynvml.NVMLError_NotSupported:
            print("UNREMOTED not supported")
        pynvml.nvmlShutdown()
        """)])
    out = done.stdout
    assert "COUNT 1" in out, out + done.stderr
    assert "NAME NVIDIA H200" in out
    assert f"UUID {emulated.gpus[0].uuid}" in out
    assert f"BEFORE {limit} 0 {limit}" in out
    assert f"AFTER {limit} {100 << 20} {limit - (100 << 20)}" in out
    assert "CC (9, 0)" in out
    assert "PROCS []" in out
    assert "FAN not supported" in out and "UNREMOTED not supported" in out
    assert "CUDA 13000" in out
