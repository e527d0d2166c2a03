"""Real munged daemons for tests: private sockets, one key shared by all of a test's daemons (as on
a cluster, where every node's munged has the same key). Needs root (munged runs as `munge`)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.daemons import wait_for


def missing() -> str:
    """Why munged cannot run here ("" when it can)."""
    munged = shutil.which("munged") or "/usr/sbin/munged"
    if os.geteuid() != 0 or not os.path.exists(munged) or not shutil.which("munge"):
        return "needs root, munged and munge(1) (Debian: munge, libmunge2)"
    try:
        pwd.getpwnam("munge")
        pwd.getpwnam("nobody")
    except KeyError:
        return "needs the munge and nobody users"
    return ""


class MungeKey:
    """A folder with a MUNGE key, where the daemons of one test keep their sockets."""

    def __init__(self) -> None:
        owner = pwd.getpwnam("munge")
        self.root = Path(tempfile.mkdtemp(prefix="rgpu-munge-"))
        self.root.chmod(0o755)                      # users must reach the sockets
        self.key = self.root / "munge.key"
        self.key.write_bytes(os.urandom(1024))
        self.key.chmod(0o400)
        for path in (self.root, self.key):
            os.chown(path, owner.pw_uid, owner.pw_gid)
        self.daemons: list[Munged] = []

    def start(self, name: str = "munge") -> "Munged":
        daemon = Munged(self, name).start()
        self.daemons.append(daemon)
        return daemon

    def remove(self) -> None:
        for daemon in self.daemons:
            daemon.kill()
        shutil.rmtree(self.root, ignore_errors=True)


class Munged:
    def __init__(self, key: MungeKey, name: str) -> None:
        self.key, self.name = key, name
        self.socket = str(key.root / f"{name}.socket")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Munged":
        root = self.key.root
        munged = shutil.which("munged") or "/usr/sbin/munged"
        self.proc = subprocess.Popen(
            ["runuser", "-u", "munge", "--", munged, "--foreground", "--force", f"--socket={self.socket}",
             f"--key-file={self.key.key}", f"--pid-file={root / self.name}.pid",
             f"--log-file={root / self.name}.log", f"--seed-file={root / self.name}.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        proc = self.proc
        wait_for(lambda: os.path.exists(self.socket) or proc.poll() is not None, what="munged's socket")
        assert proc.poll() is None, "munged exited at start"
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """kill -9 (its socket file stays behind, as after a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait()


def pool_name(address: str) -> str:
    """The name the pool at `address` answers to (PoolName, open): what users' credentials carry."""
    import grpc

    from rgpu.proto import rgpu_pb2 as pb
    from rgpu.proto import rgpu_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.PoolStub(channel).PoolName(pb.PoolNameRequest(), timeout=10).name


def user_credential(socket: str, method: str, request: bytes = b"", pool: str = "", user: str = "nobody") -> str:
    """A MUNGE credential made by `user` (a separate uid, without the secret) with munge(1), for one
    call of `method` with the serialized `request` at the pool named `pool`, as rgpu's client makes it."""
    from rgpu import munge

    done = subprocess.run(["runuser", "-u", user, "--", "munge", "-S", socket, "-s",
                           munge.call_payload(method, pool, request)],
                          capture_output=True, text=True, timeout=10, check=True)
    return done.stdout.strip()
