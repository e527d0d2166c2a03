"""GPU telemetry as metric families, for the dispatcher's endpoint and the pool's. Pure.

The names follow DCGM's exporter (the field each mirrors is in its help text) under rgpu's prefix,
so a DCGM dashboard maps one to one; a reading's `source` ("nvml" or "emulated") is a label of
the info family, so an emulated GPU is never mistaken for a measured one. Unknown readings (< 0)
are left out, not exported as -1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

GAUGES = (  # attribute, name suffix, help
    ("utilization_percent", "gpu_utilization_percent", "GPU busy over NVML's last sample period, 0-100 "
     "(DCGM_FI_DEV_GPU_UTIL)"),
    ("memory_used_bytes", "gpu_device_memory_used_bytes", "GPU memory in use as the driver counts it, "
     "every process included (DCGM_FI_DEV_FB_USED)"),
    ("temperature_celsius", "gpu_temperature_celsius", "GPU temperature (DCGM_FI_DEV_GPU_TEMP)"),
    ("power_watts", "gpu_power_watts", "GPU power draw (DCGM_FI_DEV_POWER_USAGE)"),
    ("power_limit_watts", "gpu_power_limit_watts", "GPU enforced power limit (DCGM_FI_DEV_POWER_MGMT_LIMIT)"),
    ("last_xid", "gpu_last_xid", "The last Xid error's number, 0: none (DCGM_FI_DEV_XID_ERRORS)"),
)


def telemetry_families(prefix: str, labels: Sequence[str],
                       rows: Iterable[tuple[list[str], Any]]) -> list[Metric]:
    """One family per figure; `rows` pairs each GPU's label values with its reading (a
    dispatcher GpuReading or a pb.GpuTelemetry: the same attribute names)."""
    rows = list(rows)
    families: list[Metric] = []
    for attribute, suffix, documentation in GAUGES:
        family = GaugeMetricFamily(f"{prefix}_{suffix}", documentation, labels=list(labels))
        for values, reading in rows:
            figure = getattr(reading, attribute)
            if figure >= 0:
                family.add_metric(values, figure)
        families.append(family)
    ecc = CounterMetricFamily(f"{prefix}_gpu_ecc_errors", "Volatile ECC errors since the driver loaded, by type "
                              "(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL, _DBE_VOL_TOTAL)", labels=[*labels, "type"])
    xids = CounterMetricFamily(f"{prefix}_gpu_xid_events", "Xid events seen since the dispatcher started",
                               labels=list(labels))
    source = GaugeMetricFamily(f"{prefix}_gpu_telemetry_source", "1 for where a GPU's readings come from: nvml "
                               "(measured) or emulated (derived from the sessions' work; no real GPU)",
                               labels=[*labels, "source"])
    for values, reading in rows:
        ecc.add_metric([*values, "corrected"], reading.ecc_corrected)
        ecc.add_metric([*values, "uncorrected"], reading.ecc_uncorrected)
        xids.add_metric(values, reading.xid_errors)
        source.add_metric([*values, reading.source or "unknown"], 1)
    return [*families, ecc, xids, source]
