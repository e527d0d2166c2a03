"""Tensor maps (JAX/XLA, Hopper's TMA kernels): cuTensorMapEncodeTiled, EncodeIm2col, EncodeIm2colWide
and ReplaceAddress travel to the worker, whose driver makes the private 128-byte encoding
(tests/remoting/tensor_map.c against an emulated worker, which encodes deterministically and checks
as CUDA documents; and through the real-GPU backend's ctypes calls, chained to an emulated worker)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rgpu.remoting.native import build, client_stats

from tests.remoting.conftest import Server, run_client


def _run(native_libs: build.Libraries, server: Server, binary: Path, mode: str, stats: Path, **extra: str) -> str:
    done = run_client(native_libs, server.slices(server.token()), [str(binary), mode], RGPU_CLIENT_STATS=str(stats),
                      **extra)
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0
    return done.stdout


def _round_trips(stats: Path) -> int:
    files = sorted(stats.parent.glob(stats.name + ".*"))
    assert len(files) == 1, files
    ops = {p.name: p for p in client_stats.parse(files[0].read_text())[0].values()}
    return ops["rgpuTensorMap"].sync_calls


@pytest.mark.parametrize("cache", ["1", "0"])
def test_tensor_maps_are_the_workers_encoding_and_repeats_are_answered_here(
        native_libs: build.Libraries, emulated: Server, tensor_map: Path, tmp_path: Path, cache: str) -> None:
    out = _run(native_libs, emulated, tensor_map, "encode", tmp_path / "p", RGPU_TENSOR_MAP_CACHE=cache)
    # The emulated encoding starts with the address: the device pointer as the worker has it.
    assert "MAP " in out
    # Five calls; with the cache on, the repeated encode is answered in the client.
    assert _round_trips(tmp_path / "p") == (4 if cache == "1" else 5)


def test_hostile_tensor_map_arguments_are_refused_with_cudas_errors(
        native_libs: build.Libraries, emulated: Server, tensor_map: Path, tmp_path: Path) -> None:
    _run(native_libs, emulated, tensor_map, "hostile", tmp_path / "p")
    # Sent: the three the driver refuses, rank 1, im2col and im2col-wide; the rest never left the client.
    assert _round_trips(tmp_path / "p") == 6


@pytest.mark.parametrize("mode", ["encode", "hostile"])
def test_the_real_gpu_backend_calls_the_drivers_tensor_map_entry_points(
        native_libs: build.Libraries, tensor_map: Path, chained: Server, tmp_path: Path,  # noqa: F811
        mode: str) -> None:
    done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)), [str(tensor_map), mode])
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
