"""GPU telemetry from NVML on a real GPU (issue 29). Run on a GPU machine:

    python -m pytest -m gpu -v tests/remoting/test_gpu_telemetry.py

The reader itself on GPU 0, then a real pool and an NVML rgpu-dispatcher: the pool's ListServers
carries GPU 0's readings marked nvml, and its utilisation rises while a slice's program spins.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from rgpu.remoting.dispatcher.telemetry import NvmlTelemetry
from tests.daemons import RgpuCluster, wait_for
from tests.remoting.conftest import PY, local_gpu
from tests.dispatcher_helpers import wait_state

pytestmark = pytest.mark.gpu


def test_nvml_readings_of_gpu_0_are_measured_figures() -> None:
    gpu = local_gpu()
    reader = NvmlTelemetry([gpu])
    try:
        (reading,) = reader.read([gpu], [], [], time.time(), {}, {})
    finally:
        reader.close()
    assert reading.source == "nvml" and reading.gpu_uuid == gpu.uuid
    assert 0 <= reading.utilization_percent <= 100
    assert 0 < reading.temperature_celsius < 120
    assert 0 < reading.power_watts < reading.power_limit_watts
    assert 0 < reading.memory_used_bytes < gpu.total_memory_bytes
    assert reading.ecc_uncorrected >= 0 and reading.xid_errors >= 0
    print(reading)


def test_the_pool_shows_gpu_0_busy_while_a_slice_spins(tmp_path: Path) -> None:
    from tests.remoting.gpu_helpers import spin_program

    gpu = local_gpu()
    cluster = RgpuCluster(tmp_path / "cluster")
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=5.0, reclaim_interval_seconds=0.5)
    try:
        cluster.start_pool()
        _daemon, port = cluster.start_dispatcher(None, env=cluster.env(RGPU_VISIBLE_DEVICES="0"))
        wait_state(cluster, f"127.0.0.1:{port}", "up", timeout=60)

        def reading():  # type: ignore[no-untyped-def]
            with cluster.client() as client:
                server = client.list_servers().servers[0]
            return next((t for t in server.telemetry if t.gpu_uuid == gpu.uuid), None)

        wait_for(lambda: reading() is not None, timeout=30, what="GPU 0's readings at the pool")
        assert reading().source == "nvml" and reading().temperature_celsius > 0
        program = spin_program(2_000_000, 10)   # well over a minute of kernels; killed once seen
        spin = subprocess.Popen([PY, "-m", "rgpu.remoting.client.flexrun", "-n", "1", "-p", "0.5", "--", *program],
                                env=cluster.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: reading().utilization_percent > 0, timeout=60, what="GPU 0 busy at the pool")
        finally:
            spin.kill()
            print(spin.communicate()[0][-2000:])
        print(reading())
    finally:
        cluster.stop_all()
