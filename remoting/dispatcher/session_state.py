"""What the session server keeps: its sessions (one worker process each), its runtime folders,
and starting and stopping a worker. The server's parts (session_accept.py, session_faults.py,
session_usage.py) work on this state; sessions.py puts them together."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rgpu.remoting.datapath import protocol
from rgpu.remoting.datapath.transport import parse_peer_address, parse_transport
from rgpu.remoting.datapath.worker.faults import RELEASED, REPORTS, VERDICTS
from rgpu.remoting.dispatcher.admission import Admission, SessionCaps, SessionLedger
from rgpu.remoting.dispatcher.faults import FaultEvent
from rgpu.remoting.dispatcher.front_door import FrontDoor, _Pending
from rgpu.remoting.dispatcher.lanes import LaneBook
from rgpu.remoting.dispatcher.mps import MpsDaemon
from rgpu.remoting.dispatcher.sharing import enforcement

from rgpu import tokens
from rgpu.live_leases import LiveLeases
from rgpu.log_limit import LogLimit
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


class SessionState:
    """The session server's state, its workers' folders, and starting and stopping a worker."""
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

    def _gpu_dir(self, gpu_uuid: str) -> Path:
        """Files the workers of one GPU share: their limiters' loads (lending), the emulated fault domain."""
        path = self.runtime_dir / "gpus" / hashlib.sha256(gpu_uuid.encode()).hexdigest()[:16]
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _slice_path(self, job_key: str, slice_number: int, gpu_uuid: str) -> Path:
        key = hashlib.sha256(f"{job_key}\0{slice_number}\0{gpu_uuid}".encode()).hexdigest()[:16]
        return self.runtime_dir / "slices" / key

    def _slice_dir(self, claims: tokens.SliceClaims) -> Path:
        path = self._slice_path(claims.job_key, claims.slice_number, claims.gpu_uuid)
        path.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._slice_dirs[path] = (claims.job_key, claims.slice_number, claims.issued_unix)
        return path

    def _spawn(self, conn: socket.socket, peer: str, hello: protocol.Hello, claims: tokens.SliceClaims,
               gpu: GpuInfo, mode: str, admission: Admission | None = None,
               lanes: list[socket.socket] | None = None) -> None:
        conn.settimeout(None)
        memory_limit = min(claims.memory_limit_bytes, gpu.usable_memory_bytes or claims.memory_limit_bytes)
        spec = {
            "mode": mode, "backend": self.backend, "gpu_uuid": gpu.uuid, "gpu_index": gpu.index,
            "gpu_name": gpu.name, "gpu_total_memory": gpu.total_memory_bytes,
            "compute_capability": gpu.compute_capability,
            "memory_limit": memory_limit,
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
                            memory_limit_bytes=memory_limit, compute_percent=claims.compute_percent,
                            started_unix=time.time(), lease_issued_unix=claims.issued_unix, popen=popen,
                            sharing=gpu.sharing, admission=admission)
        with self._lock:
            self._sessions[popen.pid] = rec
            self._stopped.discard(popen.pid)   # a recycled pid: this worker is new
            self._accepted += 1
        self.log.info("session %d: job %s slice %d on %s (%s) for %s", popen.pid, claims.job_key,
                      claims.slice_number, gpu.uuid, mode, peer)
