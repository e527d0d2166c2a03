"""Prometheus metrics: the pure builders on hand-made state, and the endpoints of a real pool and
real dispatchers scraped over HTTP on loopback and parsed with prometheus-client's parser."""

from __future__ import annotations

import dataclasses

import json
import re
import struct
import urllib.request

import pytest

from rgpu.errors import CapacityError, InvalidRequest, PermissionDenied, QuotaExceeded
from rgpu.model import GpuInfo, LeaseRecord, QuotaRecord, SliceRecord
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.dispatcher.metrics import DispatcherSnapshot, dispatcher_families
from rgpu.remoting.dispatcher.telemetry import GpuReading
from rgpu.remoting.pool.accounting import SliceUsageRecord
from rgpu.remoting.pool.metrics import PoolMetrics, pool_families, refusal_reason
from rgpu.remoting.pool.views import GpuView, LeaseView, PoolView, ServerView
from tests.daemons import REPO, RgpuCluster, wait_for
from tests.metrics_helpers import samples, scrape, start_with_metrics, value

GIB = 1 << 30
GPU = GpuInfo("GPU-00000000-0000-0000-0000-000000000001", 0, "NVIDIA H100", 80 * GIB, 80 * GIB, "9.0")


# --- pure ------------------------------------------------------------------------------------------

def test_refusal_reasons() -> None:
    assert refusal_reason(QuotaExceeded("pool", "x")) == "quota"
    assert refusal_reason(CapacityError("pool", "x")) == "capacity"
    assert refusal_reason(PermissionDenied("pool", "x")) == "permission"
    assert refusal_reason(InvalidRequest("pool", "x")) == "invalid"
    assert refusal_reason(RuntimeError()) == "error"


READING = pb.GpuTelemetry(gpu_uuid=GPU.uuid, source="nvml", utilization_percent=40.0, memory_used_bytes=3 * GIB,
                          temperature_celsius=51.0, power_watts=-1.0, power_limit_watts=700.0, ecc_corrected=2,
                          ecc_uncorrected=0, xid_errors=1, last_xid=31)


def a_view() -> PoolView:
    lease = LeaseRecord("job-1", "alice", "physics", 100.0, 0.0,
                        (SliceRecord("h:1", GPU.uuid, 0, GPU.name, 20 * GIB, 25),))
    return PoolView(
        now=160.0,
        servers=(ServerView("h:1", "h", "up", 1.5, "0.1.0", "580", "mps", "native", False, 1),
                 ServerView("h:2", "h2", "down", 99.0, "0.1.0", "580", "", "", True, 0)),
        gpus=(GpuView("h:1", "up", GPU, 25, 20 * GIB, 1, READING, (pb.GpuFault(gpu_uuid=GPU.uuid, error="X"),)),),
        leases=(LeaseView(lease, "active", usage=(SliceUsageRecord(sessions=1, memory_used_bytes=2 * GIB),),
                          compute_used=(12.5,)),),
        quotas=((QuotaRecord("user", "alice", 200), 25),),
        total_units=100, allocated_units=25)


def test_pool_families_from_a_view() -> None:
    found = samples(pool_families(a_view()))
    assert value(found, "rgpu_pool_servers", state="up") == 1
    assert value(found, "rgpu_pool_servers", state="down") == 1
    assert value(found, "rgpu_pool_servers", state="drained") == 0
    assert value(found, "rgpu_pool_gpu_allocated_compute_percent", gpu=GPU.uuid) == 25
    assert value(found, "rgpu_pool_gpu_allocated_memory_bytes", gpu=GPU.uuid) == 20 * GIB
    assert value(found, "rgpu_pool_slice_memory_bytes", gpu=GPU.uuid, slot="0") == 20 * GIB
    assert value(found, "rgpu_pool_leases", state="active") == 1
    assert value(found, "rgpu_pool_leases_idle") == 0
    assert value(found, "rgpu_pool_quotas", kind="user") == 1
    assert value(found, "rgpu_pool_quota_use_max", kind="user") == 0.125
    assert value(found, "rgpu_pool_quotas_at_limit", kind="user") == 0
    assert value(found, "rgpu_pool_server_info", server="h:1", compute_enforcement="mps") == 1
    # Used beside held, per slice and per GPU, and the GPU's readings with DCGM-like names.
    assert value(found, "rgpu_pool_slice_memory_used_bytes", gpu=GPU.uuid, slot="0") == 2 * GIB
    assert value(found, "rgpu_pool_slice_compute_used_percent", gpu=GPU.uuid, slot="0") == 12.5
    assert value(found, "rgpu_pool_gpu_memory_used_bytes", gpu=GPU.uuid) == 2 * GIB
    assert value(found, "rgpu_pool_gpu_device_memory_used_bytes", gpu=GPU.uuid, server="h:1") == 3 * GIB
    assert value(found, "rgpu_pool_gpu_utilization_percent", gpu=GPU.uuid) == 40
    assert value(found, "rgpu_pool_gpu_temperature_celsius", gpu=GPU.uuid) == 51
    assert not any(name == "rgpu_pool_gpu_power_watts" for name, _ in found)     # unknown: left out, not -1
    assert value(found, "rgpu_pool_gpu_ecc_errors_total", gpu=GPU.uuid, type="corrected") == 2
    assert value(found, "rgpu_pool_gpu_xid_events_total", gpu=GPU.uuid) == 1
    assert value(found, "rgpu_pool_gpu_last_xid", gpu=GPU.uuid) == 31
    assert value(found, "rgpu_pool_gpu_recent_faults", gpu=GPU.uuid) == 1
    assert value(found, "rgpu_pool_gpu_telemetry_source", gpu=GPU.uuid, source="nvml") == 1


def test_job_keys_are_no_labels_and_series_stay_bounded() -> None:
    """A user leasing and releasing under ever new job keys makes no new series: a slice is
    labelled with its slot on its GPU (issue 26: 836 series from one user on 4 GPUs)."""
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for run in range(50):
        view = a_view()
        leases = tuple(LeaseView(LeaseRecord(f"user-chosen-{run}-{n}", "alice", "physics", 100.0 + n, 0.0,
                                             (SliceRecord("h:1", GPU.uuid, 0, GPU.name, GIB, 10),)), "active")
                       for n in range(3))
        for family in pool_families(dataclasses.replace(view, leases=leases)):
            for sample in family.samples:
                assert "job_key" not in sample.labels and not any("user-chosen" in v for v in sample.labels.values())
                seen.add((sample.name, tuple(sorted(sample.labels.items()))))
    slice_series = {s for s in seen if s[0] == "rgpu_pool_slice_memory_bytes"}
    assert len(slice_series) == 3, slice_series   # slots 0-2, whatever the job keys were


def a_snapshot() -> DispatcherSnapshot:
    session = {"pid": 7, "job_key": "job-1", "slice_number": 0, "gpu_uuid": GPU.uuid, "mode": "cuda",
               "memory_limit_bytes": 20 * GIB, "memory_used_bytes": GIB}
    return DispatcherSnapshot(
        address="h:1", gpus=(GPU,), registered=True, heartbeats={"ok": 5, "unknown": 0, "failed": 1},
        registrations=2,
        sessions={"sessions": [session], "traffic": {GPU.uuid: {"received_bytes": 100, "sent_bytes": 50,
                                                                  "calls": 3, "errors": 1}},
                  "ended": {"ok": 1, "failed": 0, "revoked": 0, "fault": 2}, "accepted": 2, "refused": 1,
                  "faults": {GPU.uuid: {"cross_tenant": 1, "own": 0, "sessions": 2}},
                  "mps": {"running": False, "restarts": 0, "reason": "x"}, "compute_enforcement": "time-slicing",
                  "launch_path": "python (no compiler)", "backend": "emulated"},
        telemetry=(GpuReading(GPU.uuid, "emulated", utilization_percent=30.0, memory_used_bytes=GIB,
                              temperature_celsius=40.0, power_watts=200.0, power_limit_watts=700.0),),
        compute_rates={("job-1", 0): 30.0})


def test_dispatcher_families_from_a_snapshot() -> None:
    found = samples(dispatcher_families(a_snapshot()))
    assert value(found, "rgpu_dispatcher_sessions", gpu=GPU.uuid, mode="cuda") == 1
    assert value(found, "rgpu_datapath_received_bytes_total", gpu=GPU.uuid) == 100
    assert value(found, "rgpu_datapath_calls_total", gpu=GPU.uuid) == 3
    assert value(found, "rgpu_dispatcher_slice_memory_used_bytes", gpu=GPU.uuid, slot="0") == GIB
    assert value(found, "rgpu_dispatcher_gpu_memory_used_bytes", gpu=GPU.uuid) == GIB
    assert value(found, "rgpu_dispatcher_heartbeats_total", result="failed") == 1
    assert value(found, "rgpu_dispatcher_mps_running") == 0
    assert value(found, "rgpu_dispatcher_gpu_faults_total", gpu=GPU.uuid, scope="cross_tenant") == 1
    assert value(found, "rgpu_dispatcher_gpu_faults_total", gpu=GPU.uuid, scope="own") == 0
    assert value(found, "rgpu_dispatcher_gpu_fault_sessions_ended_total", gpu=GPU.uuid) == 2
    assert value(found, "rgpu_dispatcher_sessions_ended_total", outcome="fault") == 2
    assert value(found, "rgpu_dispatcher_info", compute_enforcement="time-slicing", launch_path="python") == 1
    assert value(found, "rgpu_dispatcher_slice_compute_used_percent", gpu=GPU.uuid, slot="0") == 30
    assert value(found, "rgpu_dispatcher_gpu_utilization_percent", gpu=GPU.uuid) == 30
    assert value(found, "rgpu_dispatcher_gpu_telemetry_source", gpu=GPU.uuid, source="emulated") == 1


def test_grafana_dashboard_uses_only_exported_metrics() -> None:
    """Every rgpu_* series the shipped Grafana dashboard queries is one the daemons export."""
    exported = {s.name for f in PoolMetrics(a_view).registry.collect() for s in f.samples}
    exported |= {s.name for f in dispatcher_families(a_snapshot()) for s in f.samples}
    exported |= {f.name for f in pool_families(a_view()) if f.type == "gauge"}   # unknown readings leave no sample
    dashboard = json.loads((REPO / "site" / "grafana" / "rgpu-pool.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel.get("targets", [])
               for name in re.findall(r"\brgpu_[a-z_]+", target["expr"])}
    assert queried and not queried - exported, f"the dashboard queries unknown series {sorted(queried - exported)}"


# --- real daemons ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_pool_and_dispatcher_metrics_over_http(cluster: RgpuCluster) -> None:
    from rgpu.remoting.datapath import protocol
    from rgpu.remoting.native.generated import api_gen

    pool_metrics, dispatcher_metrics, address = start_with_metrics(cluster)

    with cluster.client() as client:
        client.set_quota("user", "bob", 10)
        lease = client.allocate("job-m1", "alice", 2, percent=50)
        client.allocate("job-m1", "alice", 2, percent=50)                    # the same lease again
        with pytest.raises(CapacityError):
            client.allocate("job-m2", "bob", 1, percent=50)                 # over bob's quota
        with pytest.raises(CapacityError):
            client.allocate("job-m3", "carol", 1, memory_bytes=10_000 * GIB)  # no GPU that large

    found = scrape(pool_metrics)
    gpu = lease.slices[0].gpu_uuid
    assert value(found, "rgpu_pool_allocations_total", result="new") == 1
    assert value(found, "rgpu_pool_allocations_total", result="existing") == 1
    assert value(found, "rgpu_pool_allocation_refusals_total", reason="quota") == 1
    assert value(found, "rgpu_pool_allocation_refusals_total", reason="capacity") == 1
    assert value(found, "rgpu_pool_allocate_duration_seconds_count") == 4
    assert value(found, "rgpu_pool_leases", state="active") == 1
    assert value(found, "rgpu_pool_gpu_allocated_compute_percent", gpu=gpu) == 50
    assert value(found, "rgpu_pool_slice_compute_percent", gpu=gpu, slot="0") == 50
    assert value(found, "rgpu_pool_gpus", state="up") == 2
    assert value(found, "rgpu_pool_heartbeats_total", result="known") >= 1
    assert value(found, "rgpu_pool_quotas", kind="user") == 1
    # Anyone who reaches /metrics: no user, account or job key in any series (issue 26, LOW).
    text = urllib.request.urlopen(f"http://127.0.0.1:{pool_metrics}/metrics", timeout=10).read().decode()
    for secret_ish in ("alice", "bob", "carol", "job-m1", "physics"):
        assert secret_ish not in text, secret_ish
    assert not any(label in dict(labels) for _name, labels in found for label in ("user", "account", "name", "job"))

    # A session through the data path: its calls and bytes reach the dispatcher's counters.
    token = next(s.token for s in lease.slices if s.server == address)
    session, _ = protocol.handshake(address, token)

    def call(name: str, payload: bytes, seq: int, ctx: int = 0) -> bytes:
        session.sendall(protocol.pack_frame(api_gen.OPCODES[name], payload, seq=seq, ctx=ctx))
        (_, op, _, _, _, _), reply = protocol.recv_frame(session)
        assert op == protocol.OP_REPLY and struct.unpack_from("<i", reply)[0] == 0, (name, reply)
        return reply[4:]

    try:
        call("cuInit", struct.pack("<I", 0), 1)
        (ctx,) = struct.unpack("<Q", call("cuDevicePrimaryCtxRetain", struct.pack("<i", 0), 2))
        call("cuMemAlloc_v2", struct.pack("<QQQQI", 3 * GIB, 0, 0, 0, 0), 3, ctx)   # 3 GiB of the slice
        found = scrape(dispatcher_metrics)
        assert value(found, "rgpu_dispatcher_sessions", gpu=gpu, mode="cuda") == 1
        assert value(found, "rgpu_dispatcher_slice_memory_used_bytes", gpu=gpu, slot="0") == 3 * GIB
        assert value(found, "rgpu_dispatcher_slice_memory_limit_bytes", gpu=gpu, slot="0") == 40 * GIB
        assert value(found, "rgpu_dispatcher_gpu_memory_used_bytes", gpu=gpu) == 3 * GIB
        wait_for(lambda: value(scrape(dispatcher_metrics), "rgpu_datapath_calls_total", gpu=gpu) == 3,
                 what="the worker to publish its counters")
    finally:
        session.sendall(protocol.pack_frame(protocol.OP_BYE))
        session.close()
    # Ended: the totals keep the session's traffic, and the session is counted as ended well.
    wait_for(lambda: value(scrape(dispatcher_metrics), "rgpu_dispatcher_sessions_ended_total", outcome="ok") == 1,
             what="the session to end")
    found = scrape(dispatcher_metrics)
    assert value(found, "rgpu_datapath_calls_total", gpu=gpu) == 3
    assert value(found, "rgpu_datapath_received_bytes_total", gpu=gpu) >= 3 * (protocol.HEADER_SIZE + 4)
    assert value(found, "rgpu_dispatcher_gpu_memory_used_bytes", gpu=gpu) == 0
    assert value(found, "rgpu_datapath_sent_bytes_total", gpu=gpu) >= 3 * protocol.HEADER_SIZE
    assert value(found, "rgpu_dispatcher_sessions", gpu=gpu, mode="cuda") == 0
    assert value(found, "rgpu_dispatcher_sessions_accepted_total") == 1
    assert value(found, "rgpu_dispatcher_registered") == 1
    assert value(found, "rgpu_dispatcher_heartbeats_total", result="ok") >= 1
    assert value(found, "rgpu_dispatcher_mps_running") == 0

    with cluster.client() as client:
        assert client.release("job-m1")
    found = scrape(pool_metrics)
    assert value(found, "rgpu_pool_releases_total", result="released") == 1
    assert value(found, "rgpu_pool_leases", state="active") == 0


@pytest.mark.integration
def test_metrics_port_in_use_is_a_clear_error(cluster: RgpuCluster) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run([sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", "127.0.0.1:0",
                                 "--state", str(cluster.root / "p.db"), "--metrics-listen", busy],
                                env=cluster.env(), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert f"rgpu: poold: cannot serve metrics on {busy} (the port is in use;" in result.stderr
