"""Fail closed, against real daemons on loopback: session workers die with their dispatcher
(kill -9 of its main process), a dispatcher that has not heard from the pool refuses tokens, and
a credential replayed after a pool restart is refused."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from rgpu.errors import RgpuError
from rgpu.proto import rgpu_pb2 as pb
from rgpu.proto import rgpu_pb2_grpc as pb_grpc
from rgpu.remoting.datapath import protocol
from rgpu.remoting.pool.auth import AUTH_HEADER, ServerAuth, request_credential
from tests.daemons import EXAMPLES, RgpuCluster, wait_for
from tests.dispatcher_helpers import wait_state

INVENTORY = EXAMPLES / "inventory-a.toml"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and line.split()[1] in ("Z", "X") for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.integration
def test_session_workers_die_with_their_dispatcher(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    daemon, port = cluster.start_dispatcher(INVENTORY)
    address = f"127.0.0.1:{port}"
    wait_state(cluster, address, "up")
    with cluster.client() as client:
        token = client.allocate("job-orphan", "alice", 1, percent=50).slices[0].token
    sessions = [protocol.handshake(address, token)[0] for _ in range(2)]
    wait_for(lambda: daemon.log().count(": job job-orphan slice 0 on ") >= 2, what="the sessions")
    pids = [int(line.split("session ", 1)[1].split(":", 1)[0]) for line in daemon.log().splitlines()
            if ": job job-orphan slice 0 on " in line]
    assert len(pids) == 2 and not any(_gone(p) for p in pids)
    assert daemon.proc is not None
    os.kill(daemon.proc.pid, signal.SIGKILL)          # the main process only, not its process group
    t0 = time.monotonic()
    wait_for(lambda: all(_gone(p) for p in pids), timeout=5, what="the orphaned workers to end")
    print(f"\nworkers gone {time.monotonic() - t0:.2f} s after kill -9 of their dispatcher")
    for s in sessions:
        s.settimeout(5)
        try:
            assert s.recv(64) == b""                   # the client sees its session end
        except ConnectionResetError:
            pass
        s.close()


@pytest.mark.integration
def test_a_dispatcher_that_has_not_heard_from_the_pool_refuses_tokens(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    daemon, port = cluster.start_dispatcher(INVENTORY)
    address = f"127.0.0.1:{port}"
    wait_state(cluster, address, "up")
    with cluster.client() as client:
        token = client.allocate("job-revoked", "alice", 1, percent=50).slices[0].token
        assert client.release("job-revoked")
    assert cluster.pool is not None
    cluster.pool.kill()
    daemon.kill()
    # Restarted while the pool is down: it cannot know the token was revoked, so it takes none.
    _daemon2, port2 = cluster.start_dispatcher(INVENTORY, port)
    with pytest.raises(RgpuError, match="has not heard from the pool since it started") as info:
        protocol.probe(address, token, timeout=5)
    assert "\n" not in str(info.value)
    cluster.start_pool()
    wait_state(cluster, address, "up")
    wait_for(lambda: _refusal(address, token) is not None and "released or reclaimed" in _refusal(address, token),
             what="the revoked token to be refused as revoked")
    with cluster.client() as client:
        fresh = client.allocate("job-fresh", "alice", 1, percent=50).slices[0].token
    protocol.probe(address, fresh, timeout=5)


def _refusal(address: str, token: str) -> str | None:
    try:
        protocol.probe(address, token, timeout=5)
    except RgpuError as exc:
        return str(exc)
    return None


def test_credentials_made_before_the_server_started_are_refused() -> None:
    secret = b"s" * 32
    auth = ServerAuth(secret, not_before=1000.0)
    method = "/rgpu.v1.Pool/ListGpus"
    assert "before this pool started" in (auth.check(method, request_credential(secret, method, now=999.0),
                                                     now=1001.0) or "")
    good = request_credential(secret, method, now=1000.5)
    assert auth.check(method, good, now=1001.0) is None
    assert auth.check(method, good, now=1001.0) == "replayed credential"


@pytest.mark.integration
def test_a_credential_replayed_after_a_pool_restart_is_refused(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    method = "/rgpu.v1.Pool/ListGpus"
    credential = request_credential(cluster.secret, method)

    def call() -> None:
        with grpc.insecure_channel(cluster.pool_address) as channel:
            pb_grpc.PoolStub(channel).ListGpus(pb.ListGpusRequest(), metadata=[(AUTH_HEADER, credential)],
                                               timeout=5)

    call()
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in info.value.details()
    assert cluster.pool is not None
    cluster.pool.kill()
    cluster.start_pool()
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "before this pool started" in info.value.details()


class GuardsAway:
    """Shared call guards whose store is away (a full disk, PostgreSQL down): stands in for the
    SQLite file or PostgreSQL so the failure can be made on demand."""

    def first_use(self, nonce: str, now: float, window: float) -> bool:
        from rgpu.remoting.pool.call_guards import GuardError
        raise GuardError("PostgreSQL: connection refused")

    def claim(self, address: str, peer: str, live: bool, registering: bool, known: set[str]) -> str | None:
        return None

    def close(self) -> None:
        pass


@pytest.mark.integration
def test_a_credential_whose_nonce_cannot_be_recorded_is_not_run_and_can_be_retried() -> None:
    """Fail closed (an unrecorded nonce could be replayed), but as UNAVAILABLE with a one-line
    reason, so clients retry or fail over instead of taking it for a wrong secret."""
    from concurrent import futures
    secret = b"s" * 32
    ran: list[bytes] = []
    handler = grpc.method_handlers_generic_handler("probe.Probe", {"Call": grpc.unary_unary_rpc_method_handler(
        lambda request, context: ran.append(request) or b"")})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), interceptors=[ServerAuth(secret, guards=GuardsAway())])
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/probe.Probe/Call")(b"x", timeout=10, metadata=(
                    (AUTH_HEADER, request_credential(secret, "/probe.Probe/Call")),))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE   # type: ignore[attr-defined]
        details = info.value.details()   # type: ignore[attr-defined]
        assert "cannot check the call's credential now (PostgreSQL: connection refused)" in details
        assert "retry" in details and "\n" not in details
        assert ran == []
    finally:
        server.stop(0)
