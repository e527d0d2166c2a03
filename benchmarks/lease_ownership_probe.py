"""Can one user reach another's fresh lease when the pool runs several processes or daemons?
(issue 26, HIGH 1, re-measured). Two unprivileged users with MUNGE, as the tests run them: the
owner (`nobody`) leases a slice; 0-0.2 s after its reply the intruder (`daemon`) tries to renew it
for a year and to release it, in a random order, and reads it (GetLease, whose tokens must be
empty for anyone but the owner). Each call goes over a new connection, so with `--processes N`
the kernel hands it to any of the N processes (SO_REUSEPORT); with `--postgres` the owner calls
one daemon and the intruder the other. After each trial the admin checks that the lease is still
there, still the owner's, with its expiry unchanged.

    python benchmarks/lease_ownership_probe.py --processes 4 [--trials 1000]   # as root
    python benchmarks/lease_ownership_probe.py --postgres [--trials 1000]      # two rgpu-poold on one PostgreSQL

Prints per attempt kind how many were refused as they must be (PERMISSION_DENIED, or NOT_FOUND
while the serving process has not caught up), how many succeeded (a breach) and how many ended
otherwise; exits 1 on any breach. Target: no breach in 1,000 trials on either set-up.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pwd
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rgpu.errors import NotFound  # noqa: E402
from tests import munged  # noqa: E402
from tests.daemons import RgpuCluster, register_servers, two_clusters  # noqa: E402

OWNER, INTRUDER = "nobody", "daemon"
YEAR = 365 * 24 * 3600.0
TTL = 600.0
# What the intruder's renew and release must get (NotFound: the serving process has not caught up).
REFUSED = {"PermissionDenied", "NotFound"}


def _as_user(user: str, munge_socket: str, commands: Connection) -> None:
    """A client process running as `user` (no secret: its calls carry MUNGE credentials naming its
    uid). Each command is (operation, pool address, job key); each call opens a new connection.
    What it runs is loaded before it drops root: this Python may live under root's 0700 home."""
    import traceback  # noqa: F401  (multiprocessing's error path)

    from rgpu import munge
    from rgpu.errors import RgpuError
    from rgpu.remoting.pool.client import PoolClient

    munge._libmunge()
    entry = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)

    while True:
        command = commands.recv()
        if command is None:
            return
        operation, address, job_key = command
        try:
            with PoolClient(address, None, timeout=10.0, munge_socket=munge_socket) as client:
                if operation == "allocate":
                    lease = client.allocate(job_key, "", 1, percent=1, ttl_seconds=TTL)
                    commands.send(("ok", lease.expires_unix))
                elif operation == "renew":
                    commands.send(("ok", client.renew(job_key, YEAR).expires_unix))
                elif operation == "release":
                    commands.send(("ok" if client.release(job_key) else "not released", 0.0))
                elif operation == "get":
                    lease = client.get_lease(job_key)
                    commands.send(("ok" if any(s.token for s in lease.slices) else "no tokens", 0.0))
        except RgpuError as exc:
            commands.send((type(exc).__name__, str(exc)[:200]))


class UserProcess:
    def __init__(self, user: str, munge_socket: str) -> None:
        ours, theirs = mp.Pipe()
        self.pipe = ours
        self.proc = mp.get_context("spawn").Process(target=_as_user, args=(user, munge_socket, theirs), daemon=True)
        self.proc.start()

    def ask(self, operation: str, address: str, job_key: str) -> tuple[str, Any]:
        self.pipe.send((operation, address, job_key))
        return self.pipe.recv()   # type: ignore[no-any-return]

    def stop(self) -> None:
        try:
            self.pipe.send(None)
        except OSError:   # it died: its error is on stderr
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


@contextmanager
def pools(args: argparse.Namespace, munge_socket: str, root: Path) -> Iterator[tuple[RgpuCluster, str, str]]:
    """(the admin's cluster, the owner's pool address, the intruder's) for the set-up asked."""
    if not args.postgres:
        cluster = RgpuCluster(root / "pool")
        cluster.write_config(munge_socket=munge_socket, account_check="off", heartbeat_interval_seconds=5.0,
                             down_after_seconds=600.0)
        try:
            cluster.start_pool("--processes", str(args.processes))
            yield cluster, cluster.pool_address, cluster.pool_address
        finally:
            cluster.stop_all()
        return
    from tests.postgres import Postgres
    postgres = Postgres().start()
    first, second = two_clusters(root)   # one cluster secret
    try:
        for cluster in (first, second):
            cluster.write_config(store_url=postgres.url, munge_socket=munge_socket, account_check="off",
                                 heartbeat_interval_seconds=5.0, down_after_seconds=600.0)
            cluster.start_pool()
        yield first, first.pool_address, second.pool_address
    finally:
        first.stop_all()
        second.stop_all()
        postgres.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4, help="rgpu-poold --processes N on SQLite")
    parser.add_argument("--postgres", action="store_true", help="two rgpu-poold on one PostgreSQL instead")
    parser.add_argument("--seed", type=int, default=26)
    args = parser.parse_args()
    if munged.missing():
        sys.exit(f"lease_ownership_probe: {munged.missing()}")
    rng = random.Random(args.seed)
    key = munged.MungeKey()
    socket = key.start("pool").socket
    root = Path(tempfile.mkdtemp(prefix="rgpu-ownership-"))
    root.chmod(0o755)
    owner, intruder = UserProcess(OWNER, socket), UserProcess(INTRUDER, socket)
    outcomes: dict[str, Counter[str]] = {"renew": Counter(), "release": Counter(), "get": Counter(),
                                         "lease after the trial": Counter()}
    examples: list[str] = []
    delays: list[float] = []
    started = time.monotonic()
    try:
        with pools(args, socket, root) as (cluster, owner_address, intruder_address):
            with cluster.client() as admin:
                register_servers(admin, servers=2, gpus=4)
                for trial in range(args.trials):
                    job_key = f"probe-{trial}"
                    status, expires = owner.ask("allocate", owner_address, job_key)
                    if status != "ok":
                        sys.exit(f"lease_ownership_probe: the owner's Allocate failed: {status}: {expires}")
                    made = time.monotonic()
                    delay = rng.uniform(0.0, 0.2)
                    time.sleep(max(0.0, made + delay - time.monotonic()))
                    delays.append(time.monotonic() - made)
                    attempts = ["renew", "release"]
                    rng.shuffle(attempts)
                    for operation in (*attempts, "get"):
                        status, detail = intruder.ask(operation, intruder_address, job_key)
                        outcome = (f"refused ({status})" if status in REFUSED
                                   else "shown without tokens" if status == "no tokens"
                                   else "BREACH" if status == "ok" else f"other ({status})")
                        outcomes[operation][outcome] += 1
                        if (outcome == "BREACH" or outcome.startswith("other")) and len(examples) < 10:
                            examples.append(f"trial {trial} {operation}: {status}: {detail}")
                    try:
                        lease = admin.get_lease(job_key)
                    except NotFound:
                        outcomes["lease after the trial"]["BREACH (gone)"] += 1
                        continue
                    intact = lease.user == OWNER and abs(lease.expires_unix - expires) < 1.0
                    outcomes["lease after the trial"]["intact" if intact else "BREACH (changed)"] += 1
                    admin.release(job_key)
    finally:
        owner.stop()
        intruder.stop()
        key.remove()
        shutil.rmtree(root, ignore_errors=True)
    where = "two rgpu-poold on one PostgreSQL" if args.postgres else f"rgpu-poold --processes {args.processes} (SQLite)"
    delays.sort()
    print(f"lease_ownership_probe: {where}, {args.trials} trials in {time.monotonic() - started:.0f} s; "
          f"intruder's first attempt {delays[0]:.3f}-{delays[-1]:.3f} s after the owner's lease "
          f"(median {delays[len(delays) // 2]:.3f} s)")
    for operation, counts in outcomes.items():
        print(f"   {operation}: " + ", ".join(f"{what} {n}" for what, n in sorted(counts.items())))
    for line in examples:
        print(f"   e.g. {line}")
    breaches = sum(n for counts in outcomes.values() for what, n in counts.items() if what.startswith("BREACH"))
    print(f"   breaches: {breaches}")
    sys.exit(1 if breaches else 0)


if __name__ == "__main__":
    main()
