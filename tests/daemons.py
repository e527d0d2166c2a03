"""Start real rgpu daemons (rgpu-poold, rgpu-dispatcher) as subprocesses on loopback ports.

Shared by the integration, Slurm and remoting tests. Daemons bind port 0 and report the port they
got through `--port-file` (no pick-a-free-port-then-start race). Every process started here is
killed at teardown, also when a test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rgpu.portfile import read_port_file
from rgpu.secret import create_secret, load_secret

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped: kill() returns before
    they are, and a loaded CI machine once saw a just-stopped pool answer the next call."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        try:
            states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for task in Path(f"/proc/{pid}/task").iterdir()]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return bool(states) and all(state in ("T", "t") for state in states)

    wait_for(all_stopped, timeout, f"process {pid} to stop on SIGSTOP")


def wait_for_port_file(path: Path, daemon: "Daemon", timeout: float = 30.0) -> int:
    """The port a daemon started with --port-file reports once it serves; fails with its log if it
    exits first."""
    wait_for(lambda: path.exists() or not daemon.alive, timeout=timeout, what=f"{daemon.name} to report its port")
    port = read_port_file(path)
    if port is None:
        raise AssertionError(f"{daemon.name} exited before serving:\n{daemon.log()}")
    return port


@dataclass
class Daemon:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    nofile: int | None = None     # RLIMIT_NOFILE for the daemon (front-door tests)
    ids: tuple[int, int] | None = None   # (uid, gid) to run as (a pool that is not root); None: ours

    def start(self) -> "Daemon":
        log = open(self.log_path, "ab")
        limit, ids = self.nofile, self.ids

        def before_exec() -> None:
            if limit is not None:
                import resource
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
            if ids is not None:
                os.setgroups([])
                os.setgid(ids[1])
                os.setuid(ids[0])
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True,
                                     preexec_fn=before_exec if limit is not None or ids is not None else None)
        log.close()
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class RgpuCluster:
    """A pool and its dispatchers in one temp dir, with a cluster secret.

    The pool's port is known once start_pool() returns; until then pool_address names a port
    held (bound, not listening) by this object, so a dispatcher started first finds no pool
    there, and no other program can be there either."""

    root: Path
    pool_port: int = 0
    daemons: list[Daemon] = field(default_factory=list)
    pool: Daemon | None = None

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.root / "secret"
        if not self.secret_file.exists():
            create_secret(self.secret_file)
        self.secret = load_secret(self.secret_file)
        self.state = self.root / "pool.db"
        self._no_pool: socket.socket | None = None
        if not self.pool_port:
            self._no_pool = socket.socket()
            self._no_pool.bind(("127.0.0.1", 0))
            self.pool_port = self._no_pool.getsockname()[1]
        self._dispatchers_started = 0

    @property
    def pool_address(self) -> str:
        return f"127.0.0.1:{self.pool_port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RGPU_", "BF_"))}
        env.update({"RGPU_SECRET_FILE": str(self.secret_file), "RGPU_POOL": self.pool_address,
                    "RGPU_CONFIG": str(self.root / "rgpu.toml"), "PYTHONUNBUFFERED": "1"})
        env.update(extra)
        return env

    def write_config(self, **values: object) -> None:
        import json
        def toml(v: object) -> str:   # JSON is TOML for strings, numbers, booleans and lists
            if isinstance(v, dict):
                return "{ " + ", ".join(f"{json.dumps(k)} = {toml(x)}" for k, x in v.items()) + " }"
            return json.dumps(v)

        lines = [f"{k} = {toml(v)}" for k, v in values.items()]
        (self.root / "rgpu.toml").write_text("\n".join(lines) + "\n")

    def start_pool(self, *extra_args: str, env: dict[str, str] | None = None, nofile: int | None = None,
                   ids: tuple[int, int] | None = None, python: str = sys.executable) -> Daemon:
        """Start rgpu-poold: on a port of its choosing the first time, on the same port again after
        a kill (dispatchers and clients keep their address); as (uid, gid) `ids` when given, with
        a `python` that uid can run (tests/user_runtime.py)."""
        if not (self.root / "rgpu.toml").exists():
            self.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=0.5,
                              reclaim_interval_seconds=0.5)
        first = self._no_pool is not None
        if self._no_pool is not None:
            self._no_pool.close()
            self._no_pool = None
        port_file = self.root / "poold.port"
        port_file.unlink(missing_ok=True)
        listen = "127.0.0.1:0" if first else self.pool_address
        daemon = Daemon("rgpu-poold", [python, "-m", "rgpu.remoting.pool.daemon", "--listen", listen,
                                       "--state", str(self.state), "--port-file", str(port_file), *extra_args],
                        self.root / "poold.log", env or self.env(), nofile=nofile, ids=ids).start()
        self.pool = daemon
        self.daemons.append(daemon)
        self.pool_port = wait_for_port_file(port_file, daemon)
        return daemon

    def start_dispatcher(self, inventory: Path | str | None, port: int | None = None, *extra_args: str,
                         env: dict[str, str] | None = None, nofile: int | None = None) -> tuple[Daemon, int]:
        """Start rgpu-dispatcher on `port` (default: one it picks) once it serves; return it and its port.
        inventory None: the GPUs NVML finds (a GPU machine)."""
        self._dispatchers_started += 1
        n = self._dispatchers_started
        port_file = self.root / f"dispatcher-{n}.port"
        port_file.unlink(missing_ok=True)
        daemon = Daemon(f"rgpu-dispatcher-{n}",
                        [sys.executable, "-m", "rgpu.remoting.dispatcher.daemon", "-p", str(port or 0), "--host", "127.0.0.1",
                         "--advertise", "127.0.0.1", "--pool", self.pool_address,
                         *(["--inventory", str(inventory)] if inventory is not None else []),
                         "--port-file", str(port_file), *extra_args],
                        self.root / f"dispatcher-{n}.log", env or self.env(), nofile=nofile).start()
        self.daemons.append(daemon)
        return daemon, wait_for_port_file(port_file, daemon)

    def client(self):  # type: ignore[no-untyped-def]
        from rgpu.remoting.pool.client import PoolClient
        return PoolClient(self.pool_address, self.secret, timeout=5.0)

    def stop_all(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.kill()
        if self._no_pool is not None:
            self._no_pool.close()
            self._no_pool = None


@contextmanager
def one_dispatcher_cluster(root: Path, **config: object) -> Iterator[RgpuCluster]:
    """A pool and one emulated dispatcher (inventory-a) under `root`, the dispatcher up, with fast
    heartbeats and `config` added to rgpu.toml; stopped after."""
    cluster = RgpuCluster(root)
    cluster.write_config(down_after_seconds=5.0, heartbeat_interval_seconds=0.5, reclaim_interval_seconds=0.5,
                         **config)
    try:
        cluster.start_pool()
        cluster.start_dispatcher(EXAMPLES / "inventory-a.toml")
        with cluster.client() as client:
            wait_for(lambda: any(s.state == "up" for s in client.list_servers().servers), what="dispatcher up")
        yield cluster
    finally:
        cluster.stop_all()


def two_clusters(root: Path) -> tuple[RgpuCluster, RgpuCluster]:
    """Two daemons' folders, `root`/a and `root`/b, with one cluster secret (as on two pool hosts)."""
    first = RgpuCluster(root / "a")
    (root / "b").mkdir(parents=True, exist_ok=True)
    shutil.copy(first.secret_file, root / "b" / "secret")
    return first, RgpuCluster(root / "b")


def register_servers(client, servers: int = 2, gpus: int = 4) -> None:  # type: ignore[no-untyped-def]
    """Register `servers` fake dispatchers with `gpus` 80 GiB GPUs each, straight through the API."""
    from rgpu.model import GpuInfo, ServerInfo
    from rgpu.remoting.pool.convert import server_to_pb

    gib = 2**30
    for n in range(servers):
        client.register_server(server_to_pb(ServerInfo(
            address=f"127.0.0.1:{56000 + n}", hostname=f"gpu{n}", driver_version="580", cuda_version="13.0",
            gpus=tuple(GpuInfo(f"GPU-{n}-{i}", i, "NVIDIA H100", 80 * gib, 80 * gib, "9.0") for i in range(gpus)))))


@dataclass
class AllocationBurst:
    """Threads asking a pool for half-GPU leases at once, and what each ask got: acknowledged
    (the pool said yes), refused for capacity, or failed otherwise."""

    acknowledged: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ask(self, client, key: str, user: str) -> None:  # type: ignore[no-untyped-def]
        from rgpu.errors import CapacityError, RgpuError
        try:
            client.allocate(key, user, 1, percent=50)
        except CapacityError:
            outcome = self.refused
        except RgpuError as exc:
            outcome, key = self.failures, f"{key}: {exc}"
        else:
            outcome = self.acknowledged
        with self.lock:
            outcome.append(key)

    def start(self, workers: int, body: Callable[[int], None]) -> list[threading.Thread]:
        threads = [threading.Thread(target=body, args=(n,)) for n in range(workers)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(self.acknowledged) >= workers, what="the burst to start")
        return threads


class HoldingSession:
    """A real data-path session on a slice (emulated GPU) that holds `size` bytes of it at `pointer`;
    close() ends it."""

    def __init__(self, server: str, token: str, size: int) -> None:
        from rgpu.remoting.datapath import protocol

        self.socket, _ = protocol.handshake(server, token)
        self.seq = 0
        self.ctx = 0
        self.call("cuInit", struct.pack("<I", 0))
        (self.ctx,) = struct.unpack_from("<Q", self.call("cuDevicePrimaryCtxRetain", struct.pack("<i", 0)))
        (self.pointer,) = struct.unpack_from("<Q", self.call("cuMemAlloc_v2", struct.pack("<QQQQI", size, 0, 0, 0, 0)))

    def send(self, name: str, payload: bytes) -> None:
        from rgpu.remoting.datapath import protocol
        from rgpu.remoting.native.generated import api_gen

        self.seq += 1
        self.socket.sendall(protocol.pack_frame(api_gen.OPCODES[name], payload, seq=self.seq, ctx=self.ctx))

    def call(self, name: str, payload: bytes) -> bytes:
        """A call that answers: its reply's data after the status, which must be success."""
        from rgpu.remoting.datapath import protocol

        self.send(name, payload)
        (_, op, _, _, _, _), reply = protocol.recv_frame(self.socket)
        assert op == protocol.OP_REPLY and struct.unpack_from("<i", reply)[0] == 0, (name, reply)
        return reply[4:]

    def work(self, size: int, times: int) -> None:
        """Keep the worker busy: `times` memsets of `size` bytes (pipelined), then a synchronize."""
        for _ in range(times):
            self.send("cuMemsetD8_v2", struct.pack("<QBQ", self.pointer, 7, size))
        self.call("cuCtxSynchronize", b"")

    def close(self) -> None:
        self.socket.close()
