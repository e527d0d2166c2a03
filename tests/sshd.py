"""A real OpenSSH server on 127.0.0.1 for tests: generated host and user keys, an unprivileged
port, a known_hosts file naming exactly that host key. Skips where sshd is not installed
(Debian: openssh-server, listed in .ci/debian-packages.txt)."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rgpu.slurm_plugin.localcluster import free_ports

SSHD = Path("/usr/sbin/sshd")


@dataclass
class Sshd:
    port: int
    user: str
    key_file: Path
    known_hosts: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rgpu-test", "-f", str(path)], check=True)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def start_sshd(root: Path) -> Sshd:
    if not SSHD.exists() or shutil.which("ssh-keygen") is None:
        pytest.skip("needs OpenSSH's sshd and ssh-keygen (apt-get install openssh-server)")
    root.mkdir(parents=True, exist_ok=True)
    host_key, user_key = root / "host_ed25519", root / "user_ed25519"
    _keygen(host_key)
    _keygen(user_key)
    authorized = root / "authorized_keys"
    authorized.write_text(Path(f"{user_key}.pub").read_text())
    os.chmod(authorized, 0o600)
    user = getpass.getuser()
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)   # sshd's privilege-separation folder
    log = root / "sshd.log"
    # sshd cannot report a port it picked: retry on the rare clash with another program.
    for _ in range(5):
        port, = free_ports(1)
        config = root / "sshd_config"
        config.write_text("\n".join([
            "ListenAddress 127.0.0.1", f"Port {port}", f"HostKey {host_key}", f"AuthorizedKeysFile {authorized}",
            f"PidFile {root / 'sshd.pid'}", "StrictModes no", "UsePAM no", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PubkeyAuthentication yes", "PermitRootLogin prohibit-password",
            f"AllowUsers {user}", "LogLevel VERBOSE", ""]))
        proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)], stdout=open(log, "ab"),
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None and not _listening(port):
            time.sleep(0.05)
        if proc.poll() is None and _listening(port):
            known = root / "known_hosts"
            kind, blob = Path(f"{host_key}.pub").read_text().split()[:2]
            known.write_text(f"[127.0.0.1]:{port} {kind} {blob}\n")
            return Sshd(port, user, user_key, known, proc, log)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    raise AssertionError(f"sshd did not start:\n{log.read_text(errors='replace')}")
