"""Pool allocation throughput: concurrent clients doing allocate + release against a real
rgpu-poold, for each pool size asked (default 64 x 8 and 1,250 x 8 GPUs, one after the other in
one run). Prints pairs per second and latency percentiles per size, and verifies that no GPU was
ever over-committed (sampled during the run and checked at the end).

    python benchmarks/pool_alloc.py [--servers 64,1250] [--gpus-per-server 8] [--clients 4] [--seconds 10] [--json]
    python benchmarks/pool_alloc.py --postgres [--pools 2]    # state in PostgreSQL, clients spread over the daemons
    python benchmarks/pool_alloc.py --grpc-floor              # the same clients against empty gRPC handlers
    taskset -c 2-9 python benchmarks/pool_alloc.py --pool-cpus 0,1   # the pool on 2 cores of its own
    python benchmarks/pool_alloc.py --pool-processes 2           # rgpu-poold --processes 2 (one SQLite file)

Targets on a 2-core machine: at 10,000 GPUs p99 within 2x of 64 x 8 in the same run; >= 2,000
pairs/s at 64 x 8 (see the README for the figures and the machine's load when measured).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rgpu.model import GpuInfo, ServerInfo  # noqa: E402
from rgpu.remoting.pool.convert import server_to_pb  # noqa: E402
from rgpu.remoting.pool.client import PoolClient  # noqa: E402
from tests.daemons import RgpuCluster  # noqa: E402
from tests.postgres import Postgres  # noqa: E402

GiB = 2**30
FLOOR_SECRET = b"s" * 32


def client_loop(address: str, secret: bytes, worker: int, seconds: float,
                out: "mp.Queue[tuple[list[float], float, float]]") -> None:
    rng = random.Random(worker)
    latencies: list[float] = []
    with PoolClient(address, secret, timeout=10) as client:
        client.capacity()  # connect before timing
        cpu = time.process_time()
        deadline = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < deadline:
            key = f"bench-{worker}-{i}"
            start = time.perf_counter()
            client.allocate(key, f"user{worker}", rng.choice([1, 1, 2, 4]), percent=rng.choice([25, 50, 100]))
            client.release(key)
            latencies.append(time.perf_counter() - start)
            i += 1
        loop_seconds = time.perf_counter() - (deadline - seconds)
        cpu = time.process_time() - cpu
    out.put((latencies, loop_seconds, cpu))


def _empty(request: bytes, context: object) -> bytes:
    return b""


async def _empty_async(request: bytes, context: object) -> bytes:
    return b""


def floor_server(kind: str, out: "mp.Queue[int]") -> None:
    """A gRPC server whose handler does nothing: what grpcio itself costs per call."""
    import asyncio

    import grpc
    from concurrent import futures

    handler = grpc.method_handlers_generic_handler("floor.Floor", {"Call": grpc.unary_unary_rpc_method_handler(
        _empty_async if kind == "aio" else _empty)})
    if kind == "aio":
        async def serve() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers([handler])
            out.put(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            await server.wait_for_termination()
        asyncio.run(serve())
        return
    from rgpu.remoting.pool.auth import ServerAuth
    from rgpu.remoting.pool.daemon import POOL_GRPC_WORKERS
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=POOL_GRPC_WORKERS),   # as the pool's, auth included
                         interceptors=[ServerAuth(FLOOR_SECRET)])
    server.add_generic_rpc_handlers([handler])
    out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def floor_client(port: int, secret: bytes, seconds: float, out: "mp.Queue[tuple[int, float]]") -> None:
    import grpc

    from rgpu.remoting.pool.auth import request_credential
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/floor.Floor/Call")
        call(b"", timeout=30, metadata=(("x-rgpu-auth", request_credential(secret, "/floor.Floor/Call")),))   # connect
        pairs, cpu, deadline = 0, time.process_time(), time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for _ in range(2):   # a pair is two calls, each with a credential like the pool client's
                call(b"x" * 64, timeout=10, metadata=(("x-rgpu-auth", request_credential(secret, "/floor.Floor/Call")),))
            pairs += 1
        out.put((pairs, time.process_time() - cpu))


def run_floor(kind: str, args: argparse.Namespace) -> dict[str, object]:
    """The benchmark's clients against empty handlers: the CPU per pair no pool can go below."""
    ctx = mp.get_context("spawn")
    ports: mp.Queue[int] = ctx.Queue()
    server = ctx.Process(target=floor_server, args=(kind, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        results: mp.Queue[tuple[int, float]] = ctx.Queue()
        clients = [ctx.Process(target=floor_client, args=(port, FLOOR_SECRET, args.seconds, results))
                   for _ in range(args.clients)]
        server_cpu = cpu_seconds(server.pid)  # type: ignore[arg-type]
        for c in clients:
            c.start()
        done = [results.get(timeout=args.seconds + 120) for _ in clients]
        server_cpu = cpu_seconds(server.pid) - server_cpu  # type: ignore[arg-type]
        for c in clients:
            c.join()
    finally:
        server.kill()
    pairs = sum(n for n, _ in done)
    load1, load5, _ = os.getloadavg()
    return {"grpc_floor": kind, "clients": args.clients, "pairs_per_second": round(pairs / args.seconds, 1),
            "server_cpu_ms_per_pair": round(1000 * server_cpu / pairs, 3),
            "client_cpu_ms_per_pair": round(1000 * sum(c for _, c in done) / pairs, 3),
            "cpus": os.cpu_count(), "load_average_1m_5m": [round(load1, 2), round(load5, 2)]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def check_no_overcommit(client: PoolClient) -> int:
    gpus = client.list_gpus()
    bad = [g for g in gpus if g.allocated_percent > 100 or g.allocated_memory_bytes > g.gpu.usable_memory_bytes]
    if bad:
        raise SystemExit(f"OVER-COMMIT on {len(bad)} GPU(s): {bad[0]}")
    return len(gpus)


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in os.listdir(f"/proc/{current}/task"):
            try:
                todo.extend(int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split())
            except OSError:
                continue
    return found


def run_one(servers: int, gpus_per_server: int, args: argparse.Namespace) -> dict[str, object]:
    """One pool of servers x gpus_per_server GPUs: fill it, run the clients, check, measure."""
    with tempfile.TemporaryDirectory(prefix="rgpu-bench-") as tmp:
        cluster = RgpuCluster(Path(tmp) / "pool0")
        clusters = [cluster]
        for n in range(1, args.pools):   # more daemons on the same PostgreSQL, one cluster secret
            (Path(tmp) / f"pool{n}").mkdir()
            shutil.copy(cluster.secret_file, Path(tmp) / f"pool{n}" / "secret")
            clusters.append(RgpuCluster(Path(tmp) / f"pool{n}"))
        postgres = Postgres().start() if args.postgres else None
        try:
            for each in clusters:
                each.write_config(down_after_seconds=600.0, heartbeat_interval_seconds=60.0, log_level="warning",
                                  **({"store_url": postgres.url} if postgres else {}))
                each.start_pool(*(("--processes", str(args.pool_processes)) if args.pool_processes > 1 else ()))
            with cluster.client() as client:
                for n in range(servers):
                    client.register_server(server_to_pb(ServerInfo(
                        address=f"10.1.{n // 250}.{n % 250 + 1}:55001", hostname=f"gpu{n:04d}", driver_version="580",
                        cuda_version="13.0", gpus=tuple(GpuInfo(f"GPU-{n:04d}-{i}", i, "NVIDIA H100 80GB HBM3",
                                                                80 * GiB, 80 * GiB, "9.0")
                                                        for i in range(gpus_per_server)))))
                for i in range(args.prefill):
                    client.allocate(f"prefill-{i}", "prefill", 1, percent=50)

                samples = 0
                stop = threading.Event()

                def sampler() -> None:
                    nonlocal samples
                    with cluster.client() as c:
                        while not stop.wait(0.5):
                            check_no_overcommit(c)
                            samples += 1

                # spawn, not fork: gRPC's threads do not survive fork() in a process that has channels.
                ctx = mp.get_context("spawn")
                queue: mp.Queue[tuple[list[float], float, float]] = ctx.Queue()
                procs = [ctx.Process(target=client_loop, args=(clusters[w % len(clusters)].pool_address, cluster.secret,
                                                              w, args.seconds, queue)) for w in range(args.clients)]
                checker = threading.Thread(target=sampler, daemon=True)
                pids = [pid for each in clusters if each.pool is not None and each.pool.proc
                        for pid in process_tree(each.pool.proc.pid)]   # with --pool-processes: its children too
                for pid in pids if args.pool_cpus else ():
                    os.sched_setaffinity(pid, args.pool_cpus)   # its threads, started already, follow below
                    for task in os.listdir(f"/proc/{pid}/task"):
                        os.sched_setaffinity(int(task), args.pool_cpus)
                cpu_before = {pid: cpu_seconds(pid) for pid in pids}
                pool_cpu = sum(cpu_before.values())
                start = time.perf_counter()
                for p in procs:
                    p.start()
                checker.start()
                latencies: list[float] = []
                rate = 0.0  # sum of the clients' rates over their own timed loops (excludes start-up)
                client_cpu = 0.0   # the client processes' CPU over their timed loops
                for _ in procs:
                    try:
                        client_latencies, loop_seconds, cpu = queue.get(timeout=args.seconds + 120)
                    except Exception:
                        raise SystemExit("a benchmark client died; see its traceback above") from None
                    latencies.extend(client_latencies)
                    rate += len(client_latencies) / loop_seconds
                    client_cpu += cpu
                for p in procs:
                    p.join()
                elapsed = time.perf_counter() - start
                cpu_by_process = [cpu_seconds(pid) - cpu_before[pid] for pid in pids]
                pool_cpu = sum(cpu_by_process)
                stop.set()
                checker.join()
                gpus = check_no_overcommit(client)
                leftover = [lease.job_key for lease in client.list_leases() if lease.job_key.startswith("bench-")]
                if leftover:
                    raise SystemExit(f"{len(leftover)} benchmark lease(s) left behind")
        finally:
            for each in clusters:
                each.stop_all()
            if postgres is not None:
                postgres.stop()

    latencies.sort()
    load1, load5, _ = os.getloadavg()
    return {
        "store": "postgresql" if args.postgres else "sqlite", "pool_daemons": args.pools, "pool_processes": args.pool_processes, "servers": servers, "gpus_per_server": gpus_per_server, "gpus": gpus, "clients": args.clients, "pool_cpus": sorted(args.pool_cpus) if args.pool_cpus else None,
        "prefill_leases": args.prefill, "pairs": len(latencies), "seconds": round(elapsed, 2),
        "pairs_per_second": round(rate, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 2),
        "p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 2),
        "max_ms": round(1000 * latencies[-1], 2),
        # the pool daemons' CPU per pair, all of them (the over-commit samples included)
        "pool_cpu_ms_per_pair": round(1000 * pool_cpu / len(latencies), 3),
        "pool_cpu_seconds_by_process": [round(c, 2) for c in cpu_by_process],
        # the benchmark's own clients, on the same cores: what they take is not the pool's to use
        "client_cpu_ms_per_pair": round(1000 * client_cpu / len(latencies), 3),
        "overcommit_samples_checked": samples + 1, "overcommit": False, "cpus": os.cpu_count(),
        "load_average_1m_5m": [round(load1, 2), round(load5, 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="64,1250", help="pool sizes in servers, comma-separated (default 64,1250)")
    parser.add_argument("--gpus-per-server", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--prefill", type=int, default=256, help="leases of half a GPU held during the run")
    parser.add_argument("--postgres", action="store_true",
                        help="keep the pool's state in a PostgreSQL started for the run (Debian's postgresql package)")
    parser.add_argument("--pools", type=int, default=1,
                        help="pool daemons on the one PostgreSQL (with --postgres); client N talks to daemon N mod pools")
    parser.add_argument("--grpc-floor", action="store_true",
                        help="instead of a pool, empty gRPC handlers (threaded server as the pool's, with its auth "
                             "interceptor, then grpc.aio without one): "
                             "what grpcio alone costs per pair with these clients on this machine")
    parser.add_argument("--pool-processes", type=int, default=1,
                        help="rgpu-poold --processes N: N pool processes on one port and one SQLite file")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--pool-cpus", type=lambda v: {int(c) for c in v.split(",")}, default=None,
                        help="pin the pool daemon(s) to these CPUs, e.g. 0,1 (run the benchmark itself under "
                             "`taskset -c 2-9` to keep the clients off them): the pool's own rate on 2 cores")
    args = parser.parse_args()
    if args.grpc_floor:
        floors = [run_floor(kind, args) for kind in ("threaded", "aio")]
        if not args.json:
            for f in floors:
                print(f"grpc floor ({f['grpc_floor']} server, empty handler, {f['clients']} client processes, load "
                      f"{f['load_average_1m_5m']}): {f['pairs_per_second']} pairs/s; CPU per pair: server "
                      f"{f['server_cpu_ms_per_pair']} ms, clients {f['client_cpu_ms_per_pair']} ms")
        print(json.dumps(floors))
        return
    if args.pool_processes > 1 and args.postgres:
        parser.error("--pool-processes is for the SQLite store (with --postgres, start several daemons: --pools)")
    if args.pools < 1 or (args.pools > 1 and not args.postgres):
        parser.error("--pools above 1 needs --postgres (several daemons share their state through PostgreSQL)")
    sizes = [int(n) for n in args.servers.split(",") if n.strip()]

    results = []
    for servers in sizes:
        result = run_one(servers, args.gpus_per_server, args)
        results.append(result)
        if not args.json:
            print(f"pool_alloc ({result['store']}, {args.pools} pool daemon(s) of {args.pool_processes} process(es)): {servers} servers x {args.gpus_per_server} GPUs, {args.clients} client processes, "
                  f"{args.prefill} leases held, load average {result['load_average_1m_5m']} on {result['cpus']} CPUs")
            print(f"  {result['pairs']} allocate+release pairs in {args.seconds:g} s per client = "
                  f"{result['pairs_per_second']} pairs/s")
            print(f"  pair latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms; "
                  f"CPU per pair: pool daemon {result['pool_cpu_ms_per_pair']} ms, "
                  f"clients {result['client_cpu_ms_per_pair']} ms")
            print(f"  over-commit: none ({result['overcommit_samples_checked']} samples of all GPUs checked)")
    if len(results) > 1 and not args.json:
        base = results[0]
        for other in results[1:]:
            print(f"p99 at {other['gpus']} GPUs / p99 at {base['gpus']} GPUs = "
                  f"{float(other['p99_ms']) / float(base['p99_ms']):.2f}x")  # type: ignore[arg-type]
    print(json.dumps(results if len(results) > 1 else results[0]))


if __name__ == "__main__":
    main()
