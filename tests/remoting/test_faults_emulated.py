"""GPU faults that cross sessions, on the emulated backend (CI has no GPU).

The emulated GPU's fake kernels (backends/emulated_modules.py) stand in for what a real GPU does: a wild
write gives the context a sticky CUDA_ERROR_ILLEGAL_ADDRESS, and on a GPU shared by MPS every other
session of that GPU gets it too, as NVIDIA documents for MPS. The real session server, workers and
client library run; tests/remoting/test_gpu_isolation.py runs the same cases on a real GPU.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rgpu.remoting.dispatcher.faults import (FaultReport, GpuView, SessionView, decide, faulting_pid_from_log)
from rgpu.remoting.native import build
from tests.remoting.conftest import EMULATED_GPU, Server, client_env, start_server
from tests.remoting.faults_helpers import HERE, PRELUDE, PY, attacker_code, start_client, wait_line


def victim(go: Path) -> str:
    """Client code: hold memory, wait idle for `go`, then copy back (the copy meets the fault, if any)."""
    return f"""
        setup()
        r, p = alloc(1 << 20)
        check("cuMemsetD8_v2", ctypes.c_uint64(p), 7, ctypes.c_size_t(1 << 20))
        print("READY", r, flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
        buf = ctypes.create_string_buffer(16)
        r = lib.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(p), ctypes.c_size_t(16))
        print("COPY", r, buf.raw[:4] == b"\\x07" * 4, flush=True)
        print("AGAIN", lib.cuCtxSynchronize(), flush=True)
        """


def busy_victim() -> str:
    """Client code: synchronise in a loop until a call fails (a victim with work in flight)."""
    return """
        setup()
        print("READY", flush=True)
        while True:
            r = lib.cuCtxSynchronize()
            if r:
                print("BUSY_FAILED", r, flush=True)
                break
            time.sleep(0.01)
        """


def emulated_server(sharing: str) -> Server:
    gpu = replace(EMULATED_GPU, sharing=sharing)
    server, address = start_server("emulated", [gpu])
    return Server(server, address, [gpu])


def wait_fault_recovered(server: Server, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        faults = server.server.status()["faults"]
        if faults and faults[-1]["recovered_seconds"] >= 0:
            return faults[-1]
        time.sleep(0.05)
    raise AssertionError(f"no recovered fault: {server.server.status()['faults']}")


def test_a_wild_write_under_mps_ends_every_session_of_the_gpu_with_a_clear_line(
        native_libs: build.Libraries, tmp_path: Path) -> None:
    server = emulated_server("mps")
    try:
        go = tmp_path / "go"
        idle = start_client(native_libs, server.slices(server.token(job_key="victim-idle")), victim(go))
        busy = start_client(native_libs, server.slices(server.token(job_key="victim-busy")), busy_victim())
        wait_line(idle, "READY")
        wait_line(busy, "READY")
        attacker = start_client(native_libs, server.slices(server.token(job_key="attacker")),
                                attacker_code("rgpu_emulated_wild_write", """
                                    print("SYNC", lib.cuCtxSynchronize(), flush=True)
                                    print("AFTER", lib.cuCtxSynchronize(), flush=True)
                                    """))
        out, err = attacker.communicate(timeout=60)
        assert "LAUNCH 0" in out and "SYNC 700" in out and "AFTER 700" in out, out + err
        assert "this session's kernel faulted on GPU 0" in err and "ended 2 other session(s)" in err, err
        fault = wait_fault_recovered(server)
        assert fault["cross_tenant"] and fault["sessions_ended"] == 3
        assert fault["faulting"] == "job attacker slice 0" and fault["error"] == "CUDA_ERROR_ILLEGAL_ADDRESS"
        go.touch()
        for proc, marker in ((idle, "COPY 700"), (busy, "BUSY_FAILED 700")):
            out, err = proc.communicate(timeout=60)
            assert marker in out, out + err
            lines = [line for line in err.splitlines() if "another session sharing GPU 0" in line]
            assert lines, err
            assert "job attacker slice 0" in lines[0] and "isolation=strict" in lines[0]
            assert EMULATED_GPU.uuid in lines[0] and server.address in lines[0]
        print(f"\nemulated MPS fault: {fault['sessions_ended']} sessions ended, GPU serving again after "
              f"{fault['recovered_seconds']:.2f} s")
        # The GPU serves new sessions: the fault domain was recovered.
        done = subprocess.run([PY, "-c", PRELUDE + textwrap.dedent("""
            setup()
            r, p = alloc(1 << 20)
            print("NEW", r, lib.cuCtxSynchronize(), flush=True)
            """)], env=client_env(native_libs, server.slices(server.token(job_key="next"))),
            capture_output=True, text=True, timeout=60)
        assert "NEW 0 0" in done.stdout, done.stdout + done.stderr
        observed = server.server.observe()
        assert observed["faults"][EMULATED_GPU.uuid] == {"cross_tenant": 1, "own": 0, "sessions": 3}
        assert observed["ended"]["fault"] >= 1
    finally:
        server.server.stop()


def test_a_wild_write_on_an_isolated_gpu_ends_only_its_own_session(native_libs: build.Libraries,
                                                                    tmp_path: Path) -> None:
    server = emulated_server("isolated")
    try:
        go = tmp_path / "go"
        idle = start_client(native_libs, server.slices(server.token(job_key="victim")), victim(go))
        wait_line(idle, "READY")
        attacker = start_client(native_libs, server.slices(server.token(job_key="attacker")),
                                attacker_code("rgpu_emulated_wild_write", """
                                    print("SYNC", lib.cuCtxSynchronize(), flush=True)
                                    """))
        out, err = attacker.communicate(timeout=60)
        assert "SYNC 700" in out, out + err
        assert "this session's kernel faulted on GPU 0" in err and "no other session was touched" in err, err
        go.touch()
        out, err = idle.communicate(timeout=60)
        assert "COPY 0 True" in out and "AGAIN 0" in out, out + err   # the victim's data is intact
        faults = server.server.status()["faults"]
        assert len(faults) == 1 and not faults[0]["cross_tenant"] and faults[0]["sessions_ended"] == 1
    finally:
        server.server.stop()


# -- the decision, pure ------------------------------------------------------------------------------

GPU = GpuView("GPU-a", 0, "NVIDIA H100", "mps")


def test_decision_names_the_faulting_session_only_when_the_log_names_one() -> None:
    sessions = [SessionView(11, "GPU-a", "job-1", 0), SessionView(22, "GPU-a", "job-2", 0),
                SessionView(33, "GPU-b", "job-3", 0)]
    reports = [FaultReport(22, "GPU-a", 700, 100.0, "job-2", 0), FaultReport(11, "GPU-a", 700, 100.1, "job-1", 0)]
    gpus = {"GPU-a": GPU, "GPU-b": GpuView("GPU-b", 1, "NVIDIA H100", "mps")}
    (event,) = decide(reports, sessions, gpus, "node:55001", mps_log="")
    assert event.cross_tenant and [s.pid for s in event.affected] == [11, 22] and event.faulting is None
    assert all("the driver does not say which" in line and "isolation=strict" in line
               for line in event.verdicts.values())
    log = "[2026-11-23] INFO client pid 11 connected\n[2026-11-23] ERROR client pid 22 hit a fatal GPU exception\n"
    (event,) = decide(reports, sessions, gpus, "node:55001", mps_log=log)
    assert event.faulting is not None and event.faulting.pid == 22
    assert "this session's kernel faulted" in event.verdicts[22]
    assert "(job job-2 slice 0; CUDA_ERROR_ILLEGAL_ADDRESS)" in event.verdicts[11]
    assert "\n" not in "".join(event.verdicts.values())


def test_log_reading_refuses_to_guess() -> None:
    assert faulting_pid_from_log("ERROR client 11 fault\nERROR client 22 fault\n", {11, 22}) is None
    assert faulting_pid_from_log("INFO client 11 connected\n", {11}) is None
    assert faulting_pid_from_log("Xid 31 pid 99 fault\n", {11}) is None


def test_an_isolated_gpu_fault_touches_only_the_reporter() -> None:
    sessions = [SessionView(11, "GPU-i", "job-1", 0), SessionView(22, "GPU-i", "job-2", 0)]
    gpus = {"GPU-i": GpuView("GPU-i", 0, "NVIDIA H100", "isolated")}
    (event,) = decide([FaultReport(22, "GPU-i", 700, 1.0, "job-2", 0)], sessions, gpus, "node:55001")
    assert not event.cross_tenant and [s.pid for s in event.affected] == [22]
    assert event.faulting is not None and event.faulting.pid == 22
    assert "no other session was touched" in event.verdicts[22]


@pytest.mark.parametrize("bad", [{"pid": "x"}, {}, {"pid": 1, "gpu_uuid": "g", "code": "nope", "unix": 0}])
def test_bad_reports_are_refused(bad: dict) -> None:
    with pytest.raises((ValueError, KeyError, TypeError)):
        FaultReport.from_dict(bad)


@pytest.mark.integration
def test_faults_reach_the_pool_and_rgpu_admin_health(native_libs: build.Libraries, tmp_path: Path) -> None:
    """A real pool and dispatcher: the fault is in the heartbeat, `health` shows it per GPU."""
    from rgpu.adaptor import read_adaptor_conf
    from tests.daemons import RgpuCluster, wait_for
    from tests.admin_helpers import admin

    cluster = RgpuCluster(tmp_path)
    cluster.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5)
    try:
        cluster.start_pool()
        cluster.start_dispatcher(HERE.parents[1] / "examples" / "inventory-a.toml")
        with cluster.client() as client:
            wait_for(lambda: len(client.list_gpus()) == 2, what="the dispatcher registered")
        for name in ("victim", "attacker"):
            admin(cluster, "request-gpus", "-n", "1", "-p", "0.5", "--job-key", name, "-o", str(tmp_path / name))
        slices = {name: read_adaptor_conf(tmp_path / name).slices[0] for name in ("victim", "attacker")}
        assert slices["victim"].gpu_uuid == slices["attacker"].gpu_uuid      # binpack: one GPU, shared by MPS
        go = tmp_path / "go"
        victim_proc = start_client(native_libs, f"{slices['victim'].server},{slices['victim'].token}", victim(go))
        wait_line(victim_proc, "READY")
        done = subprocess.run([PY, "-c", PRELUDE + attacker_code("rgpu_emulated_wild_write",
                                                                 "print('SYNC', lib.cuCtxSynchronize())\n")],
                              env=client_env(native_libs, f"{slices['attacker'].server},{slices['attacker'].token}"),
                              capture_output=True, text=True, timeout=60)
        assert "SYNC 700" in done.stdout, done.stdout + done.stderr
        go.touch()
        out, err = victim_proc.communicate(timeout=60)
        assert "COPY 700" in out and "isolation=strict" in err, out + err

        def health_note() -> str:
            rows = json.loads(admin(cluster, "health", "--json").stdout)
            faults = rows[0]["gpu_faults"]
            return rows[0]["notes"] if faults and faults[-1]["recovered_seconds"] >= 0 else ""

        wait_for(lambda: "MPS fault ended 2 sessions" in health_note(), what="the fault in rgpu-admin health")
        note = health_note()
        assert "GPU 0: 1 fault(s), 1 across tenants" in note and "faulting job attacker slice 0" in note
        assert "serving again after" in note and "CUDA_ERROR_ILLEGAL_ADDRESS" in note
        assert "MPS fault ended 2 sessions" in admin(cluster, "health").stdout
        # The GPU's readings count it too (an emulated GPU stands a fault in for the driver's Xid 43).
        gpu = next(t for t in json.loads(admin(cluster, "health", "--json").stdout)[0]["gpu_telemetry"]
                   if t["gpu_uuid"] == slices["victim"].gpu_uuid)
        assert (gpu["source"], gpu["xid_errors"], gpu["last_xid"]) == ("emulated", 1, 43)
        assert "GPU 0: 1 Xid event(s), last Xid 43 (emulated)" in health_note()
    finally:
        cluster.stop_all()
