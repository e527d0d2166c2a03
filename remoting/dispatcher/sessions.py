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
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rgpu.log_limit import LogLimit, held_note
from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.backends.base import slice_usage
from rgpu.remoting.datapath.counters import FIELDS as TRAFFIC_FIELDS
from rgpu.remoting.datapath.counters import counters_path, read_counters
from rgpu.remoting.datapath.perf import serve_perf
from rgpu.remoting.datapath.transport import parse_peer_address, parse_transport
from rgpu.remoting.datapath.usage import read_slice_stats
from rgpu.remoting.datapath.worker.faults import EMULATED_MPS_FAULT, EMULATED_MPS_LOG, RELEASED, REPORTS, VERDICTS
from rgpu.remoting.dispatcher.admission import Admission, SessionCaps, SessionLedger
from rgpu.remoting.dispatcher.lanes import LaneBook, parse_lane_offer, parse_lane_request
from rgpu.remoting.dispatcher.faults import SETTLE_S, FaultEvent, FaultReport, GpuView, SessionView, decide
from rgpu.remoting.dispatcher.mps import MpsDaemon
from rgpu.remoting.dispatcher.sharing import enforcement

from rgpu import tokens
from rgpu.errors import AuthError
from rgpu.live_leases import LiveLeases
from rgpu.model import GpuInfo


@dataclass
class SessionRecord:
    pid: int
    job_key: str
    slice_number: int
    gpu_uuid: str
    mode: str
    client: str
    memory_limit_bytes: int
    compute_percent: int
    started_unix: float
    lease_issued_unix: float
    popen: subprocess.Popen = field(repr=False, compare=False)
    ended_by: str = ""            # why the dispatcher ended it, if it did
    kill_at: float = 0.0          # monotonic time after which a worker the dispatcher ended gets SIGKILL
    sharing: str = "mps"
    admission: Admission | None = field(default=None, repr=False, compare=False)

    def public(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__
                if name not in ("popen", "kill_at", "admission")}


def worker_environment(base: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    """The dispatcher's environment minus anything that would make a worker load rgpu's own
    client library instead of NVIDIA's driver (a dispatcher started from a flexrun shell)."""
    env = dict(base)
    if env.get("RGPU_WORKER_ALLOW_RGPU_LIBCUDA") == "1":
        return env  # tests chain a worker to another session server on purpose
    env.pop("RGPU_SLICES", None)
    if env.get("LD_LIBRARY_PATH"):
        kept = [p for p in env["LD_LIBRARY_PATH"].split(os.pathsep)
                if p and not os.path.exists(os.path.join(p, "rgpu-native.stamp"))]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    if env.get("LD_PRELOAD"):   # flexrun preloads rgpu's libnccl.so.2; the worker loads NVIDIA's
        env["LD_PRELOAD"] = " ".join(p for p in env["LD_PRELOAD"].replace(":", " ").split()
                                     if not os.path.exists(os.path.join(os.path.dirname(p), "rgpu-native.stamp")))
    return env


@dataclass(frozen=True)
class FrontDoor:
    """Limits on connections that have not yet sent their HELLO (config keys session_*)."""
    hello_deadline_s: float = 10.0     # counted from the accept, never reset by a byte
    max_handshakes: int = 256          # in progress at once, all sources
    per_address: int = 16              # in progress at once from one source address
    evict_after_s: float = 1.0         # when full, a handshake older than this gives way to a new one
    first_byte_s: float = 3.0          # a connection that has sent nothing this long is closed

    def first_byte_deadline_s(self) -> float:
        return min(self.first_byte_s, self.hello_deadline_s)

    def capped_by_open_files(self) -> int:
        """max_handshakes, lowered so that handshakes can never use up the process's file
        descriptors (accept() would then fail for everyone, the legitimate client included)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_handshakes
        return max(4, min(self.max_handshakes, (soft - 64) // 2))


@dataclass
class _Pending:
    conn: socket.socket
    host: str
    accepted: float
    evicted: bool = False
    got: int = 0       # bytes of the HELLO read so far (its handshake thread counts them)
    need: int = 0      # the whole HELLO's size, once its header is read; 0 before

    def waiting_bytes(self) -> int:
        """Bytes that arrived but are not read yet (FIONREAD); 0 if it cannot tell."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.conn.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            return 0

    def hello_in_hand(self) -> bool:
        """The whole HELLO has arrived (read or waiting): a client that means it, about to be served."""
        if self.need:
            return self.got + self.waiting_bytes() >= self.need
        if self.got:
            return False    # part of a header read, the rest not: a trickle
        # A header waiting, not read yet: its thread reads it within moments and knows the size
        # then; until then it is taken as a HELLO in hand (a peek here could block the accept loop).
        return self.waiting_bytes() >= protocol.HEADER_SIZE


def door_victim(pending: Iterable[_Pending], now: float, min_age_s: float) -> _Pending | None:
    """Which of these handshakes (oldest first) gives way to a newcomer: the oldest one at least
    min_age_s old whose whole HELLO has not arrived (idle or trickling); never one whose has, so
    a client that means it never loses its slot to idle ones. Lazy: usually one ioctl."""
    return next((p for p in pending if now - p.accepted >= min_age_s and not p.hello_in_hand()), None)


def read_text_or_empty(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def client_description(peer: str, info: dict) -> dict:
    """What worker logs say about the client: the address the connection came from (never one the
    client claims) and the few facts rgpu's client library sends (pid, host, uid), bounded and
    printable, so a client cannot forge log lines or another address."""
    out: dict = {}
    for key in ("pid", "uid"):
        if isinstance(info.get(key), int) and not isinstance(info.get(key), bool) and 0 <= info[key] < 2**32:
            out[key] = info[key]
    host = info.get("host")
    if isinstance(host, str):
        out["host"] = "".join(c if c.isprintable() else "?" for c in host[:64])
    out["address"] = peer
    return out


RUNTIME_PREFIX = "rgpu-sessions-"
DEFAULT_IMAGE_CACHE_BYTES = 16 << 30   # rgpu.config's image_cache_bytes
KILL_GRACE_S = 1.0          # a worker ended by the dispatcher gets this long after SIGTERM, then SIGKILL
FAULT_EXIT_GRACE_S = 5.0    # a worker a GPU fault ended gets this long to let go of the GPU, then SIGKILL
OWNER_FILE = "owner.pid"


def sweep_dead_runtime_dirs(tmp: Path, log: logging.Logger) -> list[Path]:
    """Remove the runtime folders of dispatchers that were killed (kill -9 leaves them): ours (same
    uid) whose owner.pid names a process that no longer exists. Never raises."""
    removed = []
    for path in tmp.glob(RUNTIME_PREFIX + "*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            pid = int((path / OWNER_FILE).read_text().strip())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("removed %s, left by a dispatcher that was killed", path)
        except (OSError, ValueError):
            continue       # no owner file (running, or not ours to judge), or the process lives
    return removed


class SessionServer:
    def __init__(self, *, listen_socket: socket.socket, advertised: str, gpus: list[GpuInfo], secret: bytes,
                 port_range: tuple[int, int], backend: str, log: logging.Logger,
                 front_door: FrontDoor | None = None, compute_lending: bool = False,
                 image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES, transport: str | None = None,
                 caps: SessionCaps | None = None, socket_buffer_bytes: int | None = None) -> None:
        if backend not in ("cuda", "emulated"):
            raise ValueError(f"unknown backend {backend!r} (cuda or emulated)")
        self.listen_socket = listen_socket
        self.advertised = advertised
        self.gpus = {g.uuid: g for g in gpus}
        self.secret = secret
        self.port_range = port_range
        self.backend = backend
        self.log = log
        self.front_door = front_door or FrontDoor()
        self.max_handshakes = self.front_door.capped_by_open_files()
        # Sessions per slice and kind, in all, and opens per slice (admission.py); under self._lock.
        self.caps = caps or SessionCaps()
        self._ledger = SessionLedger(self.caps)
        self._pending: dict[int, _Pending] = {}     # id(conn) -> handshake in progress, oldest first
        self._per_host: dict[str, int] = {}
        self._door_lock = threading.Lock()
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rgpu-sessions-spawn")
        self._dropped = {"per_address": 0, "evicted": 0, "full": 0, "deadline": 0}
        sweep_dead_runtime_dirs(Path(tempfile.gettempdir()), log)
        self.runtime_dir = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))
        os.chmod(self.runtime_dir, 0o700)
        (self.runtime_dir / OWNER_FILE).write_text(f"{os.getpid()}\n")
        self.compute_lending = compute_lending
        # Module images the workers received, by uid and SHA-256 (worker/image_cache.py): a library's
        # kernels cross the wire once per node and user while this dispatcher runs.
        self.image_cache_dir = self.runtime_dir / "images"
        self.image_cache_bytes = image_cache_bytes
        # Only GPUs shared by MPS are its clients' (isolated and exclusive GPUs run plain contexts).
        self.mps = MpsDaemon([g.uuid for g in gpus if g.sharing == "mps"], self.runtime_dir / "mps", log)
        self._sessions: dict[int, SessionRecord] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._refused = 0
        self._refusal_log = LogLimit()
        self._accepted = 0
        self._ended: list[dict] = []
        self.counters_dir = self.runtime_dir / "counters"
        # Traffic of ended sessions per GPU, and sessions ended per outcome (ok | failed | revoked).
        self._traffic_ended: dict[str, dict[str, int]] = {}
        self._ended_outcomes: dict[str, int] = {"ok": 0, "failed": 0, "revoked": 0, "fault": 0}
        self.launch_library = ""
        self.launch_path = "python"
        # Copies' transport (datapath/transport.py): rgpu.toml's `transport` (the daemon passes it), else
        # RGPU_TRANSPORT (a session server started by a test or a benchmark).
        self.transport = transport or parse_transport(os.environ.get("RGPU_TRANSPORT"))
        # Its workers' SO_SNDBUF/SO_RCVBUF (rgpu.toml's socket_buffer_bytes; None: RGPU_SOCKET_BUFFER_BYTES as
        # inherited, else the worker's default).
        self.socket_buffer_bytes = socket_buffer_bytes
        self.ucx_library = ""
        self._live: LiveLeases | None = None   # the pool's latest list; None: tokens are checked offline only
        # GPU faults (dispatcher/faults.py): reports from workers, events decided, recoveries pending.
        self.faults_dir = self.runtime_dir / "faults"
        for sub in (REPORTS, VERDICTS, RELEASED):
            (self.faults_dir / sub).mkdir(parents=True, exist_ok=True)
        self.fault_events: deque[FaultEvent] = deque(maxlen=20)
        self._fault_counts: dict[str, dict[str, int]] = {}
        self._recovering: list[tuple[FaultEvent, set[int]]] = []
        self.recovering_gpus: frozenset[str] = frozenset()   # GPUs refusing new sessions until recovered
        self._fault_handled: set[int] = set()   # workers a decided fault already ended (their late reports)
        self._stopped: set[int] = set()         # workers the dispatcher stopped (lease ended): their errors are ours
        self._slice_dirs: dict[Path, tuple[str, int, float]] = {}   # usage folder -> (job key, slice, issued)
        self._lanes = LaneBook()   # sessions being opened that wait for their data lanes (lanes.py)

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

    def _stop_worker(self, rec: SessionRecord) -> None:
        """End a worker whose kernel may run for ever: MPS drops its outstanding work first; its
        process exit destroys its context (the driver stops the kernel); SIGKILL follows after
        KILL_GRACE_S for a worker that does not exit on SIGTERM (stuck in a driver call)."""
        rec.kill_at = time.monotonic() + KILL_GRACE_S
        self._stopped.add(rec.pid)
        if rec.sharing == "mps" and rec.mode == "cuda":
            self.mps.terminate_client(rec.pid)
        try:
            rec.popen.terminate()
        except OSError:
            pass

    def _revoked(self, claims: tokens.SliceClaims) -> bool:
        with self._lock:
            live = self._live
        return live is not None and live.revoked(claims.job_key, claims.slice_number, claims.issued_unix)

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

    @property
    def enforcement(self) -> str:
        """How compute shares are enforced, for the registration: by MPS (or time-slicing where
        MPS failed) on mps GPUs; by rgpu's limiter when no GPU here is shared by MPS."""
        modes = {g.sharing for g in self.gpus.values()}
        if "mps" in modes or not modes:
            return self.mps.enforcement
        return "rgpu limiter" if "isolated" in modes else "exclusive"

    def gpu_enforcement(self, gpu: GpuInfo) -> str:
        return enforcement(gpu.sharing, self.mps.running)

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

    # ------------------------------------------------------------------ accepting

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, addr = self.listen_socket.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                self.log.warning("accept failed: %s", exc)
                time.sleep(0.2)
                continue
            pending = self._admit(conn, addr)
            if pending is None:
                continue
            t = threading.Thread(target=self._handshake, args=(pending, addr), name="rgpu-session-hello",
                                 daemon=True)
            t.start()

    def _admit(self, conn: socket.socket, addr: tuple) -> _Pending | None:
        """Take a new connection into the handshakes in progress, or drop it. One source address
        holds at most per_address of them; when all max_handshakes are taken, one gives way as
        _victim_locked says (a client that means it sends HELLO at once, so only connections that
        trickle or idle are ever old). At the per-address cap the address's own idle or stuck
        handshake makes way (door_victim); a handshake whose HELLO has arrived never does.
        Nothing here blocks the accept loop."""
        host = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        now = time.monotonic()
        victim: _Pending | None = None
        admitted: _Pending | None = None
        with self._door_lock:
            if self._per_host.get(host, 0) >= self.front_door.per_address:
                # The address's slots are full: its oldest idle (or stuck) handshake makes way, so
                # idle connections from a shared node cannot lock its other users out.
                victim = door_victim((p for p in self._pending.values() if p.host == host), now, 0.0)
                if victim is not None:
                    victim.evicted = True
                    self._forget_locked(victim)
                    self._dropped["evicted"] += 1
            if self._per_host.get(host, 0) >= self.front_door.per_address:
                self._dropped["per_address"] += 1
            else:
                if len(self._pending) >= self.max_handshakes and victim is None:
                    victim = self._victim_locked(host, now)
                    if victim is not None:
                        victim.evicted = True
                        self._forget_locked(victim)
                        self._dropped["evicted"] += 1
                if len(self._pending) < self.max_handshakes:
                    admitted = _Pending(conn, host, now)
                    self._pending[id(conn)] = admitted
                    self._per_host[host] = self._per_host.get(host, 0) + 1
                else:
                    self._dropped["full"] += 1
        if victim is not None:
            try:
                victim.conn.shutdown(socket.SHUT_RDWR)   # wakes its thread, which closes it
            except OSError:
                pass
        if admitted is None:
            self._refused += 1
            self.log.debug("connection from %s dropped: too many handshakes in progress", host)
            conn.close()
        return admitted

    def _victim_locked(self, host: str, now: float) -> _Pending | None:
        """Whom a new connection from `host` replaces when every slot is taken: first one of the
        source holding the most slots (door_victim's choice), if that is more than the newcomer's
        source would hold with it (so an attacker's many connections give way to another
        address's first); else door_victim's choice of all, at least evict_after_s old; else
        nobody (the newcomer is dropped)."""
        busiest = max(self._per_host, key=self._per_host.__getitem__)
        if self._per_host.get(host, 0) + 1 < self._per_host[busiest]:
            victim = door_victim((p for p in self._pending.values() if p.host == busiest), now, 0.0)
            if victim is not None:
                return victim
        return door_victim(self._pending.values(), now, self.front_door.evict_after_s)

    def _forget_locked(self, pending: _Pending) -> None:
        if self._pending.pop(id(pending.conn), None) is None:
            return
        left = self._per_host.get(pending.host, 1) - 1
        if left > 0:
            self._per_host[pending.host] = left
        else:
            self._per_host.pop(pending.host, None)

    def _read_hello(self, pending: _Pending) -> tuple[int, bytes]:
        """The HELLO frame, read by a deadline counted from the accept: a peer sending a byte
        at a time gains nothing. Raises TimeoutError, ConnectionError or ValueError."""
        deadline = pending.accepted + self.front_door.hello_deadline_s
        first_byte = pending.accepted + self.front_door.first_byte_deadline_s()
        conn = pending.conn

        def exact(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                left = (deadline if pending.got else first_byte) - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                conn.settimeout(left)
                chunk = conn.recv(n - len(buf))
                if not chunk:
                    raise ConnectionError("connection closed by peer")
                buf += chunk
                pending.got += len(chunk)
            return bytes(buf)

        try:
            length, op, _flags, _seq, _aux, _ctx = protocol.HEADER.unpack(exact(protocol.HEADER_SIZE))
        except struct.error as exc:   # cannot happen with exact(); kept so no struct.error escapes
            raise ValueError(str(exc)) from None
        if length > 64 << 10:
            raise ValueError(f"a HELLO of {length} bytes is larger than allowed (65536)")
        pending.need = protocol.HEADER_SIZE + length
        return op, exact(length) if length else b""

    def _refuse(self, conn: socket.socket, peer: str, message: str) -> None:
        self._refused += 1
        # Anyone who reaches the port decides how often this runs: one line a minute per kind.
        held = self._refusal_log.allow(message.split("(", 1)[0])
        if held is not None:
            self.log.warning("session from %s refused: %s%s", peer, message, held_note(held))
        try:
            conn.sendall(protocol.encode_refuse(message))
        except OSError:
            pass
        conn.close()

    def _handshake(self, pending: _Pending, addr: tuple) -> None:
        conn = pending.conn
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
        try:
            op, payload = self._read_hello(pending)
        except TimeoutError:
            with self._door_lock:
                self._dropped["deadline"] += 1
                self._forget_locked(pending)
            conn.settimeout(1.0)
            limit = self.front_door.hello_deadline_s if pending.got else self.front_door.first_byte_deadline_s()
            self._refuse(conn, peer, f"rgpu: session: no HELLO within {limit:g} s of "
                         "connecting (the connection was too slow or idle; check the network, and that the "
                         "client is rgpu's)")
            return
        except (ConnectionError, OSError) as exc:
            with self._door_lock:
                self._forget_locked(pending)
            if pending.evicted:
                self.log.debug("handshake from %s dropped for a newer connection (all slots taken)", peer)
            else:
                # Closed before a whole HELLO: port checks (rgpu-admin health --deep, monitoring) do this.
                self.log.debug("connection from %s closed before its HELLO (%s)", peer, exc)
            conn.close()
            return
        except ValueError as exc:
            with self._door_lock:
                self._forget_locked(pending)
            conn.settimeout(1.0)
            self._refuse(conn, peer, f"rgpu: session: malformed HELLO ({str(exc)[:120]}; "
                         "install the same rgpu version on both sides)")
            return
        with self._door_lock:
            self._forget_locked(pending)
        conn.settimeout(protocol.HELLO_TIMEOUT_S)
        try:
            if op != protocol.OP_HELLO:
                raise ValueError(f"expected HELLO, got frame {op}")
            version = protocol.decode_hello_version(payload)
        except (ValueError, struct.error) as exc:
            self._refuse(conn, peer, f"rgpu: session: malformed HELLO ({str(exc)[:120]}; "
                         "install the same rgpu version on both sides)")
            return
        if version != protocol.PROTOCOL_VERSION:
            self._refuse(conn, peer, protocol.version_mismatch_error(version, protocol.PROTOCOL_VERSION).format())
            return
        try:
            hello = protocol.decode_hello(payload)
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            self._refuse(conn, peer, f"rgpu: session: malformed HELLO ({str(exc)[:120]}; "
                         "install the same rgpu version on both sides)")
            return
        try:
            claims = tokens.verify(self.secret, hello.token, server=self.advertised, gpu_uuids=set(self.gpus))
        except AuthError as exc:
            self._refuse(conn, peer, str(exc))
            return
        with self._lock:
            heard = self._live is not None
        if not heard:
            # Fail closed: without the pool's list of live leases a released lease's token cannot be
            # told from a live one (a dispatcher restarted while the pool is down).
            self._refuse(conn, peer, "rgpu: session: this dispatcher has not heard from the pool since it started, "
                         "so it cannot tell a released lease's token from a live one (retry in a few seconds; "
                         "check that rgpu-poold runs and that this GPU node reaches it)")
            return
        if self._revoked(claims):
            self._refuse(conn, peer, f"rgpu: session: the lease of job {claims.job_key} (slice {claims.slice_number}) "
                         "was released or reclaimed by the pool, so its token is no longer valid (request new "
                         "slices: rerun the job, or `flexrun -n N -p F`)")
            return
        if hello.flags & protocol.HELLO_LANE:
            self._take_lane(conn, peer, hello)
            return
        gpu = self.gpus[claims.gpu_uuid]
        if gpu.uuid in self.recovering_gpus and not hello.flags & (protocol.HELLO_PERF | protocol.HELLO_NVML):
            self._refuse(conn, peer, f"rgpu: session: GPU {gpu.index} ({gpu.uuid}) of {self.advertised} is recovering "
                         "from a GPU fault that ended the sessions sharing it under MPS (retry in a few seconds)")
            return
        kind = "perf" if hello.flags & protocol.HELLO_PERF else "nvml" if hello.flags & protocol.HELLO_NVML else "cuda"
        key = (claims.job_key, claims.slice_number, claims.gpu_uuid)
        probe = bool(hello.flags & protocol.HELLO_PROBE) and kind != "perf"
        with self._lock:
            admitted = self._ledger.take_open(key, time.monotonic()) if probe else \
                self._ledger.admit(key, kind, time.monotonic())
        if isinstance(admitted, str) and admitted:
            self._refuse(conn, peer, admitted)
            return
        if kind == "perf":
            assert isinstance(admitted, Admission)
            try:
                self._serve_perf(conn, peer, claims)
            finally:
                with self._lock:
                    self._ledger.release(admitted)
            return
        mode = kind
        if probe:
            conn.sendall(protocol.encode_welcome(
                driver_version=0, memory_limit_bytes=claims.memory_limit_bytes,
                compute_percent=claims.compute_percent, flags=0,
                description=f"{gpu.name} slice ready ({self.backend} backend, {self.gpu_enforcement(gpu)})"))
            conn.close()
            return
        assert isinstance(admitted, Admission)
        lanes = self._collect_lanes(peer, hello) if mode == "cuda" else []
        try:
            self._spawn(conn, peer, hello, claims, gpu, mode, admitted, lanes)
        except OSError as exc:
            with self._lock:
                self._ledger.release(admitted)
            self._refuse(conn, peer, f"rgpu: session: cannot start a worker ({exc}; check the dispatcher host)")
            return
        finally:
            for lane in lanes:
                lane.close()   # the worker holds its own copies now
        conn.close()  # the worker holds its own copy now

    def _take_lane(self, conn: socket.socket, peer: str, hello: protocol.Hello) -> None:
        """A data lane (protocol 12), its token verified: handed to the session it names, which
        closes it once its worker holds it; refused when it proves no session's."""
        offer = parse_lane_offer(hello.info)
        conn.settimeout(None)   # blocking, as the worker's C receive expects it
        if offer is None or not self._lanes.offer(offer[0], hello.token, offer[1], conn):
            self._refuse(conn, peer, "rgpu: session: a data lane that belongs to no session being opened (its lane "
                         "key and token match none, or it came too late; the session's copies stay on its own "
                         "connection)")

    def _collect_lanes(self, peer: str, hello: protocol.Hello) -> list[socket.socket]:
        """The session's data lanes when its HELLO asked for some and all of them came in time."""
        request = parse_lane_request(hello.info)
        if request is None:
            return []
        count, key = request
        lanes, late = self._lanes.collect(key, hello.token, count)
        if not lanes:
            self.log.warning("session from %s asked for %d data lanes and %d came within %g s: its copies stay on "
                             "its one connection", peer, count, len(late), self._lanes.wait_s)
            for lane in late:
                lane.close()
        return lanes

    def _gpu_dir(self, gpu_uuid: str) -> Path:
        """Files the workers of one GPU share: their limiters' loads (lending), the emulated fault domain."""
        path = self.runtime_dir / "gpus" / hashlib.sha256(gpu_uuid.encode()).hexdigest()[:16]
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _slice_path(self, job_key: str, slice_number: int, gpu_uuid: str) -> Path:
        key = hashlib.sha256(f"{job_key}\0{slice_number}\0{gpu_uuid}".encode()).hexdigest()[:16]
        return self.runtime_dir / "slices" / key

    def _serve_perf(self, conn: socket.socket, peer: str, claims: tokens.SliceClaims) -> None:
        """rgpu-admin net-perf: this acceptor thread echoes and streams; no worker, no GPU."""
        conn.sendall(protocol.encode_welcome(
            driver_version=0, memory_limit_bytes=claims.memory_limit_bytes, compute_percent=claims.compute_percent,
            flags=protocol.WELCOME_PERF, description="perf session"))
        moved = serve_perf(conn, idle_s=self.caps.perf_idle_s)
        self.log.info("perf session from %s (job %s) moved %d bytes", peer, claims.job_key, moved)

    def _slice_dir(self, claims: tokens.SliceClaims) -> Path:
        path = self._slice_path(claims.job_key, claims.slice_number, claims.gpu_uuid)
        path.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._slice_dirs[path] = (claims.job_key, claims.slice_number, claims.issued_unix)
        return path

    def observe(self) -> dict:
        """What the metrics need: live sessions with the memory their slice holds, traffic per GPU
        (ended sessions' totals plus live ones' latest counts), session outcomes."""
        with self._lock:
            live = [(r.pid, r.public()) for r in self._sessions.values()]
            traffic = {gpu: dict(counts) for gpu, counts in self._traffic_ended.items()}
            outcomes = dict(self._ended_outcomes)
            accepted, refused = self._accepted, self._refused
        sessions = []
        for pid, rec in live:
            used = slice_usage(self._slice_path(rec["job_key"], rec["slice_number"], rec["gpu_uuid"]))
            sessions.append({**rec, "memory_used_bytes": used})
            counts = read_counters(counters_path(self.counters_dir, pid))
            if counts is not None:
                total = traffic.setdefault(rec["gpu_uuid"], dict.fromkeys(TRAFFIC_FIELDS, 0))
                for name in TRAFFIC_FIELDS:
                    total[name] += counts[name]
        return {"sessions": sessions, "traffic": traffic, "ended": outcomes, "accepted": accepted,
                "refused": refused, "mps": {"running": self.mps.running, "restarts": self.mps.restarts,
                                            "reason": self.mps.reason},
                "faults": {gpu: dict(c) for gpu, c in self._fault_counts.items()},
                "compute_enforcement": self.enforcement, "launch_path": self.launch_path,
                "backend": self.backend}

    def _collect_traffic(self, rec: SessionRecord) -> None:
        """Add an ended worker's final counts to the totals; its counters file goes. Called with
        the lock held, in the same step that drops the session, so no scrape sees the counts
        neither live nor in the totals (a counter must never go down)."""
        path = counters_path(self.counters_dir, rec.pid)
        counts = read_counters(path)
        outcome = ("fault" if rec.ended_by.startswith("a GPU fault") else "revoked" if rec.ended_by
                   else "ok" if rec.popen.returncode == 0 else "failed")
        self._ended_outcomes[outcome] += 1
        if counts is not None:
            total = self._traffic_ended.setdefault(rec.gpu_uuid, dict.fromkeys(TRAFFIC_FIELDS, 0))
            for name in TRAFFIC_FIELDS:
                total[name] += counts[name]
        path.unlink(missing_ok=True)
    def usage(self) -> list[dict]:
        """Per slice that had a CUDA session since this dispatcher started: open sessions, busy
        time, calls, memory high-water mark and in use, last activity (this host's clock)."""
        with self._lock:
            dirs = dict(self._slice_dirs)
            live: dict[tuple[str, int], int] = {}
            for rec in self._sessions.values():
                if rec.mode == "cuda" and not rec.ended_by:
                    live[(rec.job_key, rec.slice_number)] = live.get((rec.job_key, rec.slice_number), 0) + 1
        out = []
        for path, (job_key, number, _issued) in dirs.items():
            stats = read_slice_stats(path)
            sessions = live.get((job_key, number), 0)
            if not stats.sessions_seen and not sessions:
                continue
            out.append({"job_key": job_key, "slice_number": number, "sessions": sessions,
                        "busy_seconds": stats.busy_seconds, "calls": stats.calls,
                        "memory_high_water_bytes": stats.memory_high_water_bytes,
                        "memory_used_bytes": slice_usage(path), "last_active_unix": stats.last_active_unix})
        return out

    def forget_slices(self, live: LiveLeases) -> None:
        """Drop the usage folders of slices whose lease the pool no longer lists (and that run no
        session), so a long-running dispatcher does not report ended leases for ever."""
        with self._lock:
            running = {(r.job_key, r.slice_number) for r in self._sessions.values()}
            gone = [p for p, (job_key, number, issued) in self._slice_dirs.items()
                    if (job_key, number) not in running and live.revoked(job_key, number, issued)]
            for path in gone:
                del self._slice_dirs[path]
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)

    def _spawn(self, conn: socket.socket, peer: str, hello: protocol.Hello, claims: tokens.SliceClaims,
               gpu: GpuInfo, mode: str, admission: Admission | None = None,
               lanes: list[socket.socket] | None = None) -> None:
        conn.settimeout(None)
        spec = {
            "mode": mode, "backend": self.backend, "gpu_uuid": gpu.uuid, "gpu_index": gpu.index,
            "gpu_name": gpu.name, "gpu_total_memory": gpu.total_memory_bytes,
            "compute_capability": gpu.compute_capability,
            "memory_limit": min(claims.memory_limit_bytes, gpu.usable_memory_bytes or claims.memory_limit_bytes),
            "compute_percent": claims.compute_percent, "job_key": claims.job_key,
            "slice_number": claims.slice_number, "usage_dir": str(self._slice_dir(claims)),
            "server": self.advertised, "compute_enforcement": self.gpu_enforcement(gpu), "sharing": gpu.sharing,
            "faults_dir": str(self.faults_dir),
            "compute_lending": self.compute_lending, "gpu_dir": str(self._gpu_dir(gpu.uuid)),
            "client": client_description(peer, hello.info), "launch_library": self.launch_library,
            "counters_dir": str(self.counters_dir),
            "image_cache_dir": str(self.image_cache_dir), "image_cache_bytes": self.image_cache_bytes,
            "transport": self.transport, "ucx_library": self.ucx_library,
            "ucx_peer": parse_peer_address(hello.info).hex(),
            "frame_stall_s": self.caps.frame_stall_s,
        }
        env = worker_environment(os.environ)
        env["RGPU_WORKER_SESSION"] = json.dumps(spec)
        env["RGPU_WORKER_PARENT_PID"] = str(os.getpid())
        if self.socket_buffer_bytes is not None:
            env["RGPU_SOCKET_BUFFER_BYTES"] = str(self.socket_buffer_bytes)
        if self.backend == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
            env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
            if mode == "cuda" and gpu.sharing == "mps":
                env.update(self.mps.client_env(claims.compute_percent))
        fd = conn.fileno()
        lane_fds = [lane.fileno() for lane in lanes or []]
        argv = [sys.executable, "-m", "rgpu.remoting.datapath.worker", "--fd", str(fd)]
        if lane_fds:
            argv += ["--lanes", ",".join(map(str, lane_fds))]
        # Forked from the one long-lived spawner thread: the worker's parent-death signal fires when
        # the forking thread ends, and handshake threads end right after this (lifeline.py).
        popen = self._spawner.submit(
            subprocess.Popen, argv, pass_fds=[fd, *lane_fds], env=env, stdin=subprocess.DEVNULL,
            close_fds=True).result()
        rec = SessionRecord(pid=popen.pid, job_key=claims.job_key, slice_number=claims.slice_number,
                            gpu_uuid=gpu.uuid, mode=mode, client=peer,
                            memory_limit_bytes=spec["memory_limit"], compute_percent=claims.compute_percent,
                            started_unix=time.time(), lease_issued_unix=claims.issued_unix, popen=popen,
                            sharing=gpu.sharing, admission=admission)
        with self._lock:
            self._sessions[popen.pid] = rec
            self._stopped.discard(popen.pid)   # a recycled pid: this worker is new
            self._accepted += 1
        self.log.info("session %d: job %s slice %d on %s (%s) for %s", popen.pid, claims.job_key,
                      claims.slice_number, gpu.uuid, mode, peer)

    # ------------------------------------------------------------------ GPU faults

    def _check_faults(self) -> None:
        """Decide on the workers' fault reports (once the reports of one fault have settled), end
        the affected sessions, and recover each GPU once all of them let go of it."""
        reports_dir = self.faults_dir / REPORTS
        files = sorted(reports_dir.glob("*.json"))
        if files:
            newest = max(f.stat().st_mtime for f in files)
            if time.time() - newest >= SETTLE_S:
                self._decide_faults(files)
        if self._recovering:
            self._advance_recoveries()

    def _decide_faults(self, files: list[Path]) -> None:
        reports = []
        for path in files:
            try:
                reports.append(FaultReport.from_dict(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.log.warning("ignoring an unreadable GPU fault report %s: %s", path.name, exc)
            path.unlink(missing_ok=True)
        # A worker the dispatcher already ended for a fault may still report it (it met the error in a
        # call before the signal): its verdict is written; it is no new fault.
        # A worker the dispatcher stopped because its lease ended meets CUDA_ERROR_MPS_CLIENT_TERMINATED
        # (or a lost context) by our own doing: that is no fault of the GPU's, and others go on.
        reports = [r for r in reports if r.pid not in self._fault_handled and r.pid not in self._stopped]
        if not reports:
            return
        with self._lock:
            records = {r.pid: r for r in self._sessions.values() if r.mode == "cuda" and r.popen.poll() is None}
        sessions = [SessionView(r.pid, r.gpu_uuid, r.job_key, r.slice_number) for r in records.values()]
        gpus = {u: GpuView(u, g.index, g.name, g.sharing) for u, g in self.gpus.items()}
        if self.backend == "emulated":
            mps_log = "".join(read_text_or_empty(self._gpu_dir(u) / EMULATED_MPS_LOG) for u in self.gpus)
        else:
            mps_log = self.mps.server_log()
        events = decide(reports, sessions, gpus, self.advertised, mps_log)
        reporters = {r.pid for r in reports}
        for event in events:
            for pid, line in event.verdicts.items():
                tmp = self.faults_dir / VERDICTS / f".{pid}.tmp"
                tmp.write_text(line + "\n")
                os.replace(tmp, self.faults_dir / VERDICTS / str(pid))
            self._fault_handled.update(session.pid for session in event.affected)
            for session in event.affected:
                rec = records.get(session.pid)
                if rec is None:
                    continue
                with self._lock:
                    rec.ended_by = f"a GPU fault: {event.summary()}"
                    rec.kill_at = time.monotonic() + FAULT_EXIT_GRACE_S
                if session.pid not in reporters:
                    try:
                        os.kill(session.pid, signal.SIGUSR1)   # worker/session.py ends it with its verdict
                    except OSError:
                        pass
            scope = "cross_tenant" if event.cross_tenant else "own"
            with self._lock:
                counts = self._fault_counts.setdefault(event.gpu.uuid, {"cross_tenant": 0, "own": 0, "sessions": 0})
                counts[scope] += 1
                counts["sessions"] += len(event.affected)
                self.fault_events.append(event)
            self.log.warning("GPU fault: %s", event.summary())
            if event.gpu.sharing == "mps":
                self._recovering.append((event, {s.pid for s in event.affected}))
        self.recovering_gpus = frozenset(e.gpu.uuid for e, _ in self._recovering)

    def _released_pids(self) -> set[int]:
        try:
            return {int(p.name) for p in (self.faults_dir / RELEASED).iterdir() if p.name.isdigit()}
        except OSError:
            return set()

    def _advance_recoveries(self) -> None:
        released = self._released_pids()
        with self._lock:
            alive = {pid for pid, r in self._sessions.items() if r.popen.poll() is None}
        still: list[tuple[FaultEvent, set[int]]] = []
        for event, pids in self._recovering:
            holding = {pid for pid in pids if pid in alive and pid not in released}
            if holding:
                still.append((event, holding))
                continue
            self._recover_gpu(event)
            event.recovered_seconds = max(0.0, time.time() - event.unix)
            self.log.warning("GPU %d (%s) serves new sessions again, %.2f s after the fault", event.gpu.index,
                             event.gpu.uuid, event.recovered_seconds)
        self._recovering = still
        self.recovering_gpus = frozenset(e.gpu.uuid for e, _ in still)

    def _recover_gpu(self, event: FaultEvent) -> None:
        if self.backend == "emulated":
            # The emulated fault domain ends as a replaced MPS server would: clean for new clients.
            (self._gpu_dir(event.gpu.uuid) / EMULATED_MPS_FAULT).unlink(missing_ok=True)
            (self._gpu_dir(event.gpu.uuid) / EMULATED_MPS_LOG).unlink(missing_ok=True)
        else:
            self.mps.recover(f"a fault on GPU {event.gpu.index}")

    def faults(self) -> list[dict]:
        """Recent GPU faults, newest last, for the heartbeat (rgpu-admin health) and status()."""
        with self._lock:
            events = list(self.fault_events)
        return [{"gpu_uuid": e.gpu.uuid, "gpu_index": e.gpu.index, "unix": e.unix, "error": e.error_name,
                 "cross_tenant": e.cross_tenant, "sessions_ended": len(e.affected),
                 "faulting": (f"job {e.faulting.job_key} slice {e.faulting.slice_number}" if e.faulting else ""),
                 "recovered_seconds": e.recovered_seconds} for e in events]

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
