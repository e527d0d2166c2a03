"""Admin-call latency while munged is down and clients flood the pool with garbage MUNGE headers
(issue 26, HIGH 2). A real rgpu-poold on loopback with 2 registered servers, a real munged (run,
then kill -9'd or SIGSTOP'd); an admin (the cluster secret) calls ListServers back to back.
Prints p50/p99/max idle, then under the flood, and how many flood calls the pool answered.

    python benchmarks/munge_flood.py [--clients 4] [--seconds 10] [--munged kill|stop|up]   # as root
    python benchmarks/munge_flood.py --pool-cpus 0 --flood-cpus 1   # the flood from "other hosts"
    python benchmarks/munge_flood.py --health-floor                 # flood with open health checks instead

Target: admin p99 under a 4-client flood with munged down within 2x of idle.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from rgpu.proto import rgpu_pb2 as pb  # noqa: E402
from rgpu.proto import rgpu_pb2_grpc as pb_grpc  # noqa: E402
from rgpu.remoting.pool.auth import MUNGE_HEADER  # noqa: E402
from benchmarks.admin_calls import admin_latencies, p99, percentiles  # noqa: E402
from tests import munged  # noqa: E402
from tests.daemons import RgpuCluster, register_servers  # noqa: E402


def flood(address: str, seconds: float, index: int, answered: "mp.Value[int]", health: bool,
          cpus: set[int]) -> None:   # type: ignore[type-arg]
    """One client: garbage MUNGE headers (or, for the floor, health checks), back to back, for `seconds`."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    deadline = time.monotonic() + seconds
    count = 0
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PoolStub(channel)
        check = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if health:
                    check.Check(health_pb2.HealthCheckRequest(), timeout=30)
                else:
                    stub.ListGpus(pb.ListGpusRequest(), metadata=[(MUNGE_HEADER, f"MUNGE:junk-{index}-{count}:")],
                                  timeout=30)
            except grpc.RpcError:
                pass
            count += 1
    with answered.get_lock():
        answered.value += count


def pool_cpu_seconds(cluster: RgpuCluster) -> float:
    """The pool process's CPU time so far (user + system)."""
    assert cluster.pool is not None and cluster.pool.proc is not None
    fields = Path(f"/proc/{cluster.pool.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--munged", choices=["kill", "stop", "up"], default="kill")
    parser.add_argument("--health-floor", action="store_true",
                        help="flood with health checks instead (open calls, no credential): the gRPC floor")
    parser.add_argument("--pool-cpus", default="", help="e.g. 0: the pool and the admin client on these CPUs")
    parser.add_argument("--flood-cpus", default="", help="e.g. 1: the flooding clients on these CPUs (other hosts)")
    args = parser.parse_args()
    if munged.missing():
        sys.exit(f"munge_flood: {munged.missing()}")
    pool_cpus = {int(c) for c in args.pool_cpus.split(",") if c}
    flood_cpus = {int(c) for c in args.flood_cpus.split(",") if c}
    if pool_cpus:
        os.sched_setaffinity(0, pool_cpus)   # inherited by the pool (started below) and kept by the admin client
    key = munged.MungeKey()
    daemon = key.start("pool")
    cluster = RgpuCluster(Path(tempfile.mkdtemp(prefix="rgpu-munge-flood-")))
    cluster.write_config(munge_socket=daemon.socket, account_check="off", heartbeat_interval_seconds=5.0)
    try:
        cluster.start_pool()
        with cluster.client() as admin:
            register_servers(admin, servers=2, gpus=4)
        admin_latencies(cluster, 1.0)   # warm-up
        idle = admin_latencies(cluster, args.seconds)
        if args.munged == "kill":
            daemon.kill()
        elif args.munged == "stop":
            daemon.signal(signal.SIGSTOP)
        answered = mp.Value("q", 0)
        clients = [mp.Process(target=flood, args=(cluster.pool_address, args.seconds + 2, n, answered,
                                                          args.health_floor, flood_cpus))
                   for n in range(args.clients)]
        for client in clients:
            client.start()
        time.sleep(1.0)   # the flood under way
        cpu_before = pool_cpu_seconds(cluster)
        loaded = admin_latencies(cluster, args.seconds)
        cpu_used = pool_cpu_seconds(cluster) - cpu_before
        for client in clients:
            client.join()
        what = "health checks (the floor)" if args.health_floor else "garbage MUNGE headers"
        print(f"munge_flood: munged {args.munged}, {args.clients} clients flooding {what}, {args.seconds:g} s each phase"
              f"{f', pool and admin on CPUs {args.pool_cpus}, flood on {args.flood_cpus}' if pool_cpus else ''}")
        print(percentiles("idle admin calls", idle))
        print(percentiles("flood admin calls", loaded))
        ratio = p99(loaded) / p99(idle)
        rate = answered.value / (args.seconds + 2)
        print(f"   flood: {answered.value} flood calls answered ({rate:.0f}/s); pool CPU {cpu_used / args.seconds:.2f} "
              f"cores while measuring; admin p99 flood/idle {ratio:.2f}x (target <= 2x)")
    finally:
        daemon.signal(signal.SIGCONT)
        cluster.stop_all()
        key.remove()


if __name__ == "__main__":
    main()
