"""The unauthenticated HTTP endpoints (the pool's dashboard, the pool's and a dispatcher's
`/metrics`) under slow and idle connections (issue 26, HIGH 4): the front's own limits in
process (remoting/metrics/front.py), then real daemons with a lowered open-file limit, while
hundreds of connections trickle request heads at them."""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from rgpu.remoting.datapath import protocol
from rgpu.remoting.metrics.front import FrontLimits, HttpFront
from tests.daemons import EXAMPLES, RgpuCluster, register_servers, wait_for, wait_for_port_file
from tests.dispatcher_helpers import wait_state
from tests.front_door_helpers import Slowloris
from tests.http_front_helpers import TRICKLE, answers, get, open_files_of, threads_of

NOFILE = 256


@pytest.fixture(autouse=True)
def enough_open_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))


class Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


# --- the front, in process ---------------------------------------------------------------------------

def test_a_trickled_head_is_cut_at_the_deadline() -> None:
    front = HttpFront("127.0.0.1", 0, Hello, name="test", limits=FrontLimits(head_seconds=1.0))
    try:
        assert get(front.port) == (200, b"hello")
        slow = socket.create_connection(("127.0.0.1", front.port))
        started = time.monotonic()
        slow.settimeout(5)
        closed_after = None
        for byte in TRICKLE:
            try:
                slow.send(bytes([byte]))
                time.sleep(0.1)
            except OSError:
                closed_after = time.monotonic() - started
                break
        if closed_after is None:
            assert slow.recv(1) == b""
            closed_after = time.monotonic() - started
        assert closed_after < 2.5, closed_after
    finally:
        front.stop()


def test_at_the_cap_idle_connections_make_way_for_a_request_sent_at_once() -> None:
    front = HttpFront("127.0.0.1", 0, Hello, name="test", limits=FrontLimits(connections=8))
    idle = []
    try:
        idle = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(20)]
        wait_for(lambda: front.refused_connections >= 1, what="connections over the cap to be closed")
        time.sleep(0.3)
        assert front.open_connections == 8
        with pytest.raises(OSError):
            get(front.port)            # from the busiest address, and none of its own a second old: refused
        assert get(front.port, source="127.0.0.2") == (200, b"hello")   # the busiest address makes way
        time.sleep(1.1)
        assert get(front.port) == (200, b"hello")
        assert front.displaced_connections >= 1 and front.open_connections <= 8
    finally:
        for s in idle:
            s.close()
        front.stop()


def test_an_oversized_head_is_closed_without_an_answer() -> None:
    front = HttpFront("127.0.0.1", 0, Hello, name="test", limits=FrontLimits(head_bytes=1024))
    try:
        with socket.create_connection(("127.0.0.1", front.port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nX: " + b"a" * 4096 + b"\r\n\r\n")
            assert s.recv(100) == b""
        assert get(front.port) == (200, b"hello")
    finally:
        front.stop()


def test_metrics_at_an_address_without_a_host_serve_localhost_only() -> None:
    from prometheus_client import CollectorRegistry

    from rgpu.remoting.metrics.http import serve_metrics

    server = serve_metrics(":0", CollectorRegistry(), "test")
    try:
        assert server.host == "127.0.0.1"
        assert get(server.port, "/metrics")[0] == 200
    finally:
        server.stop()


# --- the real daemons -----------------------------------------------------------------------------------

@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RgpuCluster]:
    c = RgpuCluster(tmp_path / "cluster")
    c.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                   dispatcher_metrics_listen="127.0.0.1:0")
    try:
        yield c
    finally:
        c.stop_all()


@pytest.mark.integration
def test_slow_connections_to_the_pools_dashboard_and_metrics_leave_admins_served(cluster: RgpuCluster) -> None:
    root = cluster.root
    cluster.write_config(down_after_seconds=60.0, metrics_listen="127.0.0.1:0", dashboard_listen="127.0.0.1:0")
    pool = cluster.start_pool("--metrics-port-file", str(root / "metrics.port"),
                              "--dashboard-port-file", str(root / "dashboard.port"), nofile=NOFILE)
    metrics_port = wait_for_port_file(root / "metrics.port", pool)
    dashboard_port = wait_for_port_file(root / "dashboard.port", pool)
    assert pool.proc is not None
    with cluster.client() as admin:
        register_servers(admin, servers=1, gpus=4)
    threads_before = threads_of(pool.proc.pid)
    with Slowloris(metrics_port, count=300, sources=30, trickle=TRICKLE, data_port=False) as metrics_attack, \
         Slowloris(dashboard_port, count=300, sources=30, trickle=TRICKLE, data_port=False) as dashboard_attack:
        time.sleep(2.0)
        for n in range(10):
            with cluster.client() as admin:
                lease = admin.allocate(f"job-{n}", "alice", 1, percent=10)
                assert [x.job_key for x in admin.list_leases()] == [f"job-{n}"]
                admin.release(lease.job_key)
            time.sleep(0.2)
        assert threads_of(pool.proc.pid) <= threads_before + 2
        assert open_files_of(pool.proc.pid) < NOFILE - 32
        assert metrics_attack.opened > 300 and dashboard_attack.opened > 300   # closed and reopened
    # Under the flood the endpoints themselves may turn clients away; once it ends they answer.
    wait_for(lambda: answers(metrics_port, "/metrics") == 200, what="a metrics scrape after the flood")
    wait_for(lambda: answers(dashboard_port, "/") == 401, what="the dashboard's login page after the flood")
    assert pool.alive and "Traceback" not in pool.log()


@pytest.mark.integration
def test_idle_connections_to_a_dispatchers_metrics_leave_its_sessions_open(cluster: RgpuCluster) -> None:
    cluster.start_pool()
    daemon, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml", None, "--metrics-port-file",
                                            str(cluster.root / "dmetrics.port"), nofile=NOFILE)
    address = f"127.0.0.1:{port}"
    wait_state(cluster, address, "up")
    metrics_port = wait_for_port_file(cluster.root / "dmetrics.port", daemon)
    with cluster.client() as client:
        token = client.allocate("job-m", "alice", 1, percent=50).slices[0].token
    assert daemon.proc is not None
    threads_before = threads_of(daemon.proc.pid)
    idle = []
    try:
        for _ in range(NOFILE):
            idle.append(socket.create_connection(("127.0.0.1", metrics_port), timeout=5))
        wait_for(lambda: open_files_of(daemon.proc.pid) < NOFILE - 16, what="the dispatcher to drop extra idle connections")  # type: ignore[union-attr]
        for _ in range(3):
            assert "slice ready" in protocol.probe(address, token, timeout=10).description
        # Held idle by the busiest address: the scrape gets in once they are a second old.
        wait_for(lambda: answers(metrics_port, "/metrics") == 200, what="a metrics scrape")
        assert threads_of(daemon.proc.pid) <= threads_before + 2
        assert wait_state(cluster, address, "up")
    finally:
        for s in idle:
            s.close()
