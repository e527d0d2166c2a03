"""Issue 27 on real GPUs: two ranks, one whole-GPU slice each on a different GPU of this host, their
workers running NVIDIA's NCCL among themselves. Run on a machine with two GPUs:

    RGPU_NCCL_LIBRARY=/path/to/libnccl.so.2 python -m pytest -m gpu -s tests/remoting/test_gpu_nccl.py

(RGPU_NCCL_LIBRARY defaults to the nvidia-nccl wheel's library where one is installed. Skipped with
fewer than two GPUs.) Results must equal numpy's, as on the emulated GPU; PyTorch DDP's losses must
equal a local run's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from rgpu.model import GpuInfo
from rgpu.remoting.native import build

from .conftest import Server, client_env, local_gpu, start_server
from .two_gpus_helpers import nvml_gpus
from .nccl_helpers import _check, _check_outputs, _expected_more, _expected_scale, _scale_lines

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


def _use_real_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' NCCL: RGPU_NCCL_LIBRARY, else the nvidia-nccl wheel's; skip without one."""
    if not os.environ.get("RGPU_NCCL_LIBRARY"):
        found = _wheel_nccl()
        if not found:
            pytest.skip("no NCCL: set RGPU_NCCL_LIBRARY to a libnccl.so.2")
        monkeypatch.setenv("RGPU_NCCL_LIBRARY", found)


def _run_two_ranks(mode: str, nccl_ranks: Path, native_libs: build.Libraries, s: Server,
                   tmp_path: Path) -> list[tuple[int, str, str]]:
    """nccl_ranks.c's `mode` as two ranks, one whole-GPU slice each on GPU `rank`: (exit, stdout, stderr)."""
    procs = []
    for rank in range(2):
        slices = s.slices(s.token(memory_limit=8 << 30, compute_percent=100, gpu=s.gpus[rank], job_key=f"{mode}{rank}"))
        procs.append(subprocess.Popen([str(nccl_ranks), mode, str(rank), "2", str(tmp_path / "id"), "1000",
                                       str(tmp_path / f"out.{rank}")], env=client_env(native_libs, slices),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        print(f"rank {rank}: {out}{err}")
        results.append((p.returncode, out, err))
    return results


def test_two_ranks_on_two_gpus_run_real_nccl_collectives(nccl_ranks: Path, native_libs: build.Libraries,
                                                          two_gpu_server: Server, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _use_real_nccl(monkeypatch)
    for rank, (code, out, err) in enumerate(_run_two_ranks("rank", nccl_ranks, native_libs, two_gpu_server, tmp_path)):
        assert code == 0 and out.strip() == "OK", f"rank {rank}: {out}{err}"
        _check(tmp_path / f"out.{rank}", rank, 2)


def test_two_ranks_on_two_gpus_split_premulsum_alltoall_nonblocking_and_finalize_with_real_nccl(
        nccl_ranks: Path, native_libs: build.Libraries, two_gpu_server: Server, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl_ranks.c's `more` (what ProcessGroupNCCL adds) on the workers' real NCCL; numpy's results."""
    _use_real_nccl(monkeypatch)
    for rank, (code, out, err) in enumerate(_run_two_ranks("more", nccl_ranks, native_libs, two_gpu_server, tmp_path)):
        assert code == 0 and out.splitlines() == ["split 0 of 1", "OK"], f"rank {rank}: {out}{err}"
        data, at = (tmp_path / f"out.{rank}").read_bytes(), 0
        for name, want in _expected_more(rank, 2):
            got = np.frombuffer(data, dtype=want.dtype, count=want.size, offset=at)
            at += want.nbytes
            assert np.array_equal(got, want), f"rank {rank}: {name} differs from numpy's"


def test_two_ranks_on_two_gpus_init_scalable_and_shrink_with_real_nccl(
        nccl_ranks: Path, native_libs: build.Libraries, two_gpu_server: Server, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl_ranks.c's `scale` on the workers' real NCCL: ncclCommInitRankScalable with two ids (one made
    by each rank's worker), then rank 1 alone shrinks rank 0 away (NCCL's ncclCommShrink); numpy's results."""
    _use_real_nccl(monkeypatch)
    for rank, (code, out, err) in enumerate(_run_two_ranks("scale", nccl_ranks, native_libs, two_gpu_server, tmp_path)):
        assert code == 0 and out.splitlines() == _scale_lines(rank, 2), f"rank {rank}: {out}{err}"
        _check_outputs(tmp_path / f"out.{rank}", _expected_scale(rank, 2), f"rank {rank}")


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("shape", "ranks_per_root"), [("per-task", ""), ("local-rank", ""), ("per-task", "1")],
                         ids=["per-task", "local-rank", "per-task-scalable-init"])
def test_pytorch_ddp_with_the_nccl_backend_through_rgpu_has_a_local_runs_losses(shape: str, ranks_per_root: str,
                                                                             tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/ddp_train.py's DDP (2 ranks, NCCL backend, an MLP of three 4096-wide layers) locally and
    through rgpu (one whole-GPU slice per rank, each on its own GPU and session server), in the shape
    named: each rank sees only its slice (per-task), or both and picks LOCAL_RANK. Losses within 1e-5.
    TORCH_NCCL_RANKS_PER_ROOT=1 makes PyTorch form its communicators with ncclCommInitRankScalable (one
    root, and id, per rank) as it does above 128 ranks."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    if len(nvml_gpus()) < 2:
        pytest.skip("needs two GPUs")
    _use_real_nccl(monkeypatch)
    env = dict(os.environ)
    if ranks_per_root:
        env["TORCH_NCCL_RANKS_PER_ROOT"] = ranks_per_root
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_train.py"), "--steps", "5", "--mib", "16",
                           "--shapes", shape, "--json", "--timeout", "400"], env=env, capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, check=False)
    print(done.stdout, done.stderr[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    local, remote = results["local"], results[f"rgpu {shape}"]
    assert "failed" not in local, local
    assert "failed" not in remote, remote["failed"]
    assert len(remote["losses"]) == len(local["losses"]) == 8
    worst = max(abs(a - b) for a, b in zip(remote["losses"], local["losses"]))
    assert worst <= 1e-5, (remote["losses"], local["losses"])
