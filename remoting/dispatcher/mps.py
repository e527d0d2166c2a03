"""Supervision of the NVIDIA MPS control daemon that enforces compute shares.

Each worker is an MPS client with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set to its slice's compute
percent, so a 50% slice can occupy at most half of the GPU's SMs. The daemon runs with private
pipe and log folders (nothing else on the node shares it) and the dispatcher's GPUs only. A
supervisor thread checks it answers and restarts it when it died. Without the binary, or when it
will not start, sessions still run, with plain time-slicing, and status() says why.

Caveat (NVIDIA's, not ours): under MPS a fatal GPU fault in one client can end the other clients
on that GPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
CHECK_INTERVAL_S = 5.0
MAX_RESTARTS = 5


class MpsDaemon:
    def __init__(self, gpu_uuids: list[str], base_dir: Path, log: logging.Logger, binary: str | None = None) -> None:
        self.gpu_uuids = gpu_uuids
        self.pipe_dir = base_dir / "pipe"
        self.log_dir = base_dir / "log"
        self.log = log
        self.binary = binary or os.environ.get("RGPU_MPS_CONTROL") or shutil.which(CONTROL)
        self.running = False
        self.reason = "not started"
        self.restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def enforcement(self) -> str:
        return "mps" if self.running else "time-slicing"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_uuids)
        return env

    def control(self, command: str, timeout: float = 10.0) -> tuple[int, str]:
        if not self.binary:
            return 127, "no control binary"
        try:
            done = subprocess.run([self.binary], input=command + "\n", capture_output=True, text=True,
                                  env=self._env(), timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return 1, str(exc)
        return done.returncode, (done.stdout + done.stderr).strip()

    def _launch(self) -> bool:
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        assert self.binary is not None
        try:
            done = subprocess.run([self.binary, "-d"], capture_output=True, text=True, env=self._env(), timeout=15, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.reason = f"{self.binary} -d failed: {exc}"
            return False
        if done.returncode != 0:
            self.reason = f"{self.binary} -d exited {done.returncode}: {(done.stdout + done.stderr).strip()[:300]}"
            return False
        for _ in range(50):  # the daemon forks; its pipe appears shortly
            rc, _ = self.control("get_server_list", timeout=5)
            if rc == 0:
                return True
            time.sleep(0.1)
        self.reason = "the MPS control daemon started but does not answer"
        return False

    def start(self) -> None:
        if not self.binary:
            self.disable(f"{CONTROL} not found on PATH")
            return
        if self._launch():
            self.running = True
            self.reason = ""
            self.log.info("MPS control daemon running (pipe %s)", self.pipe_dir)
            self._thread = threading.Thread(target=self._supervise, name="rgpu-mps", daemon=True)
            self._thread.start()
        else:
            self.log.warning("MPS unavailable, compute shares fall back to time-slicing: %s", self.reason)

    def disable(self, reason: str) -> None:
        self.running = False
        self.reason = reason

    def _supervise(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            rc, out = self.control("get_server_list", timeout=5)
            if rc == 0:
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self.log.warning("MPS control daemon stopped answering (%s); restarting it", out[:200])
                if self.restarts >= MAX_RESTARTS:
                    self.running = False
                    self.reason = f"MPS control daemon failed {self.restarts} times; time-slicing from now on"
                    self.log.error(self.reason)
                    return
                self.restarts += 1
                if not self._launch():
                    self.running = False
                    self.log.error("MPS restart failed: %s", self.reason)
                    return

    def server_log(self, limit: int = 64 << 10) -> str:
        """The tail of the MPS server's log (it names clients that hit fatal faults, where it does)."""
        path = self.log_dir / "server.log"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - limit))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def server_pids(self) -> list[str]:
        rc, out = self.control("get_server_list", timeout=5)
        return [word for word in out.split() if word.isdigit()] if rc == 0 else []

    def terminate_client(self, client_pid: int) -> None:
        """Stop a client's outstanding GPU work (its kernel may run for ever), before it is killed."""
        if not self.running:
            return
        for server in self.server_pids():
            rc, out = self.control(f"terminate_client {server} {client_pid}", timeout=5)
            if rc != 0:
                self.log.debug("MPS terminate_client %s %d: %s", server, client_pid, out[:200])

    def recover(self, reason: str) -> bool:
        """After a fatal fault whose clients have all gone: the MPS server of the GPU is replaced with
        the next client; make sure the control daemon answers, restarting it when it does not."""
        with self._lock:
            if not self.running:
                return False
            rc, out = self.control("get_server_list", timeout=5)
            if rc == 0:
                return True
            self.log.warning("MPS control daemon does not answer after %s (%s); restarting it", reason, out[:200])
            self.control("quit", timeout=5)
            self.restarts += 1
            if not self._launch():
                self.running = False
                self.log.error("MPS restart failed: %s", self.reason)
                return False
            return True

    def client_env(self, compute_percent: int) -> dict[str, str]:
        """The environment that makes a worker an MPS client held to its share."""
        if not self.running:
            return {}
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, min(100, compute_percent)))}

    def status(self) -> dict:
        out = {"running": self.running, "reason": self.reason, "restarts": self.restarts,
               "pipe_directory": str(self.pipe_dir) if self.running else ""}
        if self.running:
            rc, servers = self.control("get_server_list", timeout=5)
            out["servers"] = servers.split() if rc == 0 else []
        return out

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self.running:
                rc, out = self.control("quit", timeout=10)
                if rc != 0:
                    self.log.warning("MPS quit failed: %s", out[:200])
                self.running = False
                self.reason = "stopped"
        if self._thread:
            self._thread.join(timeout=2)
