"""Start real rgpu daemons (rgpu-poold, rgpu-dispatcher) as subprocesses on free loopback ports.

Shared by the integration, Slurm and remoting tests. Every process started here is killed at
teardown, also when a test fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rgpu.secret import create_secret, load_secret

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class Daemon:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Daemon":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
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
    """A pool and its dispatchers in one temp dir, with a cluster secret."""

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
        self.pool_port = self.pool_port or free_port()

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
        lines = [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        (self.root / "rgpu.toml").write_text("\n".join(lines) + "\n")

    def start_pool(self, *extra_args: str, env: dict[str, str] | None = None) -> Daemon:
        if not (self.root / "rgpu.toml").exists():
            self.write_config(down_after_seconds=3.0, heartbeat_interval_seconds=0.5,
                              reclaim_interval_seconds=0.5)
        daemon = Daemon("rgpu-poold", [sys.executable, "-m", "rgpu.remoting.pool.daemon", "--listen", self.pool_address,
                                       "--state", str(self.state), *extra_args],
                        self.root / "poold.log", env or self.env()).start()
        self.pool = daemon
        self.daemons.append(daemon)
        wait_for(lambda: port_open(self.pool_port) or not daemon.alive, what="rgpu-poold to listen")
        assert daemon.alive, f"rgpu-poold exited:\n{daemon.log()}"
        return daemon

    def start_dispatcher(self, inventory: Path | str, port: int | None = None, *extra_args: str,
                         env: dict[str, str] | None = None) -> tuple[Daemon, int]:
        port = port or free_port()
        daemon = Daemon(f"rgpu-dispatcher:{port}",
                        [sys.executable, "-m", "rgpu.remoting.dispatcher.daemon", "-p", str(port), "--host", "127.0.0.1",
                         "--advertise", "127.0.0.1", "--pool", self.pool_address, "--inventory", str(inventory),
                         *extra_args],
                        self.root / f"dispatcher-{port}.log", env or self.env()).start()
        self.daemons.append(daemon)
        return daemon, port

    def client(self):  # type: ignore[no-untyped-def]
        from rgpu.remoting.pool.client import PoolClient
        return PoolClient(self.pool_address, self.secret, timeout=5.0)

    def stop_all(self) -> None:
        for daemon in reversed(self.daemons):
            daemon.kill()
