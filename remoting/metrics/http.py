"""The `/metrics` HTTP endpoint of a daemon (prometheus-client's server, on its own port).

    server = serve_metrics("127.0.0.1:0", registry, "poold")   # port 0 picks a free one
    server.port; server.stop()
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from http.server import HTTPServer
from threading import Thread

from prometheus_client import CollectorRegistry, start_http_server

from rgpu.errors import ConfigError, InvalidRequest
from rgpu.netaddr import split_host_port


@dataclass
class MetricsServer:
    port: int
    _httpd: HTTPServer
    _thread: Thread

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_metrics(listen: str, registry: CollectorRegistry, component: str,
                  key: str = "metrics_listen") -> MetricsServer:
    """Serve `registry` on http://listen/metrics; a bad or taken address is a ConfigError naming `key`."""
    try:
        host, port = split_host_port(listen, what=key, allow_empty_host=True, allow_port_zero=True)
    except InvalidRequest as exc:
        raise ConfigError(component, f"{key} {listen!r} is not HOST:PORT", exc.why,
                          f"set {key} to e.g. 0.0.0.0:9401, or empty to turn metrics off") from None
    try:
        httpd, thread = start_http_server(port, addr=host or "0.0.0.0", registry=registry)
    except OSError as exc:
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError(component, f"cannot serve metrics on {listen}", why,
                          f"pick another {key} (or empty to turn metrics off), or stop the process on that port") from None
    return MetricsServer(port=httpd.server_address[1], _httpd=httpd, _thread=thread)
