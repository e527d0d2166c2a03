"""Attribute sets without a round trip (issue 24): cuFuncSetAttribute and cuKernelSetAttribute of
the maximum dynamic shared memory and the carveout are checked in the client as CUDA checks them
and travel pipelined, ahead of the launches after them (tests/remoting/attr_loop.c against an
emulated worker, which enforces the same limits and runs the program's kernel by name). Occupancy
and limits are answered per slice when an application's slices differ."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rgpu.remoting.native import build, client_stats

from rgpu.model import GpuInfo
from tests.remoting.conftest import EMULATED_GPU, Server, run_client, serving

EMULATED_A100 = GpuInfo(uuid="GPU-32345678-1234-1234-1234-123456789abc", index=1, name="NVIDIA A100-SXM4-80GB",
                        total_memory_bytes=80 << 30, usable_memory_bytes=80 << 30, compute_capability="8.0")


@pytest.fixture
def h200_and_a100() -> Iterator[Server]:
    with serving("emulated", [EMULATED_GPU, EMULATED_A100]) as server:
        yield server


def _run(native_libs: build.Libraries, emulated: Server, binary: Path, *args: str, stats: Path | None = None,
         slices: str | None = None) -> tuple[str, str]:
    extra = {"RGPU_CLIENT_STATS": str(stats)} if stats else {}
    done = run_client(native_libs, slices or emulated.slices(emulated.token()), [str(binary), *args], **extra)
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0
    return done.stdout, done.stderr


def _profile(stats: Path) -> dict[str, client_stats.OpProfile]:
    files = sorted(stats.parent.glob(stats.name + ".*"))
    assert len(files) == 1, files
    return {p.name: p for p in client_stats.parse(files[0].read_text())[0].values()}


def test_sets_of_changing_values_before_launches_make_no_round_trip_per_iteration(
        native_libs: build.Libraries, emulated: Server, attr_loop: Path, tmp_path: Path) -> None:
    _, err = _run(native_libs, emulated, attr_loop, "loop", "3", stats=tmp_path / "few")
    assert err == "", err
    _run(native_libs, emulated, attr_loop, "loop", "60", stats=tmp_path / "many")
    few, many = _profile(tmp_path / "few"), _profile(tmp_path / "many")
    round_trips = {name: (few[name].sync_calls if name in few else 0, p.sync_calls) for name, p in many.items()
                   if p.sync_calls}
    assert all(a == b for a, b in round_trips.values()), round_trips
    # Three sets per iteration (two dynamic shared memory sizes, one carveout), all pipelined.
    assert many["rgpuSetAttribute"].async_calls == 3 * 60 and many["rgpuSetAttribute"].sync_calls == 0
    assert "cuFuncSetAttribute" not in many and "cuKernelSetAttribute" not in many
    # What the checks need travelled once: the kernel's static shared memory, the device's limit.
    assert many["cuFuncGetAttribute"].sync_calls == 1 and many["cuKernelGetAttribute"].sync_calls == 1
    assert many["cuDeviceGetAttribute"].sync_calls == 1


def test_values_cuda_refuses_fail_at_once_and_nothing_is_sent(
        native_libs: build.Libraries, emulated: Server, attr_loop: Path, tmp_path: Path) -> None:
    out, err = _run(native_libs, emulated, attr_loop, "invalid", stats=tmp_path / "p")
    assert "OK one byte beyond the opt-in limit" in out and "OK a launch with more dynamic shared memory than set" in out
    profile = _profile(tmp_path / "p")
    # Sent: the value at the limit, the default carveout and the small maximum; none of the refused.
    assert profile["rgpuSetAttribute"].async_calls == 3
    assert "cuFuncSetAttribute" not in profile and "cuKernelSetAttribute" not in profile
    # The emulated GPU refuses a launch beyond the function's maximum, as the driver does.
    assert "asked for 2048 bytes of dynamic shared memory; its MAX_DYNAMIC_SHARED_SIZE_BYTES is 1024" in err, err


def test_attributes_the_client_does_not_check_get_the_drivers_answer(
        native_libs: build.Libraries, emulated: Server, attr_loop: Path, tmp_path: Path) -> None:
    _run(native_libs, emulated, attr_loop, "other", stats=tmp_path / "p")
    profile = _profile(tmp_path / "p")
    assert profile["cuFuncSetAttribute"].sync_calls == 3
    assert "rgpuSetAttribute" not in profile


def test_a_value_the_worker_refuses_fails_the_next_synchronising_call_and_names_the_set(
        native_libs: build.Libraries, emulated: Server, attr_loop: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGPU_EMULATED_REFUSE_SHARED_ABOVE", "60000")   # the session server's workers inherit it
    _, err = _run(native_libs, emulated, attr_loop, "refused")
    assert ("rgpu: worker: cuFuncSetAttribute (attribute 8, value 70000) failed on the GPU server with "
            "CUDA_ERROR_INVALID_VALUE; it was pipelined and this is the first synchronising call after it") in err, err


def test_occupancy_and_limits_are_each_slices_own_when_the_devices_differ(
        native_libs: build.Libraries, h200_and_a100: Server, attr_loop: Path) -> None:
    server = h200_and_a100
    slices = server.slices(server.token(gpu=EMULATED_GPU), server.token(gpu=EMULATED_A100))
    out, _ = _run(native_libs, server, attr_loop, "slices", slices=slices)
    # Both workers hand out the same function handle for the same load; the answers still differ.
    assert "SLICE 0 optin 232448 smem 232448 grid 264 set200000 CUDA_SUCCESS" in out, out
    assert "SLICE 1 optin 166912 smem 166912 grid 216 set200000 CUDA_ERROR_INVALID_VALUE" in out, out


@pytest.mark.parametrize("mode", [["loop", "5"], ["invalid"]], ids=["loop", "invalid"])
def test_the_real_gpu_backend_applies_pipelined_sets(native_libs: build.Libraries, attr_loop: Path,
                                                     chained: Server,  # noqa: F811
                                                     mode: list[str]) -> None:
    # backends/cuda.py's driver calls, with rgpu's own libcuda (talking to an emulated worker) as
    # "the driver" (test_cuda_backend_chained.py).
    done = run_client(native_libs, chained.slices(chained.token(memory_limit=1 << 30)), [str(attr_loop), *mode])
    assert "DONE 0 failure(s)" in done.stdout, done.stdout + done.stderr
