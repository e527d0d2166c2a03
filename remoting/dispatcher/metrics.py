"""What rgpu-dispatcher exports to Prometheus, rebuilt at every scrape from the session server's
observe() (sessions, data-path traffic summed from the workers' counters files, MPS state) and
the registrar's counts. `dispatcher_families` is pure; the endpoint is remoting/metrics/http.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
import dataclasses
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from rgpu.model import GpuInfo
from rgpu.remoting.datapath.counters import FIELDS as TRAFFIC_FIELDS
from rgpu.remoting.metrics.gpu_telemetry import telemetry_families
from rgpu.remoting.metrics.slots import slots

TRAFFIC = {  # counters-file field: (metric name without _total, help)
    "received_bytes": ("rgpu_datapath_received_bytes", "Bytes received from clients on the data path"),
    "sent_bytes": ("rgpu_datapath_sent_bytes", "Bytes sent to clients on the data path"),
    "calls": ("rgpu_datapath_calls", "CUDA and NVML calls served (launches included)"),
    "errors": ("rgpu_datapath_errors", "Calls that returned an error to the client"),
}
assert set(TRAFFIC) == set(TRAFFIC_FIELDS)


@dataclass(frozen=True)
class DispatcherSnapshot:
    address: str
    gpus: tuple[GpuInfo, ...]
    sessions: dict[str, Any]            # SessionServer.observe()
    registered: bool
    heartbeats: dict[str, int]          # ok | unknown | failed
    registrations: int
    telemetry: tuple[Any, ...] = ()                            # telemetry.GpuReading, one per GPU
    compute_rates: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)   # (job key, slice) -> %


def dispatcher_families(snap: DispatcherSnapshot) -> list[Metric]:
    """The dispatcher's state as metric families. Pure."""
    obs = snap.sessions
    by_uuid = {g.uuid: g for g in snap.gpus}
    gpu_labels = ["gpu", "index", "model"]

    def gpu_key(uuid: str) -> list[str]:
        g = by_uuid.get(uuid)
        return [uuid, str(g.index) if g else "", g.name if g else ""]

    memory = GaugeMetricFamily("rgpu_dispatcher_gpu_memory_bytes", "Memory of a served GPU that slices divide",
                               labels=gpu_labels)
    sessions = GaugeMetricFamily("rgpu_dispatcher_sessions", "Open data-path sessions",
                                 labels=[*gpu_labels, "mode"])
    for g in snap.gpus:
        memory.add_metric(gpu_key(g.uuid), g.usable_memory_bytes)
        for mode in ("cuda", "nvml"):
            sessions.add_metric([*gpu_key(g.uuid), mode],
                                sum(s["gpu_uuid"] == g.uuid and s["mode"] == mode for s in obs["sessions"]))
    # Per slice, not per session: a slice's sessions (CUDA and NVML, several processes) share its limit.
    slice_labels = ["gpu", "slot"]   # no job key: bounded series (slots.py)
    used = GaugeMetricFamily("rgpu_dispatcher_slice_memory_used_bytes",
                             "GPU memory a slice's sessions hold (exact: the worker sees every allocation)",
                             labels=slice_labels)
    limit = GaugeMetricFamily("rgpu_dispatcher_slice_memory_limit_bytes", "A slice's memory limit",
                              labels=slice_labels)
    gpu_used = GaugeMetricFamily("rgpu_dispatcher_gpu_memory_used_bytes", "GPU memory held by the slices' sessions",
                                 labels=gpu_labels)
    compute = GaugeMetricFamily("rgpu_dispatcher_slice_compute_used_percent",
                                "A slice's workers' busy time over the last heartbeat interval, % of wall time "
                                "(as HAMi's Device_utilization_desc_of_container)", labels=slice_labels)
    slices: dict[tuple[str, str, int], dict[str, Any]] = {}
    for s in obs["sessions"]:
        slices.setdefault((s["gpu_uuid"], s["job_key"], s["slice_number"]), s)
    slot = slots((uuid, (job_key, number)) for uuid, job_key, number in sorted(slices))
    for (uuid, job_key, number), s in sorted(slices.items()):
        used.add_metric([uuid, slot[(uuid, (job_key, number))]], s["memory_used_bytes"])
        limit.add_metric([uuid, slot[(uuid, (job_key, number))]], s["memory_limit_bytes"])
        compute.add_metric([uuid, slot[(uuid, (job_key, number))]], snap.compute_rates.get((job_key, number), 0.0))
    for g in snap.gpus:
        gpu_used.add_metric(gpu_key(g.uuid), sum(s["memory_used_bytes"] for key, s in slices.items() if key[0] == g.uuid))
    families: list[Metric] = [memory, gpu_used, sessions, used, limit, compute]
    families += telemetry_families("rgpu_dispatcher", gpu_labels,
                                   ((gpu_key(r.gpu_uuid), r) for r in snap.telemetry if r.gpu_uuid in by_uuid))
    for field, (name, documentation) in TRAFFIC.items():
        family = CounterMetricFamily(name, documentation, labels=gpu_labels)
        for g in snap.gpus:
            family.add_metric(gpu_key(g.uuid), obs["traffic"].get(g.uuid, {}).get(field, 0))
        families.append(family)
    accepted = CounterMetricFamily("rgpu_dispatcher_sessions_accepted", "Sessions opened (token accepted)")
    accepted.add_metric([], obs["accepted"])
    refused = CounterMetricFamily("rgpu_dispatcher_sessions_refused",
                                  "Sessions refused (bad or revoked token, version mismatch, no worker)")
    refused.add_metric([], obs["refused"])
    ended = CounterMetricFamily("rgpu_dispatcher_sessions_ended", "Sessions ended, by outcome (failed: the "
                                "worker exited with an error or a signal; revoked: the pool ended its lease; fault: a GPU fault, its own "
                                "or another MPS client's, ended it)",
                                labels=["outcome"])
    for outcome, count in sorted(obs["ended"].items()):
        ended.add_metric([outcome], count)
    mps_running = GaugeMetricFamily("rgpu_dispatcher_mps_running",
                                    "1 when the MPS control daemon enforces compute shares, 0: time-slicing")
    mps_running.add_metric([], float(obs["mps"]["running"]))
    mps_restarts = CounterMetricFamily("rgpu_dispatcher_mps_restarts", "MPS control daemon restarts (recoveries)")
    mps_restarts.add_metric([], obs["mps"]["restarts"])
    faults = CounterMetricFamily("rgpu_dispatcher_gpu_faults", "Sticky GPU faults (scope cross_tenant: under MPS "
                                 "the fault ended every session of the GPU; own: only the faulting session)",
                                 labels=[*gpu_labels, "scope"])
    fault_sessions = CounterMetricFamily("rgpu_dispatcher_gpu_fault_sessions_ended",
                                         "Sessions ended by GPU faults (the faulting one and those it took along)",
                                         labels=gpu_labels)
    counts = obs.get("faults", {})
    for g in snap.gpus:
        for scope in ("cross_tenant", "own"):
            faults.add_metric([*gpu_key(g.uuid), scope], counts.get(g.uuid, {}).get(scope, 0))
        fault_sessions.add_metric(gpu_key(g.uuid), counts.get(g.uuid, {}).get("sessions", 0))
    families += [faults, fault_sessions]
    info = InfoMetricFamily("rgpu_dispatcher", "How this dispatcher serves")
    info.add_metric([], {"address": snap.address, "compute_enforcement": obs["compute_enforcement"],
                         "launch_path": obs["launch_path"].split(" ")[0], "backend": obs["backend"]})
    registered = GaugeMetricFamily("rgpu_dispatcher_registered", "1 while registered with the pool")
    registered.add_metric([], float(snap.registered))
    heartbeats = CounterMetricFamily("rgpu_dispatcher_heartbeats", "Heartbeats to the pool (unknown: the pool "
                                     "forgot this dispatcher; failed: no answer)", labels=["result"])
    for result, count in sorted(snap.heartbeats.items()):
        heartbeats.add_metric([result], count)
    registrations = CounterMetricFamily("rgpu_dispatcher_registrations", "Registrations with the pool "
                                        "(more than one: re-registered after a loss)")
    registrations.add_metric([], snap.registrations)
    return [*families, accepted, refused, ended, mps_running, mps_restarts, info, registered, heartbeats,
            registrations]


class _Collector(Collector):
    def __init__(self, read: Callable[[], DispatcherSnapshot]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        yield from dispatcher_families(self._read())


def dispatcher_registry(read: Callable[[], DispatcherSnapshot]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_Collector(read))
    return registry
