"""A typed client for the pool daemon: gRPC errors become rgpu errors with one-line messages.

Given several pool addresses (the `pool` setting as a list), a call that finds its pool
UNAVAILABLE (not listening, host gone, connection reset) or that its pool does not answer in time
(DEADLINE_EXCEEDED: a hung or stopped pool) is sent to the next address, round and round, until
one answers or the call's time budget is spent. So that a hung pool cannot take the whole budget,
each attempt gets an equal share of what is left among the addresses not yet tried in this round
(with two pools and 10 s, the first try waits at most 5 s). Every pool of such a list must
share one store (PostgreSQL): a job key's lease is then the same whichever pool answers, so a
retried Allocate never places twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rgpu import __version__, grpc_tls
from rgpu.config import Settings, pool_addresses
from rgpu.errors import CapacityError, ConfigError, InvalidRequest, RgpuError, Unavailable
from rgpu.model import isolation_allows
from rgpu.proto import rgpu_pb2 as pb
from rgpu.proto import rgpu_pb2_grpc as pb_grpc
from rgpu.remoting.pool.signing import AUTH_HEADER, MUNGE_HEADER, request_credential
from rgpu.remoting.pool.errors import error_from_status
from rgpu.secret import load_secret


def error_from_rpc(exc: grpc.RpcError, address: str) -> RgpuError:
    return error_from_status(exc.code(), exc.details() or "", address)


# What a pool from before AllocateRequest.percent answers a size in percent: it skips the field it
# does not know and finds no size at all (a client of this version always sends one).
_NO_SIZE_SEEN = "neither a fraction nor a memory size was given"


def older_pool_error(address: str) -> InvalidRequest:
    """The line for a pool too old to read a slice size in percent (the `fraction` it reads instead
    was a double where 0 meant unset; this client sends whole percent)."""
    return InvalidRequest("pool", f"the pool daemon at {address} is older than this client: it does not read slice "
                          "sizes in percent, and saw none", "it predates AllocateRequest.percent",
                          f"install this client's rgpu release (rgpu {__version__} with AllocateRequest.percent) on "
                          "the pool host and restart rgpu-poold; until then ask by memory size (-m 8G, "
                          "--comment=memory=8G), which it reads")


def open_channel(address: str, tls_ca_file: str | None = None, tls_server_name: str | None = None) -> grpc.Channel:
    """A channel to the pool: TLS when a CA file is configured, plain otherwise."""
    if not tls_ca_file:
        return grpc.insecure_channel(address)
    try:
        ca = Path(tls_ca_file).read_bytes()
    except OSError as exc:
        raise ConfigError("pool", f"cannot read TLS CA file {tls_ca_file}", exc.strerror or str(exc),
                          "fix tls_ca_file in rgpu.toml") from None
    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options=options)


# After every address of a list failed, wait this long before the next round (within the budget).
FAILOVER_ROUND_PAUSE_SECONDS = 0.2
# Statuses on which a call goes to the next pool: none answered (down, refused, reset), or none in
# time (hung, stopped, overloaded).
FAILOVER_STATUSES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class PoolClient:
    def __init__(self, address: str | Sequence[str], secret: bytes | None, *, timeout: float = 10.0,
                 tls_ca_file: str | None = None, tls_server_name: str | None = None,
                 munge_socket: str = "", no_secret_because: str = "") -> None:
        """With a secret: a daemon's or admin's client. Without one (secret None): a user's, whose
        calls carry a MUNGE credential naming the calling process's uid; `no_secret_because` (the
        secret file's problem) is named when MUNGE fails too."""
        self.addresses = pool_addresses(address) if isinstance(address, str) else list(address)
        if not self.addresses:
            raise ConfigError("pool", "no pool address given", "the pool setting is empty",
                              "set pool = \"HOST:PORT\" (or a list of them) in rgpu.toml")
        self.timeout = timeout
        self._tls = (tls_ca_file, tls_server_name)
        self._current = 0
        self._channels: dict[int, tuple[grpc.Channel, pb_grpc.PoolStub]] = {}
        self._calls: dict[tuple[int, str], Any] = {}   # (address number, method name): its callable
        self._pool_names: dict[int, str] = {}          # address number: the name that pool answers to
        self._secret = secret
        self._munge_socket = munge_socket
        self._no_secret_because = no_secret_because
        self._use(0)

    @property
    def address(self) -> str:
        """The pool address calls go to now (the one that answered last)."""
        return self.addresses[self._current]

    def _use(self, number: int) -> None:
        if number not in self._channels:
            raw = open_channel(self.addresses[number], *self._tls)
            self._channels[number] = (raw, pb_grpc.PoolStub(raw))
        self._current = number
        self._raw, self._stub = self._channels[number]

    def _credential(self, method: str, request: bytes, timeout: float) -> tuple[str, str]:
        """A fresh credential per attempt (a MUNGE credential decodes only once). A user's names
        the method, the pool now called (by the name it answers to PoolName) and the request's hash."""
        if self._secret is not None:
            return AUTH_HEADER, request_credential(self._secret, method)
        from rgpu import munge
        payload = munge.call_payload(method, self._pool_name(timeout), request)
        try:
            return MUNGE_HEADER, munge.encode(payload, self._munge_socket)
        except RgpuError as exc:
            if not self._no_secret_because:
                raise
            # Neither credential: the secret file's problem comes first, MUNGE's second.
            raise type(exc)("pool", "no credential for this call", f"{self._no_secret_because}, and MUNGE failed: "
                            f"{exc.what}" + (f" ({exc.why})" if exc.why else ""),
                            "give a readable secret file (--secret-file, secret_file or RGPU_SECRET_FILE), "
                            "or start munged on this node (munge_socket in rgpu.toml)") from None

    def _pool_name(self, timeout: float) -> str:
        """The name of the pool now called, asked once per address (open: no credential)."""
        name = self._pool_names.get(self._current)
        if name is None:
            name = self._pool_names[self._current] = self._stub.PoolName(pb.PoolNameRequest(), timeout=timeout).name
        return name

    def _send(self, name: str, request: bytes, timeout: float) -> Any:
        """One attempt at the pool now called, with the request serialized once: the bytes that a
        user's credential hashes are the bytes sent."""
        key = (self._current, name)
        call = self._calls.get(key)
        if call is None:
            reply = getattr(pb, pb.DESCRIPTOR.services_by_name["Pool"].methods_by_name[name].output_type.name)
            call = self._calls[key] = self._raw.unary_unary(f"/rgpu.v1.Pool/{name}", request_serializer=None,
                                                            response_deserializer=reply.FromString)
        started = time.monotonic()
        metadata = (self._credential(f"/rgpu.v1.Pool/{name}", request, timeout),)
        return call(request, timeout=max(0.001, timeout - (time.monotonic() - started)), metadata=metadata)

    def close(self) -> None:
        for raw, _ in self._channels.values():
            raw.close()

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, request: Any, timeout: float | None = None) -> Any:
        # The credential goes in each call's metadata (no interceptor: it costs the client more
        # CPU per call than the HMAC itself).
        data = request.SerializeToString()
        budget = timeout or self.timeout
        if len(self.addresses) == 1:
            try:
                return self._send(name, data, budget)
            except grpc.RpcError as exc:
                raise error_from_rpc(exc, self.address) from None
        deadline = time.monotonic() + budget
        failed: list[str] = []
        while True:
            # An equal share of what is left for each address not yet tried in this round.
            untried = len(self.addresses) - len(failed) % len(self.addresses)
            try:
                return self._send(name, data, max(0.001, (deadline - time.monotonic()) / untried))
            except grpc.RpcError as exc:
                if exc.code() not in FAILOVER_STATUSES:
                    raise error_from_rpc(exc, self.address) from None
                # A retried call is safe: the pools share one store, job keys make Allocate
                # idempotent and Release of a released lease is a no-op.
                failed.append(self.address)
                last = exc
            following = (self._current + 1) % len(self.addresses)
            if following == 0 and len(failed) >= len(self.addresses):
                time.sleep(max(0.0, min(FAILOVER_ROUND_PAUSE_SECONDS, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise Unavailable("pool", f"no pool daemon answered {name} within {budget:g} s",
                                  f"tried {', '.join(dict.fromkeys(failed))}; last: "
                                  f"{last.code().name.lower()}: {last.details()}",
                                  "start rgpu-poold on one of them, or fix the pool setting") from None
            self._use(following)

    def health(self, timeout: float = 5.0) -> str | None:
        """None when the pool's standard gRPC health service says SERVING, else why not (the health
        service is open: no credential)."""
        try:
            reply = health_pb2_grpc.HealthStub(self._raw).Check(
                health_pb2.HealthCheckRequest(service="rgpu.v1.Pool"), timeout=timeout)
        except grpc.RpcError as exc:
            return f"{exc.code().name.lower()}: {exc.details()}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return None

    def register_server(self, server: pb.Server) -> pb.RegisterServerReply:
        return self._call("RegisterServer", pb.RegisterServerRequest(server=server))

    def heartbeat(self, address: str, usage: list[pb.SliceUsage] | None = None,
                  sent_unix: float = 0.0, faults: list[pb.GpuFault] | None = None,
                  telemetry: list[pb.GpuTelemetry] | None = None) -> pb.HeartbeatReply:
        return self._call("Heartbeat", pb.HeartbeatRequest(address=address, usage=usage or [], sent_unix=sent_unix,
                                                           faults=faults or [], telemetry=telemetry or []))

    def allocate(self, job_key: str, user: str, count: int, *, percent: int = 0,
                 memory_bytes: int = 0, account: str = "", ttl_seconds: float = 0.0,
                 gpu_model: str = "", server: str = "", min_memory_bytes: int = 0,
                 isolation: str = "", same_node: bool = False) -> pb.Lease:
        """Lease `count` slices of `percent` of a GPU or of `memory_bytes` each (exactly one is
        non-zero; rgpu.slice_size.SliceSize carries them); `same_node`: all on one GPU server."""
        size = {"memory_bytes": memory_bytes} if memory_bytes else {"percent": percent}
        try:
            return self._call("Allocate", pb.AllocateRequest(
                job_key=job_key, user=user, account=account, count=count, **size,
                ttl_seconds=ttl_seconds, gpu_model=gpu_model, server=server,
                min_memory_bytes=min_memory_bytes, isolation=isolation, same_node=same_node))
        except InvalidRequest as exc:
            if not memory_bytes and str(exc).startswith(f"rgpu: pool: {_NO_SIZE_SEEN}"):
                raise older_pool_error(self.address) from None
            raise

    def renew(self, job_key: str, ttl_seconds: float) -> pb.Lease:
        return self._call("Renew", pb.RenewRequest(job_key=job_key, ttl_seconds=ttl_seconds))

    def release(self, job_key: str) -> bool:
        return self._call("Release", pb.ReleaseRequest(job_key=job_key)).released

    def admission_pending(self, job_key_prefix: str, timeout: float | None = None) -> bool:
        """AdmissionPending (rgpu.proto): whether the pool's admission has yet to catch up with the job's end."""
        return self._call("AdmissionPending", pb.AdmissionPendingRequest(job_key_prefix=job_key_prefix), timeout).pending

    def get_lease(self, job_key: str) -> pb.Lease:
        return self._call("GetLease", pb.GetLeaseRequest(job_key=job_key))

    def list_leases(self) -> list[pb.Lease]:
        return list(self._call("ListLeases", pb.ListLeasesRequest()).leases)

    def list_gpus(self) -> list[pb.GpuStatus]:
        return list(self._call("ListGpus", pb.ListGpusRequest()).gpus)

    def list_servers(self) -> pb.ListServersReply:
        return self._call("ListServers", pb.ListServersRequest())

    def set_server_state(self, server: str, drained: bool) -> pb.Server:
        return self._call("SetServerState", pb.SetServerStateRequest(server=server, drained=drained))

    def remove_server(self, server: str) -> str:
        return self._call("RemoveServer", pb.RemoveServerRequest(server=server)).address

    def set_quota(self, kind: str, name: str, limit_units: int) -> pb.Quota:
        return self._call("SetQuota", pb.SetQuotaRequest(kind=kind, name=name, limit_units=limit_units))

    def list_quotas(self) -> list[pb.Quota]:
        return list(self._call("ListQuotas", pb.ListQuotasRequest()).quotas)

    def usage(self, since_unix: float = 0.0, until_unix: float = 0.0) -> pb.UsageReply:
        return self._call("Usage", pb.UsageRequest(since_unix=since_unix, until_unix=until_unix))

    def capacity(self) -> pb.CapacityReply:
        return self._call("Capacity", pb.CapacityRequest())


def connect(settings: Settings, *, secret: bytes | None = None, timeout: float = 10.0,
            user: bool = False) -> PoolClient:
    """The pool client every component uses: address(es), secret and TLS (rgpu/grpc_tls.py) from the settings (the
    secret is read from `secret_file` unless given). With several pool addresses a call fails over
    to the next one that answers, within `timeout`. With user=True (user tools: flexrun,
    request-gpus, leases...) a caller that cannot read the secret authenticates with MUNGE instead."""
    no_secret_because = ""
    if secret is None:
        try:
            secret = load_secret(settings.secret_file)
        except ConfigError as exc:
            # No secret here (missing, or not readable by this user): a user's tool uses MUNGE.
            # A secret that is present but unsafe stays an error.
            if not user or not ("does not exist" in exc.what or exc.why == "permission denied"):
                raise
            secret = None
            no_secret_because = exc.what
    return PoolClient(pool_addresses(settings.pool), secret, timeout=timeout, tls_ca_file=grpc_tls.client_ca(settings),
                      tls_server_name=settings.tls_server_name or None, munge_socket=settings.munge_socket,
                      no_secret_because=no_secret_because)


def explain_capacity(client: PoolClient, exc: CapacityError, isolation: str, tool: str) -> RgpuError:
    """What a tool says when the pool could not place its request: for isolation=strict in a pool
    with no GPU shared isolated or exclusive no wait could ever place it, so a usage error (exit 2,
    one line); otherwise the pool's own CapacityError (exit 3: wait or ask for less)."""
    if isolation:
        sharings = [g.gpu.sharing or "mps" for g in client.list_gpus()]
        if sharings and not any(isolation_allows(isolation, sharing) for sharing in sharings):
            return InvalidRequest(tool, f"isolation={isolation} asks for GPUs shared isolated or exclusive, and "
                                  "this pool has none", "every GPU is shared with MPS or time-slicing",
                                  "ask without --isolation strict, or ask an admin to share a GPU isolated or "
                                  "exclusive (the dispatcher's gpu_sharing)")
    return exc
