"""The trace tool (python -m rgpu.remoting.native.trace): counts every driver entry point, export
table slot and NVML call an application makes. On a GPU node it wraps NVIDIA's driver; here it
wraps rgpu's own libcuda.so.1 (against an emulated worker), which exercises the same trampolines,
cuGetProcAddress and export-table wrapping, and the integrity digest over the wrapped tables."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import EXAMPLES, Server, client_env


@pytest.fixture(scope="module")
def runtime_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc not found (install the CUDA toolkit to build CUDA-runtime test programs)")
    out = tmp_path_factory.mktemp("trace") / "runtime_demo"
    done = subprocess.run([nvcc, "-O2", "-gencode", "arch=compute_90,code=[sm_90,compute_90]",
                           str(EXAMPLES / "runtime_demo.cu"), "-o", str(out)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return out


def test_trace_counts_entry_points_export_slots_and_keeps_the_runtime_working(
        native_libs: build.Libraries, emulated: Server, runtime_program: Path, tmp_path: Path) -> None:
    assert (native_libs.folder / "trace" / "libcuda.so.1").exists()
    env = client_env(native_libs, emulated.slices(emulated.token(memory_limit=1 << 30)))
    env["LD_LIBRARY_PATH"] = ""
    env["RGPU_NATIVE_DIR"] = str(native_libs.folder)
    env["RGPU_TRACE_REAL_CUDA"] = str(native_libs.libcuda)  # "the real driver" here
    report = tmp_path / "report.txt"
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.native.trace", "-o", str(report), "--",
                           str(runtime_program)], env=env, capture_output=True, text=True, timeout=120, check=False)
    # The runtime initialised through the wrapped tables: the digest over the copies was accepted.
    assert "OK cudaMalloc(&da, bytes)" in done.stdout, done.stdout + done.stderr
    assert "ROUNDTRIP ok" in done.stdout
    text = report.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# rgpu trace: 1 process(es)") and str(runtime_program) in lines[0]

    def count(name: str) -> int:
        for line in lines:
            parts = line.split(None, 2)
            if len(parts) == 3 and parts[0] == "cuda" and parts[2].split("  [")[0] == name:
                return int(parts[1])
        return 0

    assert count("cuGetProcAddress_v2") > 100  # cudart resolves the driver through it
    assert count("cuLibraryLoadData") == 1     # module registration (lazy loading)
    assert count("cuMemAlloc") == 3 and count("cuMemFree") >= 3
    assert count("export INTEGRITY_CHECK slot 1") >= 1
    assert count("export c693336e-1121-df11-a8c3-68f355d89593 slot 2") >= 1  # context-local storage get
    assert "table f8cff951-2146-8b4e-b9e2-fb469e7c0dd9 NOT_FOUND" in text
    assert "table 6bd5fb6c-5bf4-e74a-8987-d93912fd9df9 found (13 slots)" in text
    assert "cuMemAlloc  [manual]" in text
    assert text.rstrip().splitlines()[-1].startswith("# 0 entry point(s) used that rgpu does not remote")


def test_trace_names_what_rgpu_does_not_remote() -> None:
    from collections import Counter

    from rgpu.remoting.native.trace import render
    counts = Counter({("cuda", "cuMemAlloc"): 2, ("cuda", "cuGraphAddExternalSemaphoresSignalNode"): 1, ("nvml", "nvmlInit_v2"): 1,
                      ("cuda", "export 21318c60-9714-3248-8ca6-41ff7324c8f2 slot 4"): 3,
                      ("cuda", "export 6e163fbe-b958-444d-835c-e182aff1991e slot 7"): 1})
    text = render(counts, set(), ["1 /bin/app"])
    assert "cuGraphAddExternalSemaphoresSignalNode  [NOT REMOTED]" in text
    assert "export 21318c60-9714-3248-8ca6-41ff7324c8f2 slot 4  [answered in the client]" in text
    assert "export 6e163fbe-b958-444d-835c-e182aff1991e slot 7  [NOT ANSWERED]" in text
    assert text.rstrip().endswith("used that rgpu does not remote: cuGraphAddExternalSemaphoresSignalNode, "
                                  "export 6e163fbe-b958-444d-835c-e182aff1991e slot 7")
