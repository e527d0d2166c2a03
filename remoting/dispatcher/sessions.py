"""The session server: accepts data-path sessions on the dispatcher's port and runs one worker each.

The dispatcher binds its TCP port (the `server` of adaptor.conf) and hands the listening socket
here. For each connection the acceptor reads HELLO, checks the protocol version (refusing a
mismatch with a message naming both versions) and the lease token (offline, with the cluster
secret: signature, expiry, this dispatcher, one of its GPUs), then starts
`python -m rgpu.remoting.datapath.worker` with the accepted socket inherited as a file descriptor.

Data path choice: fd inheritance, not a redirect to a second port. The client keeps the one
connection it opened, so nothing but the dispatcher's port must be open in firewalls, and no port
can be taken by another session in between. `port_range` is the data ports clients connect to:
the RGPU_SERVER_PORT_MIN/MAX range the dispatcher's port was bound in, or that one port.

Compute shares: with the "cuda" backend the server starts and supervises an MPS control daemon
for its GPUs (mps.py) and gives each worker CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = the slice's
compute percent; without MPS it falls back to time-slicing and says so in status().

The server is one class made of parts, one module each: session_state.py (its state, starting
and stopping a worker), front_door.py and session_accept.py (connections up to the worker),
session_faults.py (GPU faults), session_usage.py (metrics and usage); here the lifecycle, the
status and the reaping of ended workers.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.worker.faults import RELEASED, VERDICTS
from rgpu.remoting.dispatcher.session_accept import SessionAccepting
from rgpu.remoting.dispatcher.session_faults import SessionFaults
from rgpu.remoting.dispatcher.session_state import KILL_GRACE_S
from rgpu.remoting.dispatcher.session_usage import SessionUsage

from rgpu.live_leases import LiveLeases


class SessionServer(SessionAccepting, SessionFaults, SessionUsage):
    """The session server: its parts, started and stopped together."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.backend == "cuda":
            if self.mps.gpu_uuids:
                self.mps.start()
            else:
                self.mps.disable("no GPU of this dispatcher is shared by MPS (gpu_sharing)")
            self._find_launch_library()
        else:
            self.mps.disable("the emulated backend has no GPU to share")
            self.launch_path = "none (the emulated device runs no kernels)"
        self._find_ucx_library()
        self.listen_socket.settimeout(0.5)  # lets the accept loop notice stop()
        for target, name in ((self._accept_loop, "rgpu-sessions-accept"), (self._reap_loop, "rgpu-sessions-reap")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.log.info("session server on %s (%s backend, compute shares by %s)", self.advertised, self.backend,
                      self.enforcement)

    def update_live(self, live: LiveLeases) -> None:
        """Take the pool's list of live slices (every heartbeat) and end the sessions of leases
        that were released or reclaimed: their GPU share may already belong to another job."""
        with self._lock:
            self._live = live
            gone = [rec for rec in self._sessions.values() if not rec.ended_by
                    and live.revoked(rec.job_key, rec.slice_number, rec.lease_issued_unix)]
            for rec in gone:
                rec.ended_by = "its lease was released or reclaimed by the pool"
        for rec in gone:
            self.log.warning("ending session %d (job %s slice %d): %s", rec.pid, rec.job_key, rec.slice_number,
                             rec.ended_by)
            self._stop_worker(rec)
        self.forget_slices(live)

    def _find_launch_library(self) -> None:
        """Build (once, cached) the workers' native launch loop; without a C compiler the
        workers run launches in Python, which works but caps the launch rate."""
        from rgpu.errors import ConfigError
        from rgpu.remoting.native.build import ensure_built
        try:
            self.launch_library = str(ensure_built().libworker)
            self.launch_path = "native"
        except (ConfigError, OSError) as exc:
            self.launch_path = f"python ({exc})"
            self.log.warning("workers run kernel launches in Python, at a lower launch rate: %s", exc)

    def _find_ucx_library(self) -> None:
        """The workers drive UCX with librgpu-worker.so's ucx_link.c (loaded only when a client offers it)."""
        if self.transport == "tcp":
            self.log.info("transport: tcp (the transport setting): copies go over each session's TCP stream")
            return
        if self.launch_library:
            self.ucx_library = self.launch_library
        else:
            from rgpu.errors import ConfigError
            from rgpu.remoting.native.build import ensure_built
            try:
                self.ucx_library = str(ensure_built().libworker)
            except (ConfigError, OSError) as exc:
                self.log.warning("transport: tcp (no librgpu-worker.so to drive UCX with: %s)", exc)
                return
        self.log.info("transport: %s (copies of 1 MiB and more go over UCX with clients that offer it; "
                      "each session's log says which it uses)", self.transport)

    def stop(self) -> None:
        self._stopping.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            records = list(self._sessions.values())
        for rec in records:
            if rec.popen.poll() is None:
                rec.popen.terminate()
        deadline = time.monotonic() + 5
        for rec in records:
            try:
                rec.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rec.popen.kill()
                rec.popen.wait()
        self._spawner.shutdown(wait=False)
        self.mps.stop()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def status(self) -> dict:
        with self._lock:
            sessions = [r.public() for r in self._sessions.values()]
            ended = list(self._ended[-20:])
        return {
            "compute_enforcement": self.enforcement,
            "gpu_sharing": {uuid: g.sharing for uuid, g in self.gpus.items()},
            "mps": self.mps.status(),
            "launch_path": self.launch_path,
            "backend": self.backend,
            "protocol_version": protocol.PROTOCOL_VERSION,
            "address": self.advertised,
            "data_path": "accepted connection inherited by one worker process per session",
            "data_ports": f"{self.port_range[0]}-{self.port_range[1]}",
            "sessions": sessions,
            "recently_ended": ended,
            "faults": self.faults(),
            "accepted": self._accepted,
            "refused": self._refused,
            "front_door": {"hello_deadline_seconds": self.front_door.hello_deadline_s,
                           "max_handshakes": self.max_handshakes, "per_address": self.front_door.per_address,
                           "in_progress": len(self._pending), "dropped": dict(self._dropped)},
            "caps": {"sessions_max": self.caps.sessions_max, "live": self._ledger.total,
                     "perf_live": self._ledger.perf, "refused": dict(self._ledger.refused)},
        }

    # ------------------------------------------------------------------ reaping

    def _reap_loop(self) -> None:
        while not self._stopping.wait(0.2):
            try:
                self._check_faults()
            except Exception:  # noqa: BLE001 - fault handling must never stop the reaping
                self.log.exception("checking GPU fault reports failed")
            now = time.monotonic()
            released = self._released_pids()   # tombstones: they hold no GPU, they only answer the client
            with self._lock:
                overdue = [rec for rec in self._sessions.values()
                           if rec.kill_at and now >= rec.kill_at and rec.popen.poll() is None
                           and not (rec.ended_by.startswith("a GPU fault") and rec.pid in released)]
                for rec in overdue:
                    rec.kill_at = 0.0
            for rec in overdue:
                self.log.warning("session %d (job %s slice %d) did not end on SIGTERM within %g s: killing it",
                                 rec.pid, rec.job_key, rec.slice_number, KILL_GRACE_S)
                try:
                    rec.popen.kill()
                except OSError:
                    pass
            with self._lock:
                done = [(pid, rec) for pid, rec in self._sessions.items() if rec.popen.poll() is not None]
                for pid, rec in done:
                    del self._sessions[pid]
                    self._collect_traffic(rec)
                    if rec.admission is not None:
                        self._ledger.release(rec.admission)
            for pid, rec in done:
                for sub in (VERDICTS, RELEASED):
                    (self.faults_dir / sub / str(pid)).unlink(missing_ok=True)
                self._fault_handled.discard(pid)
                code = rec.popen.returncode
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                if rec.ended_by:
                    how = f"{how}; ended by the dispatcher: {rec.ended_by}"
                entry = {**rec.public(), "ended_unix": time.time(), "how": how}
                with self._lock:
                    self._ended.append(entry)
                    del self._ended[:-100]
                (self.log.info if code == 0 else self.log.warning)(
                    "session %d (job %s slice %d) ended: %s", pid, rec.job_key, rec.slice_number, how)
