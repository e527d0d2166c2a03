"""Slow HTTP connections against the daemons' unauthenticated endpoints (issue 26, HIGH 4): a real
rgpu-poold (dashboard and /metrics on) and rgpu-dispatcher (/metrics on) on loopback, then N
connections (10,000 by default, split over the three endpoints, from 127.0.0.2..) that trickle a
request head that never ends and are reopened whenever closed. Prints admin-call latency and
data-path session opens idle and under the flood, the daemons' threads and open files, and what
the endpoints did with the connections.

    python benchmarks/http_flood.py [--connections 10000] [--seconds 20] [--every 2]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.admin_calls import admin_latencies, percentiles  # noqa: E402
from rgpu.remoting.datapath import protocol  # noqa: E402
from tests.daemons import EXAMPLES, Daemon, RgpuCluster, wait_for_port_file  # noqa: E402
from tests.dispatcher_helpers import wait_state  # noqa: E402
from tests.front_door_helpers import Slowloris  # noqa: E402
from tests.http_front_helpers import TRICKLE, answers, open_files_of, threads_of  # noqa: E402


def latencies(cluster: RgpuCluster, address: str, token: str, seconds: float) -> tuple[list[float], list[float]]:
    """(admin ListServers latencies, session open latencies: one every 50 admin calls) over `seconds`."""
    sessions: list[float] = []

    def between(n: int) -> None:
        if n % 50 == 0:
            started = time.perf_counter()
            assert "slice ready" in protocol.probe(address, token, timeout=30).description
            sessions.append(time.perf_counter() - started)
        time.sleep(0.01)

    return admin_latencies(cluster, seconds, between), sessions


def state(daemon: Daemon) -> str:
    assert daemon.proc is not None
    return f"{threads_of(daemon.proc.pid)} threads, {open_files_of(daemon.proc.pid)} open files"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between the bytes each connection trickles")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.connections + 2048)), hard))
    root = Path(tempfile.mkdtemp(prefix="rgpu-http-flood-"))
    cluster = RgpuCluster(root / "cluster")
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                         metrics_listen="127.0.0.1:0", dashboard_listen="127.0.0.1:0",
                         dispatcher_metrics_listen="127.0.0.1:0")
    try:
        pool = cluster.start_pool("--metrics-port-file", str(root / "metrics.port"),
                                  "--dashboard-port-file", str(root / "dashboard.port"))
        dispatcher, port = cluster.start_dispatcher(EXAMPLES / "inventory-a.toml", None, "--metrics-port-file",
                                                    str(root / "dmetrics.port"))
        address = f"127.0.0.1:{port}"
        wait_state(cluster, address, "up")
        ports = {"pool /metrics": wait_for_port_file(root / "metrics.port", pool),
                 "dashboard": wait_for_port_file(root / "dashboard.port", pool),
                 "dispatcher /metrics": wait_for_port_file(root / "dmetrics.port", dispatcher)}
        with cluster.client() as admin:
            token = admin.allocate("bench", "alice", 1, percent=50).slices[0].token
        latencies(cluster, address, token, 1.0)   # warm-up
        print(f"http_flood: {args.connections} slow connections over {len(ports)} endpoints, "
              f"a byte every {args.every:g} s, {args.seconds:g} s measured")
        print(f"  idle:  pool {state(pool)}; dispatcher {state(dispatcher)}")
        idle_admin, idle_sessions = latencies(cluster, address, token, args.seconds / 2)
        print("  idle:  " + percentiles("admin calls", idle_admin) + "; " + percentiles("session opens", idle_sessions))
        each = args.connections // len(ports)
        attacks = [Slowloris(p, count=each, sources=50, every=args.every, trickle=TRICKLE, data_port=False)
                   for p in ports.values()]
        for attack in attacks:
            attack.__enter__()
        try:
            time.sleep(3.0)
            flood_admin, flood_sessions = latencies(cluster, address, token, args.seconds)
            print(f"  flood: pool {state(pool)}; dispatcher {state(dispatcher)}")
            print("  flood: " + percentiles("admin calls", flood_admin) + "; " + percentiles("session opens", flood_sessions))
            scrapes = {name: answers(p, "/metrics" if "metrics" in name else "/") for name, p in ports.items()}
            print(f"  flood: one request sent at once to each endpoint answered with {scrapes} (0: turned away)")
        finally:
            for attack in attacks:
                attack.__exit__(None, None, None)
        for (name, _p), attack in zip(ports.items(), attacks):
            print(f"  {name}: {attack.opened} connections opened by the flood, {attack.closed_by_server} closed "
                  f"by the endpoint, {attack.held()} held at the end")
        time.sleep(1.0)
        after = {name: answers(p, "/metrics" if "metrics" in name else "/") for name, p in ports.items()}
        print(f"  after: {after}; pool {state(pool)}; dispatcher {state(dispatcher)}")
    finally:
        cluster.stop_all()


if __name__ == "__main__":
    main()
