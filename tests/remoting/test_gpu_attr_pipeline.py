"""Pipelined attribute sets and remoted tensor maps on NVIDIA's driver (issue 24).

Run on a GPU machine:  python -m pytest -m gpu tests/remoting/test_gpu_attr_pipeline.py -v -s
(CPU-only CI skips them; test_attr_pipeline_emulated.py and test_tensor_map_emulated.py cover the
same programs against the emulated worker.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rgpu.remoting.native import build, client_stats

from tests.remoting.conftest import Server
from tests.remoting.gpu_helpers import flexrun

pytestmark = pytest.mark.gpu


def _profile(stats: Path) -> dict[str, client_stats.OpProfile]:
    # PATH.<pid> only: the run's own files (its adaptor.conf) share the prefix
    files = sorted(f for f in stats.parent.glob(stats.name + ".*") if f.suffix[1:].isdigit())
    assert len(files) == 1, files
    return {p.name: p for p in client_stats.parse(files[0].read_text())[0].values()}


def _run(libs: build.Libraries, server: Server, tmp: Path, argv: list[str], name: str, **env: str) -> str:
    done = flexrun(libs, server, tmp, argv, name=name, extra_env=env)
    assert done.returncode == 0 and "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    return done.stdout


def test_changing_dynamic_shared_memory_before_each_launch_makes_no_round_trip_on_the_gpu(
        native_libs: build.Libraries, attr_loop: Path, gpu_server: Server, tmp_path: Path) -> None:  # noqa: F811
    # Each launch stores its dynamic shared memory size at the end of that memory and reads it back:
    # the program checks every launch got the size set before it (up to 146000 bytes, past 48 KiB).
    _run(native_libs, gpu_server, tmp_path, [str(attr_loop), "loop", "3"], "attrs-few",
         RGPU_CLIENT_STATS=str(tmp_path / "few"))
    _run(native_libs, gpu_server, tmp_path, [str(attr_loop), "loop", "200"], "attrs-many",
         RGPU_CLIENT_STATS=str(tmp_path / "many"))
    few, many = _profile(tmp_path / "few"), _profile(tmp_path / "many")
    round_trips = {name: (few[name].sync_calls if name in few else 0, p.sync_calls) for name, p in many.items()
                   if p.sync_calls}
    assert all(a == b for a, b in round_trips.values()), round_trips
    assert many["rgpuSetAttribute"].async_calls == 3 * 200
    assert "cuFuncSetAttribute" not in many and "cuKernelSetAttribute" not in many


def test_values_cuda_refuses_fail_at_once_on_the_gpu(native_libs: build.Libraries, attr_loop: Path,  # noqa: F811
                                                     gpu_server: Server, tmp_path: Path) -> None:  # noqa: F811
    _run(native_libs, gpu_server, tmp_path, [str(attr_loop), "invalid"], "attrs-invalid")


def test_tensor_maps_are_the_drivers_encoding(native_libs: build.Libraries, tensor_map: Path,  # noqa: F811
                                             gpu_server: Server, tmp_path: Path) -> None:  # noqa: F811
    # Without the client's cache both encodes reach the driver: equal bytes for equal arguments are
    # what makes the cache safe. With it, the second is answered in the client.
    for cache in ("0", "1"):
        out = _run(native_libs, gpu_server, tmp_path, [str(tensor_map), "encode"], f"tmap-{cache}",
                   RGPU_TENSOR_MAP_CACHE=cache, RGPU_CLIENT_STATS=str(tmp_path / f"tmap-{cache}"))
        assert "OK identical encodes give identical bytes" in out and "OK back at the first address" in out
        assert _profile(tmp_path / f"tmap-{cache}")["rgpuTensorMap"].sync_calls == (5 if cache == "0" else 4)


def test_hostile_tensor_map_arguments_get_cudas_errors_on_the_gpu(native_libs: build.Libraries, tensor_map: Path,  # noqa: F811
                                                                 gpu_server: Server, tmp_path: Path) -> None:  # noqa: F811
    done = flexrun(native_libs, gpu_server, tmp_path, [str(tensor_map), "hostile"], name="tmap-hostile")
    print(done.stdout)
    # What the client refuses, and the driver's documented refusals; the im2col lines are printed only
    # (their parameters are the emulated worker's idea of valid, not yet checked against a driver).
    for check in ("rank 0", "rank 6", "rank 2^32-1", "no map", "a map not 64-byte aligned", "no dimensions",
                  "no strides at rank 2", "no box", "no element strides", "a box of 512",
                  "a stride not a multiple of 16", "an address not 16-byte aligned", "rank 1 needs no strides",
                  "im2col at rank 2", "im2col without corners"):
        assert f"OK {check}\n" in done.stdout, check
