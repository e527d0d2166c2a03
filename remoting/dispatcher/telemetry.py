"""What each served GPU does, read on its node at every heartbeat: utilisation, memory in use,
temperature, power, ECC errors and Xid events (from NVML on a real GPU), and each slice's compute
use (its workers' busy time over the report interval).

Two readers behind one small interface (`TelemetrySource.read(gpus, usage, sessions, now, rates,
faults) -> list[GpuReading]`), sampled once per heartbeat by `Telemetry`:

* `NvmlTelemetry` asks the driver (pynvml); a field the GPU does not support reads as unknown (-1;
  ECC counts as 0), never as an error. Xid events come from an NVML event set a background thread waits on.
* `EmulatedTelemetry` serves the emulated backend (a static --inventory): figures derived from the
  sessions' own work, so CI can test the path end to end; every reading says `source="emulated"`.
  A CUDA node whose NVML cannot start gets it too (logged).

`compute_rates` (pure) turns the slices' cumulative busy seconds into a percentage of wall time
between two reports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from rgpu.model import GpuInfo

log = logging.getLogger("rgpu-dispatcher")

UNKNOWN = -1.0
# The emulated GPU's figures: an idle H100-like board that warms and draws more as its sessions work.
EMULATED_IDLE_C, EMULATED_BUSY_C = 32.0, 68.0
EMULATED_IDLE_W, EMULATED_LIMIT_W = 70.0, 700.0


@dataclass(frozen=True)
class GpuReading:
    gpu_uuid: str
    source: str                         # "nvml" | "emulated"
    utilization_percent: float = UNKNOWN
    memory_used_bytes: int = 0
    temperature_celsius: float = UNKNOWN
    power_watts: float = UNKNOWN
    power_limit_watts: float = UNKNOWN
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    xid_errors: int = 0
    last_xid: int = 0
    read_unix: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TelemetrySource(Protocol):
    source: str

    def read(self, gpus: Sequence[GpuInfo], usage: Sequence[dict[str, Any]], sessions: Sequence[dict[str, Any]],
             now: float, rates: dict[tuple[str, int], float], faults: dict[str, int]) -> list[GpuReading]: ...

    def close(self) -> None: ...


def compute_rates(previous: dict[tuple[str, int], tuple[float, float]], usage: Iterable[dict[str, Any]],
                  now: float) -> dict[tuple[str, int], float]:
    """Each slice's busy seconds since its last report as a percentage of the wall time between
    them (0-100); `previous` maps (job key, slice) to (busy seconds, when) and is updated. A slice
    seen for the first time reads 0 (its busy time may span many intervals)."""
    rates: dict[tuple[str, int], float] = {}
    seen = set()
    for u in usage:
        key = (str(u["job_key"]), int(u["slice_number"]))
        seen.add(key)
        busy = float(u["busy_seconds"])
        before = previous.get(key)
        if before is not None and now > before[1] and busy >= before[0]:
            rates[key] = min(100.0, 100.0 * (busy - before[0]) / (now - before[1]))
        else:
            rates[key] = 0.0
        previous[key] = (busy, now)
    for key in set(previous) - seen:
        del previous[key]
    return rates


def emulated_readings(gpus: Sequence[GpuInfo], memory_used: dict[str, int], busy_percent: dict[str, float],
                      faults: dict[str, int], now: float) -> list[GpuReading]:
    """Plausible figures for emulated GPUs. Pure. Utilisation: the slices' busy percentages summed
    (capped at 100); temperature and power follow it; a GPU fault the dispatcher saw counts as an
    Xid 43 (the driver's "GPU stopped processing" for a faulting context)."""
    out = []
    for g in gpus:
        util = min(100.0, max(0.0, busy_percent.get(g.uuid, 0.0)))
        count = faults.get(g.uuid, 0)
        out.append(GpuReading(
            gpu_uuid=g.uuid, source="emulated", utilization_percent=round(util, 1),
            memory_used_bytes=memory_used.get(g.uuid, 0),
            temperature_celsius=round(EMULATED_IDLE_C + (EMULATED_BUSY_C - EMULATED_IDLE_C) * util / 100, 1),
            power_watts=round(EMULATED_IDLE_W + (EMULATED_LIMIT_W - EMULATED_IDLE_W) * 0.8 * util / 100, 1),
            power_limit_watts=EMULATED_LIMIT_W, xid_errors=count, last_xid=43 if count else 0, read_unix=now))
    return out


def per_gpu(gpus: Sequence[GpuInfo], usage: Sequence[dict[str, Any]], sessions: Sequence[dict[str, Any]],
            rates: dict[tuple[str, int], float]) -> tuple[dict[str, int], dict[str, float]]:
    """(memory held by the slices' sessions, summed compute-use percentages) per GPU UUID. Pure."""
    slice_gpu = {(str(s["job_key"]), int(s["slice_number"])): str(s["gpu_uuid"]) for s in sessions}
    memory: dict[str, int] = {}
    busy: dict[str, float] = {}
    for u in usage:
        key = (str(u["job_key"]), int(u["slice_number"]))
        uuid = u.get("gpu_uuid") or slice_gpu.get(key, "")
        if not uuid:
            continue
        memory[uuid] = memory.get(uuid, 0) + int(u.get("memory_used_bytes", 0))
        busy[uuid] = busy.get(uuid, 0.0) + rates.get(key, 0.0)
    return memory, busy


class EmulatedTelemetry:
    source = "emulated"

    def read(self, gpus: Sequence[GpuInfo], usage: Sequence[dict[str, Any]], sessions: Sequence[dict[str, Any]],
             now: float, rates: dict[tuple[str, int], float], faults: dict[str, int]) -> list[GpuReading]:
        memory, busy = per_gpu(gpus, usage, sessions, rates)
        return emulated_readings(gpus, memory, busy, faults, now)

    def close(self) -> None:
        pass


class NvmlTelemetry:
    """NVML readings of the served GPUs; Xid events counted by a thread on an NVML event set."""

    source = "nvml"

    def __init__(self, gpus: Sequence[GpuInfo]) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handles = {g.uuid: pynvml.nvmlDeviceGetHandleByUUID(g.uuid) for g in gpus}
        self._xids: dict[str, list[int]] = {g.uuid: [0, 0] for g in gpus}   # uuid -> [count, last]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events = self._event_set()
        if self._events is not None:
            self._thread = threading.Thread(target=self._watch_xids, name="rgpu-xid-events", daemon=True)
            self._thread.start()

    def _event_set(self) -> Any:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("Xid events are not counted: NVML cannot create an event set (%s)", exc)
            return None
        registered = 0
        for uuid, handle in self._handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                registered += 1
            except nvml.NVMLError as exc:
                log.info("Xid events of GPU %s are not counted (%s)", uuid, exc)
        return events if registered else None

    def _watch_xids(self) -> None:
        nvml = self._nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 500)
            except nvml.NVMLError_Timeout:
                continue
            except nvml.NVMLError as exc:
                log.warning("waiting for Xid events failed (%s); Xids are no longer counted", exc)
                return
            try:
                uuid = nvml.nvmlDeviceGetUUID(data.device)
            except nvml.NVMLError:
                continue
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            with self._lock:
                entry = self._xids.setdefault(uuid, [0, 0])
                entry[0] += 1
                entry[1] = int(data.eventData)
            log.warning("GPU %s reported Xid %d", uuid, int(data.eventData))

    def _field(self, call: Any, *args: Any, scale: float = 1.0) -> float:
        try:
            return float(call(*args)) * scale
        except self._nvml.NVMLError:
            return UNKNOWN

    def _ecc(self, handle: Any, kind: int) -> int:
        nvml = self._nvml
        try:
            return int(nvml.nvmlDeviceGetTotalEccErrors(handle, kind, nvml.NVML_VOLATILE_ECC))
        except nvml.NVMLError:
            return 0

    def read(self, gpus: Sequence[GpuInfo], usage: Sequence[dict[str, Any]], sessions: Sequence[dict[str, Any]],
             now: float, rates: dict[tuple[str, int], float], faults: dict[str, int]) -> list[GpuReading]:
        nvml = self._nvml
        out = []
        for g in gpus:
            handle = self._handles.get(g.uuid)
            if handle is None:
                continue
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nvml.NVMLError:
                util = UNKNOWN
            try:
                used = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except nvml.NVMLError:
                used = 0
            with self._lock:
                count, last = self._xids.get(g.uuid, [0, 0])
            out.append(GpuReading(
                gpu_uuid=g.uuid, source="nvml", utilization_percent=util, memory_used_bytes=used,
                temperature_celsius=self._field(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                power_watts=self._field(nvml.nvmlDeviceGetPowerUsage, handle, scale=1e-3),
                power_limit_watts=self._field(nvml.nvmlDeviceGetEnforcedPowerLimit, handle, scale=1e-3),
                ecc_corrected=self._ecc(handle, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                ecc_uncorrected=self._ecc(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                xid_errors=count, last_xid=last, read_unix=now))
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        try:
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


class Telemetry:
    """The dispatcher's reader, sampled once per heartbeat: per-slice compute rates (from the usage
    report) and per-GPU readings. `observe` is the session server's observe() (live sessions and
    fault counts)."""

    def __init__(self, source: TelemetrySource, gpus: Sequence[GpuInfo]) -> None:
        self.source = source
        self.gpus = tuple(gpus)
        self._previous: dict[tuple[str, int], tuple[float, float]] = {}
        self._lock = threading.Lock()
        self.latest: list[GpuReading] = []
        self.rates: dict[tuple[str, int], float] = {}

    def sample(self, usage: list[dict[str, Any]], observed: dict[str, Any], now: float) -> list[dict[str, Any]]:
        """The usage report with each slice's compute_used_percent; the GPU readings kept in `latest`."""
        faults = {uuid: int(c.get("own", 0)) + int(c.get("cross_tenant", 0))
                  for uuid, c in observed.get("faults", {}).items()}
        with self._lock:
            self.rates = compute_rates(self._previous, usage, now)
            self.latest = self.source.read(self.gpus, usage, observed.get("sessions", []), now, self.rates, faults)
            rates = dict(self.rates)
        return [{**u, "compute_used_percent": round(rates.get((u["job_key"], int(u["slice_number"])), 0.0), 2)}
                for u in usage]

    def readings(self) -> list[GpuReading]:
        with self._lock:
            return list(self.latest)

    def compute_rates(self) -> dict[tuple[str, int], float]:
        with self._lock:
            return dict(self.rates)

    def close(self) -> None:
        self.source.close()


def open_telemetry(backend: str, gpus: Sequence[GpuInfo]) -> Telemetry:
    """NVML for the CUDA backend (the sessions' own figures, marked emulated, if NVML cannot
    start: logged), else emulated."""
    if backend == "cuda":
        try:
            return Telemetry(NvmlTelemetry(gpus), gpus)
        except Exception as exc:   # noqa: BLE001 - telemetry is a report; serving goes on without NVML's figures
            log.warning("GPU telemetry from NVML is unavailable (%s); reporting the sessions' own figures, "
                        "marked emulated", exc)
    return Telemetry(EmulatedTelemetry(), gpus)
