"""The `/metrics` HTTP endpoint of a daemon (prometheus-client's handler behind rgpu's bounded
HTTP front, front.py: timeouts, a worker pool and a cap on connections).

    server = serve_metrics("127.0.0.1:0", registry, "poold")   # port 0 picks a free one
    server.port; server.stop()

An address without a host (":9401") serves on 127.0.0.1 only: the endpoint needs no credential,
so serving the network is a choice written out ("0.0.0.0:9401").
"""

from __future__ import annotations

import errno

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

from rgpu.errors import ConfigError, InvalidRequest
from rgpu.netaddr import split_host_port
from rgpu.remoting.metrics.front import HttpFront

DEFAULT_HOST = "127.0.0.1"
MetricsServer = HttpFront


def serve_metrics(listen: str, registry: CollectorRegistry, component: str,
                  key: str = "metrics_listen") -> MetricsServer:
    """Serve `registry` on http://listen/metrics; a bad or taken address is a ConfigError naming `key`."""
    try:
        host, port = split_host_port(listen, what=key, allow_empty_host=True, allow_port_zero=True)
    except InvalidRequest as exc:
        raise ConfigError(component, f"{key} {listen!r} is not HOST:PORT", exc.why,
                          f"set {key} to e.g. 127.0.0.1:9401, or empty to turn metrics off") from None
    try:
        return HttpFront(host or DEFAULT_HOST, port, MetricsHandler.factory(registry), name=component)
    except OSError as exc:
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError(component, f"cannot serve metrics on {listen}", why,
                          f"pick another {key} (or empty to turn metrics off), or stop the process on that port") from None
