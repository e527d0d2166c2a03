"""Admin-call latency while munged is down and clients flood the pool with garbage MUNGE headers
(issue 26, HIGH 2). A real rgpu-poold on loopback with 2 registered servers, a real munged (run,
then kill -9'd or SIGSTOP'd); an admin (the cluster secret) calls ListServers back to back.
Prints p50/p99/max idle, then under the flood, and how many flood calls the pool answered.

    python benchmarks/munge_flood.py [--clients 4] [--seconds 10] [--munged kill|stop|up]   # as root
    python benchmarks/munge_flood.py --pool-cpus 0 --flood-cpus 1   # the flood from "other hosts"
    python benchmarks/munge_flood.py --health-floor                 # flood with open health checks instead
    python benchmarks/munge_flood.py --rounds 3                     # idle and flood phases taken in turn
    python benchmarks/munge_flood.py --in-flight 200                # each client keeps 200 calls in flight

With --rounds N the idle and flood phases alternate N times and each p99 is over all of its rounds'
calls, so load from other programs on the machine weighs on both alike.

Target: admin p99 under a 4-client flood with munged down within 2x of idle.
"""

from __future__ import annotations

import argparse
import base64
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from rgpu.proto import rgpu_pb2 as pb  # noqa: E402
from rgpu.proto import rgpu_pb2_grpc as pb_grpc  # noqa: E402
from rgpu.remoting.pool.auth import MUNGE_HEADER  # noqa: E402
from benchmarks.admin_calls import admin_latencies, p99, percentiles  # noqa: E402
from tests import munged  # noqa: E402
from tests.daemons import RgpuCluster, register_servers, wait_for  # noqa: E402


def junk(index: int, count: int) -> str:
    """A credential munged did not make, in the shape of one: the pool must ask munged about it."""
    return f"MUNGE:{base64.b64encode(f'junk-{index}-{count}'.encode()).decode()}:"


def flood(address: str, seconds: float, index: int, answered: "mp.Value[int]", health: bool,   # type: ignore[type-arg]
          cpus: set[int], in_flight: int = 1, ready: "mp.Value[int] | None" = None) -> None:   # type: ignore[type-arg]
    """One client: garbage MUNGE headers (or, for the floor, health checks), back to back, for `seconds`;
    with `in_flight` > 1 that many calls at once (each answered call is sent again at once)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    deadline = time.monotonic() + seconds
    count = 0
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PoolStub(channel)
        check = health_pb2_grpc.HealthStub(channel)
        if ready is not None:
            with ready.get_lock():
                ready.value += 1
        if in_flight > 1:
            count = flood_in_flight(stub, index, deadline, in_flight)
        while in_flight == 1 and time.monotonic() < deadline:
            try:
                if health:
                    check.Check(health_pb2.HealthCheckRequest(), timeout=30)
                else:
                    stub.ListGpus(pb.ListGpusRequest(), metadata=[(MUNGE_HEADER, junk(index, count))],
                                  timeout=30)
            except grpc.RpcError:
                pass
            count += 1
    with answered.get_lock():
        answered.value += count


def flood_in_flight(stub: pb_grpc.PoolStub, index: int, deadline: float, in_flight: int) -> int:
    """Garbage MUNGE calls, `in_flight` at a time, until `deadline`; how many were answered."""
    sent = 0

    def call() -> "grpc.Future":
        nonlocal sent
        sent += 1
        return stub.ListGpus.future(pb.ListGpusRequest(), metadata=[(MUNGE_HEADER, junk(index, sent))],
                                    timeout=30)

    pending = deque(call() for _ in range(in_flight))
    count = 0
    while pending:
        try:
            pending.popleft().result()
        except grpc.RpcError:
            pass
        count += 1
        if time.monotonic() < deadline:
            pending.append(call())
    return count


def pool_cpu_seconds(cluster: RgpuCluster) -> float:
    """The pool process's CPU time so far (user + system)."""
    assert cluster.pool is not None and cluster.pool.proc is not None
    fields = Path(f"/proc/{cluster.pool.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--in-flight", type=int, default=1,
                        help="calls each flooding client keeps in flight (1: one after another)")
    parser.add_argument("--rounds", type=int, default=1, help="idle and flood phases taken in turn this many times")
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
        if args.munged == "kill":
            daemon.kill()
        elif args.munged == "stop":
            daemon.signal(signal.SIGSTOP)
        idle: list[float] = []
        loaded: list[float] = []
        ratios: list[float] = []
        # Spawned, not forked: this process already uses gRPC, and a forked child's new channel can hang.
        spawn = mp.get_context("spawn")
        answered, ready = spawn.Value("q", 0), spawn.Value("q", 0)
        cpu_used = 0.0
        for number in range(args.rounds):
            idle_now = admin_latencies(cluster, args.seconds)
            clients = [spawn.Process(target=flood, args=(cluster.pool_address, args.seconds + 2, n, answered,
                                                              args.health_floor, flood_cpus, args.in_flight, ready))
                       for n in range(args.clients)]
            for client in clients:
                client.start()
            wait_for(lambda: ready.value == args.clients * (number + 1), timeout=60, what="the flooding clients")
            time.sleep(1.0)   # the flood under way
            cpu_before = pool_cpu_seconds(cluster)
            loaded_now = admin_latencies(cluster, args.seconds)
            cpu_used += pool_cpu_seconds(cluster) - cpu_before
            for client in clients:
                client.join()
            idle += idle_now
            loaded += loaded_now
            ratios.append(p99(loaded_now) / p99(idle_now))
        what = "health checks (the floor)" if args.health_floor else "garbage MUNGE headers"
        print(f"munge_flood: munged {args.munged}, {args.clients} clients flooding {what}"
              f"{f' ({args.in_flight} calls in flight each)' if args.in_flight > 1 else ''}, {args.seconds:g} s each phase"
              f"{f', {args.rounds} rounds' if args.rounds > 1 else ''}"
              f"{f', pool and admin on CPUs {args.pool_cpus}, flood on {args.flood_cpus}' if pool_cpus else ''}")
        print(percentiles("idle admin calls", idle))
        print(percentiles("flood admin calls", loaded))
        ratio = p99(loaded) / p99(idle)
        rate = answered.value / ((args.seconds + 2) * args.rounds)
        print(f"   flood: {answered.value} flood calls answered ({rate:.0f}/s); pool CPU "
              f"{cpu_used / (args.seconds * args.rounds):.2f} cores while measuring; admin p99 flood/idle {ratio:.2f}x "
              f"(target <= 2x){'; per round ' + ', '.join(f'{r:.2f}x' for r in ratios) if args.rounds > 1 else ''}")
    finally:
        daemon.signal(signal.SIGCONT)
        cluster.stop_all()
        key.remove()


if __name__ == "__main__":
    main()
