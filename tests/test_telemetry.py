"""Used beside held (issue 29): GPU readings and each slice's use, from the GPU node to the pool.
The pure parts on hand-made numbers; then a real pool and a real dispatcher on loopback (the
emulated backend, whose readings say so), a real session holding 2 GiB of a 40 GiB slice, and what
the pool's metrics, ListServers and `rgpu-admin stats` then say."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rgpu.model import GpuInfo
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.dispatcher.telemetry import compute_rates, emulated_readings, per_gpu
from rgpu.remoting.pool.telemetry import checked_telemetry
from tests.daemons import HoldingSession, RgpuCluster, wait_for
from tests.metrics_helpers import scrape, start_with_metrics, value

GIB = 1 << 30
GPU = GpuInfo("GPU-00000000-0000-0000-0000-000000000001", 0, "NVIDIA H100", 80 * GIB, 80 * GIB, "9.0")


# --- pure ------------------------------------------------------------------------------------------

def test_a_slices_compute_use_is_its_busy_time_over_the_interval_and_new_slices_read_zero() -> None:
    previous: dict[tuple[str, int], tuple[float, float]] = {}
    first = compute_rates(previous, [{"job_key": "j", "slice_number": 0, "busy_seconds": 50.0}], now=100.0)
    assert first == {("j", 0): 0.0}                       # its 50 s may span any time: not a rate yet
    later = compute_rates(previous, [{"job_key": "j", "slice_number": 0, "busy_seconds": 51.5}], now=105.0)
    assert later == {("j", 0): 30.0}                      # 1.5 s busy in 5 s
    capped = compute_rates(previous, [{"job_key": "j", "slice_number": 0, "busy_seconds": 70.0}], now=106.0)
    assert capped == {("j", 0): 100.0}                    # workers of several sessions: never above all of it
    assert compute_rates(previous, [], now=107.0) == {} and previous == {}   # gone slices are forgotten


def test_emulated_readings_follow_the_sessions_and_say_they_are_emulated() -> None:
    usage = [{"job_key": "j", "slice_number": 0, "memory_used_bytes": 2 * GIB, "busy_seconds": 1.0},
             {"job_key": "k", "slice_number": 0, "memory_used_bytes": GIB, "busy_seconds": 1.0}]
    sessions = [{"job_key": "j", "slice_number": 0, "gpu_uuid": GPU.uuid},
                {"job_key": "k", "slice_number": 0, "gpu_uuid": GPU.uuid}]
    memory, busy = per_gpu([GPU], usage, sessions, {("j", 0): 30.0, ("k", 0): 20.0})
    assert memory == {GPU.uuid: 3 * GIB} and busy == {GPU.uuid: 50.0}
    (idle,) = emulated_readings([GPU], {}, {}, {}, now=1.0)
    (busy_gpu,) = emulated_readings([GPU], memory, busy, {GPU.uuid: 2}, now=1.0)
    assert idle.source == busy_gpu.source == "emulated"
    assert idle.utilization_percent == 0 and busy_gpu.utilization_percent == 50
    assert idle.temperature_celsius < busy_gpu.temperature_celsius and idle.power_watts < busy_gpu.power_watts
    assert busy_gpu.memory_used_bytes == 3 * GIB and (busy_gpu.xid_errors, busy_gpu.last_xid) == (2, 43)


def test_the_pool_keeps_readings_of_its_servers_gpus_only_and_absurd_figures_as_unknown() -> None:
    readings = [pb.GpuTelemetry(gpu_uuid=GPU.uuid, source="nvml", utilization_percent=float("nan"),
                                temperature_celsius=55.0, power_watts=1e12, read_unix=90.0),
                pb.GpuTelemetry(gpu_uuid="GPU-not-registered", source="nvml"),
                pb.GpuTelemetry(gpu_uuid=GPU.uuid, source="made-up")]
    kept = checked_telemetry(readings, {GPU.uuid}, sent_unix=100.0, now=110.0)
    assert [r.gpu_uuid for r in kept] == [GPU.uuid, GPU.uuid]
    assert kept[0].utilization_percent == -1 and kept[0].power_watts == -1 and kept[0].temperature_celsius == 55
    assert kept[0].read_unix == 100.0                     # on the pool's clock (10 s skew)
    assert kept[1].source == "unknown"


# --- real daemons ----------------------------------------------------------------------------------

@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "cluster")
    c.write_config(heartbeat_interval_seconds=0.3, down_after_seconds=3.0, reclaim_interval_seconds=0.5)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.mark.integration
def test_a_slice_that_holds_40_gib_and_uses_2_gib_shows_both_in_metrics_servers_and_stats(cluster: RgpuCluster) -> None:
    pool_metrics, dispatcher_metrics, address = start_with_metrics(cluster)
    with cluster.client() as client:
        lease = client.allocate("job-t1", "alice", 1, percent=50)
    gpu = lease.slices[0].gpu_uuid
    # Readings come with every heartbeat, sessions or not; an emulated GPU says it is one.
    wait_for(lambda: ("rgpu_pool_gpu_telemetry_source", (("gpu", gpu), ("index", "0"), ("model", "NVIDIA H100 80GB HBM3"),
                      ("server", address), ("source", "emulated"))) in scrape(pool_metrics), what="the GPU's readings")
    found = scrape(pool_metrics)
    assert value(found, "rgpu_pool_gpu_utilization_percent", gpu=gpu) == 0
    assert value(found, "rgpu_pool_gpu_temperature_celsius", gpu=gpu) > 0
    assert value(found, "rgpu_pool_gpu_power_limit_watts", gpu=gpu) > value(found, "rgpu_pool_gpu_power_watts", gpu=gpu)
    assert value(found, "rgpu_pool_gpu_ecc_errors_total", gpu=gpu, type="uncorrected") == 0
    assert value(found, "rgpu_pool_gpu_recent_faults", gpu=gpu) == 0

    session = HoldingSession(address, lease.slices[0].token, 2 * GIB)   # 2 GiB of a 40 GiB slice
    try:
        def used_reported() -> bool:
            found = scrape(pool_metrics)
            return value(found, "rgpu_pool_slice_memory_used_bytes", gpu=gpu, slot="0") == 2 * GIB

        wait_for(used_reported, what="the slice's use to reach the pool")
        found = scrape(pool_metrics)
        assert value(found, "rgpu_pool_slice_memory_bytes", gpu=gpu, slot="0") == 40 * GIB
        assert 0 <= value(found, "rgpu_pool_slice_compute_used_percent", gpu=gpu, slot="0") <= 100
        assert value(found, "rgpu_pool_gpu_memory_used_bytes", gpu=gpu) == 2 * GIB
        wait_for(lambda: value(scrape(pool_metrics), "rgpu_pool_gpu_device_memory_used_bytes", gpu=gpu) == 2 * GIB,
                 what="the emulated GPU's memory in use")
        # Work on the slice: its compute use and, on the emulated GPU, its utilisation rise.
        def busy() -> bool:
            session.work(64 << 20, 4)
            found = scrape(pool_metrics)
            return (value(found, "rgpu_pool_slice_compute_used_percent", gpu=gpu, slot="0") > 0
                    and value(found, "rgpu_pool_gpu_utilization_percent", gpu=gpu) > 0)

        wait_for(busy, timeout=60, what="the slice's work to show as compute used")
        # The dispatcher's own endpoint says the same per GPU and per slice.
        found = scrape(dispatcher_metrics)
        assert value(found, "rgpu_dispatcher_gpu_telemetry_source", gpu=gpu, source="emulated") == 1
        assert value(found, "rgpu_dispatcher_gpu_device_memory_used_bytes", gpu=gpu) == 2 * GIB
        assert 0 <= value(found, "rgpu_dispatcher_slice_compute_used_percent", gpu=gpu, slot="0") <= 100

        with cluster.client() as client:
            server = next(s for s in client.list_servers().servers if s.address == address)
        reading = next(t for t in server.telemetry if t.gpu_uuid == gpu)
        assert reading.source == "emulated" and reading.memory_used_bytes == 2 * GIB
        assert {t.gpu_uuid for t in server.telemetry} == {g.uuid for g in server.gpus}

        done = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "stats", "--json"], env=cluster.env(),
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        (row,) = json.loads(done.stdout)
        assert row["memory_used_bytes"] == 2 * GIB and row["memory_limit_bytes"] == 40 * GIB
        assert row["mostly_unused"] is True and 0 <= row["compute_used_percent"] <= 100
        done = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "stats"], env=cluster.env(),
                              capture_output=True, text=True, timeout=60, check=False)
        assert "2.0 GiB now" in done.stdout and "UNUSED" in done.stdout, done.stdout
        done = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "health", "--json"], env=cluster.env(),
                              capture_output=True, text=True, timeout=60, check=False)
        (server_row,) = json.loads(done.stdout)
        assert {t["source"] for t in server_row["gpu_telemetry"]} == {"emulated"}
        assert len(server_row["gpu_telemetry"]) == server_row["gpus"]
    finally:
        session.close()
    # Per-user figures stay off the public endpoint (docs/security.md): no user or job label.
    assert not any(label in dict(labels) for _name, labels in scrape(pool_metrics) for label in ("user", "job"))


def test_every_process_of_one_pool_sees_the_readings_another_received(tmp_path: Path) -> None:
    """rgpu-poold --processes N: a dispatcher's heartbeats reach one process; the one serving the
    metrics and the page reads them from the shared SQLite file (two stores on one file, as two
    processes hold it)."""
    from rgpu.remoting.pool.store import Store
    from rgpu.remoting.pool.telemetry import REFRESH_S, TelemetryBoard

    now = [0.0]
    receiver = TelemetryBoard(Store(tmp_path / "pool.db", shared=True), clock=lambda: now[0])
    shower = TelemetryBoard(Store(tmp_path / "pool.db", shared=True), clock=lambda: now[0])
    heartbeat = pb.HeartbeatRequest(
        address="h:1", sent_unix=100.0,
        telemetry=[pb.GpuTelemetry(gpu_uuid=GPU.uuid, source="nvml", utilization_percent=61.0, read_unix=100.0)],
        faults=[pb.GpuFault(gpu_uuid=GPU.uuid, error="CUDA_ERROR_ILLEGAL_ADDRESS", unix=99.0)],
        usage=[pb.SliceUsage(job_key="job-1", slice_number=0, compute_used_percent=42.0)])
    assert shower.readings("h:1") == []                      # read now: nothing yet
    receiver.record("h:1", heartbeat, {GPU.uuid}, now=100.0)
    now[0] += REFRESH_S
    (reading,) = shower.readings("h:1")
    assert (reading.source, reading.utilization_percent) == ("nvml", 61.0)
    assert [f.error for f in shower.faults("h:1")] == ["CUDA_ERROR_ILLEGAL_ADDRESS"]
    assert shower.compute_used("h:1", "job-1", 0) == 42.0 and shower.compute_used("h:1", "job-1", 1) == -1
    # One process alone (not shared): its memory is the board, the file holds nothing.
    alone = TelemetryBoard(Store(tmp_path / "alone.db"))
    alone.record("h:1", heartbeat, {GPU.uuid}, now=100.0)
    assert alone.readings("h:1")[0].utilization_percent == 61.0
    assert Store(tmp_path / "alone.db").load_server_reports() == {}


class FakeNvml:
    """pynvml as a GPU node's driver answers it (no GPU here): an H100 drawing 312.5 W of 700 that
    reports no ECC counts, and one Xid 79 event queued. Fakes only what cannot exist in CI."""

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    NVML_TEMPERATURE_GPU, NVML_VOLATILE_ECC = 0, 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        import types
        self.events = [types.SimpleNamespace(device=GPU.uuid, eventData=79)]
        self.shut = False

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: self.shut = True
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str: return uuid
    def nvmlDeviceGetUUID(self, handle: str) -> bytes: return handle.encode()
    def nvmlEventSetCreate(self) -> object: return object()
    def nvmlDeviceRegisterEvents(self, handle: str, kinds: int, events: object) -> None: ...
    def nvmlEventSetFree(self, events: object) -> None: ...

    def nvmlEventSetWait_v2(self, events: object, timeout_ms: int) -> object:
        if self.events:
            return self.events.pop()
        import time
        time.sleep(timeout_ms / 1000)
        raise self.NVMLError_Timeout()

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> object:
        import types
        return types.SimpleNamespace(gpu=37, memory=12)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> object:
        import types
        return types.SimpleNamespace(used=5 * GIB, total=80 * GIB)

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int: return 48
    def nvmlDeviceGetPowerUsage(self, handle: str) -> int: return 312_500          # mW
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: str) -> int: return 700_000  # mW

    def nvmlDeviceGetTotalEccErrors(self, handle: str, kind: int, counter: int) -> int:
        raise self.NVMLError_NotSupported()


def test_nvml_readings_in_their_units_unsupported_ecc_as_no_count_and_xid_events_counted(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from rgpu.remoting.dispatcher.telemetry import NvmlTelemetry
    from tests.daemons import wait_for

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reader = NvmlTelemetry([GPU])
    try:
        wait_for(lambda: not fake.events, what="the Xid event to be taken")
        wait_for(lambda: reader.read([GPU], [], [], 5.0, {}, {})[0].xid_errors == 1, what="the Xid event counted")
        (reading,) = reader.read([GPU], [], [], 5.0, {}, {})
    finally:
        reader.close()
    assert fake.shut
    assert (reading.source, reading.utilization_percent, reading.memory_used_bytes) == ("nvml", 37.0, 5 * GIB)
    assert (reading.temperature_celsius, reading.power_watts, reading.power_limit_watts) == (48.0, 312.5, 700.0)
    assert (reading.ecc_corrected, reading.ecc_uncorrected) == (0, 0)       # not supported: no count
    assert (reading.xid_errors, reading.last_xid, reading.read_unix) == (1, 79, 5.0)
