"""The dispatcher's registration with the pool: register, heartbeat, register again after any
loss (a pool restart, a network outage), with capped, jittered backoff."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rgpu import grpc_tls
from rgpu.config import Settings
from rgpu.errors import ConfigError, RgpuError
from rgpu.live_leases import LiveLeases
from rgpu.proto import rgpu_pb2 as pb
from rgpu.remoting.pool.client import PoolClient, connect
from rgpu.remoting.pool.convert import live_from_pb

COMPONENT = "dispatcher"
log = logging.getLogger("rgpu-dispatcher")

POOL_CALL_TIMEOUT = 5.0
DEFAULT_HEARTBEAT_INTERVAL = 5.0


@dataclass
class Backoff:
    """Capped exponential backoff with jitter, so dispatchers do not stampede a restarted pool."""

    initial: float = 0.5
    cap: float = 10.0
    _next: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._next = self.initial

    def reset(self) -> None:
        self._next = self.initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, delay * 2)
        return delay * random.uniform(0.8, 1.0)


def sane_interval(value: float) -> float:
    """The pool's heartbeat interval, guarded against a zero or absurd value from an old pool."""
    if not math.isfinite(value) or value <= 0:
        return DEFAULT_HEARTBEAT_INTERVAL
    return min(max(value, 0.1), 300.0)


class Registrar:
    """Keeps this dispatcher registered: register, heartbeat, and register again after any loss.

    Each state change is logged once; retries in the same state are silent.
    """

    def __init__(self, server: pb.Server, connect: Callable[[], PoolClient], pool: str,
                 on_live: Callable[[LiveLeases], None] | None = None,
                 usage: Callable[[], list[pb.SliceUsage]] | None = None,
                 faults: Callable[[], list[pb.GpuFault]] | None = None,
                 telemetry: Callable[[], list[pb.GpuTelemetry]] | None = None) -> None:
        self._server = server
        self._telemetry = telemetry   # read after usage: the readings of the same sample
        self._on_live = on_live
        self._usage = usage
        self._faults = faults
        self._connect = connect
        self._pool = pool
        self._client: PoolClient | None = None
        self._registered = False
        self._ever_registered = False
        self._interval = DEFAULT_HEARTBEAT_INTERVAL
        self._problem: str | None = None
        self._backoff = Backoff()
        # For the metrics: heartbeats by result (ok | unknown | failed) and registrations.
        self.heartbeats = {"ok": 0, "unknown": 0, "failed": 0}
        self.registrations = 0

    @property
    def registered(self) -> bool:
        return self._registered

    def run(self, stop: threading.Event) -> None:
        delay = 0.0
        while not stop.wait(delay):
            try:
                delay = self.step()
            except Exception:  # never let a bug end registration; the daemon would look alive but be lost
                log.exception("registration loop failed; retrying")
                self._drop_client()
                delay = self._backoff.next()
        self._drop_client()

    def step(self) -> float:
        """One register or heartbeat attempt; returns how long to wait before the next one."""
        try:
            if self._client is None:
                self._client = self._connect()
            if not self._registered:
                return self._register(self._client)
            return self._heartbeat(self._client)
        except RgpuError as err:
            return self._failed(err)

    def _register(self, client: PoolClient) -> float:
        reply = client.register_server(self._server)
        self._interval = sane_interval(reply.heartbeat_interval_seconds)
        again = "re-registered" if self._ever_registered else "registered"
        log.info("%s with pool %s as %s (%d GPU(s)%s); heartbeat every %g s", again, self._pool,
                 self._server.address, len(self._server.gpus),
                 ", static inventory" if self._server.static_inventory else "", self._interval)
        self._registered = self._ever_registered = True
        self.registrations += 1
        self._problem = None
        self._backoff.reset()
        return 0.0  # heartbeat at once: its reply brings the pool's list of live leases

    def _heartbeat(self, client: PoolClient) -> float:
        usage: list[pb.SliceUsage] = []
        if self._usage is not None:
            try:
                usage = self._usage()
            except Exception:  # usage is a report; its failure must not stop heartbeats
                log.exception("reading the sessions' usage failed; heartbeat without it")
        faults: list[pb.GpuFault] = []
        if self._faults is not None:
            try:
                faults = self._faults()
            except Exception:  # a report too
                log.exception("reading the GPU faults failed; heartbeat without them")
        telemetry: list[pb.GpuTelemetry] = []
        if self._telemetry is not None:
            try:
                telemetry = self._telemetry()
            except Exception:  # a report too
                log.exception("reading the GPUs' telemetry failed; heartbeat without it")
        reply = client.heartbeat(self._server.address, usage, time.time(), faults, telemetry)
        self.heartbeats["ok" if reply.known else "unknown"] += 1
        if reply.known:
            live = live_from_pb(reply)
            if live is not None and self._on_live is not None:
                self._on_live(live)
            return self._interval
        log.warning("pool %s does not know %s (it restarted without its state, or was reset); "
                    "registering again", self._pool, self._server.address)
        self._registered = False
        return 0.0

    def _failed(self, err: RgpuError) -> float:
        # Any failure may mean the pool restarted: register again (it is idempotent) once it
        # answers, on a fresh channel so gRPC's own reconnect backoff (up to 2 min) cannot delay it.
        if self._registered:
            self.heartbeats["failed"] += 1
        self._registered = False
        self._drop_client()
        message = str(err)
        if message != self._problem:
            state = "lost the pool" if self._ever_registered else "waiting for the pool"
            log.warning("%s: %s; retrying with backoff (at most %g s apart)", state, message, self._backoff.cap)
            self._problem = message
        return self._backoff.next()

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def pool_connector(settings: Settings, secret: bytes) -> Callable[[], PoolClient]:
    def connect_to_pool() -> PoolClient:
        ca = grpc_tls.client_ca(settings, COMPONENT)   # grpc_tls = "required" without a CA: refused here
        try:
            return connect(settings, secret=secret, timeout=POOL_CALL_TIMEOUT)
        except ConfigError as exc:   # the only other local failure: an unreadable CA file
            raise ConfigError(COMPONENT, f"cannot read tls_ca_file {ca}", exc.why,
                              f"fix tls_ca_file (from {settings.origin('tls_ca_file')})") from None
    return connect_to_pool
