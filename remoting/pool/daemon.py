"""rgpu-poold: the pool daemon. Knows every GPU, hands out leases of slices, keeps them durable.

The gRPC servicer (servicer.py) only validates and translates; rules live in PoolCore, durability in
Store. This module starts and stops it: the server, maintenance, metrics and dashboard, the CLI.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sqlite3
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import click

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rgpu import __version__, grpc_tls, plugins
from rgpu.remoting.pool.accounts import account_policy
from rgpu.remoting.pool.auth import ServerAuth
from rgpu.remoting.pool.call_guards import CallGuards, MemoryCallGuards, PostgresCallGuards, SharedCallGuards
from rgpu.config import Settings, load_settings
from rgpu.errors import ConfigError, InvalidRequest, RgpuError
from rgpu.netaddr import bound_address, split_host_port
from rgpu.portfile import write_port_file
from rgpu.rate import KeyedBuckets
from rgpu.proto import rgpu_pb2_grpc as pb_grpc
from rgpu.remoting.metrics.http import MetricsServer, serve_metrics
from rgpu.remoting.pool.events import EventLog
from rgpu.remoting.pool.group import checked_processes, die_with_parent, serve_group
from rgpu.remoting.pool.metrics import PoolMetrics
from rgpu.remoting.pool.rules import PoolCore
from rgpu.remoting.pool.store import PoolStore, Store
from rgpu.remoting.pool.telemetry import TelemetryBoard
from rgpu.remoting.pool.views import pool_view
from rgpu.remoting.pool.servicer import PoolServicer
from rgpu.secret import load_secret

log = logging.getLogger("rgpu-poold")

# Every call is short and PoolCore serialises changes under one lock, so more threads only fight
# over the GIL: 4 gave ~10-20% more allocations per second than 16 on a 2-core machine.
POOL_GRPC_WORKERS = 2


def open_store(state: str, store_url: str = "", shared: bool = False) -> PoolStore:
    """The store the settings name: PostgreSQL when store_url is set, else SQLite at `state`
    (shared by the processes of one daemon when `shared`)."""
    if store_url:
        if not store_url.startswith(("postgresql://", "postgres://")):
            raise ConfigError("store", f"store_url {store_url.split('@')[-1]!r} is not a PostgreSQL URL", "",
                              "use postgresql://USER@HOST:PORT/DATABASE, or leave it empty for SQLite")
        from rgpu.remoting.pool.store_pg import PostgresStore
        return PostgresStore(store_url)
    return Store(state, shared=shared)


# Ended-lease history rows one maintenance pass deletes at most (history_keep_days, history_max_rows):
# a backlog goes over several passes, never in one long write that holds up allocations.
HISTORY_PRUNE_PER_PASS = 5000


def _prune_history(core: PoolCore, settings: Settings) -> int:
    ended_before = core.clock() - settings.history_keep_days * 86400 if settings.history_keep_days > 0 else None
    if ended_before is None and not settings.history_max_rows:
        return 0
    return core.store.prune_history(ended_before, settings.history_max_rows, HISTORY_PRUNE_PER_PASS)


def _maintenance_loop(core: PoolCore, metrics: PoolMetrics, interval: float, stop: threading.Event,
                      settings: Settings) -> None:
    """Reclaim expired leases, release idle ones (idle_release), notice servers that stopped
    heartbeating, prune the ended-lease history (a bounded batch a pass)."""
    while not stop.wait(interval):
        try:
            core.load_shared_usage()   # several daemons: reports others received (no-op with SQLite)
            metrics.reclaimed.inc(len(core.reclaim_expired()))
            if settings.idle_release:
                metrics.idle_released.inc(len(core.release_idle()))
            metrics.servers_down.inc(len(core.check_down_servers()))
            metrics.history_pruned.inc(_prune_history(core, settings))
        except RgpuError as exc:
            log.warning("rgpu-poold: maintenance: %s (will retry)", exc)
        except Exception:
            log.exception("rgpu-poold: maintenance failed (will retry)")


def _server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    files = {}
    for key, path in (("tls_cert_file", cert_file), ("tls_key_file", key_file)):
        try:
            files[key] = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError("poold", f"cannot read {key} {path}", exc.strerror or str(exc),
                              f"fix {key} in rgpu.toml, or run `rgpu-admin install-units` to make the pool's "
                              "certificate") from None
    return grpc.ssl_server_credentials([(files["tls_key_file"], files["tls_cert_file"])])


def _check_bindable(listen: str) -> None:
    """Fail early with a clear reason (gRPC's own bind error is a log line, not a message)."""
    try:
        host, port = split_host_port(listen, what="listen address", allow_empty_host=True, allow_port_zero=True)
    except InvalidRequest as exc:
        raise OSError(f"{listen!r} is not HOST:PORT ({exc.why})") from None
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def _start_http(settings: Settings, secret: bytes, core: PoolCore, board: TelemetryBoard, metrics: PoolMetrics,
                events: EventLog,
                report: Callable[[str, int], None]) -> list[Any]:
    """The metrics endpoint and the dashboard, each where the settings put it (none by default)."""
    started: list[Any] = []
    try:
        if settings.metrics_listen:
            server: MetricsServer = serve_metrics(settings.metrics_listen, metrics.registry, "poold")
            started.append(server)
            log.info("rgpu-poold: metrics on http://%s/metrics", bound_address(settings.metrics_listen, server.port))
            report("metrics", server.port)
        if settings.dashboard_listen:
            from rgpu.remoting.pool.dashboard import serve_dashboard
            dashboard = serve_dashboard(settings, secret, lambda: pool_view(core, board), events, core.store)
            started.append(dashboard)
            log.info("rgpu-poold: dashboard on %s (port %d); `rgpu-admin dashboard-url` prints a login link",
                     dashboard.url, dashboard.port)
            report("dashboard", dashboard.port)
    except BaseException:
        for each in started:
            each.stop()
        raise
    return started


def pool_name(settings: Settings, port: int) -> str:
    """The name users' MUNGE credentials must carry to be accepted here: `pool_name`, else this
    host's name and the port the pool listens on (the processes of one rgpu-poold share both, and
    two pools differ in one). Clients learn it from PoolName, so how they dial does not matter."""
    name = settings.pool_name or f"{socket.gethostname()}:{port}"
    if not name.isprintable() or len(name) > 200:
        raise ConfigError("poold", f"pool_name {name[:60]!r} cannot be carried in a MUNGE credential",
                          "it holds a control character or is over 200 characters", "give a short printable name")
    return name


@contextlib.contextmanager
def running_pool(settings: Settings, secret: bytes, max_workers: int = POOL_GRPC_WORKERS,
                 report: Callable[[str, int], None] | None = None, *, group_member: bool = False,
                 extras: bool = True) -> Iterator[tuple[int, PoolCore]]:
    """Start the pool on settings.listen (port 0 picks a free one); yield (port, core).
    `report(what, port)` hears where the metrics endpoint and the dashboard serve, when on.
    A `group_member` is one of the processes of `rgpu-poold --processes N` (group.py): it shares
    the port (SO_REUSEPORT) and the SQLite file with the others; `extras` (the Slurm integration,
    metrics, dashboard) run in one of them only."""
    events = EventLog.attach(log)
    store = open_store(settings.state, settings.store_url, shared=settings.pool_processes > 1)
    try:
        core = PoolCore(store=store, secret=secret, placement=settings.placement,
                        down_after_seconds=settings.down_after_seconds,
                        max_slices_per_job=settings.max_slices_per_job, idle_after_seconds=settings.idle_after_seconds)
    except (sqlite3.DatabaseError, ValueError, TypeError, KeyError) as exc:
        # Rows that do not read back (a damaged file): one line, not a traceback.
        store.close()
        events.detach()
        where = "the PostgreSQL store" if settings.store_url else settings.state
        raise ConfigError("store", f"cannot read the pool's state from {where}",
                          f"{type(exc).__name__}: {str(exc)[:120]}",
                          "restore it from a backup, or move it aside to start an empty pool") from None
    board = TelemetryBoard(store)
    metrics = PoolMetrics(lambda: pool_view(core, board))
    # Daemons on one PostgreSQL, and the processes of one rgpu-poold, share the nonces they saw and
    # the hosts servers registered from: a client may reach any of them.
    try:
        guards: CallGuards = (PostgresCallGuards(settings.store_url) if settings.store_url
                              else SharedCallGuards(f"{settings.state}.calls") if group_member else MemoryCallGuards())
    except ConfigError:
        store.close()
        events.detach()
        raise
    auth = ServerAuth(secret, munge_socket=settings.munge_socket, guards=guards)
    # A user's call waits for munged on its serving thread (at most munge_gate.TIMEOUT_SECONDS, and
    # at most MungeGate.capacity such calls at once): threads beyond those stay for the calls made
    # with the secret (dispatchers, Slurm's prologs, admins), whatever munged does.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers + auth.munge_waiters),
                         interceptors=[auth], options=[("grpc.so_reuseport", 1 if group_member else 0)])
    servicer = PoolServicer(core, settings.heartbeat_interval_seconds, metrics, account_policy(settings), guards,
                            KeyedBuckets(settings.user_lease_calls_burst, settings.user_lease_calls_per_second), board)
    pb_grpc.add_PoolServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if not group_member:   # the group's parent holds the port (SO_REUSEPORT): no probe could bind it
            _check_bindable(settings.listen)
        tls = grpc_tls.server_files(settings)
        if tls is not None:
            port = server.add_secure_port(settings.listen, _server_credentials(*tls))
        else:
            port = server.add_insecure_port(settings.listen)
    except ConfigError:
        store.close()
        guards.close()
        auth.close()
        events.detach()
        raise
    except (OSError, RuntimeError) as exc:
        store.close()
        guards.close()
        auth.close()
        events.detach()
        raise ConfigError("poold", f"cannot listen on {settings.listen}", str(exc) or "address in use or invalid",
                          "pick another --listen address or stop the process holding the port") from None
    try:
        servicer.pool_name = auth.pool_name = pool_name(settings, port)
        http = _start_http(settings, secret, core, board, metrics, events,
                           report or (lambda what, port: None)) if extras else []
    except BaseException:
        store.close()
        guards.close()
        auth.close()
        events.detach()
        raise
    stop = threading.Event()
    maintenance = threading.Thread(target=_maintenance_loop, name="maintenance", daemon=True,
                                   args=(core, metrics, min(settings.reclaim_interval_seconds, settings.down_after_seconds / 3),
                                         stop, settings))
    # Components that ride on the pool (the Slurm integration) plug in through entry points.
    running = [start(core, settings, log) for _name, start in plugins.load(plugins.POOL_PLUGINS)] if extras else []
    servicer.admission_pending = next((p.admission_pending for p in running if hasattr(p, "admission_pending")), None)
    warning = grpc_tls.plaintext_warning(settings, "poold")
    if warning and extras:
        log.warning("%s", warning)
    for service in ("", "rgpu.v1.Pool"):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    # Serving only once everything is ready: a client that connects may call at once.
    server.start()
    maintenance.start()
    try:
        yield port, core
    finally:
        for plugin in running:
            plugin.stop()
        for each in http:
            each.stop()
        health_servicer.enter_graceful_shutdown()
        stop.set()
        server.stop(grace=2).wait()
        maintenance.join(timeout=5)
        store.close()
        guards.close()
        auth.close()
        events.detach()


def _serve_group_member(settings: Settings, index: int, ready: Any) -> None:
    """One process of `rgpu-poold --processes N` (started by group.py with spawn)."""
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s [{index} pid %(process)d] %(message)s", stream=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    die_with_parent()
    try:
        with running_pool(settings, load_secret(settings.secret_file), group_member=True, extras=index == 0):
            ready.put(index)
            stop.wait()
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Config file (default /etc/rgpu/rgpu.toml).")
@click.option("--listen", help="HOST:PORT to serve gRPC on (default 0.0.0.0:50001).")
@click.option("--state", help="SQLite state file (default /var/lib/rgpu/pool.db).")
@click.option("--placement", type=click.Choice(["binpack", "spread"]), help="Placement policy.")
@click.option("--secret-file", help="Cluster secret file (mode 0600).")
@click.option("--port-file", type=click.Path(dir_okay=False),
              help="Write the port served on to this file once serving (with --listen HOST:0).")
@click.option("--metrics-listen", help="HOST:PORT for the Prometheus endpoint (:PORT is 127.0.0.1 only; default from config: off).")
@click.option("--metrics-port-file", type=click.Path(dir_okay=False),
              help="Write the metrics endpoint's port to this file once serving.")
@click.option("--dashboard-listen", help="HOST:PORT for the web dashboard (default from config: off).")
@click.option("--dashboard-port-file", type=click.Path(dir_okay=False),
              help="Write the dashboard's port to this file once serving.")
@click.option("--processes", type=int, help="Pool processes serving --listen together (default from config: 1).")
@click.version_option(__version__, prog_name="rgpu-poold")
def main(config_file: str | None, listen: str | None, state: str | None, placement: str | None,
         secret_file: str | None, port_file: str | None, metrics_listen: str | None,
         metrics_port_file: str | None, dashboard_listen: str | None, dashboard_port_file: str | None,
         processes: int | None) -> None:
    """Run the rgpu pool daemon."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        settings = load_settings(config_file, flags={"listen": listen, "state": state, "placement": placement,
                                                     "secret_file": secret_file, "metrics_listen": metrics_listen,
                                                     "dashboard_listen": dashboard_listen,
                                                     "pool_processes": processes})
        checked_processes(settings.pool_processes)
        port_files = {"metrics": metrics_port_file, "dashboard": dashboard_port_file}

        def report(what: str, bound: int) -> None:
            path = port_files.get(what)
            if path:
                write_port_file(path, bound, "poold")

        logging.getLogger().setLevel(settings.log_level.upper())
        secret = load_secret(settings.secret_file)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        if settings.pool_processes > 1:
            if any(port_files.values()):
                log.warning("rgpu-poold: with several processes the metrics and dashboard ports are not "
                            "written to files; give them fixed ports")
            # The file and its layout first, once: processes starting together must not each
            # find the other's half-made file.
            open_store(settings.state, settings.store_url, shared=True).close()
            serve_group(settings, _serve_group_member, stop,
                        lambda bound: write_port_file(port_file, bound, "poold") if port_file else None)
            log.info("rgpu-poold: shutting down")
            return
        with running_pool(settings, secret, report=report) as (port, core):
            log.info("rgpu-poold: %s serving on %s, state %s, placement %s, %d server(s) and %d lease(s) "
                     "restored", __version__, bound_address(settings.listen, port), settings.state, settings.placement,
                     len(core.servers), len(core.leases))
            if port_file:
                write_port_file(port_file, port, "poold")
            stop.wait()
            log.info("rgpu-poold: shutting down")
    except RgpuError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
