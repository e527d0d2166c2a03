"""What the dispatchers' last heartbeats said their GPUs do: readings per GPU (utilisation, memory,
temperature, power, ECC, Xid), each slice's compute use, and recent GPU faults. Held in memory by
the pool process that received the heartbeat and, where several processes or daemons share a
store, in the store too (a report, not state: a restarted pool has it again after one heartbeat
interval). Validation is pure; the board is a lock, three dictionaries and that store.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from rgpu import validate
from rgpu.errors import InvalidRequest
from rgpu.proto import rgpu_pb2 as pb

MAX_FAULTS_PER_SERVER = 20
MAX_GPUS_PER_SERVER = 64
SOURCES = ("nvml", "emulated")


def _skew(sent_unix: float, now: float) -> float:
    return now - sent_unix if sent_unix > 0 else 0.0


def checked_faults(faults: Any, sent_unix: float, now: float) -> list[pb.GpuFault]:
    """A heartbeat's GPU faults, bounded and printable, their times moved to the pool's clock."""
    out = []
    skew = _skew(sent_unix, now)
    for fault in list(faults)[-MAX_FAULTS_PER_SERVER:]:
        try:
            validate.text("GPU fault", fault.gpu_uuid, 128)
            validate.text("GPU fault", fault.error, 64)
            validate.text("GPU fault", fault.faulting, 256)
        except InvalidRequest:
            continue   # a report, not a command: a bad entry is dropped, the heartbeat stands
        copy = pb.GpuFault()
        copy.CopyFrom(fault)
        copy.unix = fault.unix + skew
        out.append(copy)
    return out


def _finite(value: float, low: float, high: float) -> float:
    """A reading in its plausible range; anything else (NaN, absurd) reads as unknown (-1)."""
    return value if math.isfinite(value) and low <= value <= high else -1.0


def checked_telemetry(readings: Iterable[pb.GpuTelemetry], gpus: set[str], sent_unix: float,
                      now: float) -> list[pb.GpuTelemetry]:
    """A heartbeat's GPU readings for GPUs the server registered, bounded, times on the pool's clock."""
    out = []
    skew = _skew(sent_unix, now)
    for r in list(readings)[:MAX_GPUS_PER_SERVER]:
        if r.gpu_uuid not in gpus:
            continue
        copy = pb.GpuTelemetry()
        copy.CopyFrom(r)
        copy.source = r.source if r.source in SOURCES else "unknown"
        copy.utilization_percent = _finite(r.utilization_percent, 0, 100)
        copy.temperature_celsius = _finite(r.temperature_celsius, 0, 200)
        copy.power_watts = _finite(r.power_watts, 0, 100_000)
        copy.power_limit_watts = _finite(r.power_limit_watts, 0, 100_000)
        copy.read_unix = r.read_unix + skew if r.read_unix > 0 else now
        out.append(copy)
    return out


def checked_compute(usage: Iterable[pb.SliceUsage]) -> dict[tuple[str, int], float]:
    """(job key, slice) -> compute used, % of wall time over the dispatcher's last interval."""
    return {(u.job_key, u.slice_number): _finite(u.compute_used_percent, 0, 100) for u in usage}


class ReportStore(Protocol):
    """Where the processes of one rgpu-poold (and daemons on one PostgreSQL) share the reports:
    the pool's store (save is a no-op and load empty where one process serves alone)."""

    def save_server_report(self, address: str, report: bytes, received: float) -> None: ...
    def load_server_reports(self) -> dict[str, bytes]: ...


REFRESH_S = 1.0   # how stale another process's reports may be when read here


class TelemetryBoard:
    def __init__(self, store: ReportStore | None = None, clock: Any = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._store = store
        self._clock = clock
        self._loaded = -REFRESH_S
        self._faults: dict[str, list[pb.GpuFault]] = {}
        self._readings: dict[str, list[pb.GpuTelemetry]] = {}
        self._compute: dict[str, dict[tuple[str, int], float]] = {}

    def record(self, address: str, request: pb.HeartbeatRequest, gpus: set[str], now: float) -> None:
        faults = checked_faults(request.faults, request.sent_unix, now)
        readings = checked_telemetry(request.telemetry, gpus, request.sent_unix, now)
        compute = checked_compute(request.usage)
        with self._lock:
            self._take(address, faults, readings, compute)
        if self._store is not None:
            report = pb.HeartbeatRequest(address=address, faults=faults, telemetry=readings, usage=[
                pb.SliceUsage(job_key=k, slice_number=n, compute_used_percent=v) for (k, n), v in compute.items()])
            self._store.save_server_report(address, report.SerializeToString(), now)

    def _take(self, address: str, faults: list[pb.GpuFault], readings: list[pb.GpuTelemetry],
              compute: dict[tuple[str, int], float]) -> None:
        self._faults[address] = faults
        self._readings[address] = readings
        self._compute[address] = compute

    def _refresh(self) -> None:
        """With a shared store: every process's reports, read at most once per REFRESH_S."""
        if self._store is None or self._clock() - self._loaded < REFRESH_S:
            return
        self._loaded = self._clock()
        for address, blob in self._store.load_server_reports().items():
            report = pb.HeartbeatRequest.FromString(blob)
            with self._lock:
                self._take(address, list(report.faults), list(report.telemetry),
                           {(u.job_key, u.slice_number): u.compute_used_percent for u in report.usage})

    def faults(self, address: str) -> list[pb.GpuFault]:
        self._refresh()
        with self._lock:
            return list(self._faults.get(address, ()))

    def readings(self, address: str) -> list[pb.GpuTelemetry]:
        self._refresh()
        with self._lock:
            return list(self._readings.get(address, ()))

    def compute_used(self, address: str, job_key: str, number: int) -> float:
        """-1 where the slice's dispatcher did not report it (no session yet, or an older dispatcher)."""
        self._refresh()
        with self._lock:
            return self._compute.get(address, {}).get((job_key, number), -1.0)

    def snapshot(self) -> tuple[dict[str, list[pb.GpuFault]], dict[tuple[str, str], pb.GpuTelemetry],
                                dict[tuple[str, str, int], float]]:
        """(faults by server, readings by (server, GPU), compute by (server, job key, slice)) for views."""
        self._refresh()
        with self._lock:
            faults = {a: list(f) for a, f in self._faults.items()}
            readings = {(a, r.gpu_uuid): r for a, rs in self._readings.items() for r in rs}
            compute = {(a, k, n): v for a, table in self._compute.items() for (k, n), v in table.items()}
        return faults, readings, compute
