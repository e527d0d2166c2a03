"""The one SSH adapter (paramiko): connect to a host with rgpu's SSH settings, run commands,
return their output. Host keys must be known: an unknown or changed key is refused."""

from __future__ import annotations

import getpass
import os
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from rgpu.errors import Unavailable

COMPONENT = "health"


@dataclass(frozen=True)
class SshTarget:
    host: str
    port: int = 22
    user: str = ""
    key_file: str = ""
    known_hosts_file: str = ""
    timeout: float = 15.0

    def describe(self) -> str:
        return f"{self.user or getpass.getuser()}@{self.host}:{self.port}"


@dataclass(frozen=True)
class RemoteResult:
    exit_status: int
    stdout: str
    stderr: str
    sent: float          # local time.time() when the command was sent
    received: float      # local time.time() when its output was complete


class SshSession:
    """One connection to one host; use as a context manager."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target
        self._client = paramiko.SSHClient()

    def __enter__(self) -> "SshSession":
        t = self.target
        known = Path(t.known_hosts_file or Path.home() / ".ssh" / "known_hosts").expanduser()
        try:
            if known.exists():
                self._client.load_host_keys(str(known))
            self._client.set_missing_host_key_policy(paramiko.RejectPolicy())
            self._client.connect(t.host, port=t.port, username=t.user or getpass.getuser(),
                                 key_filename=t.key_file or None, look_for_keys=not t.key_file,
                                 allow_agent=not t.key_file and bool(os.environ.get("SSH_AUTH_SOCK")),
                                 timeout=t.timeout, banner_timeout=t.timeout, auth_timeout=t.timeout)
        except paramiko.BadHostKeyException:
            self._client.close()
            raise Unavailable(COMPONENT, f"cannot log in to {t.describe()}", f"its host key differs from {known}",
                              "check the host; if it was reinstalled, replace its line in known_hosts") from None
        except paramiko.SSHException as exc:
            self._client.close()
            if "not found in known_hosts" in str(exc):
                raise Unavailable(COMPONENT, f"cannot log in to {t.describe()}", f"its host key is not in {known}",
                                  f"add it: ssh-keyscan -p {t.port} {t.host} >> {known} (after checking it), or set "
                                  "ssh_known_hosts_file") from None
            raise Unavailable(COMPONENT, f"cannot log in to {t.describe()}", str(exc),
                              "check ssh_user and ssh_key_file, and that the key is authorised there") from None
        except OSError as exc:
            self._client.close()
            raise Unavailable(COMPONENT, f"cannot reach {t.describe()} over SSH", exc.strerror or str(exc),
                              "check that sshd runs there and ssh_port") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def run(self, command: str, timeout: float = 120.0) -> RemoteResult:
        sent = time.time()
        try:
            _, stdout, stderr = self._client.exec_command(command, timeout=timeout)
            out = stdout.read().decode("utf-8", "replace")
            err = stderr.read().decode("utf-8", "replace")
            status = stdout.channel.recv_exit_status()
        except (paramiko.SSHException, OSError) as exc:
            raise Unavailable(COMPONENT, f"a command on {self.target.describe()} failed", str(exc) or type(exc).__name__,
                              "check the host's load and sshd") from None
        return RemoteResult(status, out, err, sent, time.time())
