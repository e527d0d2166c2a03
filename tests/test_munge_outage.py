"""A dead or paused munged on the pool host must not stall the pool (issue 26, HIGH 2).

Real rgpu-poold and rgpu-dispatcher on loopback, and two real munged sharing one key: the client
node's (users make credentials there) and the pool host's (the pool decodes them there), which
the tests kill -9 or SIGSTOP while four clients flood the pool with garbage MUNGE headers."""

from __future__ import annotations

import base64
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from rgpu.proto import rgpu_pb2 as pb
from rgpu.proto import rgpu_pb2_grpc as pb_grpc
from rgpu.remoting.pool.auth import MUNGE_HEADER
from tests import munged
from tests.daemons import EXAMPLES, RgpuCluster, two_clusters, wait_for
from tests.dispatcher_helpers import wait_state

pytestmark = pytest.mark.integration
LIST_GPUS = "/rgpu.v1.Pool/ListGpus"


@pytest.fixture
def munge_key() -> Iterator[munged.MungeKey]:
    if munged.missing():
        pytest.skip(munged.missing())
    key = munged.MungeKey()
    try:
        yield key
    finally:
        key.remove()


def credential(sock: str, address: str, method: str = LIST_GPUS) -> str:
    """A user's credential for ListGpus at the pool at `address`."""
    return munged.user_credential(sock, method, pb.ListGpusRequest().SerializeToString(), munged.pool_name(address))


def user_call(address: str, cred: str, timeout: float = 10.0) -> pb.ListGpusReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.PoolStub(channel).ListGpus(pb.ListGpusRequest(), metadata=[(MUNGE_HEADER, cred)],
                                                  timeout=timeout)


def garbage_credential(tag: str) -> str:
    """A credential munged did not make, in the shape of one (so only munged can tell)."""
    return f"MUNGE:{base64.b64encode(f'garbage-{tag}'.encode()).decode()}:"


class GarbageFlood:
    """`clients` threads, each on its own channel, sending calls with garbage MUNGE headers."""

    def __init__(self, address: str, clients: int = 4) -> None:
        self.address, self.stop, self.sent = address, threading.Event(), 0
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(clients)]

    def _run(self, n: int) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.PoolStub(channel)
            i = 0
            while not self.stop.is_set():
                i += 1
                try:
                    stub.ListGpus(pb.ListGpusRequest(), metadata=[(MUNGE_HEADER, garbage_credential(f"{n}-{i}"))],
                                  timeout=30)
                except grpc.RpcError:
                    pass
                self.sent += 1

    def __enter__(self) -> "GarbageFlood":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=40)


@pytest.fixture
def pool(tmp_path: Path, munge_key: munged.MungeKey) -> Iterator[tuple[RgpuCluster, munged.Munged, munged.Munged, str]]:
    client_munged, pool_munged = munge_key.start("client"), munge_key.start("pool")
    cluster = RgpuCluster(tmp_path / "cluster")
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                         munge_socket=pool_munged.socket, account_check="off")
    try:
        cluster.start_pool()
        _daemon, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
        dispatcher = f"127.0.0.1:{port}"
        wait_state(cluster, dispatcher, "up")
        user_call(cluster.pool_address, credential(client_munged.socket, cluster.pool_address))   # munged up: users are served
        yield cluster, client_munged, pool_munged, dispatcher
    finally:
        pool_munged.signal(signal.SIGCONT)
        cluster.stop_all()


def assert_pool_serves_daemons(cluster: RgpuCluster, dispatcher: str, seconds: float) -> list[float]:
    """Admin calls (the secret) answered throughout `seconds`, and the dispatcher's heartbeats
    (the secret) with them: it stays up, heard from within a second. Returns the calls' latencies."""
    latencies = []
    deadline = time.monotonic() + seconds
    with cluster.client() as admin:
        while time.monotonic() < deadline:
            started = time.monotonic()
            servers = {s.address: s for s in admin.list_servers().servers}
            latencies.append(time.monotonic() - started)
            assert servers[dispatcher].state == "up", servers[dispatcher]
            assert servers[dispatcher].heartbeat_age_seconds < 1.5, servers[dispatcher]
            time.sleep(0.2)
    assert max(latencies) < 1.0, latencies
    return latencies


def assert_fails_fast(cluster: RgpuCluster, cred: str, pool_socket: str) -> str:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        user_call(cluster.pool_address, cred)
    took = time.monotonic() - started
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    details = info.value.details()
    assert "\n" not in details and details.startswith("rgpu: pool: cannot check the MUNGE credential ("), details
    assert f"munged at {pool_socket} is not answering" in details and "start munged" in details, details
    assert took < 1.5, took
    return details


def test_a_killed_munged_leaves_admins_and_dispatchers_served_and_users_told_at_once(pool) -> None:  # type: ignore[no-untyped-def]
    cluster, client_munged, pool_munged, dispatcher = pool
    pool_munged.kill()
    with GarbageFlood(cluster.pool_address) as flood:
        assert_pool_serves_daemons(cluster, dispatcher, seconds=5.0)   # longer than down_after_seconds
        for _ in range(3):
            assert_fails_fast(cluster, credential(client_munged.socket, cluster.pool_address), pool_munged.socket)
    assert flood.sent > 20, flood.sent
    pool_munged.start()   # back: the next probe finds it, and users are served again
    deadline = time.monotonic() + 15
    while True:
        try:
            user_call(cluster.pool_address, credential(client_munged.socket, cluster.pool_address))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc.details()
            time.sleep(0.5)
    assert "Traceback" not in cluster.pool.log()   # type: ignore[union-attr]


def test_a_paused_munged_holds_no_serving_thread_for_long(pool) -> None:  # type: ignore[no-untyped-def]
    cluster, client_munged, pool_munged, dispatcher = pool
    pool_munged.signal(signal.SIGSTOP)
    with GarbageFlood(cluster.pool_address):
        assert_pool_serves_daemons(cluster, dispatcher, seconds=5.0)
        assert_fails_fast(cluster, credential(client_munged.socket, cluster.pool_address), pool_munged.socket)
    pool_munged.signal(signal.SIGCONT)


def test_a_munge_credential_is_good_for_one_call_across_pool_daemons(tmp_path: Path,
                                                                    munge_key: munged.MungeKey) -> None:
    """Two daemons on one PostgreSQL, on two hosts with a munged each, under one pool_name (so a
    credential is good at either): munged's replay cache is its own, so the pools' shared call guards
    must refuse the second use."""
    from tests.postgres import Postgres, server_bin

    if server_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    pytest.importorskip("psycopg")

    postgres = Postgres().start()
    first, second = two_clusters(tmp_path)   # one cluster secret
    munged_a, munged_b, client_munged = munge_key.start("a"), munge_key.start("b"), munge_key.start("client")
    try:
        for cluster, mine in ((first, munged_a), (second, munged_b)):
            cluster.write_config(store_url=postgres.url, munge_socket=mine.socket, account_check="off",
                                 pool_name="pool-on-one-store")
            cluster.start_pool()
        cred = credential(client_munged.socket, first.pool_address)
        user_call(first.pool_address, cred)
        with pytest.raises(grpc.RpcError) as info:
            user_call(second.pool_address, cred)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
        assert "replayed" in info.value.details()
        user_call(second.pool_address, credential(client_munged.socket, second.pool_address))   # a fresh one is fine
    finally:
        first.stop_all()
        second.stop_all()
        postgres.stop()



SECRET = b"s" * 32


@contextmanager
def one_thread_pool(auth: object, hold: threading.Event, holding: threading.Event) -> Iterator[grpc.Channel]:
    """A gRPC server on port 0 with `auth` and one serving thread; its ListServers holds that thread
    (setting `holding`) until `hold` is set, its ListGpus answers at once. Yields a channel to it."""
    from concurrent import futures

    def held(request: bytes, context: object) -> bytes:
        holding.set()
        hold.wait(60)
        return b""

    handler = grpc.method_handlers_generic_handler("rgpu.v1.Pool", {
        "ListServers": grpc.unary_unary_rpc_method_handler(held),
        "ListGpus": grpc.unary_unary_rpc_method_handler(lambda request, context: b"")})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), interceptors=[auth])
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        hold.set()
        server.stop(grace=None)


def refused_with(call: Callable[[], object], code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    details = info.value.details()   # type: ignore[attr-defined]
    assert info.value.code() == code, details   # type: ignore[attr-defined]
    assert details.startswith("rgpu: pool: ") and words in details and "\n" not in details, details


def admin_metadata(method: str = "/rgpu.v1.Pool/ListServers") -> tuple[tuple[str, str], ...]:
    from rgpu.remoting.pool.auth import AUTH_HEADER, request_credential
    return ((AUTH_HEADER, request_credential(SECRET, method)),)


GARBAGE = ((MUNGE_HEADER, garbage_credential("one")),)


def test_refusals_take_no_serving_thread_so_a_flood_of_them_waits_behind_none(munge_key: munged.MungeKey) -> None:
    """While munged is taken as down, a call with a MUNGE header (garbage or not) is refused off the
    serving threads, as is a call with a wrong secret: with the pool's one serving thread held by an
    admin's call, both are still answered, and the admin's call goes on (before, each refusal waited
    for a serving thread, so a flood of them queued beside the calls made with the secret)."""
    from rgpu.remoting.pool.auth import AUTH_HEADER, ServerAuth, request_credential
    from rgpu.remoting.pool.munge_gate import MungeGate

    pool_munged = munge_key.start("pool")
    pool_munged.kill()
    gate = MungeGate(pool_munged.socket, clock=lambda: 1000.0)   # time stands still: once open, the breaker stays open
    hold, holding = threading.Event(), threading.Event()
    with one_thread_pool(ServerAuth(SECRET, munge_gate=gate), hold, holding) as channel:
        list_gpus = channel.unary_unary(LIST_GPUS)
        # The first finds munged down (on the serving thread): the breaker opens.
        refused_with(lambda: list_gpus(b"", timeout=30, metadata=GARBAGE), grpc.StatusCode.UNAVAILABLE,
                     "is not answering")
        held = channel.unary_unary("/rgpu.v1.Pool/ListServers").future(b"", timeout=60, metadata=admin_metadata())
        assert holding.wait(30)   # the only serving thread is now the admin's
        refused_with(lambda: list_gpus(b"", timeout=10, metadata=GARBAGE), grpc.StatusCode.UNAVAILABLE,
                     f"munged at {pool_munged.socket} is not answering")
        refused_with(lambda: list_gpus(b"", timeout=10, metadata=((AUTH_HEADER, request_credential(b"w" * 32, LIST_GPUS)),)),
                     grpc.StatusCode.UNAUTHENTICATED, "wrong cluster secret")
        assert not held.done()
        hold.set()
        assert held.result() == b""
    gate.close()


def test_while_one_call_probes_munged_the_others_are_refused_without_a_serving_thread() -> None:
    """Once the breaker's wait is over, one call probes munged (on a serving thread, up to the
    decode deadline); the calls that come meanwhile are refused as while the breaker is open, not
    on serving threads of their own (before, each took one only to be refused)."""
    from rgpu import munge
    from rgpu.remoting.pool.auth import ServerAuth
    from rgpu.remoting.pool.munge_gate import MungeGate

    now = [1000.0]
    probing, answer = threading.Event(), threading.Event()

    def munged_away(credential: str, socket: str) -> munge.Identity:
        if now[0] > 1000.0:   # the probe: munged does not answer until the test lets it
            probing.set()
            answer.wait(60)
        raise munge.MungedUnreachable("munge", "munged is not answering", "socket gone", "start munged")

    gate = MungeGate("/nonexistent/munge.socket", decode=munged_away, timeout=60, clock=lambda: now[0])
    hold, holding = threading.Event(), threading.Event()
    with one_thread_pool(ServerAuth(SECRET, munge_gate=gate), hold, holding) as channel:
        list_gpus = channel.unary_unary(LIST_GPUS)
        refused_with(lambda: list_gpus(b"", timeout=30, metadata=GARBAGE), grpc.StatusCode.UNAVAILABLE,
                     "is not answering")   # the breaker opens
        now[0] += 60   # its wait is over: the next call probes
        probe = list_gpus.future(b"", timeout=60, metadata=GARBAGE)
        assert probing.wait(30)   # the only serving thread waits for munged's answer
        refused_with(lambda: list_gpus(b"", timeout=10, metadata=GARBAGE), grpc.StatusCode.UNAVAILABLE,
                     "/nonexistent/munge.socket is not answering")
        answer.set()
        refused_with(probe.result, grpc.StatusCode.UNAVAILABLE, "is not answering")
    gate.close()


def test_a_refused_caller_hears_why_after_a_pause_and_at_most_a_bounded_number_wait() -> None:
    """Refusals are answered after a short pause, so a client that calls again as soon as it is
    refused (a retry loop, a flood) costs the pool a few calls a second, not thousands; beyond a
    bounded number waiting, a refusal is answered at once."""
    from rgpu.remoting.pool.auth import ServerAuth
    from rgpu.remoting.pool.refusals import PacedRefusals

    now = [1000.0]
    paced = PacedRefusals(delay=0.1, held=2, clock=lambda: now[0])   # time stands still: the first two wait
    hold, holding = threading.Event(), threading.Event()
    wrong = (("x-rgpu-auth", "1.2.3.4"),)
    with one_thread_pool(ServerAuth(SECRET, refusals=paced), hold, holding) as channel:
        list_gpus = channel.unary_unary(LIST_GPUS)
        waiting = [list_gpus.future(b"", timeout=60, metadata=wrong) for _ in range(2)]
        wait_for(lambda: paced.waiting == 2, what="two refusals waiting")
        refused_with(lambda: list_gpus(b"", timeout=10, metadata=wrong), grpc.StatusCode.UNAUTHENTICATED,
                     "call refused")   # the third: answered at once
        assert not any(call.done() for call in waiting) and paced.waiting == 2
        assert list_gpus(b"", timeout=10, metadata=admin_metadata(LIST_GPUS)) == b""   # calls with the secret run
        now[0] += 1.0
        for call in waiting:
            refused_with(call.result, grpc.StatusCode.UNAUTHENTICATED, "call refused")


def test_a_header_that_is_no_munge_credential_is_refused_without_asking_munged(munge_key: munged.MungeKey) -> None:
    """A MUNGE header not in munged's shape (MUNGE:<base64>:) is refused at once, off the serving
    threads and without a decoder: with munged up and the one serving thread held, it is still
    answered (before, each was queued for a serving thread and sent to munged to be refused)."""
    from rgpu.remoting.pool.auth import ServerAuth
    from rgpu.remoting.pool.munge_gate import MungeGate

    pool_munged = munge_key.start("pool")
    gate = MungeGate(pool_munged.socket)
    hold, holding = threading.Event(), threading.Event()
    with one_thread_pool(ServerAuth(SECRET, munge_gate=gate), hold, holding) as channel:
        list_gpus = channel.unary_unary(LIST_GPUS)
        held = channel.unary_unary("/rgpu.v1.Pool/ListServers").future(b"", timeout=60, metadata=admin_metadata())
        assert holding.wait(30)
        for header in ("MUNGE:junk-1:", "garbage"):
            refused_with(lambda: list_gpus(b"", timeout=10, metadata=((MUNGE_HEADER, header),)),
                         grpc.StatusCode.UNAUTHENTICATED, "MUNGE credential refused: ")
        # Over 8 KiB: gRPC's own metadata limit may refuse it first (between its soft limit, 8 KiB, and
        # its hard limit it refuses at random: RESOURCE_EXHAUSTED in one CI run of nine); either way at
        # once, with the one serving thread still held.
        with pytest.raises(grpc.RpcError) as info:
            list_gpus(b"", timeout=10, metadata=((MUNGE_HEADER, "MUNGE:" + "A" * 9000 + ":"),))
        assert info.value.code() in (grpc.StatusCode.UNAUTHENTICATED,   # type: ignore[attr-defined]
                                     grpc.StatusCode.RESOURCE_EXHAUSTED), info.value.details()  # type: ignore[attr-defined]
        assert not held.done()
        hold.set()
        assert held.result() == b""
        # One in munged's shape is munged's to judge (on a serving thread, now free).
        refused_with(lambda: list_gpus(b"", timeout=10, metadata=GARBAGE), grpc.StatusCode.UNAUTHENTICATED,
                     "MUNGE credential refused: ")
    gate.close()
