"""Issue 13 on a real GPU: tenants sharing a GPU. Run on a GPU machine, as root (MPS needs it):

    python -m pytest -m gpu -s tests/remoting/test_gpu_isolation.py

(CPU-only CI skips them.) Each case starts a real session server with the CUDA backend on GPU 0,
shared `isolated` or `mps` (dispatcher/sharing.py), and driver-API applications
(isolation_client.py) on rgpu's libcuda.so.1; the kernels (isolation_kernels.cu) are built with nvcc
at test time (or give a prebuilt cubin in RGPU_ISOLATION_CUBIN). The figures print with -s:
- a wild write next to a verified axpy loop: isolated (the victim finishes, correct) and mps (every
  session ends with the one-line verdict; the time until a new session runs a kernel again);
- rgpu's compute limiter (isolated): two tenants at 0.5 and four at 0.25, each one's throughput
  over 1 s windows as a share of one session alone (target: within +-10% of the share);
- lending (compute_lending): a lone 0.25 tenant with and without it;
- a kernel that never finishes, stopped when its lease ends, and the GPU serving the next session.
About 2 to 3 minutes in all.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from rgpu.live_leases import LiveLeases
from rgpu.remoting.native import build
from tests.remoting.conftest import Server, client_env, run_nvcc, start_server
from tests.remoting.conftest import local_gpu
from tests.remoting.faults_helpers import wait_line

pytestmark = pytest.mark.gpu
HERE = Path(__file__).parent
CLIENT = HERE / "isolation_client.py"
SOURCE = HERE / "isolation_kernels.cu"
RECOVERY_LIMIT_S = 10.0
BURN_SECONDS = 4.0


@pytest.fixture(scope="module")
def cubin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get("RGPU_ISOLATION_CUBIN")
    if prebuilt:
        return Path(prebuilt)
    major, _, minor = local_gpu().compute_capability.partition(".")
    out = tmp_path_factory.mktemp("kernels") / f"isolation_kernels.sm_{major}{minor}.cubin"
    run_nvcc(["-cubin", f"-arch=sm_{major}{minor}", "-O2", "-o", str(out), str(SOURCE)], "RGPU_ISOLATION_CUBIN")
    return out


@contextlib.contextmanager
def serving(sharing: str) -> Iterator[Server]:
    gpu = replace(local_gpu(), sharing=sharing)
    server, address = start_server("cuda", [gpu])
    try:
        yield Server(server, address, [gpu])
    finally:
        server.stop()


@pytest.fixture
def isolated() -> Iterator[Server]:
    with serving("isolated") as server:
        yield server


@pytest.fixture
def mps() -> Iterator[Server]:
    with serving("mps") as server:
        yield server


def start(libs: build.Libraries, server: Server, job: str, percent: int, *args: str) -> subprocess.Popen[str]:
    token = server.token(memory_limit=4 << 30, compute_percent=percent, job_key=job)
    return subprocess.Popen([sys.executable, str(CLIENT), *args], env=client_env(libs, server.slices(token)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen[str], prefix: str, timeout: float = 120.0) -> str:
    return wait_line(proc, prefix, timeout).strip()


def finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    return out, err


def wild_write_next_to_a_victim(libs: build.Libraries, server: Server, cubin: Path, tmp: Path
                                ) -> tuple[str, str, str, str, float]:
    stop = tmp / "stop"
    victim = start(libs, server, "victim", 50, "victim", str(cubin), str(stop))
    read_until(victim, "VICTIM ready")
    time.sleep(1.0)                                   # the victim's loop is running
    attacker = start(libs, server, "attacker", 50, "attacker", str(cubin))
    a_out, a_err = finish(attacker)
    faulted_at = float(a_out.split(" at ")[-1]) if " at " in a_out else time.time()
    time.sleep(1.0)                                   # the victim goes on (isolated) or has ended (mps)
    stop.touch()
    v_out, v_err = finish(victim)
    print(f"\n--- attacker\n{a_out}{a_err[-2000:]}\n--- victim\n{v_out}{v_err[-2000:]}")
    return a_out, a_err, v_out, v_err, faulted_at


def test_wild_write_in_isolated_mode_ends_only_the_attacker(native_libs: build.Libraries, isolated: Server,
                                                            cubin: Path, tmp_path: Path) -> None:
    a_out, a_err, v_out, v_err, _ = wild_write_next_to_a_victim(native_libs, isolated, cubin, tmp_path)
    assert "ATTACKER sync 700" in a_out, a_out + a_err
    assert "no other session was touched" in a_err
    assert "VICTIM ok" in v_out and "results correct" in v_out, v_out + v_err
    print(f"ISOLATED: attacker ended with CUDA_ERROR_ILLEGAL_ADDRESS; {v_out.strip()}")


def test_wild_write_in_mps_mode_ends_all_with_a_clear_line_and_the_gpu_serves_again(
        native_libs: build.Libraries, mps: Server, cubin: Path, tmp_path: Path) -> None:
    assert mps.server.mps.running, mps.server.status()["mps"]
    a_out, a_err, v_out, v_err, faulted_at = wild_write_next_to_a_victim(native_libs, mps, cubin, tmp_path)
    assert "ATTACKER sync 700" in a_out, a_out + a_err
    assert "VICTIM failed" in v_out, v_out + v_err
    verdicts = [line for line in (a_err + v_err).splitlines() if line.startswith("rgpu: session:")]
    print("VERDICTS:\n" + "\n".join(verdicts))
    assert any("isolation=strict" in line and mps.gpus[0].uuid in line for line in verdicts)
    # The GPU serves a new session again: probe until one runs a verified kernel.
    recovered_after = None
    while time.time() - faulted_at < RECOVERY_LIMIT_S + 5:
        probe = start(native_libs, mps, f"probe-{time.time():.3f}", 50, "probe", str(cubin))
        try:
            out, err = finish(probe, timeout=15)
        except subprocess.TimeoutExpired:           # a client MPS has not yet taken: try a new one
            probe.kill()
            out, err = probe.communicate()
            out = "PROBE hung for 15 s " + out
        if "PROBE ok" in out:
            recovered_after = time.time() - faulted_at
            break
        print(f"probe: {out.strip()} {err.strip()[-300:]}")
        time.sleep(0.2)
    faults = mps.server.status()["faults"]
    print(f"MPS: dispatcher's record: {json.dumps(faults[-1:] if faults else faults)}")
    print(f"MPS: a new session ran a verified kernel {recovered_after} s after the fault")
    assert faults and faults[-1]["cross_tenant"] and faults[-1]["sessions_ended"] >= 2
    assert recovered_after is not None and recovered_after <= RECOVERY_LIMIT_S


def burn_shares(libs: build.Libraries, server: Server, cubin: Path, tmp: Path, percents: list[int],
                iters: int) -> list[tuple[float, list[float]]]:
    """Run one tenant per percent at once; each one's kernels per 1 s window."""
    tmp.mkdir(parents=True, exist_ok=True)
    go = tmp / f"go-{len(percents)}-{percents[0]}"
    procs = [start(libs, server, f"burn-{i}-{p}", p, "burn", str(cubin), str(iters), str(go), str(BURN_SECONDS))
             for i, p in enumerate(percents)]
    for proc in procs:
        read_until(proc, "BURN ready")
    go.touch()
    results = []
    for proc in procs:
        out, err = finish(proc, timeout=120)
        line = next((s for s in out.splitlines() if s.startswith("BURN {")), None)
        assert line is not None, out + err
        data = json.loads(line[5:])
        start_at, batches = data["start"], data["batches"]
        windows = [0.0] * int(BURN_SECONDS)
        for t in batches:
            w = int(t - start_at)
            if 0 <= w < len(windows):
                windows[w] += data["kernels_per_batch"]
        results.append((start_at, windows))
    return results


def test_rgpu_limiter_holds_tenants_to_their_shares(native_libs: build.Libraries, isolated: Server, cubin: Path,
                                                   tmp_path: Path) -> None:
    iters = int(os.environ.get("RGPU_BURN_ITERS", "65536"))   # about 1 ms per kernel on an H100
    ((_, solo),) = burn_shares(native_libs, isolated, cubin, tmp_path, [100], iters)
    solo_rate = sum(solo[1:]) / (len(solo) - 1)       # kernels per second alone (first window: warm-up)
    print(f"\nLIMITER: one session alone at 100%: {solo_rate:.0f} kernels/s (windows {solo})")
    failures = []
    for percents in ([50, 50], [25, 25, 25, 25]):
        results = burn_shares(native_libs, isolated, cubin, tmp_path, percents, iters)
        for percent, (_, windows) in zip(percents, results):
            shares = [w / solo_rate for w in windows[1:]]
            mean = sum(shares) / len(shares)
            print(f"LIMITER: {len(percents)} tenants, one at {percent}%: share per 1 s window "
                  f"{', '.join(f'{s:.3f}' for s in shares)} (mean {mean:.3f})")
            if any(abs(s - percent / 100) > 0.10 * percent / 100 for s in shares):
                failures.append(f"{percent}% of {len(percents)}: {shares}")
    assert not failures, f"windows outside +-10% of the share: {failures}"


@pytest.mark.parametrize("sharing", ["mps", "isolated"])
def test_a_kernel_that_never_finishes_is_stopped_when_its_lease_ends(native_libs: build.Libraries, cubin: Path,
                                                                    sharing: str) -> None:
    with serving(sharing) as server:
        spinner = start(native_libs, server, "spinner", 100, "spin", str(cubin))
        read_until(spinner, "SPIN spinning")
        time.sleep(1.0)
        assert spinner.poll() is None
        ended = time.time()
        # What a heartbeat does when the pool no longer lists the lease (released, expired, revoked).
        server.server.update_live(LiveLeases.of(time.time(), []))
        out, err = finish(spinner, timeout=60)
        stopped_after = time.time() - ended
        server.server.update_live(LiveLeases.of(0.0, []))      # new tokens are live again
        probe_proc = start(native_libs, server, "after-spin", 100, "probe", str(cubin))
        p_out, p_err = finish(probe_proc, timeout=60)
        print(f"\nRUNAWAY ({sharing}): the spinning session ended {stopped_after:.2f} s after its lease "
              f"ended ({out.strip()} {err.strip()[-200:]}); next session: {p_out.strip()}")
        assert "SPIN sync 0" not in out, out + err        # it was stopped, not finished
        assert "PROBE ok" in p_out, p_out + p_err


def test_lending_gives_an_idle_gpu_to_a_lone_tenant(native_libs: build.Libraries, isolated: Server, cubin: Path,
                                                    tmp_path: Path) -> None:
    iters = int(os.environ.get("RGPU_BURN_ITERS", "65536"))
    ((_, solo),) = burn_shares(native_libs, isolated, cubin, tmp_path, [100], iters)
    solo_rate = sum(solo[1:]) / (len(solo) - 1)
    ((_, held),) = burn_shares(native_libs, isolated, cubin, tmp_path / "held", [25], iters)
    isolated.server.compute_lending = True           # what compute_lending = true gives new sessions
    ((_, lent),) = burn_shares(native_libs, isolated, cubin, tmp_path / "lent", [25], iters)
    held_share = sum(held[1:]) / (len(held) - 1) / solo_rate
    lent_share = sum(lent[1:]) / (len(lent) - 1) / solo_rate
    print(f"\nLENDING: a 25% tenant alone: {held_share:.3f} of the GPU without lending, {lent_share:.3f} with it")
    assert abs(held_share - 0.25) <= 0.025 and lent_share >= 0.8
