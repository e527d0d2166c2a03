"""Issue 27 on real GPUs: two ranks, one whole-GPU slice each on a different GPU of this host, their
workers running NVIDIA's NCCL among themselves. Run on a machine with two GPUs:

    RGPU_NCCL_LIBRARY=/path/to/libnccl.so.2 python -m pytest -m gpu -s tests/remoting/test_gpu_nccl.py

(RGPU_NCCL_LIBRARY defaults to the nvidia-nccl wheel's library where one is installed. Skipped with
fewer than two GPUs.) Results must equal numpy's, as on the emulated GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from rgpu.model import GpuInfo
from rgpu.remoting.native import build

from .conftest import Server, client_env, local_gpu, start_server
from .test_gpu_two_gpus import nvml_gpus
from .test_nccl_emulated import _check, nccl_ranks  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu


def _wheel_nccl() -> str:
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "nccl" / "lib" / "libnccl.so.2"
        if lib.exists():
            return str(lib)
    return ""


@pytest.fixture(scope="module")
def two_gpu_server() -> Iterator[Server]:
    gpus = nvml_gpus()
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    first = local_gpu()
    infos = [GpuInfo(uuid=uuid, index=i, name=first.name, total_memory_bytes=total, usable_memory_bytes=total,
                     compute_capability=first.compute_capability) for i, (uuid, total) in enumerate(gpus[:2])]
    server, address = start_server("cuda", infos)
    try:
        yield Server(server, address, infos)
    finally:
        server.stop()


def test_two_ranks_on_two_gpus_run_real_nccl_collectives(nccl_ranks: Path, native_libs: build.Libraries,  # noqa: F811
                                                          two_gpu_server: Server, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.environ.get("RGPU_NCCL_LIBRARY"):
        found = _wheel_nccl()
        if not found:
            pytest.skip("no NCCL: set RGPU_NCCL_LIBRARY to a libnccl.so.2")
        monkeypatch.setenv("RGPU_NCCL_LIBRARY", found)
    s = two_gpu_server
    procs = []
    for rank in range(2):   # one whole-GPU slice each, on GPU `rank`
        slices = s.slices(s.token(memory_limit=8 << 30, compute_percent=100, gpu=s.gpus[rank], job_key=f"rank{rank}"))
        procs.append(subprocess.Popen([str(nccl_ranks), "rank", str(rank), "2", str(tmp_path / "id"), "1000",
                                       str(tmp_path / f"out.{rank}")], env=client_env(native_libs, slices),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        print(f"rank {rank}: {out}{err}")
        assert p.returncode == 0 and out.strip() == "OK", f"rank {rank}: {out}{err}"
        _check(tmp_path / f"out.{rank}", rank, 2)
