"""rgpu-poold: the pool daemon. Knows every GPU, hands out leases of slices, keeps them durable.

The gRPC servicer only validates and translates; rules live in PoolCore, durability in Store.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import signal
import socket
import sqlite3
import sys
import threading
import time
import urllib.parse
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Iterator

import click

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rgpu import __version__, grpc_tls, plugins, validate
from rgpu.remoting.pool.accounts import AccountPolicy, account_policy
from rgpu.remoting.pool.auth import ServerAuth, current_caller
from rgpu.remoting.pool.call_guards import (CallGuards, GuardError, MemoryCallGuards, PostgresCallGuards,
                                            SharedCallGuards)
from rgpu.config import Settings, load_settings
from rgpu.errors import CapacityError, ConfigError, InvalidRequest, PermissionDenied, RgpuError, Unavailable
from rgpu.netaddr import bound_address, split_host_port
from rgpu.portfile import write_port_file
from rgpu.rate import KeyedBuckets
from rgpu.model import LeaseRecord
from rgpu.proto import rgpu_pb2 as pb
from rgpu.proto import rgpu_pb2_grpc as pb_grpc
from rgpu.remoting.pool.errors import status_for
from rgpu.remoting.pool.convert import (live_to_pb, server_from_pb, server_to_pb, size_from_pb, usage_from_pb,
                                        usage_to_pb)
from rgpu.remoting.metrics.http import MetricsServer, serve_metrics
from rgpu.remoting.pool.events import EventLog
from rgpu.remoting.pool.gpu_listing import GpuListing
from rgpu.remoting.pool.group import checked_processes, die_with_parent, serve_group
from rgpu.remoting.pool.metrics import PoolMetrics, refusal_reason
from rgpu.remoting.pool.rules import AllocationRequest, PoolCore, check_owner
from rgpu.remoting.pool.store import open_store
from rgpu.remoting.pool.telemetry import TelemetryBoard
from rgpu.remoting.pool.views import pool_view
from rgpu.secret import load_secret

log = logging.getLogger("rgpu-poold")

# Every call is short and PoolCore serialises changes under one lock, so more threads only fight
# over the GIL: 4 gave ~10-20% more allocations per second than 16 on a 2-core machine.
POOL_GRPC_WORKERS = 2

_LONG_WORD = re.compile(r"[^\s(),;]{81,}")


def bounded_message(message: str, limit: int = 600) -> str:
    """An error message with no echo of more than a short prefix of the caller's input: any run
    of over 80 characters without a space is cut to 60 and its length, the whole to `limit`."""
    short = _LONG_WORD.sub(lambda m: f"{m.group()[:60]}...[{len(m.group())} chars]", message)
    return short if len(short) <= limit else short[:limit - 3] + "..."


# What a user (MUNGE credential) may call; everything else needs the cluster secret. Users lease,
# renew and release their own slices, and see everyone's leases without their tokens.
USER_METHODS = frozenset({"Allocate", "Renew", "Release", "GetLease", "ListLeases", "ListGpus", "ListServers",
                          "ListQuotas", "Capacity"})
# The calls that change leases (and write the state and its history): limited per user.
USER_LEASE_CALLS = frozenset({"Allocate", "Renew", "Release"})


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def peer_ip(peer: str) -> str:
    """The IP of a gRPC peer string ("ipv4:10.0.0.1:5555", "ipv6:[::1]:5555"); IPv4-mapped IPv6
    addresses as IPv4."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")   # grpc writes "ipv6:%5B::1%5D:5555"
    if kind == "ipv6":
        ip = rest.rsplit(":", 1)[0].strip("[]")
        return ip[7:] if ip.lower().startswith("::ffff:") and "." in ip else ip
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


def _owner() -> str | None:
    """The user a call acts for (None: a daemon, which acts on any lease). The pool core checks it
    inside the change itself, after catching up with the pool's other processes or daemons."""
    caller = current_caller()
    return None if caller.is_daemon else caller.user


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn rgpu errors into gRPC status codes with the one-line message."""

    def wrapper(self: "PoolServicer", request: Any, context: grpc.ServicerContext) -> Any:
        try:
            caller = current_caller()
            if not caller.is_daemon and method.__name__ not in USER_METHODS:
                raise PermissionDenied("pool", f"{method.__name__} is for daemons and admins",
                                       f"you called as user {caller.user} (MUNGE)",
                                       "run it where the cluster secret is readable (root or the rgpu admin)")
            if not caller.is_daemon and method.__name__ in USER_LEASE_CALLS:
                self.check_user_rate(caller.user)
            return method(self, request, context)
        except RgpuError as exc:
            context.abort(status_for(exc), bounded_message(str(exc)))
        except Exception:
            log.exception("rgpu-poold: %s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL,
                          f"rgpu: pool: internal error in {method.__name__} (a bug; see the rgpu-poold log)")

    wrapper.__name__ = method.__name__
    return wrapper



class PoolServicer(pb_grpc.PoolServicer):
    def __init__(self, core: PoolCore, heartbeat_interval: float, metrics: PoolMetrics | None = None,
                 accounts: AccountPolicy | None = None, guards: CallGuards | None = None,
                 user_calls: KeyedBuckets | None = None, board: TelemetryBoard | None = None) -> None:
        self.core = core
        # Each user's bucket of lease calls (user_lease_calls_*); None: not limited.
        self.user_calls = user_calls
        self.accounts = accounts or AccountPolicy("off")   # which accounts a user may charge
        # Which IP registered each server address: this process's, or shared by one rgpu-poold's processes.
        self.guards: CallGuards = guards or MemoryCallGuards()
        self.heartbeat_interval = heartbeat_interval
        self.pool_name = ""   # set once the pool listens (pool_name)
        self.metrics = metrics or PoolMetrics()
        self._gpu_listing = GpuListing(core)
        # Each dispatcher's GPU readings, slices' compute use and recent GPU faults, as its last
        # heartbeat reported them (health, stats, the metrics and the dashboard show them).
        self.board = board or TelemetryBoard()
        # The Slurm integration's AdmissionPending answer (slurm_plugin/poolhooks.py); None: no admission here.
        self.admission_pending: Callable[[str], bool] | None = None

    def check_user_rate(self, user: str) -> None:
        """A user's lease call within their bucket, else RESOURCE_EXHAUSTED with the time to retry."""
        if self.user_calls is None:
            return
        wait = self.user_calls.take(user, time.monotonic())
        if wait > 0:
            self.metrics.rate_limited.inc()
            raise CapacityError("pool", f"user {user[:64]} makes lease calls faster than this pool allows",
                                f"{self.user_calls.capacity:g} at once, then {self.user_calls.rate:g} a second "
                                "(user_lease_calls_burst, user_lease_calls_per_second)",
                                f"retry in {max(wait, 0.1):.1f} s")

    def _lease_pb(self, lease: LeaseRecord) -> pb.Lease:
        caller = current_caller()
        tokens = caller.is_daemon or caller.user == lease.user   # others' tokens are never shown to users
        usages = self.core.slice_usage(lease)
        since, idle = self.core.lease_idle(lease)
        return pb.Lease(
            job_key=lease.job_key, user=lease.user, account=lease.account,
            created_unix=lease.created_unix, expires_unix=lease.expires_unix,
            server_down=self.core.lease_on_down_server(lease), units=lease.units,
            idle_since_unix=since, idle=idle,
            slices=[pb.Slice(server=s.server, gpu_uuid=s.gpu_uuid, gpu_index=s.gpu_index, gpu_name=s.gpu_name,
                             memory_limit_bytes=s.memory_limit_bytes, compute_percent=s.compute_percent,
                             token=self.core.token_for(lease, i) if tokens else "",
                             usage=usage_to_pb(lease.job_key, i, usages[i],
                                               self.board.compute_used(s.server, lease.job_key, i)))
                    for i, s in enumerate(lease.slices)])

    def _check_registrar(self, address: str, context: Any, *, registering: bool) -> None:
        """A dispatcher's address is bound to the host that registered it: while that server is
        not down, registrations and heartbeats for its address from another IP are refused (every
        daemon holds the same secret, so this is what keeps one node from taking over another's
        address). A down or removed server's address may be taken by a new host; a pool restart
        forgets the bindings and the first registration after it binds again."""
        peer = peer_ip(context.peer() or "")
        if not _is_ip(peer):
            # A call answered after its client gave up may have no peer left: bound to "", the
            # address would lock its own dispatcher out for as long as the server is not down.
            raise Unavailable("pool", f"cannot tell which host sent the {'registration' if registering else 'heartbeat'} "
                              f"for server {address[:80]}", f"the call's peer is {peer[:64]!r} (its client gave up, "
                              "or it did not come over TCP)", "nothing was recorded; the dispatcher retries")
        self.core.catch_up()   # registered through another process of this pool: known here too
        entry = self.core.servers.get(address)
        live = entry is not None and self.core.state_of(entry) != "down"
        try:
            bound = self.guards.claim(address, peer, live, registering, set(self.core.servers))
        except GuardError as exc:
            raise Unavailable("pool", f"cannot check which host registered server {address[:80]}", str(exc),
                              "see the pool host's disk or PostgreSQL; the dispatcher retries") from None
        if bound is not None:
            raise PermissionDenied("pool", f"{'registration' if registering else 'heartbeat'} for server "
                                   f"{address[:80]} from {peer[:64]} refused",
                                   f"that server registered from {bound} and is not down",
                                   "each dispatcher registers its own address; remove a server that moved "
                                   "with `rgpu-admin remove-server`, or wait until it is down")

    def _server_pb(self, entry: Any) -> pb.Server:
        now = self.core.clock()
        server = server_to_pb(entry.info, self.core.state_of(entry, now), max(0.0, now - entry.last_heartbeat))
        server.faults.extend(self.board.faults(entry.info.address))
        server.telemetry.extend(self.board.readings(entry.info.address))
        return server

    @_rpc
    def RegisterServer(self, request: pb.RegisterServerRequest, context: Any) -> pb.RegisterServerReply:
        self._check_registrar(request.server.address, context, registering=True)
        self.core.register(server_from_pb(request.server))
        self.metrics.registrations.inc()
        return pb.RegisterServerReply(heartbeat_interval_seconds=self.heartbeat_interval)

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatReply:
        self._check_registrar(request.address, context, registering=False)
        if not self.core.heartbeat(request.address):
            self.metrics.heartbeats.labels("unknown").inc()
            return pb.HeartbeatReply(known=False)
        self.metrics.heartbeats.labels("known").inc()
        if request.usage:
            self.core.record_usage(request.address, [usage_from_pb(u) for u in request.usage], request.sent_unix)
        entry = self.core.servers.get(request.address)
        gpus = {g.uuid for g in entry.info.gpus} if entry is not None else set()
        self.board.record(request.address, request, gpus, self.core.clock())
        return live_to_pb(self.core.live_slices(request.address))

    @_rpc
    def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.Lease:
        started, asked_at = time.perf_counter(), self.core.clock()
        caller = current_caller()
        user, account = request.user, request.account
        try:
            if not caller.is_daemon:
                # A user's name comes from MUNGE, never from the request.
                if user and user != caller.user:
                    raise PermissionDenied("pool", f"cannot lease GPUs as {user[:64]}",
                                           f"MUNGE says you are {caller.user}", "lease as yourself (leave --user out)")
                user = caller.user
                reserved = validate.reserved_job_key_prefix(request.job_key)
                if reserved:
                    raise PermissionDenied("pool", f"job key {request.job_key[:128]!r} is reserved",
                                           f"keys starting with {reserved!r} are made by rgpu's Slurm prologs for "
                                           "Slurm jobs", "pick another key, or leave --job-key out for a generated one")
                # Said here as a permission error; the core decides again inside the change
                # (another user's key is "a different lease" there, whatever this process saw).
                self.core.catch_up()
                check_owner(self.core.leases.get(request.job_key), user, "reuse", request.job_key)
                # Only an account the user belongs to; none named: their default one.
                account = self.accounts.account_for(user, request.account)
            percent, memory_bytes = size_from_pb(request)
            lease = self.core.allocate(AllocationRequest(
                job_key=request.job_key, user=user, account=account, count=request.count,
                percent=percent, memory_bytes=memory_bytes,
                ttl_seconds=request.ttl_seconds, gpu_model=request.gpu_model, server=request.server,
                min_memory_bytes=request.min_memory_bytes, isolation=request.isolation,
                same_node=request.same_node))
        except Exception as exc:
            self.metrics.refusals.labels(refusal_reason(exc)).inc()
            raise
        finally:
            self.metrics.allocate_seconds.observe(time.perf_counter() - started)
        self.metrics.allocations.labels("existing" if lease.created_unix < asked_at else "new").inc()
        return self._lease_pb(lease)

    @_rpc
    def Renew(self, request: pb.RenewRequest, context: Any) -> pb.Lease:
        return self._lease_pb(self.core.renew(request.job_key, request.ttl_seconds, owner=_owner()))

    @_rpc
    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        released = self.core.release(request.job_key, owner=_owner())
        self.metrics.releases.labels("released" if released else "unknown").inc()
        return pb.ReleaseReply(released=released)

    @_rpc
    def GetLease(self, request: pb.GetLeaseRequest, context: Any) -> pb.Lease:
        return self._lease_pb(self.core.get_lease(request.job_key))   # another's: shown without tokens

    @_rpc
    def ListLeases(self, request: pb.ListLeasesRequest, context: Any) -> pb.ListLeasesReply:
        return pb.ListLeasesReply(leases=[self._lease_pb(lease) for lease in self.core.list_leases()])

    @_rpc
    def ListGpus(self, request: pb.ListGpusRequest, context: Any) -> pb.ListGpusReply:
        return self._gpu_listing.reply()

    @_rpc
    def ListServers(self, request: pb.ListServersRequest, context: Any) -> pb.ListServersReply:
        self.core.catch_up()
        entries = [self.core.servers[a] for a in sorted(self.core.servers)]
        return pb.ListServersReply(servers=[self._server_pb(e) for e in entries],
                                   down_after_seconds=self.core.down_after_seconds)

    @_rpc
    def SetServerState(self, request: pb.SetServerStateRequest, context: Any) -> pb.Server:
        return self._server_pb(self.core.set_drained(request.server, request.drained))

    @_rpc
    def RemoveServer(self, request: pb.RemoveServerRequest, context: Any) -> pb.RemoveServerReply:
        return pb.RemoveServerReply(address=self.core.remove_server(request.server))

    @_rpc
    def SetQuota(self, request: pb.SetQuotaRequest, context: Any) -> pb.Quota:
        quota = self.core.set_quota(request.kind, request.name, request.limit_units)
        if quota is None:
            return pb.Quota(kind=request.kind, name=request.name)
        used = dict(((q.kind, q.name), u) for q, u in self.core.quota_usage()).get((quota.kind, quota.name), 0)
        return pb.Quota(kind=quota.kind, name=quota.name, limit_units=quota.limit_units, used_units=used)

    @_rpc
    def ListQuotas(self, request: pb.ListQuotasRequest, context: Any) -> pb.ListQuotasReply:
        return pb.ListQuotasReply(quotas=[
            pb.Quota(kind=q.kind, name=q.name, limit_units=q.limit_units, used_units=used)
            for q, used in self.core.quota_usage()])

    @_rpc
    def Usage(self, request: pb.UsageRequest, context: Any) -> pb.UsageReply:
        until = request.until_unix or self.core.clock()
        since = request.since_unix
        if since >= until:
            raise InvalidRequest("pool", "the usage window is empty", f"since {since} is not before until {until}",
                                 "give --since earlier than --until")
        return pb.UsageReply(since_unix=since, until_unix=until, rows=[
            pb.UsageRow(user=t.user, account=t.account, gpu_percent_hours=t.gpu_percent_hours, leases=t.leases,
                        busy_gpu_seconds=t.busy_gpu_seconds)
            for t in self.core.usage_totals(since, until)])

    @_rpc
    def PoolName(self, request: pb.PoolNameRequest, context: Any) -> pb.PoolNameReply:
        return pb.PoolNameReply(name=self.pool_name)   # open (no credential): users' clients ask it first

    @_rpc
    def AdmissionPending(self, request: pb.AdmissionPendingRequest, context: Any) -> pb.AdmissionPendingReply:
        pending = self.admission_pending    # answered at once: a node Epilog asks until it is False
        return pb.AdmissionPendingReply(pending=bool(pending and pending(request.job_key_prefix[:256])))

    @_rpc
    def Capacity(self, request: pb.CapacityRequest, context: Any) -> pb.CapacityReply:
        cap = self.core.capacity()
        return pb.CapacityReply(total_units=cap.total_units, allocated_units=cap.allocated_units,
                                free_units=cap.free_units, gpus=cap.gpus)


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
