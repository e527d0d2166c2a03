"""A real slurmdbd on loopback for tests: MariaDB installed into a temp dir (no grant tables,
loopback only), slurmdbd on it, and a slurm.conf that points sacctmgr at it. It authenticates
with a MUNGE daemon the caller runs (its socket). No slurmctld: sacctmgr talks to slurmdbd alone.

Debian packages: slurmdbd, mariadb-server (and munge, slurm-client)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rgpu.slurm_plugin.localcluster import free_ports

CLUSTER = "rgputest"


def missing() -> str | None:
    """Why this host cannot run it, or None."""
    if os.geteuid() != 0:
        return "slurmdbd's test instance needs root (slurmdbd.conf owned by SlurmUser=root)"
    gone = [b for b in ("mariadb-install-db", "mariadbd", "slurmdbd", "sacctmgr")
            if not shutil.which(b) and not Path("/usr/sbin", b).exists()]
    return f"not installed: {', '.join(gone)} (Debian: slurmdbd, mariadb-server, slurm-client)" if gone else None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmDbd:
    def __init__(self, munge_socket: str) -> None:
        self.munge_socket = munge_socket
        self.root = Path(tempfile.mkdtemp(prefix="rgpu-slurmdbd-"))
        self.root.chmod(0o755)                  # sacctmgr run as other users reads slurm.conf
        self.conf = self.root / "slurm.conf"
        self.db_port, self.dbd_port = free_ports(2)
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **self.env})
        self._procs.append(proc)
        return proc

    def _wait(self, what: str, proc: subprocess.Popen[bytes], ready: Callable[[], bool],
              timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                                 for p in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")))
                raise RuntimeError(f"{what} did not start (exit {proc.poll()}):\n{logs}")
            time.sleep(0.2)

    def start(self) -> "SlurmDbd":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        data = self.root / "db"
        subprocess.run([_binary("mariadb-install-db"), "--no-defaults", f"--datadir={data}", "--user=root",
                        "--auth-root-authentication-method=normal", "--skip-test-db"],
                       check=True, capture_output=True, timeout=120)
        db = self._spawn("mariadbd", [_binary("mariadbd"), "--no-defaults", f"--datadir={data}", "--user=root",
                                      f"--socket={self.root / 'mysql.sock'}", f"--port={self.db_port}",
                                      "--bind-address=127.0.0.1", "--skip-grant-tables", "--skip-name-resolve",
                                      "--innodb-buffer-pool-size=16M", f"--log-error={self.root / 'mariadbd.log'}",
                                      f"--pid-file={self.root / 'mariadbd.pid'}"])
        self._wait("mariadbd", db, lambda: _answers(self.db_port))
        dbd_conf = self.root / "slurmdbd.conf"
        dbd_conf.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.dbd_port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.db_port}
StorageUser=root
StorageLoc=slurm_acct_db
PidFile={self.root / 'slurmdbd.pid'}
LogFile={self.root / 'slurmdbd.log'}
""")
        dbd_conf.chmod(0o600)
        # sacctmgr reads this; slurmdbd reads slurmdbd.conf beside it. AccountingStoragePass names
        # the MUNGE socket for connections to slurmdbd.
        self.conf.write_text(f"""\
ClusterName={CLUSTER}
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.dbd_port}
AccountingStoragePass={self.munge_socket}
NodeName=c1 NodeHostname=localhost CPUs=1 State=UNKNOWN
PartitionName=cpu Nodes=c1 Default=YES
""")
        self.start_dbd()
        self.sacctmgr("add", "cluster", CLUSTER)

    def start_dbd(self) -> None:
        dbd = self._spawn("slurmdbd", [_binary("slurmdbd"), "-D"])
        self._dbd = dbd
        self._wait("slurmdbd", dbd, lambda: _answers(self.dbd_port))

    def stop_dbd(self) -> None:
        os.killpg(self._dbd.pid, signal.SIGKILL)
        self._dbd.wait()

    def sacctmgr(self, *args: str) -> str:
        done = subprocess.run(["sacctmgr", "--immediate", *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **self.env})
        if done.returncode != 0:
            raise RuntimeError(f"sacctmgr {' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
