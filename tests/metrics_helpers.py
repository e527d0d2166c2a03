"""Scraping the daemons' Prometheus metrics, for the metrics and telemetry tests."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

from tests.daemons import EXAMPLES, RgpuCluster, wait_for, wait_for_port_file


def samples(families: Iterator | list) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of parsed or built families."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(found: dict, metric: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    hits = [v for (n, ls), v in found.items() if n == metric and set(labels.items()) <= set(ls)]
    assert len(hits) == 1, f"{len(hits)} samples of {metric} with {labels}: {sorted(k for k in found if k[0] == metric)}"
    return hits[0]


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return samples(text_string_to_metric_families(reply.read().decode()))


def start_with_metrics(cluster: RgpuCluster) -> tuple[int, int, str]:
    """A pool and an emulated dispatcher (inventory-a), each with its metrics endpoint, once the
    pool counts the dispatcher up: (pool's metrics port, dispatcher's metrics port, dispatcher's
    address). The dispatcher's port file comes before its registration, so callers that allocate
    at once would race it (CI on c3b9a00 lost that race)."""
    pool = cluster.start_pool("--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                              str(cluster.root / "pool-metrics.port"))
    pool_metrics = wait_for_port_file(cluster.root / "pool-metrics.port", pool)
    daemon, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml", None, "--metrics-listen", "127.0.0.1:0",
                                            "--metrics-port-file", str(cluster.root / "d-metrics.port"))
    dispatcher_metrics = wait_for_port_file(cluster.root / "d-metrics.port", daemon)
    wait_for(lambda: value(scrape(pool_metrics), "rgpu_pool_servers", state="up") == 1, what="the dispatcher up")
    return pool_metrics, dispatcher_metrics, f"127.0.0.1:{port}"
