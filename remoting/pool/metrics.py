"""What rgpu-poold exports to Prometheus.

Two kinds of metric: state, rebuilt from one PoolView at every scrape by the pure function
`pool_families` (GPUs, slices, leases, servers, quotas, capacity); and events, counted as they
happen by PoolMetrics (allocations, refusals by reason, allocate latency, releases, reclaims,
heartbeats, registrations). The HTTP endpoint is remoting/metrics/http.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.metrics_core import Metric

from rgpu.errors import CapacityError, InvalidRequest, NotFound, PermissionDenied, QuotaExceeded
from rgpu.remoting.metrics.gpu_telemetry import telemetry_families
from rgpu.remoting.metrics.slots import slots
from rgpu.remoting.pool.rules import QUOTA_KINDS
from rgpu.remoting.pool.views import LEASE_STATES, SERVER_STATES, PoolView

# Allocation takes ~1 ms in the pool; the tail is the SQLite commit and lock contention.
ALLOCATE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REFUSAL_REASONS = ("capacity", "quota", "permission", "invalid", "not_found", "error")


def refusal_reason(exc: BaseException) -> str:
    """The `reason` label of a refused allocation."""
    if isinstance(exc, QuotaExceeded):
        return "quota"
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, PermissionDenied):
        return "permission"
    if isinstance(exc, InvalidRequest):
        return "invalid"
    if isinstance(exc, NotFound):
        return "not_found"
    return "error"


def _gauge(name: str, documentation: str, labels: list[str],
           samples: Iterable[tuple[list[str], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


def pool_families(view: PoolView) -> list[Metric]:
    """The pool's state as metric families. Pure."""
    gpu_labels = ["server", "gpu", "index", "model"]
    # No job key, user or account: the endpoint needs no credential, and the series stay bounded by
    # the GPUs' slots (slots.py). Who holds a slot: `rgpu-admin leases`, or the dashboard (login).
    slice_labels = ["server", "gpu", "slot"]

    def gpu_key(g: object) -> list[str]:
        return [g.server, g.gpu.uuid, str(g.gpu.index), g.gpu.name]  # type: ignore[attr-defined]

    server_info = InfoMetricFamily("rgpu_pool_server", "A dispatcher known to the pool",
                                   labels=["server"])
    for s in view.servers:
        server_info.add_metric([s.address], {"hostname": s.hostname, "version": s.version,
                                             "driver_version": s.driver_version,
                                             "compute_enforcement": s.compute_enforcement or "unknown",
                                             "static_inventory": str(s.static_inventory).lower()})
    slices = sorted(((lv.lease, n, s) for lv in view.leases for n, s in enumerate(lv.lease.slices)),
                    key=lambda x: (x[2].gpu_uuid, x[0].created_unix, x[0].job_key, x[1]))
    slot = slots((s.gpu_uuid, (lease.job_key, n)) for lease, n, s in slices)
    # Used beside held: what each slice's sessions hold and how busy they are, as the dispatchers report.
    used: dict[tuple[str, int], tuple[int, float]] = {}
    for lv in view.leases:
        for n in range(len(lv.lease.slices)):
            record = lv.usage[n] if n < len(lv.usage) else None
            used[(lv.lease.job_key, n)] = (record.memory_used_bytes if record is not None else 0,
                                           lv.compute_used[n] if n < len(lv.compute_used) else -1.0)
    gpu_used: dict[tuple[str, str], int] = {}
    for lease, n, placed in slices:
        key = (placed.server, placed.gpu_uuid)
        gpu_used[key] = gpu_used.get(key, 0) + used[(lease.job_key, n)][0]
    return [
        _gauge("rgpu_pool_servers", "Dispatchers by state", ["state"],
               (([state], sum(s.state == state for s in view.servers)) for state in SERVER_STATES)),
        _gauge("rgpu_pool_server_up", "1 when the dispatcher heartbeats and is not drained", ["server"],
               (([s.address], float(s.state == "up")) for s in view.servers)),
        _gauge("rgpu_pool_server_heartbeat_age_seconds", "Time since the dispatcher's last heartbeat", ["server"],
               (([s.address], s.heartbeat_age_seconds) for s in view.servers)),
        server_info,
        _gauge("rgpu_pool_gpus", "GPUs by the state of their dispatcher", ["state"],
               (([state], sum(g.server_state == state for g in view.gpus)) for state in SERVER_STATES)),
        _gauge("rgpu_pool_gpu_memory_bytes", "GPU memory slices may divide (after any memory limit)", gpu_labels,
               ((gpu_key(g), g.gpu.usable_memory_bytes) for g in view.gpus)),
        _gauge("rgpu_pool_gpu_allocated_memory_bytes", "GPU memory held by leased slices", gpu_labels,
               ((gpu_key(g), g.allocated_memory_bytes) for g in view.gpus)),
        _gauge("rgpu_pool_gpu_allocated_compute_percent", "GPU compute held by leased slices (100 = all)",
               gpu_labels, ((gpu_key(g), g.allocated_percent) for g in view.gpus)),
        _gauge("rgpu_pool_gpu_slices", "Leased slices on the GPU", gpu_labels,
               ((gpu_key(g), g.slices) for g in view.gpus)),
        _gauge("rgpu_pool_slice_memory_bytes", "Memory limit of a leased slice", slice_labels,
               (([s.server, s.gpu_uuid, slot[(s.gpu_uuid, (lease.job_key, n))]],
                 s.memory_limit_bytes) for lease, n, s in slices)),
        _gauge("rgpu_pool_slice_compute_percent", "Compute share of a leased slice", slice_labels,
               (([s.server, s.gpu_uuid, slot[(s.gpu_uuid, (lease.job_key, n))]],
                 s.compute_percent) for lease, n, s in slices)),
        _gauge("rgpu_pool_slice_memory_used_bytes", "GPU memory a leased slice's sessions hold now, as its "
               "dispatcher reports (as HAMi's vGPU_device_memory_usage_in_bytes)", slice_labels,
               (([s.server, s.gpu_uuid, slot[(s.gpu_uuid, (lease.job_key, n))]],
                 used[(lease.job_key, n)][0]) for lease, n, s in slices)),
        _gauge("rgpu_pool_slice_compute_used_percent", "A leased slice's workers' busy time over its dispatcher's "
               "last heartbeat interval, % of wall time (absent: not reported yet)", slice_labels,
               (([s.server, s.gpu_uuid, slot[(s.gpu_uuid, (lease.job_key, n))]],
                 used[(lease.job_key, n)][1]) for lease, n, s in slices if used[(lease.job_key, n)][1] >= 0)),
        _gauge("rgpu_pool_gpu_memory_used_bytes", "GPU memory the leased slices' sessions hold now", gpu_labels,
               ((gpu_key(g), gpu_used.get((g.server, g.gpu.uuid), 0)) for g in view.gpus)),
        _gauge("rgpu_pool_gpu_recent_faults", "GPU faults in the dispatcher's last report (its last 20; "
               "`rgpu-admin health` lists them)", gpu_labels, ((gpu_key(g), len(g.faults)) for g in view.gpus)),
        *telemetry_families("rgpu_pool", gpu_labels,
                            ((gpu_key(g), g.telemetry) for g in view.gpus if g.telemetry is not None)),
        _gauge("rgpu_pool_leases", "Leases by state (expired: not reclaimed yet)", ["state"],
               (([state], sum(lv.state == state for lv in view.leases)) for state in LEASE_STATES)),
        _gauge("rgpu_pool_leases_idle", "Leases whose slices ran no call for idle_after_seconds", [],
               [([], sum(lv.idle for lv in view.leases))]),
        _gauge("rgpu_pool_capacity_units", "GPU-percent of the GPUs of dispatchers that are up (100 per GPU)", [],
               [([], view.total_units)]),
        _gauge("rgpu_pool_allocated_units", "GPU-percent leased on dispatchers that are up", [],
               [([], view.allocated_units)]),
        # Quotas are named by users and accounts: per kind only (each quota's use: `rgpu-admin quotas`).
        _gauge("rgpu_pool_quotas", "Quotas set, by kind (user, account)", ["kind"],
               (([kind], sum(q.kind == kind for q, _used in view.quotas)) for kind in QUOTA_KINDS)),
        _gauge("rgpu_pool_quotas_at_limit", "Quotas whose leases hold all they allow, by kind", ["kind"],
               (([kind], sum(q.kind == kind and used >= q.limit_units for q, used in view.quotas))
                for kind in QUOTA_KINDS)),
        _gauge("rgpu_pool_quota_use_max", "The fullest quota of the kind: used / limit (0 to 1)", ["kind"],
               (([kind], max((used / q.limit_units if q.limit_units else 1.0 for q, used in view.quotas
                              if q.kind == kind), default=0.0)) for kind in QUOTA_KINDS)),
    ]


class _StateCollector(Collector):
    def __init__(self, read_view: Callable[[], PoolView]) -> None:
        self._read_view = read_view

    def collect(self) -> Iterator[Metric]:
        yield from pool_families(self._read_view())


class PoolMetrics:
    """The pool's registry: event counters the daemon updates, and its state read at each scrape."""

    def __init__(self, read_view: Callable[[], PoolView] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.allocations = Counter("rgpu_pool_allocations", "Allocate calls answered with a lease "
                                   "(new: placed now; existing: the job key already held it)", ["result"], registry=r)
        self.refusals = Counter("rgpu_pool_allocation_refusals", "Allocate calls refused, by reason",
                                ["reason"], registry=r)
        self.allocate_seconds = Histogram("rgpu_pool_allocate_duration_seconds", "Time to answer an Allocate call",
                                          buckets=ALLOCATE_BUCKETS, registry=r)
        self.releases = Counter("rgpu_pool_releases", "Release calls (released: a lease ended; unknown: "
                                "nothing held under the job key)", ["result"], registry=r)
        self.reclaimed = Counter("rgpu_pool_leases_reclaimed", "Leases ended by their TTL", registry=r)
        self.idle_released = Counter("rgpu_pool_leases_idle_released", "Idle leases released (idle_release)",
                                     registry=r)
        self.heartbeats = Counter("rgpu_pool_heartbeats", "Dispatcher heartbeats (unknown: the dispatcher "
                                  "must register again)", ["result"], registry=r)
        self.registrations = Counter("rgpu_pool_registrations", "Dispatcher registrations", registry=r)
        self.rate_limited = Counter("rgpu_pool_user_lease_calls_limited", "Users' Allocate, Renew and Release "
                                    "calls refused by user_lease_calls_burst/_per_second", registry=r)
        self.history_pruned = Counter("rgpu_pool_history_pruned", "Ended-lease history rows pruned "
                                      "(history_keep_days, history_max_rows)", registry=r)
        self.servers_down = Counter("rgpu_pool_server_down_events", "Dispatchers found without heartbeat",
                                    registry=r)
        for result in ("new", "existing"):
            self.allocations.labels(result)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)
        for result in ("released", "unknown"):
            self.releases.labels(result)
        for result in ("known", "unknown"):
            self.heartbeats.labels(result)
        if read_view is not None:
            r.register(_StateCollector(read_view))
