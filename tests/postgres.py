"""A real PostgreSQL on loopback for tests: Debian's server binaries, a cluster initdb'd into a
temp dir, run as an unprivileged user when the tests run as root (PostgreSQL refuses root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from rgpu.slurm_plugin.localcluster import free_ports


def server_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class Postgres:
    def __init__(self) -> None:
        bindir = server_bin()
        if bindir is None:
            raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")
        self.bindir = bindir
        # Its own temp dir: pytest's are private to the user running the tests, and the server
        # runs as another one when that is root.
        self.root = Path(tempfile.mkdtemp(prefix="rgpu-pg-"))
        self.data = self.root / "pgdata"
        self.port, = free_ports(1)
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/rgpu"

    def _run(self, *argv: str) -> None:
        command = list(argv)
        if os.geteuid() == 0:
            command = ["runuser", "-u", self.user, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/")
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stdout}{result.stderr}")

    def start(self) -> "Postgres":
        if os.geteuid() == 0:
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, self.user)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", self.user, "--no-sync")
        self._start_server()
        self._run(str(self.bindir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "rgpu")
        return self

    def _start_server(self) -> None:
        # -l: the server's output goes to a file, never to the pipes this process reads
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-w",
                  "-o", f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off", "start")

    def restart(self) -> None:
        """An immediate stop (as a crash or a failover looks to clients), then start again."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self._start_server()

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except RuntimeError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
