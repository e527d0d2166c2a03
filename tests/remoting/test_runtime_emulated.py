"""CUDA-runtime programs built with nvcc (cudart static and shared) run through rgpu's libcuda.so.1
against an emulated worker: the runtime initialises on rgpu's export tables (its integrity check
included), and moves data through rgpu. Kernel launches are refused by the emulated device, so the
program runs without `launch` here; tests/remoting/test_gpu.py launches on a real GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rgpu.remoting.native import build

from tests.remoting.conftest import Server, run_client
from tests.remoting.conftest import _cudart_dir, build_runtime_program
from tests.remoting.runtime_helpers import _run


def test_runtime_program_initialises_and_moves_data_through_rgpu(native_libs: build.Libraries, emulated: Server,
                                                                 runtime_demo: tuple[str, Path]) -> None:
    kind, program = runtime_demo
    done = _run(native_libs, emulated, program)
    out = done.stdout
    # The runtime accepted rgpu's export tables (a wrong integrity hash fails here with error 801/999).
    assert "VERSIONS runtime 13000 driver 13000" in out, out + done.stderr
    assert "DEVICES 1" in out
    assert "DEVICE NVIDIA H200 cc 9.0 mem 1073741824" in out  # the slice's memory
    for step in ("cudaSetDevice(0)", "cudaFree(0)", "cudaMalloc(&da, bytes)", "cudaMemGetInfo(&free_b, &total_b)",
                 "cudaMemcpy(da, ha, bytes, cudaMemcpyHostToDevice)", "cudaMemset(dc, 0x3f, bytes)",
                 "cudaMemcpy(hc, dc, bytes, cudaMemcpyDeviceToHost)",
                 "cudaMemcpy(dc, da, bytes, cudaMemcpyDeviceToDevice)", "cudaFree(da)", "cudaDeviceReset()"):
        assert f"OK {step}" in out, f"{kind}: {step}\n{out}\n{done.stderr}"
    assert "MEMSET ok" in out and "ROUNDTRIP ok" in out
    # Module registration reached the worker: cudart loaded its fatbin through cuLibraryLoadData and
    # asked for the kernel (the emulated device knows no kernels inside fatbins: NOT_FOUND).
    assert ("OK cudaFuncGetAttributes" in out) or ("cudaFuncGetAttributes(&attr, scale_add): named symbol not found"
                                                   in out), out
    # No crash, no lost session at exit (cudart's teardown runs after rgpu said goodbye).
    assert "lost the session" not in done.stderr, done.stderr
    assert done.returncode in (0, 1)
    assert "RUNTIME" in out.splitlines()[-1]


def test_runtime_sees_no_device_without_slices(native_libs: build.Libraries, runtime_demo: tuple[str, Path]) -> None:
    _kind, program = runtime_demo
    cudart = _cudart_dir()
    env = {"LD_LIBRARY_PATH": f"{native_libs.folder}{os.pathsep}{cudart}" if cudart else str(native_libs.folder)}
    done = run_client(native_libs, "", [str(program)], timeout=60, **env)
    assert done.returncode == 1
    assert "DEVICES 0" in done.stdout or "FAIL cudaGetDeviceCount" in done.stdout, done.stdout + done.stderr


@pytest.fixture(scope="module")
def graph_host_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_runtime_program(tmp_path_factory, "graph_host_nodes.cu", "static")


def test_runtime_host_functions_in_graphs_run_in_the_client(native_libs: build.Libraries, emulated: Server,
                                                           graph_host_nodes: Path) -> None:
    """simpleCudaGraphs' pattern: cudaLaunchHostFunc inside a stream capture, cudaGraphAddHostNode in a
    graph built by hand; each host function runs in the application's process, in graph order."""
    done = _run(native_libs, emulated, graph_host_nodes)
    out = done.stdout
    assert "CAPTURED 4 nodes, 0 host calls so far" in out, out + done.stderr
    assert "ORDER 1 2 1 2 1 2" in out
    assert "VALUES 0 0" in out
    assert "HOSTNODE type 3 fn same user 10" in out   # cudaGraphNodeTypeHost
    assert "BUILT 10 11" in out
    assert "BUILT VALUES 6 5" in out
    assert "REPORTED 1010101 1010101 RESULT 0" in out   # the callback saw the copy node's result, and reset it
    assert "GRAPHS OK" in out
    assert done.returncode == 0


@pytest.fixture(scope="module", params=["static", "shared"])
def texture_demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build_runtime_program(tmp_path_factory, "texture_demo.cu", request.param)


def test_runtime_arrays_textures_and_surfaces_move_data_through_rgpu(native_libs: build.Libraries, emulated: Server,
                                                                      texture_demo: tuple[str, Path],
                                                                      tmp_path: Path) -> None:
    # cudaMallocArray/cudaMalloc3DArray (cuArray3DCreate_v2), cudaMemcpy2DToArray/FromArray/ArrayToArray and
    # cudaMemcpy3D (cuMemcpy3D_v2, cuMemcpy3DAsync_v2), texture objects on arrays, linear and pitched
    # memory and a mipmapped array, a surface object, the deprecated cudaMemcpyToArray/FromArray: every
    # memory path, bytes compared (kernels need a real GPU: test_gpu_runtime.py).
    kind, program = texture_demo
    stats = tmp_path / "stats"
    done = _run(native_libs, emulated, program, RGPU_CLIENT_STATS=str(stats))
    out = done.stdout
    for line in ("SAME array round trip", "SAME array to pitched memory", "SAME 3D array round trip",
                 "SAME linear span through an array", "SAME mipmap level round trip",
                 "OK cudaCreateTextureObject(&tex_mip, &rm, &tdm, NULL)", "OK cudaFreeMipmappedArray(mip)",
                 "SAME texture resource read back", "SAME texture descriptor read back",
                 "OK cudaMemcpy2DArrayToArray", "OK cudaMemcpy2DToArrayAsync", "OK cudaCreateSurfaceObject(&surf, &rs)",
                 "ARRAYINFO 32 0 0 0 kind 2 extent 37 19 0 flags 0", "TEXTURE OK"):
        assert line in out, f"{kind}: {line}\n{out}\n{done.stderr}"
    assert done.returncode == 0
    # The runtime asks for each array's descriptor before every copy and texture object: answered
    # in the client after the first time (one round trip per array: five, and a mipmap level).
    report = subprocess.run([sys.executable, "-m", "rgpu.remoting.native.client_stats", *map(str, tmp_path.glob("stats.*"))],
                            capture_output=True, text=True, check=True).stdout
    row = next(line for line in report.splitlines() if line.startswith("cuArray3DGetDescriptor_v2"))
    assert int(row.split()[1]) <= 6, report
