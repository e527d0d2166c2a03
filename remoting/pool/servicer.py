"""The pool's gRPC servicer: validates and translates each call (rules live in PoolCore, durability in
Store); who may call what (users through MUNGE, daemons and admins with the cluster secret), the
per-user rate of lease changes, and rgpu errors turned into gRPC status codes with one line."""

from __future__ import annotations

import ipaddress
import logging
import re
import time
import urllib.parse
from typing import Any, Callable

import grpc

from rgpu import validate
from rgpu.remoting.pool.accounts import AccountPolicy
from rgpu.remoting.pool.auth import current_caller
from rgpu.remoting.pool.call_guards import CallGuards, GuardError, MemoryCallGuards
from rgpu.errors import CapacityError, InvalidRequest, PermissionDenied, RgpuError, Unavailable
from rgpu.rate import KeyedBuckets
from rgpu.model import LeaseRecord
from rgpu.proto import rgpu_pb2 as pb
from rgpu.proto import rgpu_pb2_grpc as pb_grpc
from rgpu.remoting.pool.errors import status_for
from rgpu.remoting.pool.convert import (live_to_pb, server_from_pb, server_to_pb, size_from_pb, usage_from_pb,
                                        usage_to_pb)
from rgpu.remoting.pool.gpu_listing import GpuListing
from rgpu.remoting.pool.metrics import PoolMetrics, refusal_reason
from rgpu.remoting.pool.rules import AllocationRequest, PoolCore, check_owner
from rgpu.remoting.pool.telemetry import TelemetryBoard

log = logging.getLogger("rgpu-poold")

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
