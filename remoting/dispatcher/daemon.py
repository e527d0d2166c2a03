"""rgpu-dispatcher: serves one GPU node's GPUs to the pool (the role of Bitfusion's `flexdirect server`).

    rgpu-dispatcher [-p PORT] [--host ADDRESS] [--advertise HOST] --pool HOST:PORT
                    [--config FILE] [--inventory FILE] [--secret-file PATH] [--port-file PATH]

At startup it reads its GPUs (NVML, or a static --inventory file), applies RGPU_VISIBLE_DEVICES and
RGPU_GPU_DEVICE_MEMORY_LIMIT (see rgpu.remoting.dispatcher.inventory), binds its session port (so a port
clash is an immediate, clear error), starts the data path on that socket, and registers with the
pool. Then it heartbeats; when the pool forgets it or was unreachable, it registers again by
itself. Several dispatchers on one host work with distinct ports and disjoint GPU sets.

Exit status: 0 after SIGTERM/SIGINT; otherwise the RgpuError exit code (2 for configuration:
port in use, no driver, missing secret, bad environment).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import click

from rgpu import __version__, grpc_tls, validate
from rgpu.config import DEFAULT_DISPATCHER_PORT, Settings, load_settings, pool_addresses
from rgpu.errors import ConfigError, InvalidRequest, RgpuError
from rgpu.live_leases import LiveLeases
from rgpu.netaddr import bound_address, join_host_port
from rgpu.portfile import write_port_file
from rgpu.model import GpuInfo, ServerInfo
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.pool.convert import server_to_pb
from rgpu.remoting.dispatcher.inventory import (Inventory, InventorySource, NodeSettings, open_inventory, read_node_settings,
                                     served_gpus)
from rgpu.remoting.dispatcher.metrics import DispatcherSnapshot, dispatcher_registry
from rgpu.remoting.dispatcher.registration import POOL_CALL_TIMEOUT, Registrar, pool_connector
from rgpu.remoting.dispatcher.sharing import parse_sharing, with_sharing
from rgpu.remoting.dispatcher.telemetry import Telemetry, open_telemetry
from rgpu.remoting.metrics.http import MetricsServer, serve_metrics
from rgpu.secret import load_secret
from rgpu.units import format_bytes

COMPONENT = "dispatcher"
log = logging.getLogger("rgpu-dispatcher")

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
LISTEN_BACKLOG = 128


# --- the session socket --------------------------------------------------------------------------

def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket; a clash with another dispatcher is a ConfigError saying what to do."""
    where = join_host_port(host, port)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(COMPONENT, f"cannot resolve --host {host!r}", str(exc.strerror),
                          "give an address of this machine, or 0.0.0.0 for all") from None
    sock = socket.socket(family, kind, proto)
    # SO_REUSEADDR lets a restarted dispatcher bind despite TIME_WAIT connections from its previous
    # run; Linux still refuses the port while another socket listens on it, which is what we want.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise _bind_error(where, port, exc) from None
    return sock


def _bind_error(where: str, port: int, exc: OSError) -> ConfigError:
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(COMPONENT, f"cannot listen on {where}: port {port} is already in use",
                           "another rgpu-dispatcher or program holds it",
                           "stop that process, or give this dispatcher its own port with -p PORT")
    if exc.errno == errno.EACCES:
        return ConfigError(COMPONENT, f"cannot listen on {where}: permission denied",
                           "ports below 1024 need root", "use a port of 1024 or more with -p PORT")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(COMPONENT, f"cannot listen on {where}: no such address on this machine", "",
                           "give --host an address of this machine, or 0.0.0.0 for all")
    return ConfigError(COMPONENT, f"cannot listen on {where}", exc.strerror or str(exc), "check --host and -p")


def bind_session_port(host: str, port: int, node: NodeSettings) -> socket.socket:
    """The session socket. With a data-port range (RGPU_SERVER_PORT_MIN/MAX), the port must lie in
    it, and port 0 takes the first free port of the range; without one, any port (0: the kernel's)."""
    if not node.port_range_source:
        return bind_listener(host, port)
    low, high = node.port_range
    if port:
        if not low <= port <= high:
            raise ConfigError(COMPONENT, f"session port {port} is outside the data-port range {low}-{high}",
                              f"set by {node.port_range_source}",
                              f"give -p a port from {low} to {high} (or -p 0 for a free one there), or change the range")
        return bind_listener(host, port)
    for candidate in range(low, high + 1):
        try:
            return bind_listener(host, candidate)
        except ConfigError as exc:
            if "already in use" not in exc.what:   # a bad --host or a privileged port: no use trying on
                raise
    raise ConfigError(COMPONENT, f"no free port in the data-port range {low}-{high} on {host or '0.0.0.0'}",
                      f"every port of the range (set by {node.port_range_source}) is taken or refused",
                      "widen the range, or stop the programs holding its ports")


def default_advertise(bind_host: str) -> str:
    """The name clients are told to connect to: the bound address, else this machine's FQDN."""
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    name = socket.getfqdn()
    # Some hosts map their own name to localhost in /etc/hosts; that is useless to other nodes.
    if not name or name.startswith("localhost"):
        name = socket.gethostname()
    return name


# --- the data path ------------------------------------------------------------------------------

class DataPath(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def observe(self) -> dict[str, Any]: ...
    def update_live(self, live: LiveLeases) -> None: ...
    def usage(self) -> list[dict[str, Any]]: ...
    def faults(self) -> list[dict[str, Any]]: ...


def start_data_path(sock: socket.socket, address: str, gpus: tuple[GpuInfo, ...], secret: bytes,
                    port_range: tuple[int, int], backend: str, settings: Settings | None = None) -> DataPath:
    # Imported here: the CUDA/NVML data path is not needed to parse flags or report config errors.
    from rgpu.remoting.dispatcher.admission import SessionCaps
    from rgpu.remoting.dispatcher.front_door import FrontDoor
    from rgpu.remoting.dispatcher.sessions import SessionServer

    settings = settings or Settings()
    door = FrontDoor(hello_deadline_s=settings.session_hello_deadline_seconds,
                     max_handshakes=settings.session_handshakes_max,
                     per_address=settings.session_handshakes_per_address)
    for key in ("session_hello_deadline_seconds", "session_handshakes_max", "session_handshakes_per_address"):
        value = getattr(settings, key)
        if not value > 0 or value != value or value == float("inf"):
            raise ConfigError(COMPONENT, f"{key} = {value!r} from {settings.origin(key)} is not a positive number",
                              "it limits handshakes on the session port", f"set {key} to a number above 0")
    caps = SessionCaps(cuda_per_slice=settings.session_cuda_per_slice, nvml_per_slice=settings.session_nvml_per_slice,
                       perf_per_slice=settings.session_perf_per_slice, perf_max=settings.session_perf_max,
                       sessions_max=settings.sessions_max, opens_burst=settings.session_opens_burst,
                       opens_per_second=settings.session_opens_per_second,
                       frame_stall_s=settings.session_frame_stall_seconds,
                       perf_idle_s=settings.session_perf_idle_seconds)
    bad = caps.invalid()
    if bad:
        key = bad.split(" = ", 1)[0]
        raise ConfigError(COMPONENT, f"{bad} from {settings.origin(key)} is not a positive number",
                          "it limits the sessions a lease token may hold or open", f"set {key} to a number above 0")
    if settings.image_cache_bytes < 0:
        raise ConfigError(COMPONENT, f"image_cache_bytes = {settings.image_cache_bytes} from "
                          f"{settings.origin('image_cache_bytes')} is negative", "it bounds the module image cache",
                          "set image_cache_bytes to 0 (off) or a size in bytes")
    from rgpu.remoting.datapath.transport import parse_transport
    transport = parse_transport(settings.transport, "transport", settings.origin("transport"))
    data_path: DataPath = SessionServer(listen_socket=sock, advertised=address, gpus=list(gpus), secret=secret,
                                        port_range=port_range, backend=backend, log=log, front_door=door,
                                        compute_lending=settings.compute_lending,
                                        image_cache_bytes=settings.image_cache_bytes, transport=transport,
                                        caps=caps, socket_buffer_bytes=settings.socket_buffer_bytes)
    data_path.start()
    return data_path


# --- startup ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Options:
    port: int
    host: str
    advertise: str | None
    pool: str | None
    config_file: str | None
    inventory_file: str | None
    secret_file: str | None
    port_file: str | None = None   # where to write the bound port once serving (-p 0)
    metrics_listen: str | None = None      # overrides dispatcher_metrics_listen
    metrics_port_file: str | None = None   # where to write the metrics endpoint's port


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(format="%(asctime)s rgpu-dispatcher: %(message)s", stream=sys.stderr, force=True)
    try:
        logging.getLogger().setLevel(level.upper())
    except ValueError:
        raise ConfigError(COMPONENT, f"unknown log_level {level!r}", "",
                          "use debug, info, warning or error") from None


def _checked_pool(settings: Settings) -> str:
    try:
        return ",".join(validate.server_address(address) for address in pool_addresses(settings.pool) or [""])
    except InvalidRequest:
        raise ConfigError(COMPONENT, f"pool address {settings.pool!r} from {settings.origin('pool')} is not HOST:PORT",
                          "", "pass --pool HOST:PORT or set RGPU_POOL") from None


def _checked_advertise(name: str) -> str:
    try:
        return validate.host(name)
    except InvalidRequest:
        raise ConfigError(COMPONENT, f"cannot advertise {name!r}", "not a host name or IP address",
                          "pass --advertise HOST with the name other nodes reach this machine by") from None


def host_available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes; 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _log_startup(source: InventorySource, inventory: Inventory, node: NodeSettings, gpus: tuple[GpuInfo, ...],
                 listen: str, address: str, pool: str, data_ports: tuple[int, int]) -> None:
    log.info("%s listening on %s, advertised as %s; pool %s", __version__, listen, address, pool)
    if inventory.static:
        log.warning("using %s: these GPUs are described, not detected (development, demos and tests only)",
                    source.description)
    log.info("driver %s, CUDA %s; data ports %d-%d", inventory.driver_version, inventory.cuda_version,
             *data_ports)
    for name in node.ignored:
        log.warning("%s is ignored: %s is set too and wins", name, "RGPU_" + name[3:])
    if node.memory_limit:
        log.info("memory limit %s", node.memory_limit.describe())
    offered = sum(g.usable_memory_bytes for g in gpus)
    available = host_available_memory()
    if inventory.static and available and offered > available:
        # The emulated backend keeps each slice's "device" memory in the worker's host memory.
        log.warning("these %d emulated GPUs offer %s in all, but their device memory is this host's RAM, of which "
                    "%s is available: slices that use it get workers killed for lack of memory; set "
                    "RGPU_GPU_DEVICE_MEMORY_LIMIT=%dM (half of it over %d GPUs) or less", len(gpus), format_bytes(offered),
                    format_bytes(available), available // 2 // max(1, len(gpus)) >> 20, len(gpus))
    for gpu in gpus:
        log.info("GPU %d %s %s: %s usable of %s, compute capability %s, shared %s", gpu.index, gpu.name, gpu.uuid,
                 format_bytes(gpu.usable_memory_bytes), format_bytes(gpu.total_memory_bytes), gpu.compute_capability,
                 gpu.sharing)


def _serve_metrics(settings: Settings, options: Options, address: str, gpus: tuple[GpuInfo, ...],
                   data_path: DataPath, registrar: Registrar, telemetry: Telemetry) -> MetricsServer | None:
    """The Prometheus endpoint, where dispatcher_metrics_listen (or --metrics-listen) puts it."""
    if not settings.dispatcher_metrics_listen:
        return None

    def snapshot() -> DispatcherSnapshot:
        return DispatcherSnapshot(address=address, gpus=gpus, sessions=data_path.observe(),
                                  registered=registrar.registered, heartbeats=dict(registrar.heartbeats),
                                  registrations=registrar.registrations, telemetry=tuple(telemetry.readings()),
                                  compute_rates=telemetry.compute_rates())

    server = serve_metrics(settings.dispatcher_metrics_listen, dispatcher_registry(snapshot), COMPONENT,
                           key="dispatcher_metrics_listen")
    log.info("metrics on http://%s/metrics", bound_address(settings.dispatcher_metrics_listen, server.port))
    if options.metrics_port_file:
        write_port_file(options.metrics_port_file, server.port, COMPONENT)
    return server


def run(options: Options, env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    settings = load_settings(options.config_file, env=env,
                             flags={"pool": options.pool, "secret_file": options.secret_file,
                                    "dispatcher_metrics_listen": options.metrics_listen})
    configure_logging(settings.log_level)
    pool = _checked_pool(settings)
    secret = load_secret(settings.secret_file)
    node = read_node_settings(env)
    source = open_inventory(options.inventory_file)
    inventory = source.read()
    gpus = served_gpus(inventory, node)
    gpus = with_sharing(gpus, parse_sharing(settings.gpu_sharing, gpus, settings.origin("gpu_sharing")))
    advertise = _checked_advertise(options.advertise or default_advertise(options.host))
    connect = pool_connector(settings, secret)
    connect().close()   # a bad TLS file is a startup error, not a retry loop
    warning = grpc_tls.plaintext_warning(settings, COMPONENT)
    if warning:
        log.warning("%s", warning)

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    sock = bind_session_port(options.host, options.port, node)
    port = sock.getsockname()[1]   # differs from options.port when that is 0 (tests)
    # The ports clients connect to: the range when one is set, else this one port (the accepted
    # connection is inherited by the session's worker, no second port).
    data_ports = node.port_range if node.port_range_source else (port, port)
    address = join_host_port(advertise, port)
    try:
        _log_startup(source, inventory, node, gpus, join_host_port(options.host or "0.0.0.0", port), address, pool,
                     data_ports)
        data_path = start_data_path(sock, address, gpus, secret, data_ports, source.backend, settings)
        try:
            status = data_path.status()
            enforcement = str(status.get("compute_enforcement", ""))
            if enforcement:
                log.info("compute shares enforced by %s", enforcement)
            info = ServerInfo(address=address, hostname=inventory.hostname or socket.gethostname(),
                              driver_version=inventory.driver_version, cuda_version=inventory.cuda_version,
                              gpus=gpus, static_inventory=inventory.static, version=__version__,
                              data_ports=f"{data_ports[0]}-{data_ports[1]}",
                              compute_enforcement=enforcement, launch_path=str(status.get("launch_path", "")))
            if options.port_file:
                write_port_file(options.port_file, port, COMPONENT)
            telemetry = open_telemetry(source.backend, gpus)

            def usage_report() -> list[pb.SliceUsage]:
                report = telemetry.sample(data_path.usage(), data_path.observe(), time.time())
                return [pb.SliceUsage(**u) for u in report]

            registrar = Registrar(server_to_pb(info), connect, pool, on_live=data_path.update_live,
                                  usage=usage_report, faults=lambda: [pb.GpuFault(**f) for f in data_path.faults()],
                                  telemetry=lambda: [pb.GpuTelemetry(**r.as_dict()) for r in telemetry.readings()])
            metrics = _serve_metrics(settings, options, address, gpus, data_path, registrar, telemetry)
            thread = threading.Thread(target=registrar.run, args=(stop,), name="registrar", daemon=True)
            thread.start()
            stop.wait()
            thread.join(timeout=POOL_CALL_TIMEOUT + 1)
            if metrics is not None:
                metrics.stop()
            telemetry.close()
        finally:
            data_path.stop()
    finally:
        sock.close()
    log.info("stopped")
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-p", "--port", type=click.IntRange(0, 65535), default=DEFAULT_DISPATCHER_PORT, show_default=True,
              help="TCP port for data-path sessions (0 picks a free one).")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option("--advertise", help="Host name the pool hands to clients (default: --host if specific, else this machine's FQDN).")
@click.option("--pool", help="Pool daemon HOST:PORT (default from config or RGPU_POOL).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="Config file (default /etc/rgpu/rgpu.toml).")
@click.option("--inventory", "inventory_file", type=click.Path(dir_okay=False),
              help="Static GPU inventory (TOML) instead of NVML, for development and demos.")
@click.option("--secret-file", help="Cluster secret file (mode 0600).")
@click.option("--port-file", type=click.Path(dir_okay=False),
              help="Write the session port to this file once serving (with -p 0).")
@click.option("--metrics-listen", help="HOST:PORT for the Prometheus endpoint (:PORT is 127.0.0.1 only; default: dispatcher_metrics_listen, off).")
@click.option("--metrics-port-file", type=click.Path(dir_okay=False),
              help="Write the metrics endpoint's port to this file once serving.")
@click.version_option(__version__, prog_name="rgpu-dispatcher")
def main(port: int, host: str, advertise: str | None, pool: str | None, config_file: str | None,
         inventory_file: str | None, secret_file: str | None, port_file: str | None, metrics_listen: str | None,
         metrics_port_file: str | None) -> None:
    """Serve this node's GPUs to the rgpu pool."""
    configure_logging()
    try:
        sys.exit(run(Options(port=port, host=host, advertise=advertise, pool=pool, config_file=config_file,
                             inventory_file=inventory_file, secret_file=secret_file, port_file=port_file,
                             metrics_listen=metrics_listen, metrics_port_file=metrics_port_file)))
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
